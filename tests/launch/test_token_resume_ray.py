"""Training on a token file on a real embedded Ray cluster (2 nodes x 2 ranks, loopback only): a worker
SIGKILLed after the first checkpoint is restarted with every rank from that checkpoint, and the job ends
with fp32 weights bit-identical to an uninterrupted run's; both runs' metrics.jsonl hold every step exactly
once, with the same losses (the failed attempt's lines after the checkpoint were replaced)."""

import io
import json
import threading
from pathlib import Path

import pytest
import torch

from hybrid import checkpoint
from hybrid.data.prepare import prepare
from launch.job import plan_and_run
from launch.metrics import METRICS_FILE
from tests.launch.test_launch_ray import _kill_after_first_checkpoint, assert_loopback_only, make_spec

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def model_config(tmp_path: Path) -> Path:
    prepare([ROOT / "README.md", ROOT / "hybrid" / "train.py"], tmp_path / "data" / "corpus.bin")
    path = tmp_path / "model.yaml"
    path.write_text((ROOT / "configs" / "gpt-tiny.yaml").read_text() + "data: data/corpus.bin\n")
    return path


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]


def test_a_killed_run_on_a_token_file_ends_bit_identical_with_every_metrics_step_once(cluster, tmp_path):
    steps, every = 20, 5
    config = str(model_config(tmp_path))
    ref_dir, killed_dir = tmp_path / "ref", tmp_path / "killed"
    reference = plan_and_run(make_spec(steps=steps, config=config, checkpoint={"dir": str(ref_dir), "every": every}),
                             io.StringIO(), tty=False)
    assert reference.results[0]["reference_loss"]["name"] == "unigram entropy of the data"

    done, killed = threading.Event(), {}
    killer = threading.Thread(target=_kill_after_first_checkpoint, args=(killed_dir, 1, done, killed))
    killer.start()
    out = io.StringIO()
    try:
        result = plan_and_run(make_spec(entrypoint="tests.launch.entrypoints:train_recording_pid", steps=steps,
                                        config=config, max_failures=1,
                                        checkpoint={"dir": str(killed_dir), "every": every}), out, tty=False)
    finally:
        done.set()
        killer.join()
    assert killed and result.attempts == 2, out.getvalue()
    assert result.resumed_from is not None and result.resumed_from < steps

    got, _, got_doc = checkpoint.consolidate(killed_dir)
    want, _, _ = checkpoint.consolidate(ref_dir)
    assert got_doc["step"] == steps and sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)

    ref_rows, killed_rows = metrics(ref_dir), metrics(killed_dir)
    assert [r["step"] for r in ref_rows] == [r["step"] for r in killed_rows] == list(range(1, steps + 1))
    assert [r["loss"] for r in killed_rows] == [r["loss"] for r in ref_rows]
    assert all(r["throughput_unit"] == "tokens/s" and r["lr"] == 5e-3 and r["grad_norm"] > 0 for r in killed_rows)
    assert f"metrics {killed_dir / METRICS_FILE}" in out.getvalue()
    print(f"token kill test: reference {reference.wall_s:.1f} s, killed run {result.wall_s:.1f} s")
    assert_loopback_only(*cluster)
