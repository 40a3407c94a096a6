"""The compute floor alone vs two floor processes side by side: what sharing the machine costs by itself.

``floor`` (bench/peers.py) runs one process alone; a hybrid row runs two ranks that share the cores' memory
bandwidth and caches. This runs the floor once with one process and once with two (each its own rows, no
collective in the step), and prints both step times (median over the timed steps, slowest rank).

    .venv/bin/python bench/floor_side_by_side.py
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["OMP_NUM_THREADS"] = "1"

CASES = [(name, precision) for name in ("4M", "4M-seq256", "100M") for precision in ("fp32", "bf16")]


def main() -> int:
    from bench.measure import run_rank
    from bench.workload import workloads
    from hybrid.runtime.local_launch import run_local

    by_name = {w.name: w for w in workloads(False)}
    for name, precision in CASES:
        w = by_name[name].with_precision(precision)
        ms = {}
        for n in (1, 2):
            ranks = run_local(run_rank, n, "floor", 0, w, False, timeout_s=600, threads=1)
            ms[n] = max(statistics.median(r["times"]) for r in ranks) * 1e3
        print(f"{name} {precision}: floor alone {ms[1]:.1f} ms, two floors side by side {ms[2]:.1f} ms "
              f"({ms[2] / ms[1]:.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
