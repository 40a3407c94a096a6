"""What a job leaves in its run directory: one metrics line per step, TensorBoard events, where the logs are.

``step_entry(step, records)`` turns every rank's report of one step into the job's view of it (pure): the
loss (mean over the DP ranks; the TP ranks of a group agree), the learning rate and gradient norm (rank
0's: the norm is global), the slowest rank's step time, the throughput in the unit the entrypoint
declared (``throughput_unit``: tokens, samples, ...), the model-state bytes per rank and how many ranks
reported. A step some rank never reported -- it died with the reports still buffered, and the job restarts
from a checkpoint at or after that step -- is built from the ranks that did: its loss stays exact as long as
every DP group kept one rank, since the TP ranks of a group agree.

Held-out evaluation (``hybrid.runtime.evaluate``): a step after which the ranks evaluated carries ``EVAL_FIELDS``
(``eval_loss``, the DP mean every rank reports; ``eval_ppl``; ``eval_time_s``) in its entry; TensorBoard files
them under ``eval/`` (``eval/loss``, ...), and ``summary_lines`` names the last evaluation.

``MetricsWriter(run_dir)`` appends each entry to ``run_dir/metrics.jsonl`` as one JSON object per line and,
when the ``tensorboard`` package is installed, to event files under ``run_dir/tensorboard``. A line for
step ``s`` replaces every line for steps ``>= s`` already in the file (``lines_before``): a job that
restarts from checkpoint ``K`` -- within one launch or in a later one -- rewrites steps ``K+1 ...``, so the
file never holds a step twice and never misses one the finished job ran. TensorBoard gets the same rule
through its ``purge_step``.

Time (the plan's time model, ``hybrid.plan.cost``): each entry carries ``predicted_step_s``, the predicted step
time of the layout the ranks run, beside the measured ``step_time_s``; ``measured_step_s(history)`` is the
median of the measured ones after the first ``WARMUP_STEPS`` (allocation, first-touch pages, the optimizer's
state), ``time_line`` the summary's sentence comparing the two, and ``time_record`` what the driver writes to
``run_dir/time.json`` (``TIME_FILE``): the layout run, both figures and the terms of the prediction -- what
``hybrid plan --measured RUN_DIR`` calibrates the compute efficiency from.

``ray_log_dir()`` says where Ray keeps the ranks' full stdout and stderr (the driver prints only what the
log monitor forwards); ``summary_lines`` is what the driver prints under the run summary.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
from pathlib import Path
from typing import Any, Iterable, Optional

from hybrid.config.units import human_bytes

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TIME_FILE = "time.json"
WARMUP_STEPS = 3  # steps a step-time comparison leaves out: the first ones allocate and fault pages in
TENSORBOARD_DIR = "tensorboard"
FINAL_STEPS = 10  # the summary's final loss is the mean of this many last steps (one step's loss is noisy)


def model_state_bytes(memory) -> Optional[float]:
    """The model-state bytes (params + grads + optimizer states) in an engine memory report."""
    if isinstance(memory, (int, float)):
        return float(memory)
    if not isinstance(memory, dict):
        return None
    for key in ("model_states", "model_state_bytes", "total"):
        if key in memory:
            return model_state_bytes(memory[key])
    parts = [memory.get(k) for k in ("params", "grads", "optimizer")]
    if all(isinstance(v, (int, float)) for v in parts):
        return float(sum(parts))
    return None


def step_entry(step: int, records: dict[int, dict]) -> dict:
    """The job's metrics of ``step`` from each rank's report (rank -> record): the loss averaged over the DP
    ranks -- the ``job_loss`` a rank of ``hybrid.runtime.train.run_steps`` reports (that average, all-reduced), else the
    mean of the ranks' ``loss`` (the TP ranks of a DP rank report the same loss, so any of them stands for it,
    TP rank 0 first) --, throughput at the slowest rank's pace, each rank's model-state bytes, how many ranks
    reported (a step flushed at a restart may lack the dead rank's report; with none at all the loss is None),
    the non-finite guard where the ranks report it (``nonfinite``: this step's update was skipped for a NaN/inf
    gradient norm; ``skipped_steps``: how many so far), the ZeRO bytes per link and the int8 error where the
    ranks report them (``LINK_FIELDS``: the largest rank's), the held-out evaluation after a step the ranks
    evaluated at (``EVAL_FIELDS``) and the other numbers the entrypoint reported (``_own_numbers``)."""
    if not records:
        return {"step": step, "loss": None, "lr": None, "grad_norm": None, "step_time_s": None, "throughput": None,
                "throughput_unit": "tokens/s", "model_state_bytes": [], "ranks_reported": 0}
    by_dp: dict = {}
    for rank, r in sorted(records.items(), key=lambda kv: (kv[1].get("tp_rank", 0), kv[0])):
        by_dp.setdefault(r.get("dp_rank", rank), r)
    dp_records = list(by_dp.values())
    first = records[min(records)]
    times = [r["step_time_s"] for r in records.values() if isinstance(r.get("step_time_s"), (int, float))]
    slowest = max(times) if times else None  # an entrypoint's own report may leave it out
    unit = first.get("throughput_unit", "tokens")
    counted = [r[unit] for r in records.values() if isinstance(r.get(unit), (int, float))]
    count = max(counted) if counted else None  # an own loop that counts nothing has no throughput
    mem = [model_state_bytes(records[rank].get("memory")) for rank in sorted(records)]
    measured = {rank: records[rank]["memory_measured"] for rank in sorted(records)
                if records[rank].get("memory_measured")}
    extra = {"memory_measured": measured} if measured else {}  # hybrid.plan.budget, on measured steps
    own = _own_numbers(dp_records[0])
    job_loss = first.get("job_loss")  # run_steps' ranks report the DP mean itself: exact from any one of them
    loss = job_loss if isinstance(job_loss, (int, float)) else sum(r["loss"] for r in dp_records) / len(dp_records)
    for key in EVAL_FIELDS:  # the held-out loss: the DP mean, the same in every rank's report of the step
        value = next((r[key] for r in records.values() if isinstance(r.get(key), (int, float))), None)
        if value is not None:
            extra[key] = value
    for key in LINK_FIELDS:  # hybrid.runtime.link_metrics: the busiest rank's bytes, the largest error
        values = [r[key] for r in records.values() if isinstance(r.get(key), (int, float))]
        if values:
            extra[key] = max(values)
    guarded = [r for r in records.values() if isinstance(r.get("skipped_steps"), int)]
    if guarded:  # the engine's non-finite guard (step_metrics): every rank skips a step together
        extra.update(nonfinite=any(bool(r.get("nonfinite")) for r in guarded),
                     skipped_steps=max(r["skipped_steps"] for r in guarded))
    return {**own, **extra, "step": step, "loss": loss,
            "lr": first.get("lr"), "grad_norm": first.get("grad_norm"), "step_time_s": slowest,
            "throughput": count / slowest if slowest and count is not None else None, "throughput_unit": f"{unit}/s",
            "model_state_bytes": [m for m in mem if m is not None], "ranks_reported": len(records)}


# A step's ZeRO bytes per link and int8 error (``hybrid.runtime.link_metrics``): the entry has each rank's largest.
LINK_FIELDS = ("dp_intra_bytes", "dp_inter_bytes", "quant_error_weights", "quant_error_gradients")


# A step's held-out evaluation (``hybrid.runtime.evaluate``), where the ranks evaluated after it.
EVAL_FIELDS = ("eval_loss", "eval_ppl", "eval_time_s")


# What a rank's step report carries besides the user's own numbers: its tags (``Context.report``) and what
# ``hybrid.runtime.train.step_metrics`` and ``run_steps`` fill in (the throughput unit's count and rate are named by it).
_REPORT_FIELDS = frozenset({"rank", "step", "time", "dp_rank", "tp_rank", "loss", "job_loss", "lr", "grad_norm",
                            "step_time_s", "throughput_unit", "memory", "memory_measured", "nonfinite",
                            "skipped_steps", *LINK_FIELDS, *EVAL_FIELDS})


# What ``step_entry`` itself puts in an entry.
_ENTRY_FIELDS = frozenset({"step", "loss", "lr", "grad_norm", "step_time_s", "throughput", "throughput_unit",
                           "model_state_bytes", "ranks_reported", "memory_measured", "nonfinite", "skipped_steps",
                           "predicted_step_s", *EVAL_FIELDS})


def _own_numbers(record: dict) -> dict:
    """The numbers an entrypoint reported beside the loss (``ctx.report({"loss": l, "acc": a})``): into the
    step's entry as DP rank 0 (TP rank 0) reported them."""
    unit = record.get("throughput_unit")
    ours = _REPORT_FIELDS | {unit, f"{unit}_per_s"}
    return {k: v for k, v in record.items() if k not in ours and isinstance(k, str)
            and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _finite(value):
    """``value`` with NaN and infinities as None (JSON has no such numbers: ``jq`` and browsers refuse them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def lines_before(lines: Iterable[str], step: int) -> list[str]:
    """The metrics lines for steps below ``step`` (a torn or unreadable line -- a crash mid-write -- and
    everything after it is dropped too)."""
    kept = []
    for line in lines:
        try:
            entry_step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            break
        if entry_step >= step:
            break
        kept.append(line if line.endswith("\n") else line + "\n")
    return kept


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Every entry of a metrics.jsonl."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class MetricsWriter:
    """Appends step entries to ``run_dir/metrics.jsonl`` (and TensorBoard when installed)."""

    def __init__(self, run_dir: str | os.PathLike, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self._last_step: Optional[int] = None  # the newest step in the file, once known
        self._tensorboard = tensorboard and _tensorboard_available()
        self._tb = None

    @property
    def tensorboard_dir(self) -> Optional[Path]:
        return self.run_dir / TENSORBOARD_DIR if self._tensorboard else None

    def write(self, entry: dict) -> None:
        step = int(entry["step"])
        if self._last_step is None or step <= self._last_step:
            self._rewind(step)
        with open(self.path, "a") as f:
            f.write(json.dumps(_finite(entry), allow_nan=False) + "\n")
        self._last_step = step
        if self._tb is not None:
            self._scalars(entry)

    def event(self, record: dict) -> None:
        """A line that is no step's (a resize: ``launch.job.elastic``) after the steps up to ``record["step"]``;
        the steps after it are dropped (the next attempt writes them again)."""
        step = int(record["step"])
        self._rewind(step + 1)
        with open(self.path, "a") as f:
            f.write(json.dumps(_finite(record), allow_nan=False) + "\n")
        self._last_step = step

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def _rewind(self, step: int) -> None:
        """Drop the lines for steps >= ``step`` (a restart reruns them), atomically."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        kept = []
        if self.path.exists():
            with open(self.path) as f:
                kept = lines_before(f, step)
        tmp = self.path.with_name(f".{METRICS_FILE}.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.path)
        if self._tensorboard:
            self.close()
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.tensorboard_dir), purge_step=step)

    def _scalars(self, entry: dict) -> None:
        step = entry["step"]
        own = [k for k in entry if k not in _ENTRY_FIELDS]  # an entrypoint's own numbers (``_own_numbers``)
        for key in ("loss", "lr", "grad_norm", "step_time_s", "skipped_steps", *own):
            if isinstance(entry.get(key), (int, float)) and not isinstance(entry.get(key), bool):
                self._tb.add_scalar(f"train/{key}", entry[key], step)
        for key in EVAL_FIELDS:
            if isinstance(entry.get(key), (int, float)):
                self._tb.add_scalar(f"eval/{key[len('eval_'):]}", entry[key], step)
        if entry["throughput"] is not None:
            self._tb.add_scalar(f"train/throughput_{entry['throughput_unit'].replace('/', '_per_')}",
                                entry["throughput"], step)
        if entry["model_state_bytes"]:
            self._tb.add_scalar("memory/model_state_bytes_max", max(entry["model_state_bytes"]), step)
        self._tb.flush()


def _tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard needs the package)
    except ImportError:
        return False
    return True


def ray_log_dir() -> str:
    """Where Ray keeps every worker's stdout and stderr (on each node of a real cluster)."""
    try:
        from ray._private import worker

        node = worker._global_node
        if node is not None:
            return node.get_logs_dir_path()
    except (ImportError, AttributeError):  # Ray client mode, or a Ray without this internal
        pass
    return "/tmp/ray/session_latest/logs"


def summary_lines(results: dict[int, Any], history: list[dict], writer: MetricsWriter, logs: str,
                  saves: Iterable[dict] = ()) -> list[str]:
    """Lines under the run summary: the loss against the reference the entrypoint named, the last held-out
    evaluation (``eval_line``), the checkpoints' bytes and stall (``checkpoint_line``, from rank 0's
    ``checkpoint_saved`` reports ``saves``), and where the metrics and the full logs are."""
    lines = []
    reference = next((r.get("reference_loss") for _, r in sorted(results.items()) if isinstance(r, dict)
                      and isinstance(r.get("reference_loss"), dict)), None)
    if reference and history:
        last = history[-FINAL_STEPS:]
        loss, nats = sum(e["loss"] for e in last) / len(last), float(reference["nats"])
        verdict = "below" if loss < nats else "not yet below"
        lines.append(f"final loss {loss:.4f} nats (mean of the last {len(last)} steps), {verdict} the "
                     f"{reference['name']} ({nats:.4f} nats)")
    held_out = eval_line(history)
    if held_out is not None:
        lines.append(held_out)
    saved = checkpoint_line(list(saves))
    if saved is not None:
        lines.append(saved)
    if history or writer.path.exists():  # a resume with nothing left to train still has its metrics
        where = f"metrics {writer.path}"
        if writer.tensorboard_dir is not None:
            where += f" (TensorBoard: tensorboard --logdir {writer.tensorboard_dir})"
        lines.append(where)
    else:
        lines.append("warning: the entrypoint reported no step in this run, so there are no metrics: report "
                     "each step with ctx.report(...) or train through hybrid.runtime.train.run_steps")
    lines.append(f"full rank logs (stdout/stderr of every worker): {logs}")
    return lines


def save_cost(record: dict) -> str:
    """`` (51.0 MB, training stopped 0.05 s; written in 0.47 s in the background)`` for a ``checkpoint_saved``
    report that has the figures, else nothing."""
    if not isinstance(record.get("checkpoint_stall_s"), (int, float)):
        return ""
    where = " in the background" if record.get("checkpoint_async") else ""
    return (f" ({human_bytes(record.get('checkpoint_bytes') or 0)}, training stopped "
            f"{record['checkpoint_stall_s']:.2f} s; written in {record.get('checkpoint_write_s') or 0:.2f} s{where})")


def checkpoint_line(saves: list[dict]) -> Optional[str]:
    """The summary's sentence on this run's checkpoints: how many, their size, the median stall per save and
    the median write (None without a save that reported its figures)."""
    saves = [r for r in saves if isinstance(r.get("checkpoint_stall_s"), (int, float))]
    if not saves:
        return None
    stall = statistics.median(r["checkpoint_stall_s"] for r in saves)
    write = statistics.median(r.get("checkpoint_write_s") or 0.0 for r in saves)
    size = statistics.median(r.get("checkpoint_bytes") or 0 for r in saves)
    how = "in the background" if all(r.get("checkpoint_async") for r in saves) else "synchronously"
    return (f"checkpoints: {len(saves)} saved {how}, {human_bytes(size)} each; training stopped {stall:.2f} s per "
            f"save (median), each written in {write:.2f} s")


def eval_line(history: list[dict]) -> Optional[str]:
    """The summary's sentence on the last held-out evaluation in ``history`` (None without one)."""
    last = next((e for e in reversed(history) if isinstance(e.get("eval_loss"), (int, float))), None)
    if last is None:
        return None
    ppl = last.get("eval_ppl")
    ppl_text = f", perplexity {ppl:.2f}" if isinstance(ppl, (int, float)) else ""
    return f"held-out loss {last['eval_loss']:.4f} nats{ppl_text} (evaluated after step {last['step']})"


def link_line(history: list[dict], psi_bytes: float, theory: dict, label: str) -> Optional[str]:
    """The summary's sentence on ZeRO's traffic: the median step's bytes per GPU across nodes and inside them
    (``dp_inter_bytes``, ``dp_intra_bytes``: the busiest rank's), also as multiples of Ψ/t (``psi_bytes``: the
    GPU's share of the parameters in the model dtype), beside ``theory`` (``{"inter", "intra"}`` bytes per step)
    for the options run (``label``); None where no step reported them."""
    steps = [e for e in history if isinstance(e.get("dp_inter_bytes"), (int, float))
             and isinstance(e.get("dp_intra_bytes"), (int, float))]
    if not steps or not psi_bytes:
        return None
    if len(steps) > WARMUP_STEPS:  # the first steps may gather what later ones keep
        steps = steps[WARMUP_STEPS:]

    def median(key: str) -> float:
        values = sorted(e[key] for e in steps)
        return values[len(values) // 2]

    inter, intra = median("dp_inter_bytes"), median("dp_intra_bytes")
    return (f"ZeRO traffic per GPU and step (median of {len(steps)} steps): across nodes {human_bytes(round(inter))} "
            f"= {inter / psi_bytes:.2f} Ψ/t, inside nodes {human_bytes(round(intra))} = {intra / psi_bytes:.2f} Ψ/t; "
            f"theory for {label}: {theory.get('inter', 0) / psi_bytes:.2f} and {theory.get('intra', 0) / psi_bytes:.2f} "
            f"Ψ/t (Ψ/t = {human_bytes(round(psi_bytes))})")


# ------------------------------------------------------------------------------- predicted vs measured time


def measured_step_s(history: list[dict], warmup: int = WARMUP_STEPS) -> tuple[Optional[float], int]:
    """``(median measured step time, steps it is taken over)``: the steps after the first ``warmup`` of the
    history (all of them when there are no more), None without any."""
    times = [e["step_time_s"] for e in history if isinstance(e.get("step_time_s"), (int, float))]
    if len(times) > warmup:
        times = times[warmup:]
    if not times:
        return None, 0
    ordered = sorted(times)
    return ordered[len(ordered) // 2], len(times)


def time_line(predicted_s: Optional[float], history: list[dict], layout: str = "") -> Optional[str]:
    """The summary's sentence: predicted against measured step time (the steps run with this prediction:
    after a re-plan, those of the new layout), or None without a prediction."""
    measured, steps = measured_step_s([e for e in history if e.get("predicted_step_s", predicted_s) == predicted_s])
    if predicted_s is None or measured is None:
        return None
    return (f"step time: predicted {_seconds(predicted_s)}{f' ({layout})' if layout else ''}, measured "
            f"{_seconds(measured)} (median of {steps} steps): measured / predicted = {measured / predicted_s:.2f}")


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def time_record(layout: dict, predicted: dict, history: list[dict], hardware: dict) -> dict:
    """``time.json``: the layout run, its predicted step time and terms, the measured median, the hardware."""
    measured, steps = measured_step_s(history)
    return {"layout": layout, "predicted_step_s": predicted.get("step_s"), "predicted": predicted,
            "measured_step_s": measured, "measured_steps": steps, "hardware": hardware}


def write_time_record(run_dir, record: dict) -> Path:
    """``run_dir/time.json``, atomically; its path."""
    path = Path(run_dir) / TIME_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{TIME_FILE}.tmp")
    tmp.write_text(json.dumps(_finite(record), indent=2, allow_nan=False))
    os.replace(tmp, path)
    return path
