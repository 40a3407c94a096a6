"""The Hugging Face compatibility matrix, generated: every causal-LM type of the installed transformers, tiny,
through hybrid's build, load, TP-1 and TP-2 training and export, each cell what the product did.

    .venv/bin/python bench/hf_matrix.py [--types a,b,c | --sample] [--out FILE.md] [--jobs N] [--json FILE]

For every type of ``transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (or those
given), a tiny config of the type's own config class (``bench/hf_matrix_configs.py``: one shrinking walk
over the config's fields, per-family overrides in one table) goes through five checks
(``bench/hf_matrix_cells.py``, which states the tolerance: 10x torch fp32's own distance from an fp64 run of
the same reference, never below relative 1e-5):

- ``build``: ``AutoModelForCausalLM.from_config`` under ``hybrid.empty_init()`` (every parameter on meta);
- ``load``: a random-init model's sharded ``save_pretrained`` directory into the meta model by
  ``hybrid.materialize(weights=DIR)``: the state dict equal;
- ``tp1``: TP 1 x DP 2 (world 2), ZeRO stage 3, fp32, 3 AdamW steps, against single-process ``torch.optim.AdamW``;
- ``tp2``: the same at TP 2 x DP 1 by the model's own plan (``hybrid.tp.parallelize``), for a type with a
  ``base_model_tp_plan``;
- ``export``: the tp1 run saved by ``hybrid.checkpoint.save``, written by ``consolidate_hf``, read back by
  ``from_pretrained``: the trained weights exactly.

A cell is ``pass``, the sentence the product raised (a ``hybrid.errors.UserError``: ``ConfigError``,
``CheckpointError``, ...), ``error: <Type>: <first line>`` (anything else: a product bug, listed at the end),
or ``n/a: <why>`` (the check does not apply, or transformers itself cannot do its part). The table, its
summary (cells per kind and column; the share of dense types with a plan that pass tp2) and the grouped
errors and sentences go to ``--out`` (default ``docs/hf-matrix.md``; the whole matrix also writes the README's
summary table between its markers).

Types run in gloo worlds of 2 ranks (``bench/hf_matrix_world.py``), many types per world so that start-up is
paid once; ``--jobs N`` runs N worlds side by side. Each world runs in a process of its own session, watched
here: one that writes no progress for ``--stall-s`` seconds (default 300) is stopped, the type it was on
gets ``error: TimeoutError: ...`` in the cells it had not finished, and a fresh world goes on with the
types after it; a world that dies (a rank's crash) is handled the same way, its cells saying why. So no
cell hangs and no type is lost.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.hf_matrix_cells import CELLS, NA, PASS  # noqa: E402

# Dense and MoE, tied and untied, plans that split as they are and plans that need more (docs/hf-matrix.md)
SAMPLE = ("llama", "gpt_neox", "gemma2", "qwen2", "qwen2_moe", "qwen3")
STALL_S = 300
COMMAND = ".venv/bin/python bench/hf_matrix.py"
DEFAULT_OUT = ROOT / "docs" / "hf-matrix.md"
README = ROOT / "README.md"
README_BLOCK = re.compile(r"(<!-- hf-matrix summary -->\n).*?(<!-- /hf-matrix summary -->)", re.S)


def all_types() -> list:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


class Worker:
    """One world (``python -m bench.hf_matrix_world``) in a session of its own, over a list of types."""

    def __init__(self, types: list, workdir: Path, log):
        self.types, self.workdir, self.log = list(types), workdir, log
        self.rows: dict = {}
        self.proc = None
        self.round = 0
        self.start()

    def start(self) -> None:
        self.round += 1
        run_dir = self.workdir / f"world-{self.round}"
        run_dir.mkdir(parents=True)
        self.run_dir = run_dir
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                   HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1",
                   TQDM_DISABLE="1")
        env.setdefault("OMP_NUM_THREADS", "1")
        with open(run_dir / "world.log", "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "bench.hf_matrix_world", str(run_dir),
                                          ",".join(self.types)], cwd=ROOT, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.last = time.time()

    def progress(self) -> tuple:
        """(time of the newest progress line, its type and step)."""
        newest = (self.last, None, None)
        for path in self.run_dir.glob("progress-rank*.jsonl"):
            lines = path.read_text().splitlines()
            if lines:
                note = json.loads(lines[-1])
                if note["t"] > newest[0]:
                    newest = (note["t"], note["type"], note["step"])
        return newest

    def poll(self, stall_s: float) -> bool:
        """True while the world runs; on its end, collect its rows and start the next world if types remain."""
        self.stall_s = stall_s
        code = self.proc.poll()
        for row in read_rows(self.run_dir).values():  # said as they come
            if row.get("complete") and row["type"] in self.types:
                self._done(row)
        stalled = None
        if code is None:
            last, model_type, step = self.progress()
            if time.time() - last <= stall_s:
                return True
            stalled = (model_type, step)
            os.killpg(self.proc.pid, signal.SIGKILL)  # the world's session: its forkserver and ranks
            self.proc.wait()
        self._collect(code, stalled)
        if self.types:
            self.start()
            return True
        return False

    def _collect(self, code, stalled) -> None:
        rows = read_rows(self.run_dir)
        for model_type, row in rows.items():
            if row.get("complete"):
                self._done(row)
        if not self.types:
            return
        # the world ended before its last type: the type it was on gets why, the rest go to a new world
        _, current, step = self.progress()
        if stalled is not None:
            why = (f"error: TimeoutError: no progress in {stalled[1] or 'start-up'} for {self.stall_s:.0f} s; the "
                   "world was stopped")
        else:
            error = self.run_dir / "world-error.json"
            detail = json.loads(error.read_text())["error"] if error.exists() else \
                f"the world exited with {code} in {step or 'start-up'}"
            why = f"error: WorldDied: {detail}"[:400]
        if current is None:  # it never reached a type: a new world would fail alike
            blamed = list(self.types)
        else:
            blamed = [current] if current in self.types else []  # else it ended between two types
        for model_type in blamed:
            row = rows.get(model_type, dict(type=model_type, cells={}))
            row["cells"] = {c: row["cells"].get(c) or why for c in CELLS}
            row["complete"] = True
            self.log(f"{model_type}: the world ended ({why})")
            self._done(row)

    def _done(self, row: dict) -> None:
        if row["type"] in self.types:
            self.types.remove(row["type"])
            self.rows[row["type"]] = row
            self.log(f"{row['type']}: " + " | ".join(f"{c}={_brief(row['cells'].get(c))}" for c in CELLS)
                     + f" ({row.get('seconds', '?')} s)")


def read_rows(run_dir: Path) -> dict:
    """The rows a world wrote (``results.jsonl``): each type's latest, complete or not."""
    results = Path(run_dir) / "results.jsonl"
    rows = {}
    if results.exists():
        for line in results.read_text().splitlines():
            row = json.loads(line)
            rows[row["type"]] = row
    return rows


