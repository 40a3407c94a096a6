"""Predicted against measured memory, as the driver prints it (pure rendering, no Ray).

``largest(measured)`` picks the rank that measured the most (rank -> ``MemoryMeter.measure()`` dict);
``memory_table(predicted, measured, reports)`` is the table the driver prints after step 1 and repeats in
the run summary: per category where the measurement can be split (parameters, gradients, optimizer
states: the engine's own ``memory_report`` of that rank), then the peak -- CUDA's
``max_memory_allocated`` against the predicted allocator peak, or on CPU the peak RSS growth against the
predicted total (the CPU runtime reserve included) -- and the memory NVML attributes to the rank's process
against the total where NVML reads the GPU, each with the deviation in %; the GPU's used memory over every
process is shown beside them, not compared. ``usage_text`` is the progress line's used/budget of the
largest rank; ``near_oom_line`` the warning above ``hybrid.plan.budget.NEAR_OOM``.
"""

from __future__ import annotations

from typing import Optional

from hybrid.plan.budget import NEAR_OOM, near_oom
from hybrid.config.units import human_bytes

SPLIT = (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer states"))
PREDICTED_ONLY = (("inflight", "buckets + gathered units in flight"), ("optimizer_transient", "optimizer step copies"),
                  ("activations", "activations + logits + loss"), ("runtime_reserve", "runtime reserve"))


def largest(measured: dict) -> Optional[int]:
    """The rank with the largest measured figure (used memory), or None when none measured."""
    if not measured:
        return None
    return max(sorted(measured), key=lambda r: measured[r].get("used_bytes", measured[r]["peak_bytes"]))


def deviation(measured: float, predicted: float) -> str:
    return f"{100.0 * (measured - predicted) / predicted:+.1f}%" if predicted else "-"


def peak_pair(predicted: dict, m: dict) -> tuple[str, float, float]:
    """(label, predicted, measured) for the peak: the figure each device measures."""
    if m.get("device") == "cuda":
        return "peak allocated", predicted["peak"], m["peak_bytes"]
    return "peak (RSS growth)", predicted["total"], m["peak_bytes"]


def memory_table(predicted: dict, measured: dict, reports: dict, title: str = "memory per rank") -> list[str]:
    """The predicted-vs-measured lines (see the module docstring); ``reports`` rank -> engine memory report."""
    rank = largest(measured)
    if rank is None:
        return []
    m, report = measured[rank], reports.get(rank) or {}
    rows = [f"{title} (largest: rank {rank}, step {m.get('step', '?')}; {m.get('source', '')})",
            f"  {'':<36}{'predicted':>11}{'measured':>11}{'deviation':>11}"]

    def row(label: str, pred: float, meas: Optional[float]) -> None:
        shown = human_bytes(meas) if meas is not None else "-"
        dev = deviation(meas, pred) if meas is not None else ""
        rows.append(f"  {label:<36}{human_bytes(pred):>11}{shown:>11}{dev:>11}")

    for key, label in SPLIT:
        row(label, predicted[key], report.get(key))
    states = sum(report[k] for k, _ in SPLIT) if all(k in report for k, _ in SPLIT) else None
    row("model states", predicted["model_states"], states)
    for key, label in PREDICTED_ONLY:
        row(label, predicted[key], None)
    label, pred, meas = peak_pair(predicted, m)
    row(label, pred, meas)
    note = uncounted_note(pred, meas, m.get("device"))
    if note:
        rows.append(note)
    if "nvml_used_bytes" in m:
        row("NVML used by the rank (total)", predicted["total"], m["nvml_used_bytes"])
    if "nvml_device_used_bytes" in m:  # every process's memory on the GPU: shown, never held against the rank
        rows.append(f"  NVML used on the whole GPU: {human_bytes(m['nvml_device_used_bytes'])}")
    if m.get("budget_bytes"):
        rows.append(f"  budget {human_bytes(m['budget_bytes'])} per rank; used {m.get('fraction', 0):.0%}")
    return rows


def uncounted_note(predicted: float, measured: float, device: Optional[str]) -> Optional[str]:
    """On CPU, where the peak is off by more than ``UNCOUNTED_TOLERANCE``: one line saying what the plan does not
    count and how much of it there is (a rank's fixed memory beyond its tensors, which dominates a model of a few
    MB and vanishes beside one of hundreds: tests/dist/test_memory_prediction.py holds +-15 % there)."""
    if device == "cuda" or not predicted or abs(measured - predicted) <= UNCOUNTED_TOLERANCE * predicted:
        return None
    if measured > predicted:
        return (f"  not counted by the plan: {human_bytes(measured - predicted)} of the rank's own memory beyond "
                "the tensors it predicts (Python objects, the data's pages, gloo's and autograd's buffers, the "
                "allocator's heap) -- fixed, so it outweighs a model this small")
    return (f"  counted by the plan but not held: {human_bytes(predicted - measured)} (tensors the rank freed or "
            "never faulted in before its peak)")


UNCOUNTED_TOLERANCE = 0.30


def usage_text(measured: dict) -> str:
    """``  mem 1.20 GB/2.00 GB (rank 3)``: the largest rank's used memory and budget, or ''."""
    rank = largest(measured)
    if rank is None:
        return ""
    m = measured[rank]
    budget = f"/{human_bytes(m['budget_bytes'])}" if m.get("budget_bytes") else ""
    return f"  mem {human_bytes(m['used_bytes'])}{budget} (rank {rank})"


def near_oom_line(rank: int, m: dict) -> Optional[str]:
    if not near_oom(m):
        return None
    return (f"warning: rank {rank} is near out of memory at step {m.get('step', '?')}: "
            f"{human_bytes(m['used_bytes'])} of {human_bytes(m['budget_bytes'])} ({m['fraction']:.0%}, above "
            f"{NEAR_OOM:.0%})")


def prediction_lines(stages: dict, usable: float, device: str) -> list[str]:
    """The complete prediction per stage (stage -> ``MemoryPrediction``) as ``hybrid plan`` and ``hybrid
    estimate`` show it."""
    where = "peak RSS growth of a CPU rank" if device == "cpu" else "per GPU"
    lines = [f"predicted per rank ({where}; hybrid.plan.memory.predict_memory)",
             f"  {'stage':<6}{'states':>11}{'in flight':>11}{'opt. step':>11}{'activ.':>11}{'reserve':>11}"
             f"{'total':>11}  fits"]
    for s, p in sorted(stages.items()):
        lines.append(f"  {s:<6}{human_bytes(p.model_states):>11}{human_bytes(p.inflight):>11}"
                     f"{human_bytes(p.optimizer_transient):>11}{human_bytes(p.activations):>11}"
                     f"{human_bytes(p.runtime_reserve):>11}{human_bytes(p.total):>11}  "
                     f"{'yes' if p.total <= usable else 'no'}")
    return lines
