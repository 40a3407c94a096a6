"""cluster.yaml: load, validate and resolve into a ``LaunchSpec``.

Each section is one schema (``hybrid.config.schema``): ``ClusterSpec``, ``JobSpec`` (with ``CheckpointSpec``) and
``ParallelSpec`` declare every field's default, check and help once, and check their values on construction;
the readers here fold the YAML into them. ``load_spec(path)`` reads the file strictly
(``hybrid.config.yamlfile``: UTF-8, no duplicate keys) and returns a frozen ``LaunchSpec``, or raises
``ConfigError`` with one sentence naming the bad field, its value (quoted short) and what is allowed; the
checks are the shared ones of ``hybrid.config.validate``. Unknown keys are errors, relative paths are resolved
against the YAML file's directory. What this machine must allow is checked at load, on the built spec:
``job.entrypoint`` must be a ``module:function`` taking one argument, importable from ``job.working_dir``
(default: the cluster file's directory, which the launcher ships to every node) or an installed package, from
any current directory; the checkpoint directory must be creatable and writable. ``job.run_dir`` (default
``job.checkpoint.dir``, else ``runs/<cluster file name>`` under the current directory) receives metrics.jsonl;
``job.env`` holds environment variables for the ranks. ``job.checkpoint: {dir: ...}`` saves every 10 steps
unless ``every`` says otherwise (``CheckpointSpec.every``).
An empty value (YAML null, ``offload:`` with nothing after it) is the field left unset: its default applies,
for every field. ``parallel.offload`` and ``parallel.activation_checkpointing`` are auto (None: the planner's
choice), true or false; ``parallel.offload`` may also be ``nvme`` (the optimizer states in a swap file per rank
under ``cluster.nvme_path``, an absolute directory on each node's local disk; required with it, and what lets
auto choose it); offload with ``zero_stage: 0`` is refused. ``cluster.nvme_gb`` (optional) is the space that
directory has per node, where the probe cannot measure it (its free bytes). ``parallel.tp_plan`` (optional) is a TP
plan for a model without TP layers (``hybrid.config.tp_plan``: module-name patterns -> styles), checked here
as text; ``launch.planning.model_size`` checks it against the model. ``cluster.host_memory_gb`` (optional) is a
node's host memory where the probes cannot measure it. The time model's facts (optional, where ``hybrid
probe`` has not measured them): ``cluster.gpu`` (a GPU of ``hybrid.plan.hardware.GPUS``: ``H100``,
``A100-40GB``, an NVML name), ``cluster.gpu_tflops`` (its peak in the training precision),
``cluster.interconnect.intra_node_gbps`` / ``inter_node_gbps`` (line rate of one port, Gb/s, one direction) and
``nics_per_node``. ``job.global_batch`` (optional) is the sequences per optimizer step over all DP ranks, which
every layout the plan weighs keeps; without ``job.micro_batch`` beside it the plan chooses the micro-batch too
(``JobSpec.micro_batch_auto``). ``failure.elastic`` (optional, ``ElasticSpec``: ``min_nodes`` <= cluster.nodes
<= ``max_nodes``, default cluster.nodes; ``grace_s``) makes a lost node shrink the job rather than fail it
(``launch.job.elastic``). Nothing here contacts Ray. (Whether an embedded
cluster fits on this machine is ``launch.ray.capacity``'s check, made before one is started.)
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

from hybrid.config import validate as v
from hybrid.config.schema import (Check, Section, Where, default_of, optional, path_value, read, section_check,
                                  setting, setting_of, spelled)
from hybrid.checkpoint import layout
from hybrid.errors import ConfigError
from hybrid.plan.planner import check_lever, check_offload, check_offload_stage
from hybrid.config.tp_plan import normalize_plan
from hybrid.config.validate import DEFAULT_PRECISION, PRECISIONS
from hybrid.config.yamlfile import load_yaml, not_a_file

ADDRESS_HELP = "'local' (embedded Ray), 'auto' (the running cluster) or 'ray://host:port'"
ENTRYPOINT_HELP = "module:function, e.g. hybrid.models.gpt:train"
INTRA_NODE = ("nvlink", "pcie", "loopback")
INTER_NODE = ("infiniband", "roce", "ethernet", "loopback")
# Sane bounds: a value outside them is a typo (a timeout in ms, a world in the wrong unit), not a plan.
MAX_NODES = 100_000
MAX_GPUS_PER_NODE = 1024
MAX_WORLD_SIZE = 1 << 20  # ranks in all: beyond any cluster built, and the plan lists every rank
MAX_GPU_MEMORY_GB = 100_000
MAX_HOST_MEMORY_GB = 1_000_000
MAX_NVME_GB = 10_000_000
MAX_STEPS = 10**12
MAX_MICRO_BATCH = 1 << 20
MAX_GPU_TFLOPS = 1e6
MAX_LINK_GBPS = 1e6
MAX_FAILURES = 1000
COLLECTIVE_TIMEOUT_S = (1.0, 7 * 24 * 3600.0)
PLACEMENT_TIMEOUT_S = (1.0, 7 * 24 * 3600.0)
CONNECT_TIMEOUT_S = (1.0, 3600.0)
ELASTIC_GRACE_S = (0.0, 24 * 3600.0)


def _address(path: str, address: Any) -> str:
    """``local``, ``auto`` or ``ray://host:port`` with a port in 1..65535."""
    if isinstance(address, str) and address in ("local", "auto"):
        return address
    if isinstance(address, str) and address.startswith("ray://"):
        host, _, port = address[len("ray://"):].rpartition(":")
        if host and port.isdigit() and 1 <= int(port) <= 65535 and "/" not in host:
            return address
    raise v.invalid(path, ADDRESS_HELP + " with a port from 1 to 65535", address)