def _brief(text) -> str:
    return (text or "?")[:60]


def run_matrix(types: list, jobs: int = 1, stall_s: float = STALL_S, workdir=None, log=print) -> dict:
    """Every type's row (type -> {cells, moe, plan, tied, ...}), ``jobs`` worlds side by side."""
    with tempfile.TemporaryDirectory(prefix="hf-matrix-") as tmp:
        base = Path(workdir or tmp)
        workers = [Worker(types[i::jobs], base / f"job-{i}", log) for i in range(min(jobs, len(types)))]
        running = list(workers)
        while running:
            time.sleep(0.5)
            running = [w for w in running if w.poll(stall_s)]
        rows = {}
        for w in workers:
            rows.update(w.rows)
    return {t: rows[t] for t in types}


# ---- the report ----------------------------------------------------------------------------------------------

def kind(text: str) -> str:
    """``pass``, ``n/a``, ``error`` or ``sentence`` (the product's refusal)."""
    if text == PASS:
        return "pass"
    if text.startswith(NA):
        return "n/a"
    return "error" if text.startswith("error:") else "sentence"


def dense_with_plan(row: dict) -> bool:
    return bool(row.get("plan")) and not row.get("moe") and not row["cells"]["build"].startswith(NA)


def summary(rows: dict) -> str:
    parts = []
    for c in CELLS:
        counts = Counter(kind(r["cells"][c]) for r in rows.values())
        parts.append(f"{c}: " + ", ".join(f"{counts[k]} {k}" for k in ("pass", "sentence", "error", "n/a")
                                         if counts[k]))
    dense = [t for t, r in rows.items() if dense_with_plan(r)]
    failing = [t for t in dense if rows[t]["cells"]["tp2"] != PASS]
    passing = len(dense) - len(failing)
    share = f"{100 * passing / len(dense):.0f} %" if dense else "n/a"
    return (f"{len(rows)} types. " + "; ".join(parts) + f". Dense types with a plan passing tp2: {passing} of "
            f"{len(dense)} ({share})" + (f"; not: {', '.join(sorted(failing))}." if failing else "."))


