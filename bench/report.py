"""Turn per-rank measurements into rows, checks and the RESULTS.md text (pure functions).

* ``summarize(impl, stage, workload, per_rank)`` -> ``Row``: median over timed steps of the slowest rank's
  step time, the largest per-rank peak RSS and model-state bytes, the global loss of every step.
* ``loss_disagreements(rows, tol)``: steps where implementations' losses differ by more than ``tol``
  (relative to the step's median loss); the benchmark refuses to report times when this is non-empty.
* ``stage_summary(rows)``: hybrid's time and memory ratios against the best peer at each stage.
* ``traffic_ratios(rows)``: hybrid's measured bytes per step at each stage over stage 0, against the seed
  (stage 3 = 1.5x, stages 1-2 = 1.0x).
* ``render(...)`` the Markdown tables.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Optional

MiB = 1 << 20
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}
TIME_TARGET, MEMORY_TARGET = 0.9, 1.0
SEED_TRAFFIC_RATIO = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.5}
TRAFFIC_TOLERANCE = 0.02


@dataclass
class Row:
    impl: str
    stage: int
    size: str
    precision: str
    step_s: float = float("nan")
    peak_rss: int = 0             # bytes, largest over ranks
    delta_rss: int = 0            # bytes above the rank's RSS before the model was built, largest over ranks
    state_bytes: int = 0          # bytes, largest over ranks
    traffic: Optional[dict] = None  # bytes per step by op kind (hybrid only)
    losses: list = field(default_factory=list)
    wall_s: float = 0.0           # the whole spawned run, including start-up
    error: str = ""
    math_note: str = ""           # why this run's losses are not expected to match (left out of the check)

    @property
    def key(self) -> str:
        return f"{self.impl}:{self.stage}"


def summarize(impl: str, stage: int, size: str, precision: str, per_rank: list[dict], wall_s: float) -> Row:
    n_steps = len(per_rank[0]["times"])
    slowest = [max(r["times"][i] for r in per_rank) for i in range(n_steps)]
    n_losses = len(per_rank[0]["losses"])
    losses = [sum(r["losses"][i] for r in per_rank) / len(per_rank) for i in range(n_losses)]
    return Row(impl, stage, size, precision,
               step_s=statistics.median(slowest),
               peak_rss=max(r["peak_rss"] for r in per_rank),
               delta_rss=max(r["peak_rss"] - r["rss_before"] for r in per_rank),
               state_bytes=max(r["state_bytes"] for r in per_rank),
               traffic=per_rank[0]["traffic"],
               losses=losses, wall_s=wall_s)


def _comparable(rows: list[Row]) -> list[Row]:
    return [r for r in rows if not r.error and not r.math_note]


def loss_disagreements(rows: list[Row], tol: float) -> list[str]:
    ok = _comparable(rows)
    if len(ok) < 2:
        return []
    problems = []
    for step in range(min(len(r.losses) for r in ok)):
        values = {r.key: r.losses[step] for r in ok}
        mid = statistics.median(values.values())
        lo, hi = min(values, key=values.get), max(values, key=values.get)
        spread = (values[hi] - values[lo]) / abs(mid)
        if not spread <= tol:  # also catches NaN
            problems.append(f"step {step}: {lo}={values[lo]:.6g} vs {hi}={values[hi]:.6g} "
                            f"(relative spread {spread:.2e} > {tol:g})")
    return problems


def max_loss_spread(rows: list[Row]) -> float:
    ok = _comparable(rows)
    if len(ok) < 2:
        return 0.0
    spreads = []
    for step in range(min(len(r.losses) for r in ok)):
        values = [r.losses[step] for r in ok]
        spreads.append((max(values) - min(values)) / abs(statistics.median(values)))
    return max(spreads)


@dataclass
class StageSummary:
    stage: int
    time_ratio: float      # hybrid step time / fastest peer's
    fastest: str
    memory_ratio: float    # hybrid peak RSS growth / leanest peer's
    leanest: str

    @property
    def time_ok(self) -> bool:
        return self.time_ratio <= TIME_TARGET

    @property
    def memory_ok(self) -> bool:
        return self.memory_ratio <= MEMORY_TARGET


def stage_summary(rows: list[Row]) -> list[StageSummary]:
    out = []
    for stage in range(4):
        ours = [r for r in rows if r.impl == "hybrid" and r.stage == stage and not r.error]
        theirs = [r for r in rows if r.impl != "hybrid" and r.stage == stage and not r.error]
        if not ours or not theirs:
            continue
        fastest = min(theirs, key=lambda r: r.step_s)
        leanest = min(theirs, key=lambda r: r.delta_rss)
        out.append(StageSummary(stage, ours[0].step_s / fastest.step_s, fastest.key,
                                ours[0].delta_rss / max(leanest.delta_rss, 1), leanest.key))
    return out


def traffic_ratios(rows: list[Row]) -> dict[int, float]:
    """hybrid's bytes per step at each stage over its stage-0 bytes."""
    by_stage = {r.stage: r.traffic["total"] for r in rows if r.impl == "hybrid" and r.traffic and not r.error}
    if not by_stage.get(0):
        return {}
    return {s: by_stage[s] / by_stage[0] for s in sorted(by_stage)}


