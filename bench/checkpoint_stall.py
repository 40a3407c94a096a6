"""How long training stops for a checkpoint, synchronous against asynchronous (``job.checkpoint.async``).

    .venv/bin/python bench/checkpoint_stall.py [--model 105M|4M] [--steps 6] [--every 2] [--dir /tmp]

Two gloo ranks (one process each), ZeRO stage 1, fp32, the benchmark's GPT (``bench.workload``'s 100M with a
13th layer: 104.8M parameters), AdamW, trained by ``hybrid.runtime.train.run_steps`` exactly as a launched job
is, saving every ``--every`` steps and at the last into a fresh run directory under ``--dir``: once
synchronously, once in the background. Per save, rank 0's report: the checkpoint's bytes, the stall (training
stopped: the whole save when synchronous; the wait for the previous write, the manifest and the host copy when
asynchronous) and the write's seconds; per run, the median step time (forward + backward + optimizer step,
without the saves: a background write competes with the steps for the cores) and the seconds of the whole run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.workload import LARGE, SMALL, Workload, batch  # noqa: E402

# bench.workload's 100M GPT is 97.7M parameters; one more layer makes it 104.8M, above the 100M the issue asks for
MODELS = {"4M": SMALL, "105M": dict(LARGE, n_layers=LARGE["n_layers"] + 1)}
WORLD = 2


def _rank(model: str, steps: int, every: int, run_dir: str, background: bool) -> dict:
    import torch
    import torch.distributed as dist

    import hybrid
    from hybrid.comm.mesh import build_mesh
    from hybrid.models.gpt.model import GPT, GPTConfig
    from hybrid.runtime.train import Context, JobSettings, run_steps

    torch.set_num_threads(1)
    w = Workload(model, MODELS[model], micro_batch=2, warmup=0, steps=steps, world_size=WORLD)
    mesh = build_mesh(tp=1, dp=WORLD)
    engine = hybrid.initialize(GPT(GPTConfig(**w.model), seed=w.seed),
                               {"zero_optimization": {"stage": 1}, "gradient_clipping": 1.0,
                                "optimizer": {"lr": w.lr, "betas": list(w.betas), "weight_decay": w.weight_decay}},
                               dp_group=mesh.dp_group)
    reports = []
    settings = JobSettings(steps=steps, micro_batch=2, stage=1, precision="fp32", checkpoint_dir=run_dir,
                           checkpoint_every=every, checkpoint_keep_last=1, checkpoint_async=background)
    ctx = Context(mesh, {}, settings, rank=dist.get_rank(), world_size=WORLD, reporter=reports.append)
    started = time.perf_counter()
    run_steps(ctx, engine, lambda step: batch(w, step, mesh.dp_rank))
    seconds = time.perf_counter() - started
    return {"params": sum(p.numel() for p in engine.module.parameters()), "seconds": seconds,
            "step_s": statistics.median(r["step_time_s"] for r in reports if "loss" in r),
            "saves": [{k: r[k] for k in ("checkpoint_saved", "checkpoint_bytes", "checkpoint_stall_s",
                                         "checkpoint_write_s")} for r in reports if "checkpoint_saved" in r]}


def main() -> None:
    from hybrid.config.units import human_bytes
    from hybrid.runtime.local_launch import run_local

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="105M")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    rows = {}
    for background in (False, True):
        run_dir = tempfile.mkdtemp(prefix="hybrid-ckpt-stall-", dir=args.dir)
        try:
            rows[background] = run_local(_rank, WORLD, args.model, args.steps, args.every, run_dir, background,
                                         timeout_s=1800)[0]
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
    params = rows[False]["params"]
    print(f"model: {params / 1e6:.1f}M parameters, {WORLD} gloo ranks, ZeRO stage 1, fp32; "
          f"{args.steps} steps, a save every {args.every} and at the last")
    print("| save | step | checkpoint | stall (s) | write (s) |")
    print("|---|---:|---:|---:|---:|")
    for background, row in rows.items():
        for s in row["saves"]:
            print(f"| {'async' if background else 'sync'} | {s['checkpoint_saved']} | "
                  f"{human_bytes(s['checkpoint_bytes'])} | {s['checkpoint_stall_s']:.3f} | "
                  f"{s['checkpoint_write_s']:.3f} |")
    for background, row in rows.items():
        stall = statistics.median(s["checkpoint_stall_s"] for s in row["saves"])
        print(f"{'async' if background else 'sync'}: median stall {stall:.3f} s per save, median step "
              f"{row['step_s']:.3f} s, run {row['seconds']:.1f} s")
    print(json.dumps({("async" if k else "sync"): v for k, v in rows.items()}))


if __name__ == "__main__":
    main()