def _gpu(path: str, value: Any) -> str:
    """A GPU the time model's table knows (``hybrid.plan.hardware``), by its short or NVML name."""
    from hybrid.plan.hardware import GPU_ALIASES, gpu_spec

    if not isinstance(value, str) or gpu_spec(value) is None:
        raise v.invalid(path, "a GPU the time model knows (" + ", ".join(sorted(GPU_ALIASES)) + ", or an NVML "
                        "name such as 'NVIDIA H100 80GB HBM3'); for another, set cluster.gpu_tflops", value)
    return value


def _node_dir(path: str, value: Any) -> Path:
    """A directory on each node's own disk: an absolute path (it names the same place on every node, not one
    relative to the cluster file)."""
    directory = path_value(path, value)
    if not directory.is_absolute():
        raise ConfigError(f"{path} is {v.quote(str(value))}, a relative path; give the absolute path of a directory "
                          "on each node's local NVMe disk, e.g. /local_nvme/hybrid.")
    return directory


def _seconds(bounds: tuple) -> Check:
    return partial(v.number, lo=bounds[0], hi=bounds[1], unit="seconds")


@dataclass(frozen=True)
class ClusterSpec(Section):
    SECTION = "cluster"

    address: str = setting(check=_address, help=ADDRESS_HELP)
    nodes: int = setting(check=partial(v.positive_int, hi=MAX_NODES), help="a whole number of nodes, at least 1")
    gpus_per_node: int = setting(check=partial(v.positive_int, hi=MAX_GPUS_PER_NODE), help="ranks per node, at least 1")
    gpu_memory_gb: float = setting(check=partial(v.positive_number, hi=MAX_GPU_MEMORY_GB, unit="GB"),
                                   help="the memory of one GPU in GB, e.g. 80")  # where NVML cannot measure; plan
    intra_node: str = setting("unspecified", partial(v.one_of, choices=INTRA_NODE + ("unspecified",)),
                              key="interconnect.intra_node", help=" | ".join(INTRA_NODE))
    inter_node: str = setting("unspecified", partial(v.one_of, choices=INTER_NODE + ("unspecified",)),
                              key="interconnect.inter_node", help=" | ".join(INTER_NODE))
    connect_timeout_s: float = setting(60.0, _seconds(CONNECT_TIMEOUT_S),
                                       help="auto / ray://: how long to wait for the cluster to answer")
    host_memory_gb: Optional[float] = setting(
        None, partial(v.positive_number, hi=MAX_HOST_MEMORY_GB, unit="GB"),
        help="per node; used where the probe cannot measure, and by `hybrid plan`")
    nvme_path: Optional[Path] = setting(
        None, _node_dir, help="a directory on each node's local NVMe disk: the optimizer states offloaded there "
                              "(parallel.offload: nvme, or auto)")
    nvme_gb: Optional[float] = setting(
        None, partial(v.positive_number, hi=MAX_NVME_GB, unit="GB"),
        help="per node: the space nvme_path has for them, where the probe cannot measure it, and for `hybrid plan`")
    runtime_reserve_gb: Optional[float] = setting(  # checked below, against gpu_memory_gb
        None, help="CUDA context and NCCL buffers per GPU, outside the allocator; unset: hybrid.plan.memory's "
                   "default on GPUs")
    enforce_memory_budget: bool = setting(
        False, v.boolean, help="without GPUs, make gpu_memory_gb each rank's enforced memory budget (measured RSS "
                               "growth above it is an out-of-memory error and a re-plan); on GPUs it is the GPU's")
    # The time model's facts where no probe measured them (hybrid.plan.hardware)
    gpu: Optional[str] = setting(None, _gpu, help="a GPU of the time model's table (H100, A100-40GB, or an NVML name)")
    gpu_tflops: Optional[float] = setting(None, partial(v.positive_number, hi=MAX_GPU_TFLOPS, unit="TFLOP/s"),
                                          help="the GPU's peak TFLOP/s in the training precision")
    intra_node_gbps: Optional[float] = setting(None, partial(v.positive_number, hi=MAX_LINK_GBPS, unit="Gb/s"),
                                               key="interconnect.intra_node_gbps",
                                               help="line rate of one intra-node port, Gb/s, one direction")
    inter_node_gbps: Optional[float] = setting(None, partial(v.positive_number, hi=MAX_LINK_GBPS, unit="Gb/s"),
                                               key="interconnect.inter_node_gbps",
                                               help="line rate of one inter-node NIC, Gb/s, one direction")
    nics_per_node: Optional[int] = setting(None, partial(v.positive_int, hi=MAX_GPUS_PER_NODE),
                                           key="interconnect.nics_per_node", help="inter-node NICs of one node")

    def _check_together(self, where: Where) -> None:
        nodes, gpus = self.nodes, self.gpus_per_node
        if nodes * gpus > MAX_WORLD_SIZE:
            raise ConfigError(f"{where('nodes')} x {where('gpus_per_node')} is {nodes} x {gpus} = {nodes * gpus} "
                              f"ranks, above the {MAX_WORLD_SIZE} hybrid plans for; lower {where('nodes')} or "
                              f"{where('gpus_per_node')}.")
        if self.nvme_gb is not None and self.nvme_path is None:
            raise ConfigError(f"{where('nvme_gb')} is set but {where('nvme_path')} is not; set {where('nvme_path')} "
                              f"to the directory on each node's local NVMe disk that {where('nvme_gb')} measures.")
        if self.runtime_reserve_gb is not None:
            need = f"a number from 0 to below {where('gpu_memory_gb')} ({self.gpu_memory_gb:g} GB)"
            self._set("runtime_reserve_gb", v.number(where("runtime_reserve_gb"), self.runtime_reserve_gb, 0,
                                                     self.gpu_memory_gb, hi_open=True, need=need))

    @property
    def is_local(self) -> bool:
        return self.address == "local"

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class CheckpointSpec(Section):
    SECTION = "job.checkpoint"

    dir: Optional[Path] = setting(None, path_value, help="the directory for checkpoints")  # unset: no checkpoints
    every: int = setting(10, partial(v.positive_int, hi=MAX_STEPS),
                         help="save every this many steps (and at the last step)")
    keep_last: int = setting(2, partial(v.positive_int, hi=MAX_STEPS), help="the newest checkpoints kept")
    every_seconds: Optional[float] = setting(None, partial(v.positive_number, hi=7 * 24 * 3600, unit="seconds"),
                                             help="also save once this many seconds passed since the last save")
    async_: bool = setting(False, v.boolean, key="async",
                           help="write from a host copy in the background while training goes on")