def slowest(rows: dict, n: int = 5) -> str:
    """The ``n`` slowest types, each with its slowest step."""
    ranked = sorted(rows.values(), key=lambda r: -r.get("seconds", 0))[:n]
    return ", ".join(f"{r['type']} {r.get('seconds', 0):.0f} s" + (
        " ({} {:.0f} s)".format(*max(r["steps"].items(), key=lambda kv: kv[1])) if r.get("steps") else "")
        for r in ranked)


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


_MODEL_CLASS = re.compile(r"\b[A-Za-z0-9_]+(ForCausalLM|ForConditionalGeneration|LMHeadModel|WithLMHead|Decoder)\b")


def _group_key(text: str) -> str:
    """Messages that differ only in quoted names, model classes and numbers group together."""
    text = _MODEL_CLASS.sub("<model>", re.sub(r"'[^']*'", "'…'", text))
    return re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", text)


def grouped(rows: dict, which: str) -> list:
    """[(example message, [type (cells)])] for the cells of kind ``which``, largest group first."""
    groups: dict = defaultdict(list)
    example: dict = {}
    for t, row in rows.items():
        for c in CELLS:
            text = row["cells"][c]
            if kind(text) == which:
                key = _group_key(text)
                example.setdefault(key, text)
                groups[key].append(f"{t} ({c})")
    return sorted(((example[k], v) for k, v in groups.items()), key=lambda item: -len(item[1]))


_KEPT = ("moe", "tied", "plan", "seconds", "steps")  # what the report keeps of a row beside its cells
_META = re.compile(r"^<!-- hf_matrix: (.*) -->$", re.M)


def report(rows: dict, command: str, seconds: float, updates: tuple = ()) -> str:
    """The Markdown report; its last line keeps what the table does not show (``read_report``)."""
    import transformers

    said = "".join(f" Rows of {', '.join(u['types'])} updated by `{u['command']}` ({u['seconds']:.0f} s)."
                   for u in updates)
    lines = [f"# Hugging Face compatibility matrix (transformers {transformers.__version__})", "",
             f"Generated by `{command}` in {seconds:.0f} s.{said} The command regenerates it (`--types a,b "
             "--update` re-runs those rows only); `bench/hf_matrix.py` says what each check does, "
             "`bench/hf_matrix_cells.py` the tolerance. A cell is `pass`, the sentence the product raised, "
             "`error: ...` (a product bug, grouped at the end) or `n/a: ...` (the check does not apply, or "
             "transformers itself cannot do its part).", "",
             summary(rows), "", f"Slowest: {slowest(rows)}.", "",
             "| type | build | load | tp1 | tp2 | export |", "|---|---|---|---|---|---|"]
    for t in sorted(rows):
        row = rows[t]
        tags = ", ".join(x for x, on in (("MoE", row.get("moe")), ("tied", row.get("tied"))) if on)
        name = f"{t} ({tags})" if tags else t
        lines.append("| " + " | ".join([_md(name)] + [_md(row["cells"][c]) for c in CELLS]) + " |")
    for which, title in (("error", "Errors (product bugs), grouped"),
                         ("sentence", "The product's sentences, grouped"), ("n/a", "Not applicable, grouped")):
        groups = grouped(rows, which)
        if groups:
            lines += ["", f"## {title}", ""]
            lines += [f"- {_md(text)} -- {len(where)}: {', '.join(where)}" for text, where in groups]
    meta = dict(command=command, seconds=round(seconds), updates=list(updates),
                rows={t: {k: r[k] for k in _KEPT if k in r} for t, r in sorted(rows.items())})
    lines += ["", f"<!-- hf_matrix: {json.dumps(meta, separators=(',', ':'))} -->"]
    return "\n".join(lines) + "\n"


