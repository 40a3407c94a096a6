"""Optimizer offload to NVMe vs to host memory, measured on this machine's disk: the step time of each, their
ratio, and the bytes the swap file moves per step.

    .venv/bin/python bench/nvme_offload.py [--model 4M|100M] [--steps 8] [--sub-group-size 1000000] [--dir /tmp]

One process (world size 1, so the rank's shard is the whole model: the most bytes per step), ZeRO stage 1, fp32,
the benchmark's GPT (``bench.workload``) built on meta, AdamW. Each variant runs in a fresh process, 2 warm-up
steps then ``--steps`` timed ones (forward + backward + optimizer step); step time is the median. The NVMe run
keeps its swap file under ``--dir`` (its filesystem is printed, and whether direct I/O took: without it the
page cache, not the disk, serves the reads). Bytes moved: what the swap store read and wrote over the timed
steps, per step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.workload import LARGE, SMALL, Workload, batch  # noqa: E402

MODELS = {"4M": SMALL, "100M": LARGE}
WARMUP = 2


def _run(model: str, device: str, steps: int, sub_group_size: int, directory: str) -> dict:
    import statistics

    import torch

    import hybrid
    from hybrid.models.gpt.model import GPT, GPTConfig

    torch.set_num_threads(1)
    w = Workload(model, MODELS[model], micro_batch=2, warmup=WARMUP, steps=steps, world_size=1)
    offload = {"device": "cpu"} if device == "cpu" else {"device": "nvme", "nvme_path": directory}
    engine = hybrid.initialize(GPT(GPTConfig(**w.model), device="meta"),
                               {"zero_optimization": {"stage": 1, "sub_group_size": sub_group_size,
                                                      "offload_optimizer": offload},
                                "optimizer": {"lr": w.lr, "betas": list(w.betas), "weight_decay": w.weight_decay},
                                "gradient_clipping": 1.0})
    swap = engine.optimizer.swap
    times, moved = [], 0
    for step in range(WARMUP + steps):
        if step == WARMUP and swap is not None:
            moved = swap.bytes_read + swap.bytes_written
        x, y = batch(w, step, 0)
        start = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    out = {"step_s": statistics.median(times), "loss": loss.item(),
           "params": sum(p.numel() for p in engine.module.parameters())}
    if swap is not None:
        out.update(bytes_per_step=(swap.bytes_read + swap.bytes_written - moved) / steps,
                   file_bytes=swap.layout.file_bytes, records=len(swap.layout.records), direct=swap.direct,
                   host_buffers=swap.host_bytes)
    engine.close()
    return out


def _fresh(args, device: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", device, "--model", args.model, "--steps",
           str(args.steps), "--sub-group-size", str(args.sub_group_size), "--dir", args.dir]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if done.returncode:
        raise SystemExit(f"the {device} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _filesystem(path: str) -> str:
    best = ("?", "")
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, point, kind = line.split()[:3]
            if (path + "/").startswith(point.rstrip("/") + "/") and len(point) > len(best[1]):
                best = (kind, point)
    return f"{best[0]} at {best[1]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="4M")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--sub-group-size", type=int, default=1_000_000)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--child", choices=("cpu", "nvme"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_run(args.model, args.child, args.steps, args.sub_group_size, args.dir)))
        return
    from hybrid.config.units import human_bytes

    cpu, nvme = _fresh(args, "cpu"), _fresh(args, "nvme")
    assert cpu["loss"] == nvme["loss"], (cpu["loss"], nvme["loss"])  # the same training, bit for bit
    print(f"model {args.model} ({cpu['params'] / 1e6:.1f}M parameters), world 1, stage 1, fp32, AdamW, "
          f"sub_group_size {args.sub_group_size:,} ({nvme['records']} records), {args.steps} timed steps")
    print(f"swap file under {args.dir} ({_filesystem(os.path.realpath(args.dir))}, direct I/O "
          f"{'on' if nvme['direct'] else 'off: the page cache serves it'}): {human_bytes(nvme['file_bytes'])}, "
          f"host buffers {human_bytes(nvme['host_buffers'])}")
    print("| offload | step time (ms) | swap bytes moved per step |")
    print("|---|---:|---:|")
    print(f"| cpu | {cpu['step_s'] * 1e3:.1f} | - |")
    print(f"| nvme | {nvme['step_s'] * 1e3:.1f} | {human_bytes(nvme['bytes_per_step'])} "
          f"(read + written) |")
    print(f"step time NVMe / CPU offload: {nvme['step_s'] / cpu['step_s']:.2f}; losses equal bit for bit")


if __name__ == "__main__":
    main()