def _entrypoint(path: str, entrypoint: Any) -> str:
    if not isinstance(entrypoint, str) or entrypoint.count(":") != 1 or not all(entrypoint.split(":")):
        raise v.invalid(path, ENTRYPOINT_HELP, entrypoint)
    return entrypoint


def _env(path: str, d: Any) -> dict:
    d = v.mapping(path, d, example="{MY_FLAG: '1'}")
    env = {}
    for key, value in d.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise v.invalid(path, "environment variable names: non-empty strings without '='", key)
        if isinstance(value, (dict, list)) or value is None or (isinstance(value, str) and "\0" in value):
            raise v.invalid(v.join(path, key), "a string (without a NUL character) or a number", value)
        if isinstance(value, float):  # YAML already turned 1.10 into 1.1: what was written is lost
            raise v.invalid(v.join(path, key), f"a string (quote it, as in {key}: '{value}', so it reaches "
                            "the ranks exactly as written) or a whole number", value)
        env[key] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


@dataclass(frozen=True)
class JobSpec(Section):
    SECTION = "job"

    entrypoint: str = setting(check=_entrypoint, help=ENTRYPOINT_HELP)
    config: Path = setting(check=path_value, help="the path of the model config YAML")
    steps: int = setting(check=partial(v.positive_int, hi=MAX_STEPS), help="the number of training steps")
    micro_batch: int = setting(8, partial(v.positive_int, hi=MAX_MICRO_BATCH), help="rows per rank per micro-step")
    checkpoint: CheckpointSpec = setting(factory=CheckpointSpec, check=section_check(CheckpointSpec),
                                         help="{dir, every, every_seconds, keep_last, async}; unset: no checkpoints")
    max_failures: int = setting(0, partial(v.integer, lo=0, hi=MAX_FAILURES),
                                help="restarts of the whole worker group before the job gives up")
    collective_timeout_s: float = setting(300.0, _seconds(COLLECTIVE_TIMEOUT_S),
                                          help="a collective that waits longer raises instead of hanging")
    seed: int = setting(0, partial(v.integer, lo=0, hi=v.MAX_SEED), help="the data and dropout seed")
    run_dir: Optional[Path] = setting(
        None, path_value, help="metrics.jsonl and TensorBoard events; from a cluster file: job.checkpoint.dir, "
                               "else runs/<cluster file name> under the current directory")
    working_dir: Optional[Path] = setting(
        ".", optional(path_value), help="shipped to every rank; the entrypoint's module is found here (relative "
                                        "to the cluster file)")
    env: dict = setting(factory=dict, check=_env, help="environment variables for the ranks")
    isolate_gpus: bool = setting(False, v.boolean, help="each rank sees only its own GPU (cuda:0); else the "
                                                        "node's, cuda:LOCAL_RANK")
    max_replans: int = setting(3, partial(v.integer, lo=0, hi=MAX_FAILURES),
                               help="out-of-memory re-plans (launch.planning.replan), not counted as failures")
    placement_timeout_s: float = setting(120.0, _seconds(PLACEMENT_TIMEOUT_S),
                                         help="how long Ray may take to reserve the nodes before the job fails")
    global_batch: Optional[int] = setting(None, partial(v.positive_int, hi=MAX_MICRO_BATCH * MAX_WORLD_SIZE),
                                          help="sequences per optimizer step over all DP ranks, kept by every "
                                               "layout the plan weighs; unset: micro_batch x DP")
    micro_batch_auto: bool = setting(False, v.boolean, derived=True,
                                     help="the plan chooses micro_batch (job.global_batch given without it)")


