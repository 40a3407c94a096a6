"""TP plans on a real embedded Ray cluster (2 nodes × 2 ranks, the package's).

The README's examples/own_model with ``parallel.tp_plan`` (cluster-tp.yaml) runs at TP 2 × DP 2: its entrypoint's
``ctx.parallelize`` splits the plain PyTorch model by the cluster file's plan, so the two ranks of a TP group
report one loss and the two DP ranks two.

A Hugging Face model without code:
The model config names a transformers Llama by its ``config.json`` (``hf:``, ``hybrid.models.hf``) and a token
file; at ``tp: 2`` the model's own TP plan splits it (4 heads, 2 KV heads; ``tp: auto`` would weigh TP 1 and 2
by time and pick 1 for a model this small), so the two ranks of a node hold one head each of every layer and DP spans the nodes. The job
trains with the built-in loop and checkpoints; with its last checkpoint removed, a second launch resumes from
the one before and ends with the same losses and bit-identical weights.
"""

import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from hybrid import checkpoint
from hybrid.data.prepare import prepare
from launch.job.driver import plan_and_run
from launch.job.metrics import METRICS_FILE
from launch.spec import load_spec, parse_spec

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY = 4, 2


def _job_dir(tmp_path: Path) -> Path:
    transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=True).save_pretrained(tmp_path / "tiny-llama")
    prepare([ROOT / "README.md"], tmp_path / "data" / "corpus.bin")
    (tmp_path / "model.yaml").write_text("hf: {config: tiny-llama/config.json, seq_len: 16}\n"
                                         "data: data/corpus.bin\ntrain: {lr: 0.01}\n")
    return tmp_path


def _spec(job_dir: Path):
    return parse_spec({
        "cluster": {"address": "local", "nodes": 2, "gpus_per_node": 2, "gpu_memory_gb": 80},
        "job": {"entrypoint": "hybrid.models.hf:train", "config": "model.yaml", "steps": STEPS, "micro_batch": 4,
                "collective_timeout_s": 120,
                "checkpoint": {"dir": str(job_dir / "run"), "every": EVERY, "keep_last": 2}},
        "parallel": {"tp": 2, "precision": "fp32"},  # tp auto: the time model picks TP 1 for a model this small
    }, base_dir=job_dir)


def _losses(run_dir: Path) -> dict:
    return {row["step"]: row["loss"] for row in map(json.loads, (run_dir / METRICS_FILE).read_text().splitlines())}


def test_the_own_model_example_with_a_tp_plan_trains_at_tp_2(cluster):
    spec = load_spec(ROOT / "examples" / "own_model" / "cluster-tp.yaml")
    out = io.StringIO()
    result = plan_and_run(spec, out, tty=False)
    text = out.getvalue()
    assert (result.plan.layout.tp, result.plan.layout.dp) == (2, 2), text
    assert "tp 2 as requested (parallel.tp), split by parallel.tp_plan" in text
    assert all((r["tp"], r["dp"]) == (2, 2) for r in result.results.values())
    last = [result.last_reports[r]["loss"] for r in range(4)]
    assert last[0] == last[1] and last[2] == last[3] and last[0] != last[2], last  # TP pairs, DP ranks
    losses = [h["loss"] for h in result.history]
    assert len(losses) == spec.job.steps and losses[-1] < losses[0] - 1.0, losses


def test_a_hugging_face_config_trains_with_tp_from_its_own_plan_and_resumes_bit_exactly(cluster, tmp_path):
    job_dir = _job_dir(tmp_path)
    out = io.StringIO()
    first = plan_and_run(_spec(job_dir), out, tty=False)
    text = out.getvalue()
    assert (first.plan.layout.tp, first.plan.layout.dp) == (2, 2), text
    assert "tp 2 as requested (parallel.tp), split by LlamaForCausalLM's own TP plan" in text
    assert "counted on the meta device by hybrid.models.hf.build_model" in text
    # planned by the model's measured profile, time included: the summary sets the measured step beside it
    assert re.search(r"step time: predicted [\d.]+ m?s \(tp2 z\d mb \d+.*\), measured [\d.]+ m?s \(median of \d+ "
                     r"steps\): measured / predicted = [\d.]+", text), text
    assert all(r["tp"] == 2 for r in first.results.values())
    assert first.results[0]["reference_loss"]["name"] == "unigram entropy of the data"
    losses = _losses(job_dir / "run")
    assert sorted(losses) == list(range(1, STEPS + 1)) and losses[STEPS] < losses[1], losses
    want, want_dir, _ = checkpoint.consolidate(job_dir / "run")
    assert want_dir.name == f"step-{STEPS:06d}"
    assert want["model.embed_tokens.weight"].shape == (256, 32)  # whole tensors, as the unsplit model's

    shutil.rmtree(want_dir)  # the last checkpoint gone: a launch resumes from the one before
    out = io.StringIO()
    second = plan_and_run(_spec(job_dir), out, tty=False)
    assert second.resumed_from == STEPS - EVERY, out.getvalue()
    assert _losses(job_dir / "run") == losses
    got, got_dir, _ = checkpoint.consolidate(job_dir / "run")
    assert got_dir.name == f"step-{STEPS:06d}"
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    # the checkpoint records the architecture: `consolidate --hf` writes a directory from_pretrained loads, with
    # no config path to give, and the loaded model's weights are the run's
    exported = checkpoint.consolidate_hf(job_dir / "run", tmp_path / "exported")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    assert all(torch.equal(loaded.state_dict()[k], want[k]) for k in want), exported
