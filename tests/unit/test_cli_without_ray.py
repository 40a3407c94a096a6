"""The ``hybrid`` CLI where Ray cannot be imported (a GPU machine that trains under torchrun only): ``launch``
says in one ``error:`` sentence that it needs Ray and exits 2, never a traceback; ``estimate``, ``plan``,
``checkpoint inspect`` and ``monitor`` work as they do with Ray.

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


@pytest.mark.parametrize("args", [
    ["estimate", "--params", "1B", "--gpus", "8", "--json"],
    ["plan", "clusters/local.yaml"],
    ["monitor", "--json"],
], ids=["estimate", "plan", "monitor"])
def test_the_other_commands_work_without_ray(no_ray_env, args):
    proc = hybrid(args, no_ray_env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    if "--json" in args:
        json.loads(proc.stdout)


def test_checkpoint_inspect_works_without_ray(no_ray_env, tmp_path):
    proc = hybrid(["checkpoint", "inspect", str(tmp_path)], no_ray_env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: ") and "is not a run directory" in proc.stderr