def _tp(path: str, value: Any) -> Optional[int]:
    if isinstance(value, str) and value == "auto":
        return None
    return v.integer(path, value, 1, need="'auto' or a whole number that divides cluster.gpus_per_node")


@dataclass(frozen=True)
class ParallelSpec(Section):
    SECTION = "parallel"

    tp: Optional[int] = setting(None, _tp, auto=True,
                                help="auto: gpus_per_node for a model with TP layers, else 1")
    zero_stage: Optional[int] = setting(None, partial(v.stage, auto=True), auto=True,
                                        help="auto (the planner's choice) or 0-3")
    precision: str = setting(DEFAULT_PRECISION, partial(v.one_of, choices=PRECISIONS), help="bf16 | fp32")
    offload: Any = setting(None, check_offload, auto=True,
                           help="optimizer states off the GPU: auto (the planner's choice), true (host memory), nvme "
                                "(each node's local disk, cluster.nvme_path) or false")
    activation_checkpointing: Optional[bool] = setting(None, check_lever, auto=True,
                                                       help="auto (the planner's choice), true or false")
    tp_plan: Optional[dict] = setting(None, lambda path, value: normalize_plan(value, path),
                                      help="module-name pattern -> TP style (hybrid.config.tp_plan); unset: the "
                                           "model's own plan")

    def _check_together(self, where: Where) -> None:
        check_offload_stage(self.offload, self.zero_stage, where("offload"), where("zero_stage"))


