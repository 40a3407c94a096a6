"""What the driver shows while a job runs, and the table it leaves at the end.

``Progress`` collects the per-step reports of every rank. A step is shown once all ranks reported it:
on a terminal as one line rewritten in place, elsewhere (CI, pipes) as plain lines. A line holds the
step, the loss (mean over the DP ranks), the job's throughput in the entrypoint's unit (tokens/s,
samples/s), the per-rank model-state memory, the largest rank's measured memory against its budget,
and the latest NVML sample of each node where NVML is available. A step after which the ranks evaluated on
held-out data (``eval_loss`` in its entry) is followed by a plain line with that loss and its perplexity,
whatever the plain-line cadence (a tty's rewritten line would hide it). With a ``prediction`` (``new_plan``),
the first step every rank measured is followed by the predicted-vs-measured table
(``launch.job.memory_view``), which the summary repeats; with ``predicted_step_s`` (the time model's step
time of the running layout) every entry carries it and the summary compares it with the measured median; a rank above 95 % of its budget is warned about once
per attempt. ``summary()`` renders the final per-rank table. ``on_step`` (the metrics writer) gets every
entry that goes into the history, re-run steps included (they replace the earlier ones).

One ``Progress`` spans every attempt of a job. Checkpoint events become plain lines: rank 0's
``checkpoint_saved`` right after its step's line, rank 0's ``resumed_from`` at once.

Restarts (``restart(step)``, which the driver calls between attempts, after draining every report the
surviving ranks still held): the steps up to the resume checkpoint that are not out yet are shown then,
in order, from the ranks that did report them (the dead rank's last reports die with it; such a line
says how many ranks it stands for), so they are never lost: the checkpoint holds them and no attempt
runs them again. Steps after the checkpoint are dropped from the history and run again by the next
attempt; the re-run replaces them in the history, and a step whose line was already printed is not
printed a second time. So every step's line appears once, in order, and the history holds each step
once, as the attempt that finished the job ran it (or, for the steps flushed at a restart, as the
failed attempt's surviving ranks reported it).
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from typing import Callable, Optional, TextIO

from hybrid.config.units import human_bytes
from launch.job.memory_view import memory_table, near_oom_line, usage_text


from launch.job.metrics import model_state_bytes, save_cost, step_entry, time_line  # noqa: E402,F401  (re-exported)


def eval_text(entry: dict) -> str:
    """The line of a step's held-out evaluation."""
    ppl = entry.get("eval_ppl")
    ppl_text = f"  perplexity {ppl:.2f}" if isinstance(ppl, (int, float)) else ""
    return f"step {entry['step']}: eval loss {entry['eval_loss']:.4f}{ppl_text}"


