"""The shared validation vocabulary (hybrid.config.validate), the strict YAML loader, the embedded-cluster
capacity rule and the Ray address helpers: pure, no Ray started."""

import math
from pathlib import Path

import pytest

from hybrid.config import validate as v
from hybrid.errors import ConfigError
from hybrid.config.yamlfile import load_yaml
from launch.ray.capacity import embedded_limit_error
from launch.ray.embedded_processes import marked_pids
from launch.ray.cluster import EMBEDDED_PREFIX, is_embedded, split_host_port


def test_checkers_return_normalised_values():
    assert v.positive_int("a", 3) == 3 and v.integer("a", 5e8, 1, whole_floats=True) == 500_000_000
    assert v.number("a", 2) == 2.0 and isinstance(v.number("a", 2), float)
    assert v.stage("s", "auto", auto=True) is None and v.stage("s", 2.0, whole_floats=True) == 2
    assert v.one_of("p", "bf16", v.PRECISIONS) == "bf16" and v.boolean("b", False) is False
    assert v.mapping("m", {"x": 1}, ("x", "y")) == {"x": 1}
    assert v.yaml_number("1e-5") == 1e-5 and v.yaml_number("abc") == "abc"


@pytest.mark.parametrize("check, message", [
    (lambda: v.positive_int("job.steps", 0), "job.steps must be a positive integer, got 0."),
    (lambda: v.positive_int("job.steps", True), "job.steps must be a positive integer, got True."),
    (lambda: v.integer("job.seed", 2**70, 0, v.MAX_SEED),
     f"job.seed must be a whole number from 0 to {v.MAX_SEED}, got 1180591620717411303424."),
    (lambda: v.number("t", math.inf, 1, 10), "t must be a number from 1 to 10, got inf."),
    (lambda: v.number("t", math.nan), "t must be a finite number, got nan."),
    (lambda: v.positive_number("m", 0, unit="GB"), "m must be a number above 0 GB, got 0."),
    (lambda: v.stage("zero.stage", 5), "zero.stage must be 0, 1, 2 or 3, got 5."),
    (lambda: v.stage("zero.stage", True), "zero.stage must be 0, 1, 2 or 3, got True."),
    (lambda: v.one_of("precision", 1, v.PRECISIONS), "precision must be one of bf16, fp32, got 1."),
    (lambda: v.one_of("precision", ["x"], v.PRECISIONS), "precision must be one of bf16, fp32, got ['x']."),
    (lambda: v.mapping("zero", [1]), "zero must be a mapping, got list [1]."),
    (lambda: v.mapping("zero", {"stag": 1}, ("stage",)), "zero.stag is not a known setting; use one of: stage."),
    (lambda: v.mapping("zero", {"stag": 1, "x" * 60: 2, "b": 3}, ("stage",)),
     f"zero.stag, zero.{'x' * 60} and zero.b are not known settings; use one of: stage."),
    (lambda: v.positive_int("train_batch_size", "auto"), "train_batch_size must be a positive integer, got 'auto' "
     "(\"auto\" is a placeholder the Hugging Face Trainer/Accelerate fill in before DeepSpeed reads the config; "
     "write the real value)."),
    (lambda: v.required({}, "job", "steps", "the step count"), "job.steps is missing; add it (the step count)."),
    (lambda: v.number("lr", "1e-3"),
     "lr must be a finite number, got '1e-3' (YAML reads 1e-3 as a string, a float needs a dot and a signed "
     "exponent: write 1.0e-3 or the plain number)."),
    (lambda: v.number("lr", "1.0e3"),
     "lr must be a finite number, got '1.0e3' (YAML reads 1.0e3 as a string, a float needs a dot and a signed "
     "exponent: write 1.0e+3 or the plain number)."),
    (lambda: v.number("lr", "1.0e+3"), "lr must be a finite number, got '1.0e+3' (a string: write the number "
     "without quotes)."),
])
def test_each_error_is_one_sentence_naming_the_field(check, message):
    with pytest.raises(ConfigError) as err:
        check()
    assert str(err.value) == message


def test_quote_is_short_whatever_the_value():
    big = [["x" * 1000] * 1000] * 1000
    assert len(v.quote(big)) <= v.QUOTE_LIMIT and len(v.quote("y" * 10**6)) <= v.QUOTE_LIMIT
    assert v.quote(10**5000) == "an integer of about 5001 digits" and v.quote("ab") == "'ab'"
    assert len(v.quote({"k" * 500: 1})) <= v.QUOTE_LIMIT


def test_the_constants_live_in_one_place():
    import hybrid.config.training
    import hybrid.plan.memory
    import hybrid.plan.planner
    import launch.spec

    assert hybrid.config.training.PRECISIONS is v.PRECISIONS and launch.spec.PRECISIONS is v.PRECISIONS
    assert hybrid.plan.memory.STAGES is v.STAGES and hybrid.plan.planner.STAGES is v.STAGES