@dataclass(frozen=True)
class ElasticSpec(Section):
    SECTION = "failure.elastic"

    min_nodes: int = setting(1, partial(v.positive_int, hi=MAX_NODES),
                             help="the fewest nodes the job may shrink to before it fails")
    max_nodes: Optional[int] = setting(None, partial(v.positive_int, hi=MAX_NODES),
                                       help="the most nodes it may grow to; unset: cluster.nodes")
    grace_s: float = setting(10.0, _seconds(ELASTIC_GRACE_S),
                             help="how long a lost node may take to come back before the job shrinks")


@dataclass(frozen=True)
class FailureSpec(Section):
    SECTION = "failure"

    elastic: Optional[ElasticSpec] = setting(
        None, section_check(ElasticSpec), help="{min_nodes, max_nodes, grace_s}: a lost node shrinks the job "
                                               "instead of failing it (launch.job.elastic); unset: not elastic")


@dataclass(frozen=True)
class LaunchSpec:
    """The cluster file: its four sections (each checked on construction) and where it was read from."""

    cluster: ClusterSpec
    job: JobSpec
    parallel: ParallelSpec
    path: Optional[Path] = None
    failure: FailureSpec = dataclasses.field(default_factory=FailureSpec)

    def __post_init__(self) -> None:
        if self.parallel.offload == "nvme" and self.cluster.nvme_path is None:
            raise ConfigError("parallel.offload is nvme but cluster.nvme_path is not set; set it to a directory on "
                              "each node's local NVMe disk (each rank keeps its swap file there), or use "
                              "parallel.offload: true for host memory.")
        gpus, tp = self.cluster.gpus_per_node, self.parallel.tp
        if tp is not None and gpus % tp:
            raise ConfigError(f"parallel.tp is {tp}, which does not divide cluster.gpus_per_node = {gpus}; TP "
                              f"groups must lie inside one node, so use a divisor of {gpus} or 'auto'.")
        elastic = self.failure.elastic
        if elastic is not None:
            _check_elastic(elastic, self.cluster.nodes)

    @property
    def max_nodes(self) -> int:
        """The most nodes the job may run on: ``failure.elastic.max_nodes``, else ``cluster.nodes``."""
        elastic = self.failure.elastic
        return elastic.max_nodes if elastic is not None and elastic.max_nodes is not None else self.cluster.nodes

    @property
    def tp(self) -> int:
        """``parallel.tp``, or under auto ``gpus_per_node`` (the plan's degree for a model with TP layers;
        ``launch.planning.plan.choose_tp`` gives 1 to a model without them)."""
        return self.parallel.tp if self.parallel.tp is not None else self.cluster.gpus_per_node

    @property
    def dp(self) -> int:
        return self.cluster.world_size // self.tp

    def with_overrides(self, steps: Optional[int] = None, stage: Optional[int] = None) -> "LaunchSpec":
        """The spec with ``--steps`` / ``--stage`` from the command line applied (checked like the file, named
        by the flag)."""
        job, parallel = self.job, self.parallel
        if steps is not None:
            job = dataclasses.replace(job, steps=steps, where=Where("job", {"steps": "--steps"}))
        if stage is not None:
            parallel = dataclasses.replace(parallel, zero_stage=stage,
                                           where=Where("parallel", {"zero_stage": "--stage"}))
        return dataclasses.replace(self, job=job, parallel=parallel)


