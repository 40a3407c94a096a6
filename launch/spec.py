"""cluster.yaml: load, validate and resolve into a ``LaunchSpec``.

``load_spec(path)`` reads the file with ``yaml.safe_load`` and returns a frozen ``LaunchSpec`` (cluster,
job, parallel sections), or raises ``ConfigError`` with one sentence naming the bad field, its value and
what is allowed. Unknown keys are errors, relative paths are resolved against the YAML file's directory,
and ``job.entrypoint`` must be a ``module:function`` importable from ``job.working_dir`` (default: the
cluster file's directory, which the launcher ships to every node) or an installed package, from any
current directory. ``job.run_dir`` (default ``job.checkpoint.dir``, else ``runs/<cluster file name>``
under the current directory) receives metrics.jsonl; ``job.env`` holds environment variables for the
ranks. Nothing here contacts Ray.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from hybrid.errors import ConfigError

ADDRESS_HELP = "'local' (embedded Ray), 'auto' (the running cluster) or 'ray://host:port'"
INTRA_NODE = ("nvlink", "pcie", "loopback")
INTER_NODE = ("infiniband", "roce", "ethernet", "loopback")
PRECISIONS = ("bf16", "fp32")


@dataclass(frozen=True)
class ClusterSpec:
    address: str
    nodes: int
    gpus_per_node: int  # ranks per node
    gpu_memory_gb: float  # used where NVML cannot measure, and by `hybrid plan`
    intra_node: str = "unspecified"
    inter_node: str = "unspecified"

    @property
    def is_local(self) -> bool:
        return self.address == "local"

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class CheckpointSpec:
    dir: Optional[Path] = None  # None: no checkpoints
    every: int = 0
    keep_last: int = 2


@dataclass(frozen=True)
class JobSpec:
    entrypoint: str  # "module:function"
    config: Path  # the model config YAML
    steps: int
    micro_batch: int = 8
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    max_failures: int = 0
    collective_timeout_s: float = 300.0
    seed: int = 0
    run_dir: Optional[Path] = None  # metrics.jsonl, TensorBoard events (resolved default: see _run_dir)
    working_dir: Optional[Path] = None  # shipped to every rank; the entrypoint's module is found here
    env: dict = field(default_factory=dict)  # environment variables for the ranks
    isolate_gpus: bool = False  # True: each rank sees only its own GPU (cuda:0); else the node's, cuda:LOCAL_RANK


@dataclass(frozen=True)
class ParallelSpec:
    tp: Optional[int] = None  # None: auto = gpus_per_node
    zero_stage: Optional[int] = None  # None: auto = the planner's choice
    precision: str = "bf16"


@dataclass(frozen=True)
class LaunchSpec:
    cluster: ClusterSpec
    job: JobSpec
    parallel: ParallelSpec
    path: Optional[Path] = None

    @property
    def tp(self) -> int:
        return self.parallel.tp if self.parallel.tp is not None else self.cluster.gpus_per_node

    @property
    def dp(self) -> int:
        return self.cluster.world_size // self.tp

    def with_overrides(self, steps: Optional[int] = None, stage: Optional[int] = None) -> "LaunchSpec":
        """The spec with ``--steps`` / ``--stage`` from the command line applied (validated like the file)."""
        job, parallel = self.job, self.parallel
        if steps is not None:
            job = dataclasses.replace(job, steps=_int(steps, "--steps", minimum=1))
        if stage is not None:
            parallel = dataclasses.replace(parallel, zero_stage=_stage(stage, "--stage"))
        return dataclasses.replace(self, job=job, parallel=parallel)


# ---------------------------------------------------------------------------------------------- loading


def load_spec(path: str | os.PathLike) -> LaunchSpec:
    """Read and validate a cluster.yaml; every problem is a ``ConfigError`` of one sentence."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"cluster file {path} does not exist; pass the path of a cluster.yaml.")
    text = path.read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as err:
        line = err.problem_mark.line + 1 if err.problem_mark is not None else "?"
        raise ConfigError(f"{path} line {line}: YAML syntax error ({err.problem}); "
                          "fix the indentation or quoting there.") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: YAML syntax error ({err}); fix the file.") from None
    return parse_spec(data, base_dir=path.resolve().parent, path=path)


