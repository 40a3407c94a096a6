"""The time model against the clock: predicted vs measured step time of real launches on this machine.

    python bench/time_model.py            # 20 layouts: 12 of the built-in GPT, 8 of an hf: Llama (GQA), world 4
    python bench/time_model.py --quick    # 4 layouts (2 per model), 6 steps: checks the script, proves nothing
    python bench/time_model.py --world 2  # one node of 2 ranks instead of 2 nodes of 2

Two models of about the same size: the built-in GPT (its FLOPs and ops from its measured profile) and a transformers
Llama with grouped-query attention (``hf: {config: llama/config.json, seq_len: 64}``, the config written into the
work directory from ``LLAMA``), which the plan prices from its measured profile (``ModelShape.from_profile``:
FLOPs per token, eager ops per micro-step, TP split by the model's own TP plan). Each model's layouts are a
covering array of TP 1/2 x stage 1/2/3 x activation checkpointing x two micro-batches (``layouts``): every pair
of two factors' values appears, in about half the runs of the full product.

Runs ``hybrid probe`` once on a local cluster (2 simulated nodes x 2 ranks, gloo on CPU), then ``hybrid launch``
for each layout with every choice fixed in the cluster file (``parallel.tp``, ``zero_stage``,
``activation_checkpointing``, ``offload: false``; ``job.global_batch`` and ``job.micro_batch``) and the probe's
``probe.json`` in its run directory, so its plan predicts with the measured links and rates -- the real
commands, end to end. Each launch leaves ``time.json`` (``launch.job.metrics.time_record``): the predicted
step time beside the median measured one (the first steps left out). The report: one row per layout
(predicted, measured, measured / predicted), the Spearman rank correlation of predicted and measured over both
models' layouts together (the ranking the planner relies on), and the calibrated prediction: every layout's
prediction times the first layout's measured / predicted -- the level an embedded cluster's launch takes from
its trial of one layout (``launch.planning.trial_local``: every predicted step scaled alike), so what is judged
is how well one layout's level and the model's ratios predict every other layout. Pass: every layout after the
first within +-30 % calibrated, and Spearman >= 0.8 (exit 1 otherwise); the uncalibrated ratios are shown
beside them. Timings need a quiet machine; the full run takes ~15 min on 2 cores. Without ``--quick`` the
section "Time model" of bench/RESULTS.md is replaced.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODEL = {"vocab_size": 2048, "seq_len": 64, "n_layers": 4, "hidden": 256, "n_heads": 4, "mlp_ratio": 4,
         "dropout": 0.0}
# A transformers LlamaConfig of the GPT's size class: 4 layers, width 256, 8 query heads sharing 2 key/value
# heads (GQA), a gated MLP of 688; 4.3M parameters with untied embeddings.
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 2048, "hidden_size": 256,
         "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
         "max_position_embeddings": 128, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
SEQ = 64
MODELS = ("gpt", "llama")
SECTION = "## Time model: predicted vs measured step time (issue 35)"
TOLERANCE = 0.30
MIN_SPEARMAN = 0.8


# Covering arrays over (tp, stage, ac, micro-batch half): every pair of two factors' values in some row.
GPT_ROWS = [(1, 1, False, 0), (1, 1, True, 1), (1, 2, False, 1), (1, 2, True, 0), (1, 3, False, 0),
            (1, 3, True, 1), (2, 1, False, 1), (2, 1, True, 0), (2, 2, False, 0), (2, 2, True, 1),
            (2, 3, False, 1), (2, 3, True, 0)]
LLAMA_ROWS = [(1, 1, False, 0), (1, 2, True, 1), (1, 3, False, 1), (1, 3, True, 0), (2, 1, True, 1),
              (2, 2, False, 0), (2, 3, False, 0), (2, 3, True, 1)]


def layouts(world: int, quick: bool) -> list[dict]:
    """Each model's covering array (``GPT_ROWS``, ``LLAMA_ROWS``) at one global batch of 16 sequences: micro-batch
    the rows per DP rank, or half of them (two micro-steps); ``quick``: each model's first and last."""
    out = []
    for model, rows in (("gpt", GPT_ROWS), ("llama", LLAMA_ROWS)):
        chosen = [rows[0], rows[-1]] if quick else rows
        for tp, stage, ac, half in chosen:
            micro = 16 // (world // tp) // (2 if half else 1)
            out.append({"model": model, "tp": tp, "stage": stage, "ac": ac, "micro_batch": micro})
    return out