# ---------------------------------------------------------------------------------------------- loading


def load_spec(path: str | os.PathLike) -> LaunchSpec:
    """Read and validate a cluster.yaml; every problem is a ``ConfigError`` of one sentence."""
    path = Path(path)
    data = load_yaml(path, "cluster file")
    return parse_spec(data, base_dir=path.resolve().parent, path=path)


def parse_spec(data: Any, base_dir: Path, path: Optional[Path] = None) -> LaunchSpec:
    """Validate an already-parsed cluster.yaml mapping; relative paths resolve against ``base_dir``."""
    if not isinstance(data, dict):
        shown = f"cluster file {v.quote(str(path))}" if path else "the cluster file"
        raise ConfigError(f"{shown} must be a mapping with sections cluster, job (and optionally parallel), "
                          f"got {'nothing' if data is None else type(data).__name__}.")
    v.known_keys("", data, ("cluster", "job", "parallel", "failure"))
    cluster = read(ClusterSpec, _section(data, "cluster", required=True),
                   examples={"interconnect": "{intra_node: nvlink, inter_node: infiniband}"}, nulls_unset=True)
    job = _job(_section(data, "job", required=True), base_dir, cluster.is_local, path.stem if path else "job")
    parallel = read(ParallelSpec, _section(data, "parallel", required=False))
    failure = read(FailureSpec, _section(data, "failure", required=False), nulls_unset=True,
                   examples={"elastic": "{min_nodes: 2, max_nodes: 3}"})
    return LaunchSpec(cluster=cluster, job=job, parallel=parallel, path=path, failure=failure)


def _check_elastic(elastic: ElasticSpec, nodes: int) -> None:
    """``failure.elastic``'s bounds around ``cluster.nodes``: min_nodes <= nodes <= max_nodes."""
    if elastic.min_nodes > nodes:
        raise ConfigError(f"failure.elastic.min_nodes is {elastic.min_nodes}, more than cluster.nodes = {nodes}; "
                          f"the job must be able to start, so use at most {nodes}.")
    if elastic.max_nodes is not None and elastic.max_nodes < nodes:
        raise ConfigError(f"failure.elastic.max_nodes is {elastic.max_nodes}, fewer than cluster.nodes = {nodes}; "
                          f"use at least {nodes}, or leave it unset (cluster.nodes).")


def _job(d: dict, base_dir: Path, local: bool, name: str = "job") -> JobSpec:
    """``job`` of a cluster file: paths resolved against ``base_dir``, then what this machine must allow (the
    entrypoint imports, the model config is a file, the run directory is writable) checked on the built spec."""
    values, where = spelled(JobSpec, d, "job")
    values["working_dir"] = _directory(values.get("working_dir", default_of(JobSpec, "working_dir")),
                                       "job.working_dir", base_dir)
    config = v.text("job.config", values["config"], "the path of the model config YAML")
    values["config"] = _resolve(config, base_dir, "job.config")
    state = not_a_file(values["config"])
    if state:
        raise ConfigError(f"job.config is {v.quote(config)}, but {v.quote(str(values['config']))} {state}; "
                          "give the path of the model config YAML (relative to the cluster file).")
    values["checkpoint"] = _checkpoint(values.get("checkpoint"), base_dir, local)
    run_dir = values.get("run_dir")
    if run_dir is not None:
        run_dir = _resolve(v.text("job.run_dir", run_dir, "a directory path for metrics and logs"), base_dir,
                           "job.run_dir")
    values["run_dir"] = run_dir or values["checkpoint"].dir or Path.cwd() / "runs" / name
    values["micro_batch_auto"] = values.get("global_batch") is not None and "micro_batch" not in values
    job = JobSpec(**values, where=where)
    check_entrypoint(job.entrypoint, job.working_dir)
    check_writable_dir(job.run_dir, "job.run_dir", only_if_here=not local)  # the driver writes metrics there
    return job


