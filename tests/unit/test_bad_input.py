"""Bad input through the real CLI entry: every malformed cluster file and bad argument is one sentence.

Each case runs ``launch.cli.main`` in-process (no Ray starts: every one fails before that) and must
exit 2 with exactly one ``error:`` line on stderr that names the field and then the fix (``FIXES``,
``ARG_FIXES``: after the '; ' where the sentence has one), and no traceback. A few run
through a subprocess, as a user's shell would.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybrid.config.validate import QUOTE_LIMIT
from launch.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "gpt-tiny.yaml")


def good() -> dict:
    return {
        "cluster": {"address": "local", "nodes": 2, "gpus_per_node": 2, "gpu_memory_gb": 80},
        "job": {"entrypoint": "hybrid.models.gpt:train", "config": TINY, "steps": 5},
        "parallel": {"tp": "auto", "zero_stage": "auto"},
    }


DROP = object()


def edit(section: str, key: str, value) -> dict:
    """The good file with ``section.key`` (dots for deeper) set to ``value`` (``DROP``: removed)."""
    doc = good()
    *parents, last = [section] + key.split(".") if key else [section]
    target = doc
    for name in parents:
        target = target.setdefault(name, {})
    if value is DROP:
        target.pop(last)
    else:
        target[last] = value
    return doc


def dump(doc) -> str:
    return yaml.safe_dump(doc, sort_keys=False)


def replaced(old: str, new: str) -> str:
    text = dump(good())
    assert old in text, text
    return text.replace(old, new)


def _bomb(levels: int) -> str:
    """A YAML value that expands to 10^levels leaves through anchors (a "billion laughs")."""
    text = "&a0 [x, x, x, x, x, x, x, x, x, x]"
    for k in range(1, levels):
        text = f"&a{k} [{text}, " + ", ".join([f"*a{k - 1}"] * 9) + "]"
    return text


# (cluster.yaml text or a function of tmp_path giving it, the field the error must name)
FILES = {
    # cluster
    "address not an address": (dump(edit("cluster", "address", "10.0.0.1")), "cluster.address"),
    "ray address port not a number": (dump(edit("cluster", "address", "ray://host:notaport")), "cluster.address"),
    "ray address without host": (dump(edit("cluster", "address", "ray://:10001")), "cluster.address"),
    "ray address port 0": (dump(edit("cluster", "address", "ray://host:0")), "cluster.address"),
    "ray address port too big": (dump(edit("cluster", "address", "ray://host:70000")), "cluster.address"),
    "address a number": (dump(edit("cluster", "address", 42)), "cluster.address"),
    "address missing": (dump(edit("cluster", "address", DROP)), "cluster.address"),
    "nodes 0": (dump(edit("cluster", "nodes", 0)), "cluster.nodes"),
    "nodes negative": (dump(edit("cluster", "nodes", -1)), "cluster.nodes"),
    "nodes fractional": (dump(edit("cluster", "nodes", 2.5)), "cluster.nodes"),
    "nodes a string": (dump(edit("cluster", "nodes", "2")), "cluster.nodes"),
    "nodes a boolean": (dump(edit("cluster", "nodes", True)), "cluster.nodes"),
    "nodes absurd": (dump(edit("cluster", "nodes", 10**6)), "cluster.nodes"),
    "nodes a list": (dump(edit("cluster", "nodes", [2])), "cluster.nodes"),
    "gpus_per_node 0": (dump(edit("cluster", "gpus_per_node", 0)), "cluster.gpus_per_node"),
    "gpus_per_node auto": (dump(edit("cluster", "gpus_per_node", "auto")), "cluster.gpus_per_node"),
    "gpus_per_node absurd": (dump(edit("cluster", "gpus_per_node", 5000)), "cluster.gpus_per_node"),
    "gpu memory 0": (dump(edit("cluster", "gpu_memory_gb", 0)), "cluster.gpu_memory_gb"),
    "gpu memory negative": (dump(edit("cluster", "gpu_memory_gb", -80)), "cluster.gpu_memory_gb"),
    "gpu memory inf": (replaced("gpu_memory_gb: 80", "gpu_memory_gb: .inf"), "cluster.gpu_memory_gb"),
    "gpu memory nan": (replaced("gpu_memory_gb: 80", "gpu_memory_gb: .nan"), "cluster.gpu_memory_gb"),
    "gpu memory with unit": (dump(edit("cluster", "gpu_memory_gb", "80GB")), "cluster.gpu_memory_gb"),
    "gpu memory 1e3 read as a string": (replaced("gpu_memory_gb: 80", "gpu_memory_gb: 1e3"),
                                        "cluster.gpu_memory_gb"),
    "gpu memory missing": (dump(edit("cluster", "gpu_memory_gb", DROP)), "cluster.gpu_memory_gb"),
    "interconnect a string": (dump(edit("cluster", "interconnect", "nvlink")), "cluster.interconnect"),
    "intra_node unknown": (dump(edit("cluster", "interconnect", {"intra_node": "fast"})),
                           "cluster.interconnect.intra_node"),
    "inter_node a number": (dump(edit("cluster", "interconnect", {"inter_node": 5})),
                            "cluster.interconnect.inter_node"),
    "interconnect unknown key": (dump(edit("cluster", "interconnect", {"bogus": "x"})), "cluster.interconnect.bogus"),
    "interconnect false": (dump(edit("cluster", "interconnect", False)), "cluster.interconnect"),
    "job.env a float YAML made of 1.10": (dump(edit("job", "env", {"VERSION": 1.1})), "job.env.VERSION"),
    "connect timeout 0": (dump(edit("cluster", "connect_timeout_s", 0)), "cluster.connect_timeout_s"),
    "connect timeout inf": (replaced("gpu_memory_gb: 80", "gpu_memory_gb: 80\n  connect_timeout_s: .inf"),
                            "cluster.connect_timeout_s"),
    "connect timeout 1e-6": (dump(edit("cluster", "connect_timeout_s", 1e-6)), "cluster.connect_timeout_s"),
    "connect timeout a day": (dump(edit("cluster", "connect_timeout_s", 86400)), "cluster.connect_timeout_s"),
    "cluster unknown key": (dump(edit("cluster", "typo", 1)), "cluster.typo"),
    "cluster a list": (dump({**good(), "cluster": [1, 2]}), "cluster"),
    "cluster missing": (dump({k: v for k, v in good().items() if k != "cluster"}), "cluster"),
    # job
    "entrypoint missing": (dump(edit("job", "entrypoint", DROP)), "job.entrypoint"),
    "entrypoint without colon": (dump(edit("job", "entrypoint", "hybrid.models.gpt")), "job.entrypoint"),
    "entrypoint two colons": (dump(edit("job", "entrypoint", "a:b:c")), "job.entrypoint"),
    "entrypoint module missing": (dump(edit("job", "entrypoint", "no_such_pkg.mod:train")), "job.entrypoint"),
    "entrypoint function missing": (dump(edit("job", "entrypoint", "hybrid.models.gpt:nope")), "job.entrypoint"),
    "entrypoint wrong signature": (dump(edit("job", "entrypoint", "hybrid.config.validate:join")), "job.entrypoint"),
    "entrypoint no arguments": (dump(edit("job", "entrypoint", "os:getcwd")), "job.entrypoint"),
    "entrypoint not callable": (dump(edit("job", "entrypoint", "hybrid.config.validate:PRECISIONS")), "job.entrypoint"),
    "entrypoint a number": (dump(edit("job", "entrypoint", 123)), "job.entrypoint"),
    "config missing": (dump(edit("job", "config", DROP)), "job.config"),
    "config absent file": (dump(edit("job", "config", "nothere.yaml")), "job.config"),
    "config a directory": (lambda tmp: dump(edit("job", "config", str(tmp))), "job.config"),
    "config a number": (dump(edit("job", "config", 5)), "job.config"),
    "steps 0": (dump(edit("job", "steps", 0)), "job.steps"),
    "steps negative": (dump(edit("job", "steps", -5)), "job.steps"),
    "steps a word": (dump(edit("job", "steps", "ten")), "job.steps"),
    "steps 1e3 read as a string": (replaced("steps: 5", "steps: 1e3"), "job.steps"),
    "steps fractional": (dump(edit("job", "steps", 10.5)), "job.steps"),
    "steps missing": (dump(edit("job", "steps", DROP)), "job.steps"),
    "micro_batch 0": (dump(edit("job", "micro_batch", 0)), "job.micro_batch"),
    "micro_batch absurd": (dump(edit("job", "micro_batch", 2**30)), "job.micro_batch"),
    "max_failures negative": (dump(edit("job", "max_failures", -1)), "job.max_failures"),
    "max_failures absurd": (dump(edit("job", "max_failures", 100000)), "job.max_failures"),
    "seed 2^70": (dump(edit("job", "seed", 2**70)), "job.seed"),
    "seed negative": (dump(edit("job", "seed", -1)), "job.seed"),
    "seed fractional": (dump(edit("job", "seed", 1.5)), "job.seed"),
    "collective timeout inf": (replaced("steps: 5", "steps: 5\n  collective_timeout_s: .inf"),
                               "job.collective_timeout_s"),
    "collective timeout 1e-6": (dump(edit("job", "collective_timeout_s", 1e-6)), "job.collective_timeout_s"),
    "collective timeout 0": (dump(edit("job", "collective_timeout_s", 0)), "job.collective_timeout_s"),
    "collective timeout with unit": (dump(edit("job", "collective_timeout_s", "300s")), "job.collective_timeout_s"),
    "collective timeout absurd": (dump(edit("job", "collective_timeout_s", 10**9)), "job.collective_timeout_s"),
    "placement timeout 0": (dump(edit("job", "placement_timeout_s", 0)), "job.placement_timeout_s"),
    "placement timeout text": (dump(edit("job", "placement_timeout_s", "2 min")), "job.placement_timeout_s"),
    "checkpoint a string": (dump(edit("job", "checkpoint", "./runs")), "job.checkpoint"),
    "checkpoint dir missing": (dump(edit("job", "checkpoint", {"every": 5})), "job.checkpoint.dir"),
    "checkpoint dir is a file": (lambda tmp: dump(edit("job", "checkpoint", {"dir": str(_file(tmp))})),
                                 "job.checkpoint.dir"),
    "checkpoint dir under a file": (lambda tmp: dump(edit("job", "checkpoint", {"dir": str(_file(tmp) / "run")})),
                                    "job.checkpoint.dir"),
    "checkpoint dir not writable": (dump(edit("job", "checkpoint", {"dir": "/proc/hybrid-runs"})),
                                    "job.checkpoint.dir"),
    "checkpoint every 0": (lambda tmp: dump(edit("job", "checkpoint", {"dir": str(tmp), "every": 0})),
                           "job.checkpoint.every"),
    "checkpoint keep_last 0": (lambda tmp: dump(edit("job", "checkpoint", {"dir": str(tmp), "keep_last": 0})),
                               "job.checkpoint.keep_last"),
    "checkpoint unknown key": (lambda tmp: dump(edit("job", "checkpoint", {"dir": str(tmp), "evry": 5})),
                               "job.checkpoint.evry"),
    "job unknown key": (dump(edit("job", "stpes", 7)), "job.stpes"),
    "job a string": (dump({**good(), "job": "train"}), "job"),
    # parallel
    "tp does not divide": (dump(edit("parallel", "tp", 3)), "parallel.tp"),
    "tp 0": (dump(edit("parallel", "tp", 0)), "parallel.tp"),
    "tp a word": (dump(edit("parallel", "tp", "two")), "parallel.tp"),
    "stage 4": (dump(edit("parallel", "zero_stage", 4)), "parallel.zero_stage"),
    "stage negative": (dump(edit("parallel", "zero_stage", -1)), "parallel.zero_stage"),
    "stage a string": (dump(edit("parallel", "zero_stage", "3")), "parallel.zero_stage"),
    "stage a boolean": (dump(edit("parallel", "zero_stage", True)), "parallel.zero_stage"),
    "precision fp8": (dump(edit("parallel", "precision", "fp8")), "parallel.precision"),
    "precision a list": (dump(edit("parallel", "precision", ["bf16"])), "parallel.precision"),
    "parallel unknown key": (dump(edit("parallel", "bogus", 1)), "parallel.bogus"),
    "parallel a number": (dump({**good(), "parallel": 5}), "parallel"),
    # the file as a whole
    "unknown section": (dump({**good(), "jobs": {}}), "jobs"),
    "a list": ("- cluster\n- job\n", "cluster file"),
    "empty": ("", "cluster file"),
    "duplicate key": (replaced("  nodes: 2\n", "  nodes: 2\n  nodes: 3\n"), "'nodes' is given twice"),
    "duplicate section": (dump(good()) + "job: {steps: 3}\n", "'job' is given twice"),
    "not utf-8": ("cluster:\n  address: caf\xe9\n".encode("latin-1"), "not UTF-8"),
    "yaml syntax": (replaced("  steps: 5\n", "  steps: [5\n"), "line "),
    "tab indentation": (replaced("  nodes: 2\n", "\tnodes: 2\n"), "line "),
    "yaml bomb": (replaced("nodes: 2", f"nodes: {_bomb(6)}"), "cluster.nodes"),  # 10^7 leaves, if printed
    "huge string value": (dump(edit("job", "steps", "9" * 100_000 + "x")), "job.steps"),
}


# The fix each sentence gives, after the field it names (after the '; ' when the sentence has one): what to
# write instead, or the range a value must lie in.
FIXES = {
    'a list': 'must be a mapping with sections cluster, job (and optionally parallel)',
    'address a number': "must be 'local' (embedded Ray), 'auto' (the running cluster) or 'ray://host:port' with a port from 1 to 65535",
    'address missing': "add it ('local' (embedded Ray), 'auto' (the running cluster) or 'ray://host:port')",
    'address not an address': "must be 'local' (embedded Ray), 'auto' (the running cluster) or 'ray://host:port'",
    'checkpoint a string': 'must be a mapping like {dir: ./runs/demo, every: 10}',
    'checkpoint dir is a file': 'give a directory path',
    'checkpoint dir missing': 'add it (the directory for checkpoints)',
    'checkpoint dir not writable': 'give a directory you can write to',
    'checkpoint dir under a file': 'give a directory path',
    'checkpoint every 0': 'must be a whole number from 1 to 1000000000000',
    'checkpoint keep_last 0': 'must be a whole number from 1 to 1000000000000',
    'checkpoint unknown key': 'use one of: dir, every, keep_last',
    'cluster a list': 'must be a mapping',
    'cluster missing': 'add it (see clusters/local.yaml for the shape)',
    'cluster unknown key': 'use one of: address, nodes, gpus_per_node, gpu_memory_gb, interconnect',
    'collective timeout 0': 'must be a number from 1 to 604800 seconds',
    'collective timeout 1e-6': 'must be a number from 1 to 604800 seconds',
    'collective timeout absurd': 'must be a number from 1 to 604800 seconds',
    'collective timeout inf': 'must be a number from 1 to 604800 seconds',
    'collective timeout with unit': 'must be a number from 1 to 604800 seconds',
    'config a directory': 'give the path of the model config YAML (relative to the cluster file)',
    'config a number': 'must be the path of the model config YAML',
    'config absent file': 'give the path of the model config YAML (relative to the cluster file)',
    'config missing': 'add it (the path of the model config YAML)',
    'connect timeout 0': 'must be a number from 1 to 3600 seconds',
    'connect timeout 1e-6': 'must be a number from 1 to 3600 seconds',
    'connect timeout a day': 'must be a number from 1 to 3600 seconds',
    'connect timeout inf': 'must be a number from 1 to 3600 seconds',
    'duplicate key': 'keep one of them',
    'duplicate section': 'keep one of them',
    'empty': 'must be a mapping with sections cluster, job (and optionally parallel)',
    'entrypoint a number': 'must be module:function, e.g. hybrid.models.gpt:train',
    'entrypoint function missing': 'give an importable module:function',
    'entrypoint missing': 'add it (module:function, e.g. hybrid.models.gpt:train)',
    'entrypoint module missing': 'give a module:function importable from there or installed',
    'entrypoint no arguments': "give a function that takes the rank's Context, def train(ctx)",
    'entrypoint not callable': 'give an importable module:function',
    'entrypoint two colons': 'must be module:function, e.g. hybrid.models.gpt:train',
    'entrypoint without colon': 'must be module:function, e.g. hybrid.models.gpt:train',
    'entrypoint wrong signature': "give a function that takes the rank's Context, def train(ctx)",
    'gpu memory 0': 'must be a number above 0 and at most 100000 GB',
    'gpu memory 1e3 read as a string': 'must be a number above 0 and at most 100000 GB',
    'gpu memory inf': 'must be a number above 0 and at most 100000 GB',
    'gpu memory missing': 'add it (the memory of one GPU in GB, e.g. 80)',
    'gpu memory nan': 'must be a number above 0 and at most 100000 GB',
    'gpu memory negative': 'must be a number above 0 and at most 100000 GB',
    'gpu memory with unit': 'must be a number above 0 and at most 100000 GB',
    'gpus_per_node 0': 'must be a whole number from 1 to 1024',
    'gpus_per_node absurd': 'must be a whole number from 1 to 1024',
    'gpus_per_node auto': 'write the real value',
    'huge string value': 'must be a whole number from 1 to 1000000000000',
    'inter_node a number': 'must be one of infiniband, roce, ethernet, loopback, unspecified',
    'interconnect a string': 'must be a mapping like {intra_node: nvlink, inter_node: infiniband}',
    'interconnect false': 'must be a mapping like {intra_node: nvlink, inter_node: infiniband}',
    'interconnect unknown key': 'use one of: intra_node, inter_node',
    'intra_node unknown': 'must be one of nvlink, pcie, loopback, unspecified',
    'job a string': 'must be a mapping',
    'job unknown key': 'use one of: entrypoint, config, steps, micro_batch',
    'job.env a float YAML made of 1.10': "must be a string (quote it, as in VERSION: '1.1', so it reaches the ranks exactly as written)",
    'max_failures absurd': 'must be a whole number from 0 to 1000',
    'max_failures negative': 'must be a whole number from 0 to 1000',
    'micro_batch 0': 'must be a whole number from 1 to 1048576',
    'micro_batch absurd': 'must be a whole number from 1 to 1048576',
    'nodes 0': 'must be a whole number from 1 to 100000',
    'nodes a boolean': 'must be a whole number from 1 to 100000',
    'nodes a list': 'must be a whole number from 1 to 100000',
    'nodes a string': 'write the number without quotes',
    'nodes absurd': 'must be a whole number from 1 to 100000',
    'nodes fractional': 'must be a whole number from 1 to 100000',
    'nodes negative': 'must be a whole number from 1 to 100000',
    'not utf-8': 'save it as UTF-8',
    'parallel a number': 'must be a mapping',
    'parallel unknown key': 'use one of: tp, zero_stage, precision, offload, activation_checkpointing',
    'placement timeout 0': 'must be a number from 1 to 604800 seconds',
    'placement timeout text': 'must be a number from 1 to 604800 seconds',
    'precision a list': 'must be one of bf16, fp32',
    'precision fp8': 'must be one of bf16, fp32',
    'ray address port 0': 'with a port from 1 to 65535',
    'ray address port not a number': 'with a port from 1 to 65535',
    'ray address port too big': 'with a port from 1 to 65535',
    'ray address without host': "or 'ray://host:port'",
    'seed 2^70': 'must be a whole number from 0 to 4294967295',
    'seed fractional': 'must be a whole number from 0 to 4294967295',
    'seed negative': 'must be a whole number from 0 to 4294967295',
    'stage 4': "must be 'auto' or 0, 1, 2 or 3",
    'stage a boolean': "must be 'auto' or 0, 1, 2 or 3",
    'stage a string': 'write the number without quotes',
    'stage negative': "must be 'auto' or 0, 1, 2 or 3",
    'steps 0': 'must be a whole number from 1 to 1000000000000',
    'steps 1e3 read as a string': 'write 1.0e+3 or the plain number',
    'steps a word': 'must be a whole number from 1 to 1000000000000',
    'steps fractional': 'must be a whole number from 1 to 1000000000000',
    'steps missing': 'add it (the number of training steps)',
    'steps negative': 'must be a whole number from 1 to 1000000000000',
    'tab indentation': 'fix the indentation or quoting there',
    'tp 0': "must be 'auto' or a whole number that divides cluster.gpus_per_node",
    'tp a word': "must be 'auto' or a whole number that divides cluster.gpus_per_node",
    'tp does not divide': "use a divisor of 2 or 'auto'",
    'unknown section': 'use one of: cluster, job, parallel',
    'yaml bomb': 'must be a whole number from 1 to 100000',
    'yaml syntax': 'fix the indentation or quoting there',
}

def _file(tmp: Path) -> Path:
    path = tmp / "a-file"
    path.write_text("x")
    return path


def assert_one_error_line(code: int, err: str, field: str, fix: str = None) -> str:
    """One ``error:`` line, exit 2, naming ``field``; with ``fix``, the fix follows the field (in the part after
    the '; ' where the sentence has one)."""
    lines = err.strip().splitlines()
    assert code == 2, err
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert field in lines[0], (field, lines[0])
    if fix is not None:
        after_field = lines[0][lines[0].index(field) + len(field):]
        fix_part = after_field.split("; ", 1)[1] if "; " in after_field else after_field
        assert fix in fix_part, (fix, lines[0])
    return lines[0]


def test_the_sweep_is_as_wide_as_promised_and_every_case_has_its_fix():
    assert len(FILES) >= 60 and len(ARGS) >= 15
    assert sorted(FIXES) == sorted(FILES) and sorted(ARG_FIXES) == sorted(ARGS)


@pytest.mark.parametrize("case", sorted(FILES))
def test_a_malformed_cluster_file_is_one_sentence_naming_the_field(case, tmp_path, capsys):
    text, field = FILES[case]
    text = text(tmp_path) if callable(text) else text
    path = tmp_path / "cluster.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    line = assert_one_error_line(main(["plan", str(path)]), capsys.readouterr().err, field, FIXES[case])
    assert len(line) < 400, line  # user values are quoted short


def test_values_are_quoted_short_and_yaml_strings_explained(tmp_path, capsys):
    path = tmp_path / "cluster.yaml"
    path.write_text(FILES["huge string value"][0])
    line = assert_one_error_line(main(["plan", str(path)]), capsys.readouterr().err, "job.steps")
    assert "'999" in line and len(line) < 200 + QUOTE_LIMIT
    path.write_text(FILES["steps 1e3 read as a string"][0])
    line = assert_one_error_line(main(["plan", str(path)]), capsys.readouterr().err, "job.steps")
    assert "YAML reads 1e3 as a string, a float needs a dot and a signed exponent: write 1.0e+3 or the plain number" in line


def test_the_cluster_file_itself(tmp_path, capsys):
    assert_one_error_line(main(["plan", str(tmp_path / "absent.yaml")]), capsys.readouterr().err, "does not exist")
    assert_one_error_line(main(["plan", str(tmp_path)]), capsys.readouterr().err, "is a directory")
    # /proc/self/mem exists but cannot be read from the start (EIO), even by root
    assert_one_error_line(main(["plan", "/proc/self/mem"]), capsys.readouterr().err, "cannot be read")


def test_the_model_config_of_the_built_in_entrypoint_is_checked_at_plan_time(tmp_path, capsys):
    model = tmp_path / "model.yaml"
    tiny = Path(TINY).read_text()
    for text, field in ((tiny + "train: {lr: -1}\n", "train.lr"), (tiny + "train: {lrr: 1}\n", "train.lrr"),
                        (tiny.replace("n_heads: 4", "n_heads: 4\n  n_heads: 2"), "'n_heads' is given twice"),
                        (tiny.replace("hidden: 64", "hidden: .inf"), "model.hidden"),
                        # a misspelt data: must not train on the synthetic stream without a word
                        (tiny + "dataset: corpus.bin\n", f"the model config {model}: dataset is not a known setting"),
                        (tiny + "data: .\n", f"data file {tmp_path} is a directory"),
                        (tiny + "data: ''\n", "data is '' in the model config")):
        model.write_text(text)
        path = tmp_path / "cluster.yaml"
        path.write_text(dump(edit("job", "config", str(model))))
        assert_one_error_line(main(["plan", str(path)]), capsys.readouterr().err, field)


def test_the_embedded_cluster_must_fit_this_machine_before_any_ray_process_starts(tmp_path, capsys):
    for key, value, field in (("nodes", 100_000, "cluster.nodes"), ("gpus_per_node", 1000, "cluster.gpus_per_node")):
        path = tmp_path / "cluster.yaml"
        path.write_text(dump(edit("cluster", key, value)))
        line = assert_one_error_line(main(["launch", str(path)]), capsys.readouterr().err, field)
        assert "this machine" in line


def test_address_auto_with_no_cluster_is_one_sentence_within_the_timeout(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where Ray's `ray start` would record its cluster: nothing
    path = tmp_path / "cluster.yaml"
    doc = edit("cluster", "address", "auto")
    doc["cluster"]["connect_timeout_s"] = 1
    path.write_text(dump(doc))
    assert_one_error_line(main(["launch", str(path)]), capsys.readouterr().err, "cluster.address")
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")  # a dead cluster's record
    line = assert_one_error_line(main(["launch", str(path)]), capsys.readouterr().err, "cluster.address")
    assert "127.0.0.1:1" in line and "cluster.connect_timeout_s" in line
    doc["cluster"]["address"] = "ray://127.0.0.1:1"  # Ray Client, nobody listening
    path.write_text(dump(doc))
    line = assert_one_error_line(main(["launch", str(path)]), capsys.readouterr().err, "cluster.address")
    assert "'ray://127.0.0.1:1'" in line


ARGS = {
    "launch without a file": (["launch"], "CLUSTER_FILE"),
    "launch unknown option": (["launch", "{file}", "--bogus"], "--bogus"),
    "launch steps 0": (["launch", "{file}", "--steps", "0"], "--steps"),
    "launch steps a word": (["launch", "{file}", "--steps", "abc"], "--steps"),
    "launch steps absurd": (["launch", "{file}", "--steps", str(10**13)], "--steps"),
    "launch stage 5": (["launch", "{file}", "--stage", "5"], "--stage"),
    "plan json with a value": (["plan", "{file}", "--json=3"], "--json"),
    "unknown command": (["nope"], "nope"),
    "estimate params unparsable": (["estimate", "--params", "7X", "--gpus", "8"], "--params"),
    "estimate params 0": (["estimate", "--params", "0", "--gpus", "8"], "--params"),
    "estimate params inf": (["estimate", "--params", "inf", "--gpus", "8"], "--params"),
    "estimate params overflowing": (["estimate", "--params", "1e1000000", "--gpus", "8"], "--params"),
    "estimate params absurd": (["estimate", "--params", "1e400", "--gpus", "8"], "--params"),
    "estimate gpus 0": (["estimate", "--params", "7B", "--gpus", "0"], "--gpus"),
    "estimate gpus not a multiple of tp": (["estimate", "--params", "7B", "--gpus", "8", "--tp", "3"], "--gpus"),
    "estimate tp 0": (["estimate", "--params", "7B", "--gpus", "8", "--tp", "0"], "--tp"),
    "estimate gpu memory inf": (["estimate", "--params", "7B", "--gpus", "8", "--gpu-memory", "inf"], "--gpu-memory"),
    "estimate gpu memory nan": (["estimate", "--params", "7B", "--gpus", "8", "--gpu-memory", "nan"], "--gpu-memory"),
    "estimate gpu memory negative": (["estimate", "--params", "7B", "--gpus", "8", "--gpu-memory", "-1"],
                                     "--gpu-memory"),
    "estimate headroom 1": (["estimate", "--params", "7B", "--gpus", "8", "--headroom", "1"], "--headroom"),
    "estimate headroom negative": (["estimate", "--params", "7B", "--gpus", "8", "--headroom", "-0.5"], "--headroom"),
    "estimate precision fp8": (["estimate", "--params", "7B", "--gpus", "8", "--precision", "fp8"], "--precision"),
    "estimate partial shape": (["estimate", "--params", "7B", "--gpus", "8", "--layers", "2"],
                               "needs the whole model shape"),
    "estimate layers 0": (["estimate", "--params", "7B", "--gpus", "8", "--layers", "0", "--hidden", "64", "--heads",
                           "4", "--seq", "32", "--micro-batch", "1"], "--layers"),
}


ARG_FIXES = {
    'estimate gpu memory inf': 'must be a number above 0 and at most 100000 GB per GPU',
    'estimate gpu memory nan': 'must be a number above 0 and at most 100000 GB per GPU',
    'estimate gpu memory negative': 'must be a number above 0 and at most 100000 GB per GPU',
    'estimate gpus 0': 'must be a whole number from 1 to 10,000,000',
    'estimate gpus not a multiple of tp': 'must be a multiple of --tp (3)',
    'estimate headroom 1': 'must be a fraction in [0, 1), e.g. 0.1 keeps 10% free',
    'estimate headroom negative': 'must be a fraction in [0, 1), e.g. 0.1 keeps 10% free',
    'estimate layers 0': 'must be a positive integer',
    'estimate params 0': 'must be a whole number from 1 to 10^18',
    'estimate params absurd': 'must be a whole number from 1 to 10^18',
    'estimate params inf': 'must be a count such as 7B, 350M, 13e9 or 7000000000',
    'estimate params overflowing': 'must be a count such as 7B, 350M, 13e9 or 7000000000',
    'estimate params unparsable': 'must be a count such as 7B, 350M, 13e9 or 7000000000',
    'estimate partial shape': 'also give --hidden, --heads, --seq, --micro-batch',
    'estimate precision fp8': 'see hybrid estimate --help',
    'estimate tp 0': 'must be a whole number from 1 to 10,000,000',
    'launch stage 5': 'see hybrid launch --help',
    'launch steps 0': 'must be a whole number from 1 to 1000000000000',
    'launch steps a word': 'see hybrid launch --help',
    'launch steps absurd': 'must be a whole number from 1 to 1000000000000',
    'launch unknown option': 'see hybrid launch --help',
    'launch without a file': 'see hybrid launch --help',
    'plan json with a value': 'see hybrid plan --help',
    'unknown command': 'see hybrid --help',
}

@pytest.mark.parametrize("case", sorted(ARGS))
def test_a_bad_argument_is_one_sentence_naming_it(case, tmp_path, capsys):
    argv, field = ARGS[case]
    path = tmp_path / "cluster.yaml"
    path.write_text(dump(good()))
    argv = [a.replace("{file}", str(path)) for a in argv]
    assert_one_error_line(main(argv), capsys.readouterr().err, field, ARG_FIXES[case])


def _hybrid(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from launch.cli import main; sys.exit(main())", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.slow  # three CLI processes, each importing torch: not in the fast tier (make test-fast)
def test_through_a_real_process(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(FILES["seed 2^70"][0])
    done = _hybrid("plan", str(path))
    assert_one_error_line(done.returncode, done.stderr, "job.seed", FIXES["seed 2^70"])
    path.write_bytes(FILES["not utf-8"][0])
    done = _hybrid("launch", str(path))
    assert_one_error_line(done.returncode, done.stderr, "not UTF-8", FIXES["not utf-8"])
    done = _hybrid("estimate", "--params", "7B", "--gpus", "8", "--gpu-memory", "inf")
    assert_one_error_line(done.returncode, done.stderr, "--gpu-memory", ARG_FIXES["estimate gpu memory inf"])


FIELDS = [("cluster", k) for k in ("address", "nodes", "gpus_per_node", "gpu_memory_gb", "interconnect",
                                   "connect_timeout_s")] + \
         [("job", k) for k in ("entrypoint", "config", "steps", "micro_batch", "checkpoint", "max_failures",
                               "collective_timeout_s", "seed")] + \
         [("parallel", k) for k in ("tp", "zero_stage", "precision")]
ANY_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-2**80, max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=30)
    | st.sampled_from(["auto", "local", "ray://h:1", "1e3", ".inf", "bf16", "nvlink", "hybrid.models.gpt:train"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "cluster.yaml"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(FIELDS), ANY_VALUE)
def test_any_value_in_any_field_is_accepted_or_one_sentence_never_a_traceback(capsys, scratch, field, value):
    capsys.readouterr()
    scratch.write_text(dump(edit(*field, value)))
    code = main(["plan", "--json", str(scratch)])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if code != 0:  # the field itself, or what it made impossible (a tp the model cannot split, say)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
