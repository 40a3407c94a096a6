"""Turn per-rank measurements into rows, checks and the RESULTS.md text (pure functions).

* ``summarize(impl, stage, workload, per_rank)`` -> ``Row``: median over timed steps of the slowest rank's
  step time, the largest per-rank peak RSS and model-state bytes, the global loss of every step.
* ``combine_passes(passes)`` -> ``Row``: one row from the same run repeated: the lower median of the passes'
  step times (with 2 passes: the faster), their spread, the largest RSS and model-state bytes.
* ``loss_disagreements(rows, tol)``: steps where implementations' losses differ by more than ``tol``
  (relative to the step's median loss); the benchmark refuses to report times when this is non-empty.
* ``stage_summary(rows)``: at each stage, hybrid's step time over the compute floor's and over the fastest
  peer's, and its RSS growth over the leanest peer's, each against the issue's target.
* ``traffic_ratios(rows)``: hybrid's measured bytes per step at each stage over stage 0, against the seed
  (stage 3 = 1.5x, stages 1-2 = 1.0x).
* ``render(...)`` the Markdown tables.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Optional

from bench.peers import FLOOR, is_peer

MiB = 1 << 20
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}
TIME_TARGET, MEMORY_TARGET = 0.9, 1.0  # hybrid / fastest peer (step time), hybrid / leanest peer (RSS growth)
FLOOR_TARGET = {0: 1.05, 1: 1.05, 2: 1.05, 3: 1.15}  # hybrid / compute floor (step time)
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
    pass_times: list = field(default_factory=list)  # step_s of each pass (combine_passes)

    @property
    def key(self) -> str:
        return f"{self.impl}:{self.stage}"

    @property
    def pass_spread(self) -> float:
        """(slowest - fastest) / fastest pass step time; 0 with a single pass."""
        if len(self.pass_times) < 2:
            return 0.0
        return max(self.pass_times) / min(self.pass_times) - 1


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


def combine_passes(passes: list[Row]) -> Row:
    """One row from the passes of the same run: the pass whose step time is the lower median (with 2 passes
    the faster one) gives the time, losses and traffic; RSS and model states are the largest over passes;
    wall time is the sum. A failed pass makes the row failed."""
    failed = [r for r in passes if r.error]
    if failed:
        return dataclasses.replace(failed[0], wall_s=sum(r.wall_s for r in passes))
    times = [r.step_s for r in passes]
    chosen = next(r for r in passes if r.step_s == statistics.median_low(times))
    return dataclasses.replace(chosen, peak_rss=max(r.peak_rss for r in passes),
                               delta_rss=max(r.delta_rss for r in passes),
                               state_bytes=max(r.state_bytes for r in passes),
                               wall_s=sum(r.wall_s for r in passes), pass_times=times)


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
    floor_ratio: Optional[float]   # hybrid step time / the compute floor's (None: the floor did not run)
    time_ratio: Optional[float]    # hybrid step time / fastest peer's (None: no peer at this stage)
    fastest: str
    memory_ratio: Optional[float]  # hybrid peak RSS growth / leanest peer's
    leanest: str

    @property
    def floor_target(self) -> float:
        return FLOOR_TARGET[self.stage]

    @property
    def floor_ok(self) -> bool:
        return self.floor_ratio is not None and self.floor_ratio <= self.floor_target

    @property
    def time_ok(self) -> bool:
        return self.time_ratio is not None and self.time_ratio <= TIME_TARGET

    @property
    def memory_ok(self) -> bool:
        return self.memory_ratio is not None and self.memory_ratio <= MEMORY_TARGET


def stage_summary(rows: list[Row]) -> list[StageSummary]:
    """Per stage where hybrid ran and the floor or a peer did too: hybrid's ratios to them."""
    ok = [r for r in rows if not r.error]
    floor = next((r for r in ok if r.impl == FLOOR), None)
    out = []
    for stage in range(4):
        ours = next((r for r in ok if r.impl == "hybrid" and r.stage == stage), None)
        theirs = [r for r in ok if is_peer(r.impl) and r.stage == stage]
        if ours is None or not (theirs or floor):
            continue
        fastest = min(theirs, key=lambda r: r.step_s, default=None)
        leanest = min(theirs, key=lambda r: r.delta_rss, default=None)
        out.append(StageSummary(
            stage,
            floor_ratio=ours.step_s / floor.step_s if floor else None,
            time_ratio=ours.step_s / fastest.step_s if fastest else None,
            fastest=fastest.key if fastest else "",
            memory_ratio=ours.delta_rss / max(leanest.delta_rss, 1) if leanest else None,
            leanest=leanest.key if leanest else ""))
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
    """The per-run table: hybrid first at each stage, then its peers; the floor (no stage) first of all."""
    hybrid_time = {r.stage: r.step_s for r in rows if r.impl == "hybrid" and not r.error}
    lines = ["| implementation | stage | step time (ms) | pass spread % | vs hybrid | peak RSS (MiB) "
             "| RSS growth (MiB) | model states (MiB/rank) | traffic (MiB/step) | final loss |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r.impl != FLOOR, r.stage, r.impl != "hybrid", r.impl)):
        name = labels.get(r.impl, r.impl) + (" (*)" if r.math_note else "")
        stage = "any" if r.impl == FLOOR else r.stage
        if r.error:
            lines.append(f"| {name} | {stage} | failed: {r.error} | | | | | | | |")
            continue
        if r.impl == FLOOR:
            ratio = "--"  # compared with every stage in the summary below
        else:
            ratio = f"{r.step_s / hybrid_time[r.stage]:.2f}" if r.stage in hybrid_time else "n/a"
        traffic = f"{r.traffic['total'] / MiB:.2f}" if r.traffic else "n/a"
        lines.append(f"| {name} | {stage} | {r.step_s * 1e3:.1f} | {r.pass_spread * 100:.1f} | {ratio} "
                     f"| {r.peak_rss / MiB:.0f} | {r.delta_rss / MiB:.0f} | {r.state_bytes / MiB:.2f} | {traffic} "
                     f"| {r.losses[-1]:.4f} |")
    return "\n".join(lines)


def render_summary(summaries: list[StageSummary]) -> str:
    """The targets, then hybrid's three ratios per stage, each followed by whether it meets its target."""
    lines = [render_targets(), "",
             f"| stage | hybrid time / floor | target | hybrid time / fastest peer | target <= {TIME_TARGET:g} "
             f"| hybrid RSS growth / leanest peer | target <= {MEMORY_TARGET:g} |",
             "|---:|---:|---|---:|---|---:|---|"]
    for s in summaries:
        floor = _ratio_cells(s.floor_ratio, s.floor_ok, "")
        time = _ratio_cells(s.time_ratio, s.time_ok, s.fastest)
        memory = _ratio_cells(s.memory_ratio, s.memory_ok, s.leanest)
        lines.append(f"| {s.stage} | {floor[0]} | <= {s.floor_target:g}: {floor[1]} | {time[0]} | {time[1]} "
                     f"| {memory[0]} | {memory[1]} |")
    return "\n".join(lines)


def render_targets() -> str:
    """The issue's targets in one sentence, from ``FLOOR_TARGET``, ``TIME_TARGET`` and ``MEMORY_TARGET``."""
    stages_by_target: dict[float, list[str]] = {}
    for stage, target in FLOOR_TARGET.items():
        stages_by_target.setdefault(target, []).append(str(stage))
    floor = " and ".join(f"{t:g}x at stage{'s' if len(st) > 1 else ''} {', '.join(st)}"
                         for t, st in stages_by_target.items())
    return (f"Targets: hybrid step time <= the compute floor's {floor}, and <= {TIME_TARGET:g}x the fastest "
            f"peer's; hybrid RSS growth <= {MEMORY_TARGET:g}x the leanest peer's.")


def _ratio_cells(ratio: Optional[float], ok: bool, against: str) -> tuple[str, str]:
    """("ratio (against)", "yes" | "no (ratio)"), or ("n/a", "n/a") when there was nothing to compare with."""
    if ratio is None:
        return "n/a", "n/a"
    value = f"{ratio:.2f}" + (f" ({against})" if against else "")
    return value, "yes" if ok else f"no ({ratio:.2f})"


def render_traffic(ratios: dict[int, float]) -> str:
    if not ratios:
        return "(hybrid traffic not measured)"
    cells = ", ".join(f"stage {s}: {r:.3f}x (seed {SEED_TRAFFIC_RATIO[s]:.1f}x)" for s, r in ratios.items())
    return f"hybrid traffic per step / stage 0: {cells}"