def _directory(value: Any, name: str, base_dir: Path) -> Path:
    path = _resolve(v.text(name, value, "a directory path (relative to the cluster file)"), base_dir, name)
    if not path.is_dir():
        raise ConfigError(f"{name} is {v.quote(value)}, but {v.quote(str(path))} is not a directory; give an "
                          "existing directory (relative to the cluster file).")
    return path


def _checkpoint(d: Any, base_dir: Path, local: bool) -> CheckpointSpec:
    """``job.checkpoint`` of a cluster file (none: no checkpoints): ``dir`` required, resolved against
    ``base_dir``, writable and laid out as a run directory."""
    if d is None:
        return CheckpointSpec()
    values, where = spelled(CheckpointSpec, d, "job.checkpoint", example="{dir: ./runs/demo, every: 10}",
                            nulls_unset=True)
    need = setting_of(CheckpointSpec, "dir").help
    directory = v.text("job.checkpoint.dir", v.required(values, "job.checkpoint", "dir", need), "a directory path")
    path = _resolve(directory, base_dir, "job.checkpoint.dir")
    spec = CheckpointSpec(**{**values, "dir": path}, where=where)
    check_writable_dir(path, "job.checkpoint.dir", only_if_here=not local)
    problem = layout.layout_problem(path)
    if problem is not None:
        raise ConfigError(f"job.checkpoint.dir {v.quote(str(path))}: {problem}.")
    if (path / "checkpoints").is_dir():  # where the saves go (hybrid.checkpoint.layout): it may be another mount
        check_writable_dir(path / "checkpoints", "job.checkpoint.dir", only_if_here=not local)
    return spec


def check_writable_dir(path: Path, field_name: str, only_if_here: bool = False) -> None:
    """``path`` is a directory we can write in, or can be created: its nearest existing ancestor is a
    writable directory. Probed by creating a temporary file, because ``os.access`` says yes to root on a
    read-only mount. With ``only_if_here`` (a remote cluster), a path none of whose parents exist on this
    machine may live on the cluster's own filesystem, so only what exists here is judged."""
    shown = v.quote(str(path))
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if only_if_here and existing == Path(existing.anchor):
        return
    if not existing.is_dir():
        what = "is a file" if existing == path else f"lies under the file {v.quote(str(existing))}"
        raise ConfigError(f"{field_name} {shown} {what}; give a directory path.")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise ConfigError(f"{field_name} {shown} is not writable: creating a file in {v.quote(str(existing))} "
                          f"failed ({err.strerror or err}); give a directory you can write to.") from None


# ------------------------------------------------------------------------------------------- entrypoint


def check_entrypoint(entrypoint: Any, working_dir: Optional[Path] = None) -> None:
    """Raise ``ConfigError`` unless ``entrypoint`` names a ``module:function`` importable from
    ``working_dir`` or an installed package that can be called with one argument (the rank's ``Context``)."""
    fn = resolve_entrypoint(entrypoint, field_name="job.entrypoint", working_dir=working_dir)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable without a signature: cannot tell
        return
    try:
        signature.bind(None)
    except TypeError:
        raise ConfigError(f"job.entrypoint is {v.quote(entrypoint)}, but {fn.__name__}{signature} cannot be "
                          "called with one argument; give a function that takes the rank's Context, "
                          "def train(ctx).") from None


