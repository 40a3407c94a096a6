"""What every rank actor starts with: Ray's ``runtime_env`` for the job (pure functions of the spec).

``runtime_env(spec)`` ships ``job.working_dir`` (the cluster file's directory by default) to every node, as
Ray Jobs do: Ray zips it (less ``working_dir_excludes``: virtual environments, git data, caches, the Ray logs
kept by earlier launches, and the job's run and checkpoint directories when they lie inside it), uploads it
through the cluster's GCS once, unpacks it on each node and starts the actor there with it as current
directory and first on the import path, so the user's entrypoint module and files beside it exist on every
node. ``env_vars`` are ``rank_env``: one BLAS thread per rank, the driver's ``PYTHONPATH`` (and, on the
embedded cluster, which shares this machine, its current directory, after the working directory), the NCCL
defaults (flight recorder dumping into the checkpoint directory, expandable segments) under the driver's own
``NCCL_*`` / ``TORCH_NCCL_*`` / ``TORCH_FR_*`` / ``PYTORCH_CUDA_ALLOC_CONF``, gloo on loopback and the
driver's own proxy settings for the embedded cluster (whose head node's processes start with loopback ones),
then ``job.env``. ``localize`` maps a driver path inside the working directory to its copy
on the rank's node.

Ray accepts a local ``working_dir`` only in ``ray.init``'s job-wide ``runtime_env``; one launcher driver may
run several jobs on one connection, so ``ship`` does what ``ray.init`` does -- zip, upload to the GCS
(content-addressed: an unchanged directory is not uploaded again) -- and gives the actors the package URI.
Before Ray packs the directory, ``launch.ray.working_dir_check.check_working_dir`` refuses a directory link that
loops back (Ray's walk follows them and would pack forever) and a named pipe, socket or device file.
"""

from __future__ import annotations

import inspect
import logging
import os
import tempfile
from pathlib import Path
from typing import Optional

from hybrid.errors import ConfigError, first_line
from launch.ray import cluster as ray_cluster
from launch.ray.embedded_processes import KEPT_LOGS, PREVIOUS_SUFFIX
from launch.ray.working_dir_check import check_working_dir, ray_default_excludes
from launch.spec import LaunchSpec

# Never worth shipping: environments, VCS data, caches (gitignore-style patterns, as Ray's excludes take).
# And the session logs every earlier launch kept in its run directory (``launch.ray.embedded_processes``):
# a working directory that held 13 earlier runs' (their worker logs, events) made every TP-2 rank of the next
# launch of the bench (bench/time_model.py) die at start-up ("oneMKL FATAL ERROR: Cannot load
# libtorch_cpu.so"), reproducibly, and the same launch with them excluded trained.
ALWAYS_EXCLUDED = (".venv/", "venv/", ".git", "__pycache__/", "*.pyc", ".pytest_cache/", ".hypothesis/",
                   "*.egg-info/", ".mypy_cache/", f"{KEPT_LOGS}/", f"{KEPT_LOGS}{PREVIOUS_SUFFIX}/")


# NCCL hygiene on every rank: the flight recorder on and dumped when a collective times out, and the CUDA
# caching allocator's expandable segments (less fragmentation). The driver's own values win, job.env over all.
# The TORCH_FR_* names replaced TORCH_NCCL_TRACE_BUFFER_SIZE / _DEBUG_INFO_TEMP_FILE (which torch still reads,
# with a deprecation warning from every rank).
NCCL_DEFAULTS = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                 "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
FLIGHT_RECORDER_DIR = "nccl-flight-recorder"
PASSED_THROUGH = ("NCCL_", "TORCH_NCCL_", "TORCH_FR_", "PYTORCH_CUDA_ALLOC_CONF")


