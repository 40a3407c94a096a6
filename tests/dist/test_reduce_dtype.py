"""``zero.reduce_dtype: fp32`` with bf16 parameters really reduces in fp32 (DeepSpeed's
``communication_data_type``, FSDP2's ``MixedPrecisionPolicy(reduce_dtype=...)``), on 2 gloo ranks, stages 0-3.

The gradients are built so that their bf16 sum is not their fp32 sum: ``loss = sum(w * x)`` gives rank r the
gradient ``x_r / 2`` (the engine divides the loss by the DP size), with ``x_0 = 1`` and ``x_1 = 2^-8``, both
exact in bf16; their sum ``0.5 + 2^-9`` lies halfway between two bf16 numbers and rounds to ``0.5``. One SGD
step (lr 1, from w = 0) leaves the fp32 master at minus the gradient the optimizer saw: exactly
``-(0.5 + 2^-9)`` when reduced in fp32, ``-0.5`` when reduced in bf16 (the default), which the same run shows.
The gradient collectives of the backward move exactly twice the bytes in fp32 (``engine.comm_report()``).
"""

import pytest
import torch
from torch import nn

import hybrid
from hybrid.runtime.local_launch import run_local

pytestmark = pytest.mark.slow

NUMEL = 64
X = (1.0, 2.0 ** -8)  # rank r's input; its gradient is X[r] / 2
FP32_SUM, BF16_SUM = 0.5 + 2.0 ** -9, 0.5


class _Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(NUMEL))

    def forward(self, x):
        return (self.w * x).sum()


def _config(stage: int, reduce_dtype) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if reduce_dtype:
        zero["reduce_dtype"] = reduce_dtype
    return {"zero_optimization": zero, "bf16": {"enabled": True},
            "optimizer": {"type": "SGD", "params": {"lr": 1.0, "weight_decay": 0.0}}}


def _step_once():
    rank = torch.distributed.get_rank()
    out = {}
    for stage in range(4):
        for reduce_dtype in ("fp32", None):
            engine = hybrid.initialize(_Probe(), _config(stage, reduce_dtype))
            loss = engine(torch.full((NUMEL,), X[rank]))
            engine.reset_comm()  # after the forward: the backward's collectives alone
            engine.backward(loss)
            traffic = engine.comm_report()
            engine.step()
            view = engine.shard_views()["w"]
            out[(stage, reduce_dtype)] = dict(
                grad_bytes=traffic["all_reduce"] + traffic["reduce_scatter"],
                master=sorted(set((-view.master).tolist())), owned=view.end - view.start,
                master_dtype=str(view.master.dtype))
    return out


def test_fp32_reduction_of_bf16_gradients_is_what_the_optimizer_sees_at_twice_the_bytes():
    assert torch.tensor(FP32_SUM, dtype=torch.bfloat16).item() != FP32_SUM  # bf16 cannot hold the fp32 sum
    halves = [torch.tensor(x / 2, dtype=torch.bfloat16) for x in X]
    assert [h.item() for h in halves] == [x / 2 for x in X] and (halves[0] + halves[1]).item() == BF16_SUM
    for rank, res in enumerate(run_local(_step_once, 2, timeout_s=180)):
        for stage in range(4):
            fp32, bf16 = res[(stage, "fp32")], res[(stage, None)]
            case = f"rank {rank} stage {stage}"
            assert fp32["owned"] > 0 and fp32["master_dtype"] == "torch.float32", (case, fp32)
            assert fp32["master"] == [FP32_SUM], (case, fp32)  # every owned element, exactly
            assert bf16["master"] == [BF16_SUM], (case, bf16)  # what a silent bf16 reduction gives
            assert bf16["grad_bytes"] > 0 and fp32["grad_bytes"] == 2 * bf16["grad_bytes"], (case, fp32, bf16)
