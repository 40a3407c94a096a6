"""What every rank actor starts with: Ray's ``runtime_env`` for the job (pure functions of the spec).

``runtime_env(spec)`` ships ``job.working_dir`` (the cluster file's directory by default) to every node, as
Ray Jobs do: Ray zips it (less ``working_dir_excludes``: virtual environments, git data, caches, and the
job's run and checkpoint directories when they lie inside it), uploads it through the cluster's GCS once,
unpacks it on each node and starts the actor there with it as current directory and first on the import
path, so the user's entrypoint module and files beside it exist on every node. ``env_vars`` are
``rank_env``: one BLAS thread per rank, the driver's ``PYTHONPATH``, gloo on loopback for the embedded
cluster, then ``job.env``. ``localize`` maps a driver path inside the working directory to its copy on
the rank's node.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from launch import ray_cluster
from launch.spec import LaunchSpec

# Never worth shipping: environments, VCS data, caches (gitignore-style patterns, as Ray's excludes take).
ALWAYS_EXCLUDED = (".venv/", "venv/", ".git", "__pycache__/", "*.pyc", ".pytest_cache/", ".hypothesis/",
                   "*.egg-info/", ".mypy_cache/")


def rank_env(spec: LaunchSpec) -> dict:
    """Environment variables of every rank actor."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {"OMP_NUM_THREADS": "1",
           # torch's deprecation notices from every rank would bury the progress lines
           "PYTHONWARNINGS": "ignore::FutureWarning"}
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if spec.cluster.is_local:
        env.update(GLOO_SOCKET_IFNAME="lo", MASTER_ADDR=ray_cluster.LOOPBACK)
    env.update(spec.job.env)
    return env


def working_dir_excludes(spec: LaunchSpec) -> list[str]:
    """Ray ``excludes`` for the shipped working directory: ``ALWAYS_EXCLUDED`` plus the job's run and
    checkpoint directories when they lie inside it (anchored at the working directory's root)."""
    excludes = list(ALWAYS_EXCLUDED)
    root = spec.job.working_dir
    for directory in (spec.job.run_dir, spec.job.checkpoint.dir):
        if root is not None and directory is not None and _inside(Path(directory), root):
            relative = Path(directory).resolve().relative_to(Path(root).resolve()).as_posix()
            if relative != ".":
                excludes.append(f"/{relative}/")
    return list(dict.fromkeys(excludes))


def runtime_env(spec: LaunchSpec) -> dict:
    """The ``runtime_env`` of every rank actor: env vars, and the working directory with its excludes."""
    env = {"env_vars": rank_env(spec)}
    if spec.job.working_dir is not None:
        env.update(working_dir=str(spec.job.working_dir), excludes=working_dir_excludes(spec))
    return env


def localize(path: str, working_dir: Optional[str], here: str) -> str:
    """``path`` as seen on a rank whose copy of the driver's ``working_dir`` is ``here`` (its current
    directory): a path inside the working directory maps into the copy, any other stays as it is."""
    if not working_dir or not _inside(Path(path), Path(working_dir)):
        return path
    return str(Path(here) / Path(path).resolve().relative_to(Path(working_dir).resolve()))


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True
