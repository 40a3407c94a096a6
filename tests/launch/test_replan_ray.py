"""Out of memory -> re-plan, end to end on a real embedded Ray cluster (2 nodes x 2 ranks, CPU, gloo).

The model (27.6M parameters, fp32, tp=1, dp=4, small ``zero:`` buckets) and ``cluster.gpu_memory_gb = 0.56``
make the planner choose stage 1 (stage 0 fits its arithmetic). The entrypoint
``tests.launch.entrypoints:train_holding_extra`` holds a buffer the planner cannot see (allocated after the
step-2 checkpoint, sized once per rank to take its resident memory OVER_MB past the budget; each rank's
memory meter keeps glibc from holding freed heap, so RSS follows the live tensors and the stage-1 and stage-3 footprints lie
~120 MB apart rather than within heap noise of each other), so at
step 3 every rank's measured peak RSS growth exceeds the 0.56 GB budget and its budget check raises
``torch.OutOfMemoryError``. The driver re-plans from the
measured figures, prints the re-plan line, restarts every rank from checkpoint step 2 at a higher stage,
and the job finishes; its losses after the restart equal (fp32, bit for bit) those of a run forced to the
new stage from a copy of the same checkpoint. A buffer no plan can absorb ends in ``JobFailed``: one
sentence naming what would fit, the step-2 checkpoint intact. The cluster is the package's (conftest.py).
"""

import io
import re
import shutil
from pathlib import Path

import pytest
import yaml

from hybrid.checkpoint import layout
from launch.job.driver import JobFailed, plan_and_run
from launch.planning.memory_loop import load
from launch.spec import parse_spec

pytestmark = pytest.mark.slow

MODEL = {"model": {"vocab_size": 2048, "seq_len": 32, "n_layers": 8, "hidden": 512, "n_heads": 8},
         "zero": {"reduce_bucket_size": 500_000, "prefetch_bucket_size": 500_000}}
BUDGET_GB, OVER_MB, STEPS = 0.56, 10, 4


def make_spec(tmp: Path, run: str, env: dict, stage="auto", checkpointing="auto"):
    config = tmp / "model.yaml"
    config.write_text(yaml.safe_dump(MODEL))
    return parse_spec({
        "cluster": {"address": "local", "nodes": 2, "gpus_per_node": 2, "gpu_memory_gb": BUDGET_GB,
                    "enforce_memory_budget": True},
        "job": {"entrypoint": "tests.launch.entrypoints:train_holding_extra", "config": str(config), "steps": STEPS,
                "micro_batch": 2, "checkpoint": {"dir": str(tmp / run), "every": 2, "keep_last": 10},
                "collective_timeout_s": 120, "env": env},
        "parallel": {"tp": 1, "zero_stage": stage, "precision": "fp32", "activation_checkpointing": checkpointing},
    }, base_dir=Path(__file__).resolve().parents[2])


def test_a_rank_over_budget_is_replanned_to_a_higher_stage_and_continues_the_run(cluster, tmp_path):
    """Over 20 s: three or four starts of four rank actors (stage 1, the re-plan to 2 and possibly to 3, and
    the reference forced to the new stage), each importing torch, on a model big enough (27.6M parameters)
    that the stage-1 and stage-3 footprints lie ~120 MB apart, far outside the heap's noise; fewer steps would
    leave no checkpoint before the overshoot (step 2) and no steps after it to compare."""
    out = io.StringIO()
    result = plan_and_run(make_spec(tmp_path, "run", {"HOLD_OVER_BUDGET_MB": str(OVER_MB)}), out, tty=False)
    text = out.getvalue()
    assert result.plan.stage == 1, text
    lines = re.findall(r"rank \d ran out of memory at stage ([12]) \(measured [\d.]+ MB of 560(?:\.0+)? MB, predicted "
                       r"[\d.]+ MB\): restarting from step 2 at stage ([23])( with activation checkpointing)? "
                       r"\(predicted [\d.]+ MB\)", text)
    assert lines and lines[0][0] == "1", text  # stage 2 may still be over budget: then a second re-plan to 3
    new_stage, checkpointing = int(lines[-1][1]), bool(lines[-1][2])
    assert len(result.replans) == len(lines) and result.attempts == 1, text  # a re-plan is not a failure
    assert all(r["stage"] == new_stage for r in result.results.values())
    assert "memory per rank after step 1" in text and "peak (RSS growth)" in text
    record = load(tmp_path / "run")
    assert record["finished"] and record["plan"]["stage"] == new_stage and len(record["overshoots"]) == len(lines)
    assert record["overshoots"][0]["measured_bytes"] > BUDGET_GB * 1e9

    # the reference: the same job forced to the new stage from a copy of the step-2 checkpoint
    step2 = next(e.path for e in layout.scan(tmp_path / "run") if e.step == 2)
    shutil.copytree(step2, layout.checkpoints_dir(tmp_path / "ref") / step2.name)
    for sized in (tmp_path / "run").glob("hold-rank*.mb"):  # the reference holds the same bytes per rank
        shutil.copy(sized, tmp_path / "ref" / sized.name)
    reference = plan_and_run(make_spec(tmp_path, "ref", {"HOLD_OVER_BUDGET_MB": str(OVER_MB)}, stage=new_stage,
                                       checkpointing=checkpointing), io.StringIO(), tty=False)
    after = {e["step"]: e["loss"] for e in result.history if e["step"] > 2}
    assert sorted(after) == [3, 4]
    assert after == {e["step"]: e["loss"] for e in reference.history if e["step"] > 2}


def test_a_budget_nothing_can_meet_ends_in_one_sentence_with_the_checkpoint_intact(cluster, tmp_path):
    """About 20 s: four rank actors must train the 27.6M-parameter model past its step-2 checkpoint before the
    600 MB it then holds can overshoot; that checkpoint is what the sentence must leave intact."""
    out = io.StringIO()
    with pytest.raises(JobFailed) as info:
        plan_and_run(make_spec(tmp_path, "run", {"HOLD_EXTRA_MB": "600"}), out, tty=False)
    message = str(info.value)
    assert "\n" not in message and "ran out of memory at stage 1" in message
    assert re.search(r"nothing fits 0\.504 GB usable per rank: even stage 3 with (activation checkpointing, )?"
                     r"micro-batch 1 x 2 accumulation steps needs [\d.]+ GB .*it would fit with (at least \d+ nodes \(cluster\.nodes, now 2\) or )?"
                     r"cluster\.gpu_memory_gb >= [\d.]+$", message)
    entries = {e.step: e for e in layout.scan(tmp_path / "run")}
    assert entries[2].complete and 4 not in entries  # the last good checkpoint is the one before the overshoot
    assert load(tmp_path / "run")["finished"] is False