def readme_table(rows: dict, command: str) -> str:
    """The README's table: per check, how many types pass, get the product's sentence, error or do not apply."""
    import transformers

    lines = [f"| transformers {transformers.__version__}, {len(rows)} causal-LM types | pass | product's sentence "
             "| error | n/a |", "|---|---|---|---|---|"]
    for c in CELLS:
        counts = Counter(kind(r["cells"][c]) for r in rows.values())
        lines.append(f"| {c} | " + " | ".join(str(counts[k]) for k in ("pass", "sentence", "error", "n/a")) + " |")
    dense = [r for r in rows.values() if dense_with_plan(r)]
    passing = sum(r["cells"]["tp2"] == PASS for r in dense)
    lines += ["", f"Dense types with a TP plan of their own passing tp2: {passing} of {len(dense)}. Generated by "
              f"`{command}` (table: [docs/hf-matrix.md](docs/hf-matrix.md))."]
    return "\n".join(lines) + "\n"


def write_readme_table(rows: dict, command: str, path=README) -> None:
    """Put ``readme_table`` between the README's ``<!-- hf-matrix summary -->`` markers."""
    text = Path(path).read_text()
    if README_BLOCK.search(text) is None:
        raise SystemExit(f"{path} has no <!-- hf-matrix summary --> ... <!-- /hf-matrix summary --> block")
    Path(path).write_text(README_BLOCK.sub(lambda m: m.group(1) + readme_table(rows, command) + m.group(2), text))


def read_report(path) -> tuple:
    """(rows, how it was made) from a report ``report`` wrote: the cells from its table."""
    text = Path(path).read_text()
    found = _META.search(text)
    if found is None:
        raise SystemExit(f"{path} was not written by this version of bench/hf_matrix.py; run it without --update.")
    meta = json.loads(found.group(1))
    rows = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| type |"):
            parts = [p.strip().replace("\\|", "|") for p in re.split(r"(?<!\\)\|", line)[1:-1]]
            model_type = parts[0].split(" (")[0]
            rows[model_type] = dict(meta["rows"].get(model_type, {}), type=model_type,
                                    cells=dict(zip(CELLS, parts[1:])))
    return rows, meta


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", help="comma-separated model types (default: every causal-LM type)")
    parser.add_argument("--sample", action="store_true", help=f"the fixed sample: {', '.join(SAMPLE)}")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--update", action="store_true", help="re-run these types' rows of the report in --out")
    parser.add_argument("--jobs", type=int, default=1, help="gloo worlds side by side (2 processes each)")
    parser.add_argument("--stall-s", type=float, default=STALL_S, help="stop a world silent this long")
    parser.add_argument("--json", help="also write every row (cells, kinds, tolerances, seconds) here")
    args = parser.parse_args(argv)
    types = args.types.split(",") if args.types else list(SAMPLE) if args.sample else all_types()
    unknown = sorted(set(types) - set(all_types()))
    if unknown:
        parser.error(f"not causal-LM types of this transformers: {', '.join(unknown)}")
    previous = read_report(args.out) if args.update else None
    start = time.time()
    rows = run_matrix(types, jobs=max(1, args.jobs), stall_s=args.stall_s,
                      log=lambda line: print(line, flush=True))
    seconds = time.time() - start
    command = " ".join([COMMAND] + ([f"--types {args.types}"] if args.types else ["--sample"] if args.sample else [])
                       + ([f"--jobs {args.jobs}"] if args.jobs != 1 else [])
                       + ([f"--out {args.out}"] if Path(args.out).resolve() != DEFAULT_OUT else []))
    if previous is None:
        Path(args.out).write_text(report(rows, command, seconds))
    else:
        old_rows, meta = previous
        update = dict(command=command + " --update", seconds=round(seconds), types=types)
        rows = {**old_rows, **rows}
        Path(args.out).write_text(report(rows, meta["command"], meta["seconds"], tuple(meta["updates"]) + (update,)))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if Path(args.out).resolve() == DEFAULT_OUT and (previous is not None or not (args.types or args.sample)):
        write_readme_table(rows, previous[1]["command"] if previous is not None else command)  # the whole matrix
    print(summary(rows))
    print(f"wrote {args.out} in {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
