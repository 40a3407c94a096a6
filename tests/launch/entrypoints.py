"""Entrypoints the launcher tests run on the rank actors (importable as tests.launch.entrypoints:NAME)."""

import os
import sys
import time
from pathlib import Path

import ray
import torch
import torch.distributed as dist

from hybrid.models.gpt.training import train


def where(ctx):
    """``placement`` of this rank, reported as the job's one step."""
    found = placement(ctx)
    ctx.report({"loss": 0.0, "step_time_s": 1.0, "tokens": 0})
    return found


def train_then_where(ctx):
    """The built-in GPT training, then ``placement`` of this rank (no report of its own: training reported
    every step)."""
    return {"train": train(ctx), "where": placement(ctx)}


def placement(ctx):
    """This rank's Ray node, its real TP/DP process-group members and their timeouts, its torchrun variables
    and where its mesh says it runs, after an all-reduce over DP then TP (``sum``)."""
    t = torch.ones(1)
    ctx.mesh.dp_comm.all_reduce(t)
    ctx.mesh.tp_comm.all_reduce(t)
    return {"rank": dist.get_rank(), "node_id": ray.get_runtime_context().get_node_id(),
            "tp_group": dist.get_process_group_ranks(ctx.mesh.tp_group),
            "dp_group": dist.get_process_group_ranks(ctx.mesh.dp_group),
            "sum": t.item(), "stage": ctx.stage, "steps": ctx.steps,
            "timeouts_s": [_timeout_s(g) for g in (dist.group.WORLD, ctx.mesh.dp_group, ctx.mesh.tp_group)],
            "env": {key: os.environ.get(key) for key in RANK_ENV}, "node_index": ctx.mesh.node_index,
            "local_rank": ctx.mesh.local_rank, "tp": ctx.mesh.tp, "device": str(ctx.device)}


def _timeout_s(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def fail_on_rank_1(ctx):
    if ctx.rank == 1:
        raise RuntimeError("rank one is broken on purpose")
    return {"rank": ctx.rank}


def fail_then_exit_on_rank_1(ctx):
    """Rank 1 raises on the job's first attempt and calls sys.exit(3) on every later one (the file named by
    FAILED_ONCE, in job.env, marks that the first attempt failed)."""
    if ctx.rank == 1:
        marker = Path(os.environ["FAILED_ONCE"])
        if not marker.exists():
            marker.write_text("attempt 1 failed")
            raise RuntimeError("rank one is broken on purpose")
        sys.exit(3)
    return {"rank": ctx.rank}


def train_recording_pid(ctx):
    """The built-in GPT training, after leaving this rank's process id in RUN_DIR/pids/rank{R} for the test
    that kills it."""
    pids = Path(ctx.settings.checkpoint_dir) / "pids"
    pids.mkdir(parents=True, exist_ok=True)
    (pids / f"rank{ctx.rank}").write_text(str(os.getpid()))
    return train(ctx)


def hang_on_rank_1(ctx):
    """Rank 1 never joins a collective (until the driver stops it); the others all-reduce over TP, then DP."""
    if ctx.rank == 1:
        while not ctx.should_stop():
            time.sleep(0.05)
        return {"rank": 1}
    t = torch.ones(1)
    ctx.mesh.tp_comm.all_reduce(t)
    ctx.mesh.dp_comm.all_reduce(t)
    return {"rank": ctx.rank}


RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "GROUP_WORLD_SIZE",
            "MASTER_ADDR", "MASTER_PORT")


SLEEP_S = 120.0  # far past the tests' collective timeout; the driver kills the sleeper when it gives up


def sleep_past_timeout_on_rank_1(ctx, numel: int = 1):
    """Three steps of a TP then a DP all-reduce on every rank; before step 3 rank 1 sleeps for SLEEP_S."""
    t = torch.ones(numel)
    for step in range(3):
        if step == 2 and ctx.rank == 1:
            time.sleep(SLEEP_S)
        ctx.mesh.tp_comm.all_reduce(t)
        ctx.mesh.dp_comm.all_reduce(t)
        ctx.step = step + 1
        ctx.report({"loss": 0.0, "step_time_s": 1.0, "tokens": 0})
    return {"rank": ctx.rank}


def sleep_past_timeout_on_rank_1_shm(ctx):
    """The same with 1 MiB all-reduces, which go through shared memory between the ranks of one host."""
    from hybrid.comm.collectives import SHM_MIN_BYTES

    return sleep_past_timeout_on_rank_1(ctx, SHM_MIN_BYTES // 4)


def train_holding_extra(ctx):
    """The built-in GPT training, plus memory the planner cannot see: from step 2 on (after the first
    checkpoint; after the first step of a resumed attempt) the rank holds a buffer, written so its pages are
    really resident: HOLD_EXTRA_MB MB (job.env), or with HOLD_OVER_BUDGET_MB what takes the rank's resident
    memory that far over its budget at the first hold -- sized once per rank (kept in the run directory), so
    every later attempt holds the same bytes whatever stage it runs at."""
    held = []
    extra = float(os.environ.get("HOLD_EXTRA_MB", "0"))
    over = os.environ.get("HOLD_OVER_BUDGET_MB")

    def size_mb(ctx) -> float:
        if over is None:
            return extra
        path = Path(ctx.settings.checkpoint_dir) / f"hold-rank{ctx.rank}.mb"
        if not path.exists():
            meter = ctx.memory_meter
            # From the resident memory now, not the peak: the buffer (fresh mmap'ed pages) adds to what is
            # resident, and freed heap pages below the peak would otherwise absorb part of it (seen in CI:
            # a hold sized from the peak left the rank 7 MB under its budget).
            now = meter.resident_growth()
            path.write_text(str(max(0.0, (meter.budget_bytes - now) / 1e6 + float(over))))
        return float(path.read_text())

    def hold(ctx, engine, step):
        if step >= 2 and not held:
            mb = size_mb(ctx)
            if mb:
                held.append(torch.ones(int(mb * 1e6 / 4)))

    return train(ctx, after_step=[hold])