def resolve_entrypoint(entrypoint: Any, field_name: str = "job.entrypoint",
                       working_dir: Optional[str | os.PathLike] = None, check_shadowing: bool = True) -> Callable:
    """Import ``module:function`` and return the function; ``working_dir`` goes first on ``sys.path``
    (as Ray puts a job's working_dir first on its workers). The driver also refuses a working-dir module that
    an installed one of that name shadows (``check_shadowing``; a rank, which imports from its shipped copy,
    leaves that to the driver)."""
    module_name, fn_name = _entrypoint(field_name, entrypoint).split(":")
    if working_dir is not None and str(working_dir) not in sys.path:
        sys.path.insert(0, str(working_dir))
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as err:  # ImportError, or the module raising (or exiting) while imported
        where = f" from job.working_dir {v.quote(str(working_dir))}" if working_dir is not None else ""
        raise ConfigError(f"{field_name} is {v.quote(entrypoint)}, but module {v.quote(module_name)} cannot be "
                          f"imported{where} ({type(err).__name__}: {v.quote(str(err))[1:-1]}); give a "
                          "module:function importable from there or installed.") from None
    if check_shadowing:
        _check_not_shadowed(module_name, working_dir, field_name, entrypoint)
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"{field_name} is {v.quote(entrypoint)}, but {module_name} has no function "
                          f"{v.quote(fn_name)}; give an importable module:function.")
    return fn


def _check_not_shadowed(module_name: str, working_dir, field_name: str, entrypoint: str) -> None:
    """The working dir's own module of that name must be the one imported: a ``launch.py`` or ``hybrid/`` of the
    user's loses to the toolkit's packages of those names, and a ``queue.py`` to the standard library's, when
    they were imported first (here and on the ranks)."""
    if working_dir is None:
        return
    top = module_name.split(".")[0]
    mine = [p for p in (Path(working_dir) / f"{top}.py", Path(working_dir) / top) if p.exists()]
    loaded = getattr(sys.modules.get(top), "__file__", None)
    if not mine or loaded is None:
        return
    loaded_path = Path(loaded).resolve()
    if _inside(loaded_path, Path(working_dir).resolve()) or not any(_inside(loaded_path, d) for d in _installed_dirs()):
        return  # the user's own module (a rank may import it from the job's original directory)
    raise ConfigError(f"{field_name} is {v.quote(entrypoint)}, but the module name {v.quote(top)} is already "
                      f"taken by {v.quote(str(Path(loaded).parent if loaded.endswith('__init__.py') else loaded))}, "
                      f"which is imported instead of job.working_dir's {v.quote(mine[0].name)}; rename yours "
                      "(and the entrypoint) to a name of its own.")


def _inside(path: Path, directory: Path) -> bool:
    try:
        path.relative_to(directory)
        return True
    except ValueError:
        return False


def _installed_dirs() -> list:
    """Where modules that are not the user's live: the toolkit's own packages, the standard library,
    site-packages."""
    import sysconfig

    root = Path(__file__).resolve().parents[1]
    dirs = {root / "hybrid", root / "launch"}
    paths = sysconfig.get_paths()
    dirs.update(Path(paths[key]).resolve() for key in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(key))
    return sorted(dirs)


# -------------------------------------------------------------------------------------------- helpers


def _section(data: dict, name: str, required: bool) -> dict:
    if name not in data or data[name] is None:
        if required:
            raise ConfigError(f"section {name!r} is missing from the cluster file; add it "
                              "(see clusters/local.yaml for the shape).")
        return {}
    return v.without_nulls(v.mapping(name, data[name]))


def _resolve(p: str, base_dir: Path, field_name: str) -> Path:
    if "\0" in p or len(p) > 4096:
        raise v.invalid(field_name, "a path (no NUL character, at most 4096 characters)", p)
    path = Path(os.path.expanduser(p))
    return path if path.is_absolute() else (base_dir / path).resolve()