class Progress:
    def __init__(self, total_steps: int, world_size: int, stream: TextIO = sys.stdout, tty: Optional[bool] = None,
                 on_step: Optional[Callable[[dict], None]] = None):
        self.total_steps, self.world_size, self.stream = total_steps, world_size, stream
        self.on_step = on_step  # called with each completed step's entry (the metrics writer)
        self.tty = stream.isatty() if tty is None else tty
        self.every = 1 if total_steps <= 100 else total_steps // 50  # plain-line cadence
        self.pending: dict[int, dict[int, dict]] = defaultdict(dict)  # step -> rank -> record
        self.last: dict[int, dict] = {}  # rank -> its latest record
        self.history: list[dict] = []  # one entry per completed step
        self.nvml: dict[int, dict] = {}  # rank (local rank 0 of a node) -> latest sample
        self.checkpoint_step: Optional[int] = None  # the newest checkpoint a rank reported saving or loading
        self.saves: list[dict] = []  # rank 0's checkpoint_saved reports: bytes, stall, write seconds of each save
        self.resumed_from: Optional[int] = None  # the checkpoint step the latest attempt started from
        self._done = 0  # the last step in the history, in order
        self._printed = 0  # the last step whose line is out: re-run steps up to it are not printed again
        self._notes: list[tuple[int, str]] = []  # (step, text): waiting for that step's line
        self.started = time.perf_counter()
        self._line_open = False
        self.prediction: Optional[dict] = None  # hybrid.plan.memory.MemoryPrediction.as_dict() of the running plan
        self.measured: dict[int, dict] = {}  # rank -> its latest memory_measured (with its step)
        self.reports: dict[int, dict] = {}  # rank -> the engine memory report of that measurement
        self._table_out = False  # the predicted-vs-measured table of this attempt is printed
        self._warned: set = set()  # ranks warned near out of memory in this attempt
        self.predicted_step_s: Optional[float] = None  # the time model's step time of the running layout
        self.predicted_layout = ""  # its label (hybrid.plan.cost.Layout.label)

    # ------------------------------------------------------------------------------------------ input

    def add(self, drained: dict) -> None:
        """Take one rank's drained reports and NVML samples."""
        for record in drained.get("reports", []):
            if "resumed_from" in record:
                self._resumed(record)
            elif "checkpoint_warning" in record:
                if record["rank"] == 0:
                    self.note(f"warning: {record['checkpoint_warning']}")
            elif "checkpoint_saved" in record:
                self._saved(record)
            elif "loss" in record:
                self.last[record["rank"]] = record
                self.pending[record["step"]][record["rank"]] = record
                if record.get("memory_measured"):
                    self._measured(record)
        if drained.get("nvml"):
            self.nvml[drained["rank"]] = drained["nvml"][-1]
        for step in sorted(self.pending):
            if step <= self._done:  # a stale report of a step already complete
                del self.pending[step]
                continue
            if len(self.pending[step]) < self.world_size:
                break
            self._complete(step, self.pending.pop(step))
        self._flush_notes()

    def new_plan(self, prediction: Optional[dict]) -> None:
        """The next attempt runs a plan predicted at ``prediction``: its measurements start afresh."""
        self.prediction = prediction
        self.measured, self.reports, self._table_out, self._warned = {}, {}, False, set()

    def memory_lines(self, title: str = "memory per rank") -> list[str]:
        """The predicted-vs-measured table (``launch.job.memory_view``), or none before any measurement."""
        if self.prediction is None:
            return []
        return memory_table(self.prediction, self.measured, self.reports, title)

    def _measured(self, record: dict) -> None:
        rank = record["rank"]
        self.measured[rank] = {**record["memory_measured"], "step": record["step"]}
        self.reports[rank] = record.get("memory") or {}
        warning = near_oom_line(rank, self.measured[rank])
        if warning and rank not in self._warned:
            self._warned.add(rank)
            self.note(warning)

    def begin_at(self, step: int) -> None:
        """An earlier launch left checkpoint ``step``: the steps up to it are not this launch's to show (a
        restart before rank 0 reported its resume would otherwise list them as lost)."""
        self._done = max(self._done, step)

    def restart(self, step: int) -> None:
        """A new attempt starts from checkpoint ``step``: show the steps up to it that are not out yet from
        the ranks that reported them, then drop what the failed attempt left of the steps after it."""
        for s in range(self._done + 1, step + 1):
            self._complete(s, self.pending.pop(s, {}))
        self._flush_notes(everything=True)  # a checkpoint rank 0 reported saving was published
        self.pending.clear()
        self._rewind(step)

    def note(self, text: str) -> None:
        """A plain line between progress lines (attempt restarts, warnings)."""
        self._end_line()
        print(text, file=self.stream, flush=True)

    def close(self) -> None:
        self._flush_notes(everything=True)
        self._end_line()

    def _resumed(self, record: dict) -> None:
        step = int(record["resumed_from"])
        self.checkpoint_step = max(step, self.checkpoint_step or 0)
        if record["rank"] != 0:
            return
        self.resumed_from = step
        self._rewind(step)
        left = "nothing left to train" if step >= self.total_steps else f"continuing at step {step + 1}"
        skipped = record.get("skipped_checkpoints")
        skipped = f", skipping the damaged or unfinished {', '.join(skipped)}" if skipped else ""
        self.note(f"resumed from checkpoint step {step} ({record.get('checkpoint', '?')}{skipped}); {left}")

    def _saved(self, record: dict) -> None:
        step = int(record["checkpoint_saved"])
        self.checkpoint_step = max(step, self.checkpoint_step or 0)
        self.saves.append(record)
        self._notes.append((step, f"checkpoint step {step} saved: {record.get('checkpoint', '?')}{save_cost(record)}"))

    def _rewind(self, step: int) -> None:
        self.history = [e for e in self.history if e["step"] <= step]
        self._done = step

    def _flush_notes(self, everything: bool = False) -> None:
        ready = [n for n in self._notes if everything or n[0] <= self._done]
        self._notes = [n for n in self._notes if n not in ready]
        for _, text in sorted(ready, key=lambda n: n[0]):
            self.note(text)

    # ------------------------------------------------------------------------------------------ output

    def _complete(self, step: int, records: dict[int, dict]) -> None:
        """Step ``step`` is done: into the history, its line out (unless printed before a restart), then
        the checkpoint lines of the steps up to it. ``records`` may lack ranks only at a restart."""
        entry = step_entry(step, records)
        if self.predicted_step_s is not None:
            entry["predicted_step_s"] = self.predicted_step_s
        self.history.append(entry)
        self._done = step
        if self.on_step is not None:
            self.on_step(entry)
        if step > self._printed:
            self._printed = step
            self._print(entry)
            if isinstance(entry.get("eval_loss"), (int, float)):
                self.note(eval_text(entry))
        if not self._table_out and self.prediction is not None and len(self.measured) >= self.world_size:
            self._table_out = True
            for line in self.memory_lines(f"memory per rank after step {step}"):
                self.note(line)
        self._flush_notes()

    def _print(self, entry: dict) -> None:
        step = entry["step"]
        if self.tty:
            self.stream.write("\r\033[K" + self._bar(step) + self._line(entry))
            self.stream.flush()
            self._line_open = True
        elif step % self.every == 0 or step == self.total_steps:
            print(self._line(entry), file=self.stream, flush=True)

    def _bar(self, step: int, width: int = 20) -> str:
        done = width * min(step, self.total_steps) // max(self.total_steps, 1)
        return "[" + "#" * done + "." * (width - done) + "] "

    def _line(self, e: dict) -> str:
        width = len(str(self.total_steps))
        mem = e["model_state_bytes"]
        mem_text = ""
        if mem:
            lo, hi = min(mem), max(mem)
            mem_text = f"  model states/rank {human_bytes(hi)}" if lo == hi else \
                f"  model states/rank {human_bytes(lo)}..{human_bytes(hi)}"
        head = f"step {e['step']:>{width}}/{self.total_steps}"
        if e["loss"] is None:
            return f"{head}  no report (lost with the failed attempt's ranks)"
        ranks = e["ranks_reported"]
        partial = f"  ({ranks} of {self.world_size} ranks reported)" if ranks < self.world_size else ""
        rate = f"  {e['throughput']:,.0f} {e['throughput_unit']}" if e["throughput"] is not None else ""
        return (f"{head}  loss {e['loss']:.4f}{rate}{mem_text}"
                f"{usage_text(self.measured)}{self._nvml_text()}{partial}")

    def _nvml_text(self) -> str:
        parts = []
        for rank, sample in sorted(self.nvml.items()):
            gpus = sample.get("gpus", [])
            if gpus:
                used = sum(g["used_bytes"] for g in gpus)
                total = sum(g["total_bytes"] for g in gpus)
                util = [g["utilization"] for g in gpus if g.get("utilization") is not None]
                util_text = f" {sum(util) / len(util):.0f}%" if util else ""
                parts.append(f"node@rank{rank}{util_text} {human_bytes(used)}/{human_bytes(total)}")
        return ("  gpu " + ", ".join(parts)) if parts else ""

    def _end_line(self) -> None:
        if self._line_open:
            self.stream.write("\n")
            self.stream.flush()
            self._line_open = False

    def summary(self, placement: list, wall_s: float) -> str:
        """The final table: one row per rank, then loss and throughput over the run."""
        reported = [e for e in self.history if e["loss"] is not None]
        unit = reported[-1]["throughput_unit"] if reported else "tokens/s"
        rows = [f"{'rank':>4} {'node':>4} {'dp':>3} {'tp':>3}  {'last loss':>9}  {'job ' + unit:>14}  "
                f"{'model states':>12}"]
        for p in placement:
            r = self.last.get(p.rank, {})
            mem = model_state_bytes(r.get("memory"))
            loss = f"{r['loss']:.4f}" if "loss" in r else "-"
            rows.append(f"{p.rank:>4} {p.node_index:>4} {r.get('dp_rank', '-'):>3} {r.get('tp_rank', '-'):>3}  "
                        f"{loss:>9}  {r.get(r.get('throughput_unit', 'tokens') + '_per_s', 0):>14,.0f}  "
                        f"{human_bytes(mem) if mem is not None else '-':>12}")
        if reported:
            first, last = reported[0], reported[-1]
            rates = [e["throughput"] for e in reported if e["throughput"] is not None]
            mean_text = f"; {sum(rates) / len(rates):,.0f} {unit} mean" if rates else ""
            rows.append(f"steps {last['step']}/{self.total_steps} in {wall_s:.1f} s; loss {first['loss']:.4f} (step "
                        f"{first['step']}) -> {last['loss']:.4f} (step {last['step']}){mean_text}")
        timing = time_line(self.predicted_step_s, reported, self.predicted_layout)
        if timing is not None:
            rows.append(timing)
        rows += self.memory_lines()
        return "\n".join(rows)