def label(lay: dict) -> str:
    return (f"{lay.get('model', 'gpt')} tp{lay['tp']} z{lay['stage']} mb {lay['micro_batch']}"
            + (" AC" if lay["ac"] else ""))


def write_models(work: Path) -> dict:
    """The two model configs in ``work``: ``{name: path}``."""
    (work / "llama").mkdir()
    (work / "llama" / "config.json").write_text(json.dumps(LLAMA, indent=1))
    paths = {"gpt": work / "gpt.yaml", "llama": work / "llama.yaml"}
    paths["gpt"].write_text(json.dumps({"model": {**MODEL, "seq_len": SEQ}}))
    paths["llama"].write_text(json.dumps({"hf": {"config": "llama/config.json", "seq_len": SEQ}}))
    return paths


def cluster_text(nodes: int, per_node: int, model: Path, run_dir: Path, steps: int, lay: dict | None) -> str:
    parallel = "{precision: fp32}" if lay is None else (
        f"{{precision: fp32, tp: {lay['tp']}, zero_stage: {lay['stage']}, activation_checkpointing: "
        f"{str(lay['ac']).lower()}, offload: false}}")
    micro = "" if lay is None else f", micro_batch: {lay['micro_batch']}"
    return (f"cluster: {{address: local, nodes: {nodes}, gpus_per_node: {per_node}, gpu_memory_gb: 16, "
            f"interconnect: {{intra_node: loopback, inter_node: loopback}}}}\n"
            f"job: {{entrypoint: 'hybrid.models.gpt:train', config: {model}, steps: {steps}, run_dir: {run_dir}, "
            f"global_batch: 16{micro}, collective_timeout_s: 300}}\n"
            f"parallel: {parallel}\n")