def test_strict_yaml(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("a: 1\nb: {c: 2, c: 3}\n")
    with pytest.raises(ConfigError, match=r"line 2: key 'c' is given twice; keep one of them\.$"):
        load_yaml(path, "model config")
    path.write_text("base: &base {x: 1}\nother:\n  <<: *base\n  x: 2\n")  # a merge key may be overridden
    assert load_yaml(path) == {"base": {"x": 1}, "other": {"x": 2}}
    path.write_bytes(b"\xef\xbb\xbfa: 1\n")  # a UTF-8 byte-order mark is fine
    assert load_yaml(path) == {"a": 1}
    path.write_bytes(b"a: \xff\n")
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 3\); save it as UTF-8\.$"):
        load_yaml(path)


def test_the_embedded_cluster_is_bounded_by_cpus_and_memory():
    assert embedded_limit_error(2, 2, cpus=2, memory_bytes=16 * 10**9) is None
    assert embedded_limit_error(1, 8, cpus=1, memory_bytes=None) is None  # the demos fit a 1-core runner
    assert "cluster.nodes is 100000" in embedded_limit_error(100_000, 1, cpus=64, memory_bytes=None)
    assert "cluster.gpus_per_node is 64" in embedded_limit_error(2, 64, cpus=8, memory_bytes=None)
    memory = embedded_limit_error(8, 8, cpus=64, memory_bytes=4 * 10**9)
    assert memory.startswith("cluster.nodes is 8 with 8 ranks each") and "4.0 GB" in memory


def _fake_proc(root: Path, processes: dict) -> Path:
    for pid, args in processes.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in args))
    return root


def test_auto_never_takes_an_embedded_cluster_of_another_hybrid_process(tmp_path):
    proc = _fake_proc(tmp_path / "proc", {
        11: ["raylet", "--gcs-address=127.0.0.1:6379", "--session_dir=/tmp/ray/session_1"],
        12: ["raylet", "--gcs-address=127.0.0.1:7000", '--static_resource_list=CPU,2,hybrid_node_0,1'],
        13: ["gcs_server", "--gcs_server_port=7100", f"--session-dir=/tmp/{EMBEDDED_PREFIX}ab12/ray/session_2"],
    })
    assert not is_embedded("127.0.0.1:6379", proc)  # a cluster the user started
    assert is_embedded("127.0.0.1:7000", proc) and is_embedded("127.0.0.1:7100", proc)
    assert marked_pids(f"/tmp/{EMBEDDED_PREFIX}ab12", proc) == [13]
    (proc / "14").mkdir()  # an agent that retitled itself: only its environment names the cluster
    (proc / "14" / "cmdline").write_bytes(b"ray::DashboardAgent")
    (proc / "14" / "environ").write_bytes(f"HOME=/root\0RAY_TMPDIR=/tmp/{EMBEDDED_PREFIX}ab12\0".encode())
    (proc / "15").mkdir()  # another cluster's agent, whose temp dir only starts like ours
    (proc / "15" / "cmdline").write_bytes(b"ray::DashboardAgent")
    (proc / "15" / "environ").write_bytes(f"RAY_TMPDIR=/tmp/{EMBEDDED_PREFIX}ab123\0".encode())
    assert sorted(marked_pids(f"/tmp/{EMBEDDED_PREFIX}ab12", proc)) == [13, 14]
    (proc / "16" / "fd").mkdir(parents=True)  # retitled, RAY_TMPDIR not inherited: only its open log says
    (proc / "16" / "cmdline").write_bytes(b"ray::RuntimeEnvAgent")
    (proc / "16" / "fd" / "3").symlink_to(f"/tmp/{EMBEDDED_PREFIX}ab12/ray/session_2/logs/agent.log")
    (proc / "17" / "fd").mkdir(parents=True)
    (proc / "17" / "cmdline").write_bytes(b"ray::RuntimeEnvAgent")
    (proc / "17" / "fd" / "3").symlink_to(f"/tmp/{EMBEDDED_PREFIX}ab123/ray/session_2/logs/agent.log")
    (proc / "18").mkdir()  # a user's shell reading the logs: never taken for an agent
    (proc / "18" / "cmdline").write_bytes(b"bash")
    (proc / "18" / "cwd").symlink_to(f"/tmp/{EMBEDDED_PREFIX}ab12/ray/session_2/logs")
    assert sorted(marked_pids(f"/tmp/{EMBEDDED_PREFIX}ab12", proc)) == [13, 14, 16]
    assert split_host_port("ray://head:10001") == ("head", 10001) and split_host_port("10.0.0.5:6379")[1] == 6379
    with pytest.raises(ConfigError, match="not host:port"):
        split_host_port("head")
