"""The driver's side of the closed memory loop, across the attempts of one job.

``MemoryLoop(plan, progress)`` holds the plan the ranks run now (``choice``, a ``launch.replan.Choice``)
and its prediction, which it hands to the display (``Progress.new_plan``) so the first measured step is
followed by the predicted-vs-measured table. When an attempt ends with a rank out of memory,
``replan(rank, step)`` takes that rank's last measurement (its budget when that was below it: CUDA raised
mid-step, after the last measurement),
records the overshoot, asks ``launch.replan.replan`` for the first candidate that fits the measured
figures, switches to it and returns the one line the driver prints::

    rank 3 ran out of memory at stage 1 (measured 71.90 GB of 72.00 GB, predicted 64.20 GB): restarting
    from step 40 at stage 2 (predicted 41.00 GB)

It raises ``launch.replan.NothingFits`` (one sentence naming what would fit) when no candidate fits or
``job.max_replans`` re-plans are used up. ``save()`` writes ``run_dir/memory.json``: the plan run last,
its prediction, every rank's last measurement and engine report, the budget, and each overshoot with
the re-plan it caused -- what ``hybrid plan --measured RUN_DIR`` re-plans from (``load``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Optional

from launch import replan
from hybrid.units import human_bytes

MEMORY_FILE = "memory.json"


class MemoryLoop:
    def __init__(self, plan, progress):
        self.plan, self.progress = plan, progress
        self.choice = replan.initial_choice(plan)
        self.prediction = replan.predict(plan, self.choice)
        self.overshoots: list[dict] = []
        self.lines: list[str] = []
        self.resume_step: Optional[int] = None
        self.finished: Optional[bool] = None
        progress.new_plan(self.prediction.as_dict())

    def record_attempt(self, ok: bool) -> None:
        self.finished = ok

    def overshoot(self, rank: Optional[int]) -> replan.Overshoot:
        budget = replan.budget_bytes(self.plan)
        m = self.progress.measured.get(rank) if rank is not None else None
        if m is None and self.progress.measured:  # no figure from that rank: the largest one's
            m = max(self.progress.measured.values(), key=lambda x: x["peak_bytes"])
        if m and m.get("budget_bytes"):
            budget = m["budget_bytes"]
        measured = max(m["peak_bytes"], m.get("nvml_used_bytes", 0)) if m else budget
        # Below the budget: CUDA raised mid-step, after the last measurement; the rank hit the wall.
        measured = max(measured, budget)
        predicted = self.prediction.total if not m or m.get("device") != "cuda" else self.prediction.peak
        step = m.get("step", 0) if m else 0
        return replan.Overshoot(rank if rank is not None else -1, float(measured), float(budget), float(predicted),
                                step)

    def replan(self, rank: Optional[int], resume_step: Optional[int]) -> str:
        """Switch to the first plan that fits the measured figures; the line saying so (see the docstring)."""
        over = self.overshoot(rank)
        head = (f"rank {over.rank} ran out of memory at {self.choice.describe()} (measured "
                f"{human_bytes(over.measured)} of {human_bytes(over.budget)}, predicted "
                f"{human_bytes(over.predicted)})")
        record = {"rank": over.rank, "step": over.step, "measured_bytes": over.measured,
                  "budget_bytes": over.budget, "predicted_bytes": over.predicted,
                  "from": dataclasses.asdict(self.choice)}
        self.overshoots.append(record)
        limit = self.plan.spec.job.max_replans
        try:
            choice, prediction = replan.replan(self.plan, self.choice, over)
        except replan.NothingFits as err:
            raise replan.NothingFits(f"{head}, and {err}") from None
        if len(self.lines) >= limit:
            raise replan.NothingFits(
                f"{head}, and job.max_replans ({limit}) allows no more re-plans; it would fit at "
                f"{choice.describe()} (predicted {human_bytes(prediction.total)}): set parallel.zero_stage or "
                f"job.micro_batch accordingly, or raise job.max_replans")
        record["to"] = dataclasses.asdict(choice)
        self.choice, self.prediction, self.resume_step = choice, prediction, resume_step
        origin = f"step {resume_step}" if resume_step is not None else "step 0 (no checkpoint yet)"
        line = f"{head}: restarting from {origin} at {choice.describe()} (predicted {human_bytes(prediction.total)})"
        self.lines.append(line)
        self.progress.new_plan(prediction.as_dict())
        return line

    def as_dict(self) -> dict:
        return {"finished": self.finished, "plan": dataclasses.asdict(self.choice),
                "device": replan.device_of(self.plan), "budget_bytes": replan.budget_bytes(self.plan),
                "predicted": self.prediction.as_dict(),
                "measured": {str(r): m for r, m in sorted(self.progress.measured.items())},
                "engine_reports": {str(r): m for r, m in sorted(self.progress.reports.items())},
                "overshoots": self.overshoots, "replans": self.lines}

    def save(self) -> Optional[Path]:
        """Write ``run_dir/memory.json`` atomically (a crash leaves the previous one); its path."""
        run_dir = self.plan.spec.job.run_dir
        if run_dir is None:
            return None
        path = Path(run_dir) / MEMORY_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.as_dict(), indent=2))
        os.replace(tmp, path)
        return path


def load(run_dir) -> dict:
    """The ``memory.json`` of a run directory (``ConfigError`` naming the path when there is none)."""
    from hybrid.errors import ConfigError

    path = Path(run_dir) / MEMORY_FILE
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict):
            raise ValueError(f"a JSON {type(record).__name__}, not an object")
        return record
    except FileNotFoundError:
        raise ConfigError(f"--measured {run_dir}: there is no {MEMORY_FILE} in it; give the run_dir of a job "
                          "launched with this version (its metrics.jsonl sits beside memory.json)") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"--measured {run_dir}: {path} is unreadable ({err}); give the run_dir of a finished "
                          "or failed job") from None