def parse_spec(data: Any, base_dir: Path, path: Optional[Path] = None) -> LaunchSpec:
    """Validate an already-parsed cluster.yaml mapping; relative paths resolve against ``base_dir``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'the cluster file'} must be a mapping with sections cluster, job "
                          f"(and optionally parallel); it holds {type(data).__name__}.")
    _known(data, "", ("cluster", "job", "parallel"))
    cluster = _cluster(_section(data, "cluster", required=True))
    job = _job(_section(data, "job", required=True), base_dir, path.stem if path else "job")
    parallel = _parallel(_section(data, "parallel", required=False), cluster)
    return LaunchSpec(cluster=cluster, job=job, parallel=parallel, path=path)


def _cluster(d: dict) -> ClusterSpec:
    _known(d, "cluster", ("address", "nodes", "gpus_per_node", "gpu_memory_gb", "interconnect"))
    address = _required(d, "cluster", "address", ADDRESS_HELP)
    if not (isinstance(address, str) and (address in ("local", "auto") or _is_ray_client(address))):
        raise ConfigError(f"cluster.address is {address!r}; use {ADDRESS_HELP}.")
    nodes = _int(_required(d, "cluster", "nodes", "a whole number of nodes, at least 1"), "cluster.nodes", 1)
    gpus = _int(_required(d, "cluster", "gpus_per_node", "ranks per node, at least 1"),
                "cluster.gpus_per_node", 1)
    memory = _required(d, "cluster", "gpu_memory_gb", "the memory of one GPU in GB, e.g. 80")
    if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not memory > 0:
        raise ConfigError(f"cluster.gpu_memory_gb is {memory!r}; give the memory of one GPU in GB, "
                          "a number above 0 (e.g. 80).")
    links = d.get("interconnect") or {}
    if not isinstance(links, dict):
        raise ConfigError(f"cluster.interconnect is {links!r}; give a mapping like "
                          "{intra_node: nvlink, inter_node: infiniband}.")
    _known(links, "cluster.interconnect", ("intra_node", "inter_node"))
    intra = _choice(links.get("intra_node", "unspecified"), "cluster.interconnect.intra_node",
                    INTRA_NODE + ("unspecified",))
    inter = _choice(links.get("inter_node", "unspecified"), "cluster.interconnect.inter_node",
                    INTER_NODE + ("unspecified",))
    return ClusterSpec(address, nodes, gpus, float(memory), intra, inter)


def _job(d: dict, base_dir: Path, name: str = "job") -> JobSpec:
    _known(d, "job", ("entrypoint", "config", "steps", "micro_batch", "checkpoint", "max_failures",
                      "collective_timeout_s", "seed", "run_dir", "working_dir", "env", "isolate_gpus"))
    working_dir = _directory(d.get("working_dir", "."), "job.working_dir", base_dir)
    entrypoint = _required(d, "job", "entrypoint", "module:function, e.g. hybrid.models.gpt:train")
    check_entrypoint(entrypoint, working_dir)
    config = _required(d, "job", "config", "the path of the model config YAML")
    if not isinstance(config, str):
        raise ConfigError(f"job.config is {config!r}; give the path of the model config YAML.")
    config_path = _resolve(config, base_dir)
    if not config_path.is_file():
        raise ConfigError(f"job.config is {config!r}, but {config_path} does not exist; "
                          "give the path of the model config YAML (relative to the cluster file).")
    steps = _int(_required(d, "job", "steps", "the number of training steps"), "job.steps", 1)
    micro_batch = _int(d.get("micro_batch", 8), "job.micro_batch", 1)
    max_failures = _int(d.get("max_failures", 0), "job.max_failures", 0)
    seed = _int(d.get("seed", 0), "job.seed", 0)
    timeout = d.get("collective_timeout_s", 300)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ConfigError(f"job.collective_timeout_s is {timeout!r}; give seconds, a number above 0.")
    checkpoint = _checkpoint(d.get("checkpoint"), base_dir)
    run_dir = d.get("run_dir")
    if run_dir is not None and (not isinstance(run_dir, str) or not run_dir):
        raise ConfigError(f"job.run_dir is {run_dir!r}; give a directory path for metrics and logs.")
    run_dir = _resolve(run_dir, base_dir) if run_dir else (checkpoint.dir or Path.cwd() / "runs" / name)
    isolate_gpus = d.get("isolate_gpus", False)
    if not isinstance(isolate_gpus, bool):
        raise ConfigError(f"job.isolate_gpus is {isolate_gpus!r}; give true (each rank sees only its own GPU) "
                          "or false (the ranks of a node share its GPUs, the default).")
    return JobSpec(entrypoint, config_path, steps, micro_batch, checkpoint, max_failures, float(timeout), seed,
                   run_dir, working_dir, _env(d.get("env")), isolate_gpus)


def _directory(value: Any, name: str, base_dir: Path) -> Path:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{name} is {value!r}; give a directory path (relative to the cluster file).")
    path = _resolve(value, base_dir)
    if not path.is_dir():
        raise ConfigError(f"{name} is {value!r}, but {path} is not a directory; give an existing directory "
                          "(relative to the cluster file).")
    return path


def _env(d: Any) -> dict:
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ConfigError(f"job.env is {d!r}; give a mapping of environment variables like {{MY_FLAG: '1'}}.")
    env = {}
    for key, value in d.items():
        if not isinstance(key, str) or not key or "=" in key:
            raise ConfigError(f"job.env has the key {key!r}; environment variable names are non-empty strings "
                              "without '='.")
        if isinstance(value, (dict, list)) or value is None:
            raise ConfigError(f"job.env.{key} is {value!r}; give a string or a number.")
        env[key] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


def _checkpoint(d: Any, base_dir: Path) -> CheckpointSpec:
    if d is None:
        return CheckpointSpec()
    if not isinstance(d, dict):
        raise ConfigError(f"job.checkpoint is {d!r}; give a mapping like {{dir: ./runs/demo, every: 10}}.")
    _known(d, "job.checkpoint", ("dir", "every", "keep_last"))
    directory = _required(d, "job.checkpoint", "dir", "the directory for checkpoints")
    if not isinstance(directory, str) or not directory:
        raise ConfigError(f"job.checkpoint.dir is {directory!r}; give a directory path.")
    every = _int(d.get("every", 10), "job.checkpoint.every", 1)
    keep_last = _int(d.get("keep_last", 2), "job.checkpoint.keep_last", 1)
    return CheckpointSpec(_resolve(directory, base_dir), every, keep_last)


def _parallel(d: dict, cluster: ClusterSpec) -> ParallelSpec:
    _known(d, "parallel", ("tp", "zero_stage", "precision"))
    tp = d.get("tp", "auto")
    if tp == "auto":
        tp = None
    else:
        tp = _int(tp, "parallel.tp", 1, allowed="'auto' or a whole number that divides cluster.gpus_per_node")
        if cluster.gpus_per_node % tp:
            raise ConfigError(f"parallel.tp is {tp}, which does not divide cluster.gpus_per_node = "
                              f"{cluster.gpus_per_node}; TP groups must lie inside one node, so use a divisor "
                              f"of {cluster.gpus_per_node} or 'auto'.")
    stage = d.get("zero_stage", "auto")
    stage = None if stage == "auto" else _stage(stage, "parallel.zero_stage")
    precision = _choice(d.get("precision", "bf16"), "parallel.precision", PRECISIONS)
    return ParallelSpec(tp, stage, precision)


# ------------------------------------------------------------------------------------------- entrypoint


def check_entrypoint(entrypoint: Any, working_dir: Optional[Path] = None) -> None:
    """Raise ``ConfigError`` unless ``entrypoint`` names a ``module:function`` importable from
    ``working_dir`` or an installed package."""
    resolve_entrypoint(entrypoint, field_name="job.entrypoint", working_dir=working_dir)


def resolve_entrypoint(entrypoint: Any, field_name: str = "job.entrypoint",
                       working_dir: Optional[str | os.PathLike] = None) -> Callable:
    """Import ``module:function`` and return the function; ``working_dir`` goes first on ``sys.path``
    (as Ray puts a job's working_dir first on its workers)."""
    if not isinstance(entrypoint, str) or entrypoint.count(":") != 1 or not all(entrypoint.split(":")):
        raise ConfigError(f"{field_name} is {entrypoint!r}; give module:function, "
                          "e.g. hybrid.models.gpt:train.")
    module_name, fn_name = entrypoint.split(":")
    if working_dir is not None and str(working_dir) not in sys.path:
        sys.path.insert(0, str(working_dir))
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or the module itself raising while imported
        raise ConfigError(f"{field_name} is {entrypoint!r}, but module {module_name!r} cannot be imported "
                          f"({type(err).__name__}: {err}) from job.working_dir {working_dir}; give a module:function "
                          "importable from there or installed.") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"{field_name} is {entrypoint!r}, but {module_name} has no function {fn_name!r}; "
                          "give an importable module:function.")
    return fn