def traffic_mismatches(ratios: dict[int, float]) -> list[str]:
    return [f"stage {s}: measured {ratio:.3f}x stage 0, seed says {SEED_TRAFFIC_RATIO[s]:.1f}x"
            for s, ratio in ratios.items() if abs(ratio - SEED_TRAFFIC_RATIO[s]) > TRAFFIC_TOLERANCE]


# --- Markdown ------------------------------------------------------------------------------------

def render_rows(rows: list[Row], labels: dict[str, str]) -> str:
    hybrid_time = {r.stage: r.step_s for r in rows if r.impl == "hybrid" and not r.error}
    lines = ["| implementation | stage | step time (ms) | vs hybrid | peak RSS (MiB) | RSS growth (MiB) "
             "| model states (MiB/rank) | traffic (MiB/step) | final loss |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r.stage, r.impl != "hybrid", r.impl)):
        name = labels.get(r.impl, r.impl) + (" (*)" if r.math_note else "")
        if r.error:
            lines.append(f"| {name} | {r.stage} | failed: {r.error} | | | | | | |")
            continue
        ratio = r.step_s / hybrid_time[r.stage] if r.stage in hybrid_time else float("nan")
        traffic = f"{r.traffic['total'] / MiB:.2f}" if r.traffic else "n/a"
        lines.append(f"| {name} | {r.stage} | {r.step_s * 1e3:.1f} | {ratio:.2f} | {r.peak_rss / MiB:.0f} "
                     f"| {r.delta_rss / MiB:.0f} | {r.state_bytes / MiB:.2f} | {traffic} | {r.losses[-1]:.4f} |")
    return "\n".join(lines)


def render_summary(summaries: list[StageSummary]) -> str:
    lines = ["| stage | hybrid time / fastest peer | target 0.9 | hybrid RSS growth / leanest peer | target 1.0 |",
             "|---:|---:|---|---:|---|"]
    for s in summaries:
        t = "met" if s.time_ok else f"missed by {(s.time_ratio / TIME_TARGET - 1) * 100:.1f}%"
        m = "met" if s.memory_ok else f"missed by {(s.memory_ratio / MEMORY_TARGET - 1) * 100:.1f}%"
        lines.append(f"| {s.stage} | {s.time_ratio:.2f} ({s.fastest}) | {t} | {s.memory_ratio:.2f} ({s.leanest}) "
                     f"| {m} |")
    return "\n".join(lines)


def render_traffic(ratios: dict[int, float]) -> str:
    if not ratios:
        return "(hybrid traffic not measured)"
    cells = ", ".join(f"stage {s}: {r:.3f}x (seed {SEED_TRAFFIC_RATIO[s]:.1f}x)" for s, r in ratios.items())
    return f"hybrid traffic per step / stage 0: {cells}"
