"""Start-up cost of sharded construction: per-rank CPU time and peak RSS growth of ``hybrid.initialize``.

A ~100M-parameter built-in GPT is built on the meta device and initialized at ZeRO stage 3 on DP 1, 2 and
4 gloo ranks (one process each, one thread). Each rank draws only the chunks of its own shard (plus the
small persistent parameters), so the CPU time per rank falls with the DP size; the goal is that DP 4
costs at most 0.5x DP 1. For contrast, the same model built the ordinary way (every rank draws the
whole model, then keeps its shard) is measured too.

    .venv/bin/python bench/init_cost.py [--hidden 768 --layers 14] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hybrid  # noqa: E402
from hybrid.runtime.local_launch import run_local  # noqa: E402
from hybrid.models.gpt.model import GPT, GPTConfig  # noqa: E402


def _rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


def _rank(cfg: GPTConfig, meta: bool, stage: int) -> dict:
    before, t0 = _rss(), time.process_time()
    model = GPT(cfg, device="meta") if meta else GPT(cfg, seed=0)
    engine = hybrid.initialize(model, {"zero_optimization": {"stage": stage}, "precision": "bf16"}, seed=0)
    cpu = time.process_time() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"cpu_s": cpu, "rss_growth": peak - before, "states": engine.init_report["model_state_bytes"],
            "params": sum(engine.layout.numels)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    cfg = GPTConfig(vocab_size=8192, seq_len=256, hidden=args.hidden, n_layers=args.layers,
                    n_heads=args.hidden // 64)
    rows = []
    for meta in (True, False):
        for world in [int(w) for w in args.worlds.split(",")]:
            results = run_local(_rank, world, cfg, meta, args.stage, timeout_s=900)
            rows.append({"build": "meta" if meta else "ordinary", "dp": world,
                         "cpu_s": max(r["cpu_s"] for r in results),
                         "rss_growth_mib": max(r["rss_growth"] for r in results) / 2 ** 20,
                         "states_mib": max(r["states"] for r in results) / 2 ** 20, "params": results[0]["params"]})
    base = {r["build"]: r["cpu_s"] for r in rows if r["dp"] == 1}
    for r in rows:
        r["cpu_vs_dp1"] = r["cpu_s"] / base[r["build"]] if base.get(r["build"]) else None
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"GPT {rows[0]['params'] / 1e6:.1f}M parameters, stage {args.stage}, bf16, one thread per rank")
    print("| build | DP | CPU s per rank (max) | vs DP 1 | peak RSS growth MiB | model states MiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['cpu_vs_dp1']:.2f}" if r["cpu_vs_dp1"] is not None else "-"
        print(f"| {r['build']} | {r['dp']} | {r['cpu_s']:.2f} | {ratio} | {r['rss_growth_mib']:.0f} | "
              f"{r['states_mib']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
