"""The plan's calibration on an embedded local cluster: a short probe of CPU ranks on this machine before the plan
is printed, so the predicted step time is this machine's and not the tables'.

An embedded cluster (``cluster.address: local``) runs its ranks as processes of this host, on CPU with gloo, so
the driver can measure them itself: ``calibrate_local(spec)`` starts the cluster's world of ranks here
(``hybrid.runtime.local_launch.run_local``: forked, no Ray actors), each calling
``hybrid.runtime.probe.measure_rank(..., quick=True)`` -- collectives inside and across the simulated nodes timed
in training's rhythm (after compute on every rank at once, where a call also waits for its peers' turns on the
shared cores), the matmul, eager op and copy rates each rank alone for a moment -- and returns
``launch.planning.probe_figures.summarize``'s figures with ``quick: True`` and the seconds it took (a few on a
2-core host, most of it starting the ranks; the op rate's op count is counted once, here). They stand in for ``probe.json``,
which ``hybrid probe`` writes and which wins where there is one; nothing is written. ``calibration_line`` is the
line the launch prints. ``HYBRID_LOCAL_CALIBRATION=0`` plans from the tables instead (``wanted``; the test suite
sets it: its launches compare no timings, and a probe per launch would cost CI minutes).

Why (issue 44): the tables' loopback link priced a small collective at 100 us, once per call; on 4 ranks of a
2-core host a TP all-reduce in training took 1.5-4 ms, and a ring of 4 ranks about three times a ring of 2's, so
the demo's 13 TP and 3 DP calls per step were most of its measured 41-59 ms against a predicted 5 ms.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

from launch.planning.probe_figures import summarize

log = logging.getLogger(__name__)

QUICK_TIMEOUT_S = 120.0
SWITCH = "HYBRID_LOCAL_CALIBRATION"  # 0 / false / off / no: plan from the tables (the test suite's setting)


def wanted(spec, use_gpus: bool) -> bool:
    """Whether a launch of ``spec`` calibrates here: an embedded cluster of CPU ranks, unless ``SWITCH`` is off."""
    off = os.environ.get(SWITCH, "1").strip().lower() in ("0", "false", "off", "no")
    return spec.cluster.is_local and not use_gpus and not off


def _measure_here(ranks_per_node: int, precision: str, op_count: int) -> dict:
    import torch.distributed as dist

    from hybrid.runtime.probe import measure_rank

    return measure_rank(dist.get_rank(), dist.get_world_size(), ranks_per_node, "cpu", precision, quick=True,
                        op_count=op_count)


def calibrate_local(spec) -> Optional[dict]:
    """The quick probe's figures for ``spec``'s embedded cluster (see the module docstring); None, with a warning
    saying why, where the probe did not finish (the plan then takes the tables: a calibration never stops a job)."""
    from hybrid.runtime.local_launch import LocalRunError, run_local
    from hybrid.runtime.probe import op_block_count

    c = spec.cluster
    started = time.perf_counter()
    try:
        ranks = run_local(_measure_here, c.world_size, c.gpus_per_node, spec.parallel.precision, op_block_count(),
                          timeout_s=QUICK_TIMEOUT_S)
    except (LocalRunError, OSError, TimeoutError) as err:
        last = [line for line in str(err).splitlines() if line.strip()][-1:] or [type(err).__name__]
        log.warning("the calibration probe did not finish (%s); the plan uses the tables", last[0].strip()[:300])
        return None
    figures = summarize(ranks, c.nodes, c.gpus_per_node, spec.parallel.precision, "local (quick probe)")
    figures.update(quick=True, seconds=time.perf_counter() - started)
    return figures


def calibration_line(figures: Optional[dict]) -> str:
    """What the quick probe measured, in one line (or that it measured nothing)."""
    if figures is None:
        return "probe   the calibration probe did not finish (see the warning above); the plan uses the tables"
    parts = []
    for key, name in (("intra", "inside a node"), ("inter", "across nodes")):
        g = figures.get(key)
        if g:
            parts.append(f"{name} {g['latency'] * 1e3:.2g} ms per call of {g['group_size']} ranks, "
                         f"{g['bandwidth'] / 1e9:.2g} GB/s")
    matmul = next(iter(figures["matmul_flops"].values()))
    parts.append(f"matmul {matmul / 1e9:.3g} GFLOP/s")
    if figures.get("op_rate"):
        parts.append(f"{1e6 / figures['op_rate']:.3g} us per eager op")
    return (f"probe   calibrated on this machine in {figures.get('seconds', 0):.1f} s ({figures['nodes']} x "
            f"{figures['gpus_per_node']} CPU ranks, collectives after compute, rates at each rank's share of the "
            f"cores): {'; '.join(parts)}; hybrid probe measures more and keeps it in probe.json")
