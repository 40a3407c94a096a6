"""Entrypoints the launcher tests run on the rank actors (importable as tests.launch.entrypoints:NAME)."""

import ray
import torch
import torch.distributed as dist


def where(ctx):
    """Report this rank's Ray node, its real TP/DP process-group members, and check an all-reduce."""
    t = torch.ones(1)
    ctx.mesh.dp_comm.all_reduce(t)
    ctx.mesh.tp_comm.all_reduce(t)
    ctx.report({"loss": 0.0, "step_time_s": 1.0, "tokens": 0})
    return {"rank": dist.get_rank(), "node_id": ray.get_runtime_context().get_node_id(),
            "tp_group": dist.get_process_group_ranks(ctx.mesh.tp_group),
            "dp_group": dist.get_process_group_ranks(ctx.mesh.dp_group),
            "sum": t.item(), "stage": ctx.stage, "steps": ctx.steps}


def fail_on_rank_1(ctx):
    if ctx.rank == 1:
        raise RuntimeError("rank one is broken on purpose")
    return {"rank": ctx.rank}


def fail_first_attempt(ctx):
    """Rank 1 fails the first time (it leaves a marker in the checkpoint directory), then all succeed."""
    import os

    marker = os.path.join(ctx.settings.checkpoint_dir, "rank1-failed-once")
    if ctx.rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        raise RuntimeError("transient failure")
    return {"rank": ctx.rank}
