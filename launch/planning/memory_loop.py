"""The driver's side of the closed memory loop, across the attempts of one job.

``MemoryLoop(plan, progress)`` holds the plan the ranks run now (``choice``, a ``launch.planning.replan.Choice``)
and its prediction, which it hands to the display (``Progress.new_plan``) so the first measured step is
followed by the predicted-vs-measured table. When an attempt ends with a rank out of memory,
``replan(rank, step)`` takes that rank's last measurement (its budget when that was below it: CUDA raised
mid-step, after the last measurement),
records the overshoot, asks ``launch.planning.replan.replan`` for the first candidate that fits the measured
figures, switches to it and returns the one line the driver prints::

    rank 3 ran out of memory at stage 1 (measured 71.90 GB of 72.00 GB, predicted 64.20 GB): restarting
    from step 40 at stage 2 (predicted 41.00 GB)

It raises ``launch.planning.replan.NothingFits`` (one sentence naming what would fit) when no candidate fits or
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

from launch.planning import replan
from hybrid.config import validate as v
from hybrid.errors import ConfigError
from hybrid.config.yamlfile import read_regular_file
from hybrid.config.units import human_bytes

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
    """The ``memory.json`` of a run directory with its figures checked (``check_record``); ``ConfigError`` of one
    sentence naming the run directory when there is none, it cannot be read or parsed, or a field is wrong."""
    path = Path(run_dir) / MEMORY_FILE
    if not path.exists():
        raise ConfigError(f"--measured {run_dir}: there is no {MEMORY_FILE} in it; give the run_dir of a job "
                          "launched with this version (its metrics.jsonl sits beside memory.json)")
    text = read_regular_file(path, f"--measured {run_dir}: {path}", "give the run_dir of a finished or failed job")
    try:
        # every number as a float, as the re-plan uses them: Python refuses an integer of over 4300 digits,
        # and a float past its range is inf, which the check refuses
        record = json.loads(text, parse_int=float)
        if not isinstance(record, dict):
            raise ValueError(f"a JSON {type(record).__name__}, not an object")
    except RecursionError:
        raise ConfigError(f"--measured {run_dir}: {path} nests too deeply to be a {MEMORY_FILE}; give the run_dir "
                          "of a finished or failed job") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"--measured {run_dir}: {path} is unreadable ({err}); give the run_dir of a finished "
                          "or failed job") from None
    try:
        return check_record(record)
    except ConfigError as err:
        raise ConfigError(f"--measured {run_dir}: its {MEMORY_FILE} lacks or garbles a field "
                          f"({str(err).rstrip('.')}); give the run_dir of a job launched with this version") from None


def check_record(record: dict) -> dict:
    """``record`` with what ``launch.planning.replan.from_measured`` reads checked and made floats (``step`` an int):
    each rank of ``measured`` (a whole-number key) with ``peak_bytes`` and, where given (a null is not),
    ``nvml_used_bytes`` and ``budget_bytes`` finite numbers at least 0, ``step`` a whole number at least 0;
    when any rank measured, ``predicted.total`` (and ``predicted.peak`` where a rank ran on CUDA) a finite
    number at least 0, as each is where given. ``ConfigError`` names the field."""
    measured = v.mapping("measured", record.get("measured") or {})
    checked = {rank: _rank_figures(v.join("measured", v.key_name(rank)), rank, m) for rank, m in measured.items()}
    if not checked:
        return {**record, "measured": {}}
    predicted = v.mapping("predicted", v.required(record, "", "predicted", "the run's prediction"))
    # the figure a rank's measurement is set against (from_measured): peak allocated on CUDA, else the total
    needed = ("peak", "total") if any(m.get("device") == "cuda" for m in checked.values()) else ("total",)
    for key in ("peak", "total"):
        if key in predicted or key in needed:
            predicted[key] = v.number(v.join("predicted", key), v.required(predicted, "predicted", key, "bytes"), 0,
                                      unit="bytes")
    return {**record, "measured": checked, "predicted": predicted}


def _rank_figures(path: str, rank: str, m) -> dict:
    if not (rank.isascii() and rank.isdecimal()):
        raise ConfigError(f"the key {v.quote(rank, 40)} of measured must be a rank, a whole number.")
    m = v.without_nulls(v.mapping(path, m))  # a null figure is one not measured: the re-plan's default applies
    v.required(m, path, "peak_bytes", "bytes")
    for key in ("peak_bytes", "nvml_used_bytes", "budget_bytes"):
        if key in m:
            m[key] = v.number(v.join(path, key), m[key], 0, unit="bytes")
    if "step" in m:
        m["step"] = v.integer(v.join(path, "step"), m["step"], 0, whole_floats=True)
    return m