def hybrid(*argv: str, log: Path) -> None:
    """Run ``hybrid ARGV`` (the real CLI) with its output in ``log``; raise when it fails."""
    from launch.ray.cluster import LOOPBACK_ONLY_ENV

    # loopback only, also when this script is run by hand and not from `make`
    env = {**os.environ, **LOOPBACK_ONLY_ENV,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with open(log, "w") as out:
        code = subprocess.call([sys.executable, "-m", "launch.cli", *argv], stdout=out, stderr=subprocess.STDOUT,
                               cwd=ROOT, env=env)
    if code != 0:
        raise RuntimeError(f"hybrid {' '.join(argv)} exited {code}; see {log}")


def launched(cluster: Path, run_dir: Path, lay: dict, retried: list) -> bool:
    """``hybrid launch cluster``, once more if it fails (a rank's process dying at start-up is not the time
    model's error). False, and the layout left out of the table, if it fails again. (Every TP-2 launch of three
    runs died so -- "oneMKL FATAL ERROR: Cannot load libtorch_cpu.so" -- while the working directory, this
    script's, shipped the Ray logs the earlier launches kept; ``launch.ray.runtime_env`` excludes them now.)"""
    for attempt in (1, 2):
        try:
            hybrid("launch", str(cluster), log=run_dir / "launch.log")
            return True
        except RuntimeError as failed:
            print(f"{label(lay)}: {failed} (attempt {attempt} of 2)", flush=True)
            shutil.copy(run_dir / "launch.log", run_dir / f"launch-failed-{attempt}.log")
            retried.append(f"{label(lay)} (attempt {attempt} failed)")
    return False


def spearman(xs: list, ys: list) -> float:
    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        r = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


def run(args) -> dict:
    from launch.planning.probe_figures import PROBE_FILE

    nodes, per_node = (2, 2) if args.world == 4 else (1, args.world)
    work = Path(args.work).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    models = write_models(work)
    probe_dir = work / "probe"
    (work / "probe.yaml").write_text(cluster_text(nodes, per_node, models["gpt"], probe_dir, args.steps, None))
    started = time.perf_counter()
    hybrid("probe", str(work / "probe.yaml"), log=work / "probe.log")
    probe = json.loads((probe_dir / PROBE_FILE).read_text())
    rows, retried = [], []
    for i, lay in enumerate(layouts(args.world, args.quick)):
        run_dir = work / f"run-{i:02d}"
        run_dir.mkdir()
        shutil.copy(probe_dir / PROBE_FILE, run_dir / PROBE_FILE)
        cluster = work / f"run-{i:02d}.yaml"
        cluster.write_text(cluster_text(nodes, per_node, models[lay["model"]], run_dir, args.steps, lay))
        if not launched(cluster, run_dir, lay, retried):
            continue
        record = json.loads((run_dir / "time.json").read_text())
        rows.append({"layout": label(lay), **lay, "predicted_s": record["predicted_step_s"],
                     "measured_s": record["measured_step_s"], "steps": record["measured_steps"],
                     "terms": record["predicted"]})
        print(f"{label(lay):<24} predicted {rows[-1]['predicted_s'] * 1e3:8.2f} ms  measured "
              f"{rows[-1]['measured_s'] * 1e3:8.2f} ms", flush=True)
    return {"rows": rows, "probe": {k: v for k, v in probe.items() if k != "ranks"}, "nodes": nodes,
            "per_node": per_node, "minutes": (time.perf_counter() - started) / 60, "retried": retried}


def verdict(rows: list) -> dict:
    """Judged as a launch on an embedded cluster predicts: every layout's prediction at the level one layout's
    run sets (the first's measured / predicted, as ``launch.planning.trial_local`` scales every layout by its
    trial), each later layout within ``TOLERANCE`` of its measurement; the ranking by Spearman."""
    predicted = [r["predicted_s"] for r in rows]
    measured = [r["measured_s"] for r in rows]
    first = rows[0]
    scale = first["measured_s"] / first["predicted_s"]  # the trial's level: one run's ratio
    calibrated = [p * scale for p in predicted]
    within = [abs(m / c - 1) <= TOLERANCE for c, m in zip(calibrated, measured)]
    rho = spearman(predicted, measured) if len(rows) > 2 else float("nan")
    return {"within": within, "spearman": rho, "calibrated": calibrated, "scale": scale,
            "passed": all(within[1:]) and rho >= MIN_SPEARMAN}


def markdown(result: dict, check: dict, command: str, quick: bool = False) -> str:
    p = result["probe"]
    intra, inter = p.get("intra") or {}, p.get("inter") or {}
    lines = [SECTION, "",
             f"- Command: `{command}`, {result['minutes']:.1f} min in all",
             f"- Machine: {os.cpu_count()} cores ({platform.processor() or platform.machine()}), Linux "
             f"{platform.release()}, Python {platform.python_version()}; load average at the end "
             f"{os.getloadavg()[0]:.1f} (timings need a quiet machine: other jobs share the cores and the probe)",
             f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- Cluster: local, {result['nodes']} nodes x {result['per_node']} ranks, gloo on CPU, fp32; GPT "
             f"{MODEL} (its measured profile); hf: Llama {LLAMA} at seq_len {SEQ} (its measured profile); global batch 16 "
             f"sequences in every layout; each layout one `hybrid launch` with its choices "
             f"fixed in the cluster file and the probe's probe.json in its run_dir",
             f"- Probe (`hybrid probe`): matmul {next(iter(p['matmul_flops'].values())) / 1e9:.3g} GFLOP/s"
             + (f", AdamW {p['optimizer_rate'] / 1e6:.3g}M parameters/s" if p.get("optimizer_rate") else "")
             + (f", {1e6 / p['op_rate']:.3g} us per eager op" if p.get("op_rate") else "")
             + (f", copy {p['memory_bandwidth'] / 1e9:.3g} GB/s" if p.get("memory_bandwidth") else "")
             + f" (each CPU rank's share of its host's cores); intra-node "
             f"{intra.get('bandwidth', 0) / 1e9:.3g} GB/s, "
             f"{intra.get('latency', 0) * 1e6:.0f} us; inter-node {inter.get('bandwidth', 0) / 1e9:.3g} GB/s, "
             f"{inter.get('latency', 0) * 1e6:.0f} us",
             *([f"- Launches whose rank process died at start-up (`launched`; a layout that failed twice is not "
                f"in the table): {', '.join(result['retried'])}"] if result.get("retried") else []),
             "- measured: median step time of the slowest rank over the steps after the first 3 "
             "(`launch.job.metrics.measured_step_s`); calibrated: every prediction scaled by the first layout's "
             f"measured / predicted (x{check['scale']:.3g}: the level an embedded cluster's launch takes from its "
             "trial of one layout, `launch.planning.trial_local`); judged: the calibrated prediction of every "
             "layout after the first",
             *(["- **A short run (`--quick`: 4 layouts, 6 steps) that checks the script, not the model**; the "
                "acceptance run is the full one (20 layouts, 15 steps) on a quiet machine", ""] if quick else [""]),
             "| layout | compute ms | TP ms | DP ms | optim ms | micro ms | predicted ms | measured ms "
             "| measured / predicted | calibrated ms | measured / calibrated | within 30% |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for i, (r, ok, cal) in enumerate(zip(result["rows"], check["within"], check["calibrated"])):
        t = r["terms"]
        lines.append(f"| {r['layout']} | {t['compute_s'] * 1e3:.2f} | {t['tp_s'] * 1e3:.2f} | {t['dp_s'] * 1e3:.2f} | "
                     f"{t['optimizer_s'] * 1e3:.2f} | {t.get('micro_s', 0.0) * 1e3:.2f} | "
                     f"{r['predicted_s'] * 1e3:.2f} | {r['measured_s'] * 1e3:.2f} | "
                     f"{r['measured_s'] / r['predicted_s']:.2f} | {cal * 1e3:.2f} | {r['measured_s'] / cal:.2f} | "
                     f"{'(sets the level)' if i == 0 else 'yes' if ok else 'no'} |")
    for model in MODELS:
        ratios = [r["measured_s"] / r["predicted_s"] for r in result["rows"] if r.get("model", "gpt") == model]
        if ratios:
            lines.append(f"\n{model}: measured / predicted {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} "
                         "layouts.")
    lines += ["", f"Within +-{TOLERANCE:.0%} calibrated: {sum(check['within'][1:])} of {len(check['within']) - 1} "
                  f"layouts after the first; Spearman "
                  f"rank correlation of predicted and measured: {check['spearman']:.2f} (target >= {MIN_SPEARMAN}). "
                  f"{'PASS' if check['passed'] else 'FAIL'}.", ""]
    return "\n".join(lines)


def write_section(path: Path, text: str) -> None:
    """Replace this bench's section of RESULTS.md (from its heading to the next ``## ``), else append it."""
    old = path.read_text() if path.exists() else ""
    if SECTION in old:
        head, _, rest = old.partition(SECTION)
        tail = rest[rest.find("\n## ") + 1:] if "\n## " in rest else ""
        new = head + text + ("\n" + tail if tail else "")
    else:
        new = old.rstrip("\n") + "\n\n" + text
    path.write_text(new)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 layouts, 6 steps: checks the script")
    ap.add_argument("--world", type=int, default=4, choices=(2, 4), help="ranks (4: 2 nodes x 2; 2: 1 node)")
    ap.add_argument("--steps", type=int, default=None, help="steps per launch (default 15; --quick 6)")
    ap.add_argument("--work", default=str(ROOT / "runs" / "bench-time-model"), help="scratch directory")
    ap.add_argument("--out", default=None, help="markdown file (default bench/RESULTS.md; --quick: none)")
    args = ap.parse_args(argv)
    args.steps = args.steps or (6 if args.quick else 15)
    result = run(args)
    check = verdict(result["rows"])
    command = "python bench/time_model.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    text = markdown(result, check, command.strip(), args.quick)
    print(text)
    out = args.out or (None if args.quick else str(Path(__file__).with_name("RESULTS.md")))  # --quick --out X: X
    if out:
        write_section(Path(out), text)
    return 0 if check["passed"] or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
