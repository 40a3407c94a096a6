"""Odd input files are refused in one sentence, never a traceback or a hang: a YAML integer of more than 4300
digits, a FIFO or device file (or an oversized file) given as a config file, and garbage figures in the
``memory.json`` that ``hybrid plan --measured`` re-plans from."""

import json
import os
import tracemalloc
from pathlib import Path

import pytest

import hybrid.config.yamlfile
from hybrid.config.validate import quote
from hybrid.errors import ConfigError
from hybrid.config.yamlfile import load_yaml
from launch.cli import main
from tests.unit.test_checkpoint_integrity import _refused

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "gpt-tiny.yaml"
HUGE_INT = "9" * 5000  # past Python's 4300-digit limit for int(str)


def _cluster(tmp_path: Path, config=TINY, steps="3") -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text("cluster: {address: local, nodes: 1, gpus_per_node: 1, gpu_memory_gb: 80}\n"
                    f"job: {{entrypoint: 'hybrid.models.gpt:train', config: '{config}', steps: {steps}}}\n")
    return path


# ------------------------------------------------------------------------------------------- YAML files


def test_an_integer_too_long_to_convert_names_the_file_and_line(tmp_path, capsys):
    cluster = _cluster(tmp_path, steps=HUGE_INT)
    err = _refused(["plan", str(cluster)], capsys)
    assert f"cluster file {quote(str(cluster))} line 2: an integer of 5000 digits is too long to read" in err, err

    model = tmp_path / "model.yaml"
    model.write_text(TINY.read_text().replace("hidden: 64", f"hidden: {HUGE_INT}"))
    err = _refused(["plan", str(_cluster(tmp_path, config=model))], capsys)
    assert f"model config {quote(str(model))} line " in err and "5000 digits" in err, err


def test_a_value_python_cannot_convert_is_one_sentence_with_its_line(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("a: 1\nb: [2020-13-01]\n")
    with pytest.raises(ConfigError, match=r"x\.yaml' line 2: '2020-13-01' cannot be read \(month must be in "
                                          r"1\.\.12\); correct it, or quote it to keep it as text\.$"):
        load_yaml(path)


def test_a_device_file_is_not_a_config_file(tmp_path, capsys):
    device = "/dev/null"  # /dev/zero takes the same path; without the check it would read until memory ran out
    err = _refused(["plan", device], capsys)
    assert f"cluster file {quote(str(device))} is not a regular file; pass the path of a YAML file." in err, err
    err = _refused(["plan", str(_cluster(tmp_path, config=device))], capsys)
    assert f"job.config is {quote(str(device))}, but {quote(str(device))} is not a regular file;" in err, err


@pytest.mark.timeout(30)  # the bug was a read that blocked forever, waiting for a writer
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path, capsys):
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    err = _refused(["plan", str(fifo)], capsys)
    assert f"cluster file {quote(str(fifo))} is not a regular file" in err, err
    err = _refused(["plan", str(_cluster(tmp_path, config=fifo))], capsys)
    assert f"{quote(str(fifo))} is not a regular file" in err, err
    with pytest.raises(ConfigError, match=r"^model config '.*pipe\.yaml' is not a regular file; pass the path"):
        load_yaml(fifo, "model config")


def test_an_oversized_file_is_refused_after_reading_no_more_than_the_cap(tmp_path, capsys):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(48 * 2**20)  # sparse: no disk used, but a read of all of it would hold 48 MiB
    tracemalloc.start()
    try:
        err = _refused(["plan", str(big)], capsys)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert f"cluster file {quote(str(big))} is larger than 16 MiB" in err, err
    assert peak < 32 * 2**20, peak  # the cap and one byte, read once


def test_a_file_at_the_cap_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(hybrid.config.yamlfile, "MAX_YAML_BYTES", 16)
    path = tmp_path / "x.yaml"
    path.write_text("a: 1\n" + "#" * 11)  # 16 bytes
    assert load_yaml(path) == {"a": 1}
    path.write_text("a: 1\n" + "#" * 12)
    with pytest.raises(ConfigError, match="is larger than"):
        load_yaml(path)


# ---------------------------------------------------------------------------------- memory.json figures


def _record(peak="100000000", predicted="{\"total\": 1000, \"peak\": 1000}") -> str:
    return f'{{"measured": {{"0": {{"peak_bytes": {peak}, "step": 2}}}}, "predicted": {predicted}}}'


