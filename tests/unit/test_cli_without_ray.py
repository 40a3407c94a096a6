"""The ``hybrid`` CLI where Ray cannot be imported (a GPU machine that trains under torchrun only): ``launch``
says in one ``error:`` sentence that it needs Ray and exits 2, never a traceback; ``estimate``, ``plan``,
``checkpoint inspect`` and ``monitor`` work as they do with Ray: estimate gives the ZeRO paper's figures, plan the
planner's plan of that cluster file (stage, tp, dp, memory per stage) as computed here with Ray importable, monitor
this machine's probe.

Ray is hidden by a fake ``ray`` package first on PYTHONPATH whose import raises ``ImportError``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every case runs the CLI in a process: not in the fast tier (make test-fast)
ROOT = Path(__file__).resolve().parents[2]
HYBRID = [sys.executable, "-c", "import sys; from launch.cli import main; sys.exit(main())"]
UNAVAILABLE = "ray is deliberately unavailable in this test"


@pytest.fixture
def no_ray_env(tmp_path):
    fake = tmp_path / "noray" / "ray"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"raise ImportError({UNAVAILABLE!r})\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(fake.parent), str(ROOT)])
    return env


def hybrid(args, env, cwd=ROOT, timeout=120):
    return subprocess.run(HYBRID + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_launch_without_ray_is_one_error_sentence_and_exit_2(no_ray_env):
    proc = hybrid(["launch", "clusters/local.yaml", "--steps", "2"], no_ray_env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = lines[0]
    assert line.startswith("error: hybrid launch needs Ray, which cannot be imported here (")
    assert UNAVAILABLE in line and "`pip install ray`" in line and "torchrun" in line
    assert line.endswith("needs no Ray.")


def test_a_bad_cluster_file_is_still_reported_as_such_without_ray(no_ray_env, tmp_path):
    proc = hybrid(["launch", str(tmp_path / "missing.yaml")], no_ray_env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "missing.yaml" in proc.stderr and "needs Ray" not in proc.stderr


def _json_of(args, env) -> dict:
    proc = hybrid(args, env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def test_estimate_without_ray_gives_the_papers_figures(no_ray_env):
    doc = _json_of(["estimate", "--params", "1B", "--gpus", "8", "--json"], no_ray_env)
    # ZeRO paper, bf16 weights with fp32 Adam (K = 12 bytes per parameter), psi = 1e9, Nd = 8, in GB:
    # stage 0: 2 + 2 + 12 = 16; stage 1: 2 + 2 + 12/8; stage 2: 2 + 2/8 + 12/8; stage 3: (2 + 2 + 12)/8
    assert (doc["params"], doc["dp"], doc["tp"], doc["gpu_memory_gb"]) == (1_000_000_000, 8, 1, 80)
    assert {s: (v["params_gb"], v["grads_gb"], v["optimizer_gb"], v["total_gb"]) for s, v in doc["stages"].items()} \
        == {"0": (2.0, 2.0, 12.0, 16.0), "1": (2.0, 2.0, 1.5, 5.5), "2": (2.0, 0.25, 1.5, 3.75),
            "3": (0.25, 0.25, 1.5, 2.0)}
    assert all(v["fits"] for v in doc["stages"].values())
    assert (doc["recommended_stage"], doc["offload"], doc["activation_checkpointing"]) == (1, False, False)


def test_plan_without_ray_is_the_planners_plan_of_that_cluster_file(no_ray_env):
    from launch.planning.plan import build_plan, plan_dict
    from launch.spec import load_spec

    doc = _json_of(["plan", "clusters/local.yaml", "--json"], no_ray_env)
    planned = build_plan(load_spec(ROOT / "clusters" / "local.yaml"))  # here, where Ray can be imported
    assert {k: doc[k] for k in plan_dict(planned)} == json.loads(json.dumps(plan_dict(planned)))
    # clusters/local.yaml: 2 nodes x 2 ranks, gpt-tiny-text (134,912 parameters), fp32, tp auto, stage auto
    assert (doc["mesh"]["tp"], doc["mesh"]["dp"], doc["stage"], doc["offload"]) == (2, 2, 1, False)
    assert doc["memory"]["source"] == "declared" and doc["memory"]["gpu_memory_bytes"] == 80e9
    # fp32 with Adam, n = 134,912 / tp parameters per rank: 4n params, 4n grads, 8n Adam moments at stage 0;
    # stage 1 splits the moments over dp = 2, stage 2 the gradients too, stage 3 the parameters too
    n = 134_912 // 2
    assert {s: (v["params"], v["grads"], v["optimizer"]) for s, v in doc["memory"]["stages"].items()} == {
        "0": (4 * n, 4 * n, 8 * n), "1": (4 * n, 4 * n, 4 * n), "2": (4 * n, 2 * n, 4 * n), "3": (2 * n, 2 * n, 4 * n)}


def test_monitor_without_ray_is_this_machines_probe(no_ray_env):
    from hybrid.plan.monitor import probe

    assert _json_of(["monitor", "--json"], no_ray_env) == json.loads(json.dumps(probe().as_dict()))


def test_checkpoint_inspect_works_without_ray(no_ray_env, tmp_path):
    proc = hybrid(["checkpoint", "inspect", str(tmp_path)], no_ray_env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: ") and "is not a run directory" in proc.stderr