# -------------------------------------------------------------------------------------------- helpers


def _section(data: dict, name: str, required: bool) -> dict:
    if name not in data or data[name] is None:
        if required:
            raise ConfigError(f"section {name!r} is missing from the cluster file; add it "
                              "(see clusters/local.yaml for the shape).")
        return {}
    if not isinstance(data[name], dict):
        raise ConfigError(f"section {name!r} is {data[name]!r}; it must be a mapping of fields.")
    return data[name]


def _known(d: dict, where: str, keys: tuple) -> None:
    """Unknown keys are errors: a typo must never silently fall back to a default."""
    for key in d:
        if key not in keys:
            name = f"{where}.{key}" if where else str(key)
            place = where or "the top level"
            raise ConfigError(f"{name} is not a known key; allowed keys in {place}: {', '.join(keys)}.")


def _required(d: dict, section: str, key: str, allowed: str) -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(f"{section}.{key} is missing; add it ({allowed}).")
    return d[key]


def _int(value: Any, name: str, minimum: int, allowed: Optional[str] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = allowed or f"a whole number, at least {minimum}"
        raise ConfigError(f"{name} is {value!r}; it must be {allowed}.")
    return value


def _stage(value: Any, name: str) -> int:
    if value == "auto" and name.startswith("--"):
        raise ConfigError(f"{name} is 'auto'; omit {name} to let the planner choose, or give 0, 1, 2 or 3.")
    if isinstance(value, bool) or value not in (0, 1, 2, 3):
        raise ConfigError(f"{name} is {value!r}; use 'auto' or a ZeRO stage 0, 1, 2 or 3.")
    return int(value)


def _choice(value: Any, name: str, allowed: tuple) -> str:
    if value not in allowed:
        raise ConfigError(f"{name} is {value!r}; use one of {', '.join(allowed)}.")
    return value


def _resolve(p: str, base_dir: Path) -> Path:
    path = Path(os.path.expanduser(p))
    return path if path.is_absolute() else (base_dir / path).resolve()


def _is_ray_client(address: str) -> bool:
    host_port = address[len("ray://"):] if address.startswith("ray://") else ""
    return bool(host_port) and ":" in host_port