def rank_env(spec: LaunchSpec, driver_env: Optional[dict] = None) -> dict:
    """Environment variables of every rank actor (``driver_env``: the driver's, ``os.environ`` by default)."""
    driver_env = os.environ if driver_env is None else driver_env
    paths = [p for p in driver_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if spec.cluster.is_local:  # the embedded cluster's ranks share this machine: what ran from here still does
        paths.append(os.getcwd())
    env = {"OMP_NUM_THREADS": "1",
           # torch's deprecation notices from every rank would bury the progress lines
           "PYTHONWARNINGS": "ignore::FutureWarning", **NCCL_DEFAULTS}
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if spec.job.checkpoint.dir is not None:
        env["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(spec.job.checkpoint.dir, FLIGHT_RECORDER_DIR, "rank_")
    env.update({k: v for k, v in driver_env.items() if k.startswith(PASSED_THROUGH)})
    if spec.cluster.is_local:
        env.update(GLOO_SOCKET_IFNAME="lo", MASTER_ADDR=ray_cluster.LOOPBACK)
        # the driver's proxy settings, not the loopback ones the embedded head node's processes start with
        # (empty: none, as urllib, requests and httpx read an empty one)
        env.update({name: driver_env.get(name, "") for name in ray_cluster.PROXY_VARS})
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


def client_runtime_env(spec: LaunchSpec) -> Optional[dict]:
    """The job-level ``runtime_env`` for a Ray Client connection: the working directory and its excludes
    (Ray Client uploads it at ``ray.init``; a local directory cannot be given per actor there). For a
    ``ray://`` address the directory is checked first (``check_working_dir``), as Ray Client packs it."""
    if spec.job.working_dir is None:
        return None
    env = {"working_dir": str(spec.job.working_dir), "excludes": working_dir_excludes(spec)}
    if spec.cluster.address.startswith("ray://"):
        # Ray Client reads .gitignore unless RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1
        check_working_dir(env["working_dir"], ray_default_excludes() + env["excludes"],
                                include_gitignore=os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1")
    return env


def ship(env: dict) -> dict:
    """``env`` with its local ``working_dir`` uploaded to the connected Ray cluster and replaced by the
    package's URI (the ``excludes`` are applied and dropped); ``env`` without one is returned as it is. A
    directory link that loops back or a pipe (``check_working_dir``) is refused before Ray packs anything."""
    if "working_dir" not in env:
        return env
    from ray._private.runtime_env.working_dir import upload_working_dir_if_needed

    env = dict(env)
    options = {}
    if "include_gitignore" in inspect.signature(upload_working_dir_if_needed).parameters:
        options["include_gitignore"] = True  # as ray.init does: what git ignores is not shipped either
    directory = env["working_dir"]
    check_working_dir(directory, ray_default_excludes() + list(env.get("excludes") or []),
                            include_gitignore=options.get("include_gitignore", True))
    try:
        env = upload_working_dir_if_needed(env, scratch_dir=tempfile.gettempdir(),
                                           logger=logging.getLogger(__name__), **options)
    except Exception as err:  # Ray's RuntimeEnvSetupError, ValueError: too large, unreadable, ...
        first = first_line(err, type(err).__name__)
        raise ConfigError(f"job.working_dir {directory} could not be shipped to the ranks ({first}); keep only "
                          "code and small files there (data and runs elsewhere) or point job.working_dir at "
                          "the code's directory.") from None
    env.pop("excludes", None)
    return env


def localize(path: str, working_dir: Optional[str], here: str) -> str:
    """``path`` as seen on a rank whose copy of the driver's ``working_dir`` is ``here`` (its current
    directory): a path inside the working directory maps into the copy, any other stays as it is."""
    if not working_dir or not _inside(Path(path), Path(working_dir)):
        return path
    return str(Path(here) / Path(path).resolve().relative_to(Path(working_dir).resolve()))


def localize_shipped(path: str, working_dir: Optional[str], here: str) -> str:
    """``localize``, except that a file the shipped copy lacks (left out by a .gitignore or an exclude
    pattern) but this node sees at the driver's path (one machine, a shared filesystem) is read there."""
    local = localize(path, working_dir, here)
    if local != path and not os.path.exists(local) and os.path.exists(path):
        return path
    return local


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True
