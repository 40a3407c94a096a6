"""The ranks of these tests start from one forkserver per pytest process (``hybrid.runtime.local_launch``); most
of them save, load or consolidate checkpoints, so the forkserver imports ``torch.distributed.checkpoint``
(0.7 s of CPU) once instead of every such rank importing it again (test_checkpoint alone starts ~30 ranks)."""

from hybrid.runtime import local_launch

local_launch.preload("torch.distributed.checkpoint", "hybrid.checkpoint.sharded", "hybrid.checkpoint.offline")