GARBAGE = {
    "infinite": (_record(peak="1e400"), "measured.0.peak_bytes", "got inf"),
    "NaN": (_record(peak="NaN"), "measured.0.peak_bytes", "got nan"),
    "NaN predicted": (_record(predicted='{"total": NaN}'), "predicted.total", "got nan"),
    "negative": (_record(peak="-5"), "measured.0.peak_bytes", "got -5"),
    "negative predicted": (_record(predicted='{"total": -1e30}'), "predicted.total", "got -1e+30"),
    "boolean": (_record(peak="true"), "measured.0.peak_bytes", "got True"),
    "boolean budget": ('{"measured": {"0": {"peak_bytes": 1, "budget_bytes": false}}, "predicted": {"total": 1}}',
                       "measured.0.budget_bytes", "got False"),
    "too many digits": (_record(peak="9" * 5000), "measured.0.peak_bytes", "got inf"),
    "step": ('{"measured": {"0": {"peak_bytes": 1, "step": 1.5}}, "predicted": {"total": 1}}',
             "measured.0.step", "got 1.5"),
    "rank": ('{"measured": {"x": {"peak_bytes": 1}}, "predicted": {"total": 1}}', "the key 'x' of measured", ""),
    "cuda peak missing": ('{"measured": {"0": {"peak_bytes": 1, "device": "cuda"}}, "predicted": {"total": 1}}',
                          "predicted.peak is missing", ""),
    "deeply nested": ("[" * 100_000, "nests too deeply", ""),
}


@pytest.mark.parametrize("case", GARBAGE)
def test_garbage_in_memory_json_is_one_sentence_naming_the_field(case, tmp_path, capsys):
    text, field, got = GARBAGE[case]
    run = tmp_path / "run"
    run.mkdir()
    (run / "memory.json").write_text(text)
    err = _refused(["plan", str(_cluster(tmp_path)), "--measured", str(run)], capsys)
    assert err.startswith(f"error: --measured {run}: ") and "memory.json" in err, err
    assert field in err and got in err, err


def test_a_sound_memory_json_is_re_planned_from(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "memory.json").write_text(json.dumps({"measured": {"0": {"peak_bytes": 10**8, "nvml_used_bytes": None,
                                                                    "step": 2}},
                                                 "predicted": {"total": 1000}}))
    assert main(["plan", str(_cluster(tmp_path)), "--measured", str(run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["measured"]
    assert out["rank"] == 0 and out["measured_bytes"] == 10**8 and out["predicted_bytes"] == 1000


def test_yaml_11_number_forms_that_surprise_are_not_numbers(tmp_path):
    """``1:30`` was 90 (base 60), ``010`` was 8 (octal), ``1_0`` was 10: a config number is decimal, ``_`` only
    between groups of three digits; the rest stays text, which the field's own check then names."""
    from hybrid.config.yamlfile import load_yaml

    path = tmp_path / "numbers.yaml"
    path.write_text("sexagesimal: 1:30\nleading_zero: 010\nodd_group: 1_0\ngrouped: 1_000_000\nhex: 0x10\n"
                    "octal: 0o17\nbinary: 0b11\nfloat: 1.5\nbig: 5.0e+8\ngrouped_float: 1_000.5\nneg: -3\n"
                    "inf: .inf\ndate: 2020-01-01\nflag: true\n")
    doc = load_yaml(path)
    assert doc["sexagesimal"] == "1:30" and doc["leading_zero"] == 10 and doc["odd_group"] == "1_0"
    assert (doc["grouped"], doc["hex"], doc["octal"], doc["binary"]) == (1_000_000, 16, 15, "0b11")
    assert (doc["float"], doc["big"], doc["grouped_float"], doc["neg"]) == (1.5, 5e8, 1000.5, -3)
    assert doc["inf"] == float("inf") and str(doc["date"]) == "2020-01-01" and doc["flag"] is True


@pytest.mark.timeout(30)
def test_a_memory_json_that_is_a_pipe_is_one_sentence(tmp_path, capsys):
    from launch.cli import main

    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "memory.json")
    assert main(["plan", str(ROOT / "clusters" / "local.yaml"), "--measured", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --measured ") and "is not a regular file" in err and err.count("\n") == 1, err
