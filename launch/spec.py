"""cluster.yaml: load, validate and resolve into a ``LaunchSpec``.

``load_spec(path)`` reads the file strictly (``hybrid.config.yamlfile``: UTF-8, no duplicate keys) and returns a
frozen ``LaunchSpec`` (cluster, job, parallel sections), or raises ``ConfigError`` with one sentence
naming the bad field, its value (quoted short) and what is allowed; the checks are the shared ones of
``hybrid.config.validate``. Unknown keys are errors, relative paths are resolved against the YAML file's
directory, ``job.entrypoint`` must be a ``module:function`` taking one argument, importable from
``job.working_dir`` (default: the cluster file's directory, which the launcher ships to every node) or an
installed package, from any current directory; the checkpoint directory must be creatable and writable.
``job.run_dir`` (default ``job.checkpoint.dir``, else ``runs/<cluster file name>`` under the current
directory) receives metrics.jsonl; ``job.env`` holds environment variables for the ranks.
An empty value (YAML null, ``offload:`` with nothing after it) is the field left unset: its default applies,
for every field. ``parallel.offload`` and ``parallel.activation_checkpointing`` are auto (None: the planner's
choice), true or false; offload with ``zero_stage: 0`` is refused. ``cluster.host_memory_gb`` (optional) is a node's host
memory where the probes cannot measure it. The time model's facts (optional, where ``hybrid probe`` has
not measured them): ``cluster.gpu`` (a GPU of ``hybrid.plan.hardware.GPUS``: ``H100``, ``A100-40GB``, an NVML
name), ``cluster.gpu_tflops`` (its peak in the training precision), ``cluster.interconnect.intra_node_gbps``
/ ``inter_node_gbps`` (line rate of one port, Gb/s, one direction) and ``nics_per_node``.
``job.global_batch`` (optional) is the sequences per optimizer step over all DP ranks, which every layout the
plan weighs keeps; without ``job.micro_batch`` beside it the plan chooses the micro-batch too. Nothing here
contacts Ray. (Whether an embedded cluster fits on this machine is ``launch.ray.capacity``'s check, made
before one is started.)
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from hybrid.config import validate as v
from hybrid.checkpoint import layout
from hybrid.errors import ConfigError
from hybrid.plan.planner import check_lever, check_offload_stage
from hybrid.config.validate import DEFAULT_PRECISION, PRECISIONS
from hybrid.config.yamlfile import load_yaml, not_a_file

ADDRESS_HELP = "'local' (embedded Ray), 'auto' (the running cluster) or 'ray://host:port'"
INTRA_NODE = ("nvlink", "pcie", "loopback")
INTER_NODE = ("infiniband", "roce", "ethernet", "loopback")
# Sane bounds: a value outside them is a typo (a timeout in ms, a world in the wrong unit), not a plan.
MAX_NODES = 100_000
MAX_GPUS_PER_NODE = 1024
MAX_WORLD_SIZE = 1 << 20  # ranks in all: beyond any cluster built, and the plan lists every rank
MAX_GPU_MEMORY_GB = 100_000
MAX_HOST_MEMORY_GB = 1_000_000
MAX_STEPS = 10**12
MAX_MICRO_BATCH = 1 << 20
MAX_GPU_TFLOPS = 1e6
MAX_LINK_GBPS = 1e6
MAX_FAILURES = 1000
COLLECTIVE_TIMEOUT_S = (1.0, 7 * 24 * 3600.0)
PLACEMENT_TIMEOUT_S = (1.0, 7 * 24 * 3600.0)
CONNECT_TIMEOUT_S = (1.0, 3600.0)


@dataclass(frozen=True)
class ClusterSpec:
    address: str
    nodes: int
    gpus_per_node: int  # ranks per node
    gpu_memory_gb: float  # used where NVML cannot measure, and by `hybrid plan`
    intra_node: str = "unspecified"
    inter_node: str = "unspecified"
    connect_timeout_s: float = 60.0  # auto / ray://: how long to wait for the cluster to answer
    host_memory_gb: Optional[float] = None  # per node; used where the probe cannot measure, and by `hybrid plan`
    # CUDA context and NCCL buffers per GPU, outside the allocator; None: hybrid.plan.memory's default on GPUs
    runtime_reserve_gb: Optional[float] = None
    # Without GPUs, gpu_memory_gb is a planning figure; true makes it each rank's enforced memory budget too
    # (measured RSS growth above it is an out-of-memory error and a re-plan). On GPUs the budget is the GPU's.
    enforce_memory_budget: bool = False
    # The time model's facts where no probe measured them (hybrid.plan.hardware): the GPU (a name of its
    # table), its peak TFLOP/s, the links' line rates per port in Gb/s and the NICs of a node.
    gpu: Optional[str] = None
    gpu_tflops: Optional[float] = None
    intra_node_gbps: Optional[float] = None
    inter_node_gbps: Optional[float] = None
    nics_per_node: Optional[int] = None

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
    max_replans: int = 3  # out-of-memory re-plans (launch.planning.replan); they do not count against max_failures
    placement_timeout_s: float = 120.0  # how long Ray may take to reserve the nodes before the job fails
    # Sequences per optimizer step over all DP ranks; None: micro_batch x DP at the default TP degree. With it,
    # the plan chooses micro-batch x accumulation per layout (micro_batch_auto) unless micro_batch is given.
    global_batch: Optional[int] = None
    micro_batch_auto: bool = False


@dataclass(frozen=True)
class ParallelSpec:
    tp: Optional[int] = None  # None: auto = gpus_per_node for a model with TP layers, else 1
    zero_stage: Optional[int] = None  # None: auto = the planner's choice
    precision: str = DEFAULT_PRECISION
    offload: Optional[bool] = None  # optimizer states in host memory; None: auto = the planner's choice
    activation_checkpointing: Optional[bool] = None  # None: auto = the planner's choice


@dataclass(frozen=True)
class LaunchSpec:
    cluster: ClusterSpec
    job: JobSpec
    parallel: ParallelSpec
    path: Optional[Path] = None

    @property
    def tp(self) -> int:
        """``parallel.tp``, or under auto ``gpus_per_node`` (the plan's degree for a model with TP layers;
        ``launch.planning.plan.choose_tp`` gives 1 to a model without them)."""
        return self.parallel.tp if self.parallel.tp is not None else self.cluster.gpus_per_node

    @property
    def dp(self) -> int:
        return self.cluster.world_size // self.tp

    def with_overrides(self, steps: Optional[int] = None, stage: Optional[int] = None) -> "LaunchSpec":
        """The spec with ``--steps`` / ``--stage`` from the command line applied (validated like the file)."""
        job, parallel = self.job, self.parallel
        if steps is not None:
            job = dataclasses.replace(job, steps=v.positive_int("--steps", steps, MAX_STEPS))
        if stage is not None:
            parallel = dataclasses.replace(parallel, zero_stage=v.stage("--stage", stage))
            check_offload_stage(parallel.offload, parallel.zero_stage, "parallel.offload", "--stage")
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
    v.known_keys("", data, ("cluster", "job", "parallel"))
    cluster = _cluster(_section(data, "cluster", required=True))
    job = _job(_section(data, "job", required=True), base_dir, cluster.is_local, path.stem if path else "job")
    parallel = _parallel(_section(data, "parallel", required=False), cluster)
    return LaunchSpec(cluster=cluster, job=job, parallel=parallel, path=path)


def _cluster(d: dict) -> ClusterSpec:
    v.known_keys("cluster", d, ("address", "nodes", "gpus_per_node", "gpu_memory_gb", "interconnect",
                                "connect_timeout_s", "host_memory_gb", "runtime_reserve_gb",
                                "enforce_memory_budget", "gpu", "gpu_tflops"))
    address = check_address(v.required(d, "cluster", "address", ADDRESS_HELP))
    nodes = v.positive_int("cluster.nodes", v.required(d, "cluster", "nodes", "a whole number of nodes, at least 1"),
                           MAX_NODES)
    gpus = v.positive_int("cluster.gpus_per_node",
                          v.required(d, "cluster", "gpus_per_node", "ranks per node, at least 1"), MAX_GPUS_PER_NODE)
    if nodes * gpus > MAX_WORLD_SIZE:
        raise ConfigError(f"cluster.nodes x cluster.gpus_per_node is {nodes} x {gpus} = {nodes * gpus} ranks, "
                          f"above the {MAX_WORLD_SIZE} hybrid plans for; lower cluster.nodes or cluster.gpus_per_node.")
    memory = v.positive_number("cluster.gpu_memory_gb",
                               v.required(d, "cluster", "gpu_memory_gb", "the memory of one GPU in GB, e.g. 80"),
                               MAX_GPU_MEMORY_GB, unit="GB")
    links = d.get("interconnect")
    links = {} if links is None else links
    links = v.without_nulls(v.mapping("cluster.interconnect", links, ("intra_node", "inter_node") + LINK_RATES,
                                      example="{intra_node: nvlink, inter_node: infiniband}"))
    intra = v.one_of("cluster.interconnect.intra_node", links.get("intra_node", "unspecified"),
                     INTRA_NODE + ("unspecified",))
    inter = v.one_of("cluster.interconnect.inter_node", links.get("inter_node", "unspecified"),
                     INTER_NODE + ("unspecified",))
    connect = v.number("cluster.connect_timeout_s", d.get("connect_timeout_s", 60), *CONNECT_TIMEOUT_S, unit="seconds")
    host = d.get("host_memory_gb")
    if host is not None:
        host = v.positive_number("cluster.host_memory_gb", host, MAX_HOST_MEMORY_GB, unit="GB")
    reserve = d.get("runtime_reserve_gb")
    if reserve is not None:
        need = f"a number from 0 to below cluster.gpu_memory_gb ({memory:g} GB)"
        reserve = v.number("cluster.runtime_reserve_gb", reserve, 0, memory, hi_open=True, need=need)
    enforce = v.boolean("cluster.enforce_memory_budget", d.get("enforce_memory_budget", False))
    return ClusterSpec(address, nodes, gpus, memory, intra, inter, connect, host, reserve, enforce,
                       *_time_facts(d, links))


LINK_RATES = ("intra_node_gbps", "inter_node_gbps", "nics_per_node")


def _time_facts(d: dict, links: dict) -> tuple:
    """``cluster.gpu``, ``cluster.gpu_tflops`` and the interconnect's rates, each checked (None where unset)."""
    from hybrid.plan.hardware import GPU_ALIASES, gpu_spec

    gpu = d.get("gpu")
    if gpu is not None and (not isinstance(gpu, str) or gpu_spec(gpu) is None):
        raise v.invalid("cluster.gpu", "a GPU the time model knows (" + ", ".join(sorted(GPU_ALIASES)) +
                        ", or an NVML name such as 'NVIDIA H100 80GB HBM3'); for another, set cluster.gpu_tflops",
                        gpu)
    tflops = d.get("gpu_tflops")
    if tflops is not None:
        tflops = v.positive_number("cluster.gpu_tflops", tflops, MAX_GPU_TFLOPS, unit="TFLOP/s")
    rates = [None if links.get(k) is None else
             v.positive_number(f"cluster.interconnect.{k}", links[k], MAX_LINK_GBPS, unit="Gb/s")
             for k in LINK_RATES[:2]]
    nics = links.get("nics_per_node")
    if nics is not None:
        nics = v.positive_int("cluster.interconnect.nics_per_node", nics, MAX_GPUS_PER_NODE)
    return gpu, tflops, rates[0], rates[1], nics


def check_address(address: Any) -> str:
    """``local``, ``auto`` or ``ray://host:port`` with a port in 1..65535."""
    if address in ("local", "auto"):
        return address
    if isinstance(address, str) and address.startswith("ray://"):
        host, _, port = address[len("ray://"):].rpartition(":")
        if host and port.isdigit() and 1 <= int(port) <= 65535 and "/" not in host:
            return address
    raise v.invalid("cluster.address", ADDRESS_HELP + " with a port from 1 to 65535", address)


def _job(d: dict, base_dir: Path, local: bool, name: str = "job") -> JobSpec:
    v.known_keys("job", d, ("entrypoint", "config", "steps", "micro_batch", "checkpoint", "max_failures",
                            "collective_timeout_s", "seed", "run_dir", "working_dir", "env", "isolate_gpus",
                            "max_replans", "placement_timeout_s", "global_batch"))
    working_dir = _directory(d.get("working_dir", "."), "job.working_dir", base_dir)
    entrypoint = v.required(d, "job", "entrypoint", "module:function, e.g. hybrid.models.gpt:train")
    check_entrypoint(entrypoint, working_dir)
    config = v.text("job.config", v.required(d, "job", "config", "the path of the model config YAML"),
                    "the path of the model config YAML")
    config_path = _resolve(config, base_dir, "job.config")
    state = not_a_file(config_path)
    if state:
        raise ConfigError(f"job.config is {v.quote(config)}, but {v.quote(str(config_path))} {state}; "
                          "give the path of the model config YAML (relative to the cluster file).")
    steps = v.positive_int("job.steps", v.required(d, "job", "steps", "the number of training steps"), MAX_STEPS)
    micro_batch = v.positive_int("job.micro_batch", d.get("micro_batch", 8), MAX_MICRO_BATCH)
    global_batch = d.get("global_batch")
    if global_batch is not None:
        global_batch = v.positive_int("job.global_batch", global_batch, MAX_MICRO_BATCH * MAX_WORLD_SIZE)
    max_failures = v.integer("job.max_failures", d.get("max_failures", 0), 0, MAX_FAILURES)
    max_replans = v.integer("job.max_replans", d.get("max_replans", 3), 0, MAX_FAILURES)
    seed = v.integer("job.seed", d.get("seed", 0), 0, v.MAX_SEED)
    timeout = v.number("job.collective_timeout_s", d.get("collective_timeout_s", 300), *COLLECTIVE_TIMEOUT_S,
                       unit="seconds")
    placement_timeout = v.number("job.placement_timeout_s",
                                 d.get("placement_timeout_s", JobSpec.placement_timeout_s), *PLACEMENT_TIMEOUT_S,
                                 unit="seconds")
    checkpoint = _checkpoint(d.get("checkpoint"), base_dir, local)
    run_dir = d.get("run_dir")
    if run_dir is not None:
        run_dir = _resolve(v.text("job.run_dir", run_dir, "a directory path for metrics and logs"), base_dir,
                           "job.run_dir")
    run_dir = run_dir or checkpoint.dir or Path.cwd() / "runs" / name
    check_writable_dir(run_dir, "job.run_dir", only_if_here=not local)  # the driver writes metrics there
    isolate_gpus = v.boolean("job.isolate_gpus", d.get("isolate_gpus", False))
    return JobSpec(entrypoint, config_path, steps, micro_batch, checkpoint, max_failures, timeout, seed,
                   run_dir, working_dir, _env(d.get("env")), isolate_gpus, max_replans=max_replans,
                   placement_timeout_s=placement_timeout, global_batch=global_batch,
                   micro_batch_auto=global_batch is not None and "micro_batch" not in d)


def _directory(value: Any, name: str, base_dir: Path) -> Path:
    path = _resolve(v.text(name, value, "a directory path (relative to the cluster file)"), base_dir, name)
    if not path.is_dir():
        raise ConfigError(f"{name} is {v.quote(value)}, but {v.quote(str(path))} is not a directory; give an "
                          "existing directory (relative to the cluster file).")
    return path


def _env(d: Any) -> dict:
    if d is None:
        return {}
    d = v.mapping("job.env", d, example="{MY_FLAG: '1'}")
    env = {}
    for key, value in d.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise v.invalid("job.env", "environment variable names: non-empty strings without '='", key)
        if isinstance(value, (dict, list)) or value is None or (isinstance(value, str) and "\0" in value):
            raise v.invalid(v.join("job.env", key), "a string (without a NUL character) or a number", value)
        if isinstance(value, float):  # YAML already turned 1.10 into 1.1: what was written is lost
            raise v.invalid(v.join("job.env", key), f"a string (quote it, as in {key}: '{value}', so it reaches "
                            "the ranks exactly as written) or a whole number", value)
        env[key] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


def _checkpoint(d: Any, base_dir: Path, local: bool) -> CheckpointSpec:
    if d is None:
        return CheckpointSpec()
    d = v.without_nulls(v.mapping("job.checkpoint", d, ("dir", "every", "keep_last"),
                                  example="{dir: ./runs/demo, every: 10}"))
    directory = v.text("job.checkpoint.dir", v.required(d, "job.checkpoint", "dir", "the directory for checkpoints"),
                       "a directory path")
    every = v.positive_int("job.checkpoint.every", d.get("every", 10), MAX_STEPS)
    keep_last = v.positive_int("job.checkpoint.keep_last", d.get("keep_last", 2), MAX_STEPS)
    path = _resolve(directory, base_dir, "job.checkpoint.dir")
    check_writable_dir(path, "job.checkpoint.dir", only_if_here=not local)
    problem = layout.layout_problem(path)
    if problem is not None:
        raise ConfigError(f"job.checkpoint.dir {v.quote(str(path))}: {problem}.")
    if (path / "checkpoints").is_dir():  # where the saves go (hybrid.checkpoint.layout): it may be another mount
        check_writable_dir(path / "checkpoints", "job.checkpoint.dir", only_if_here=not local)
    return CheckpointSpec(path, every, keep_last)


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


def _parallel(d: dict, cluster: ClusterSpec) -> ParallelSpec:
    v.known_keys("parallel", d, ("tp", "zero_stage", "precision", "offload", "activation_checkpointing"))
    tp = d.get("tp", "auto")
    if tp == "auto":
        tp = None
    else:
        tp = v.integer("parallel.tp", tp, 1, need="'auto' or a whole number that divides cluster.gpus_per_node")
        if cluster.gpus_per_node % tp:
            raise ConfigError(f"parallel.tp is {tp}, which does not divide cluster.gpus_per_node = "
                              f"{cluster.gpus_per_node}; TP groups must lie inside one node, so use a divisor "
                              f"of {cluster.gpus_per_node} or 'auto'.")
    stage = v.stage("parallel.zero_stage", d.get("zero_stage", "auto"), auto=True)
    precision = v.one_of("parallel.precision", d.get("precision", DEFAULT_PRECISION), PRECISIONS)
    offload = check_lever("parallel.offload", d.get("offload", "auto"))
    checkpointing = check_lever("parallel.activation_checkpointing", d.get("activation_checkpointing", "auto"))
    check_offload_stage(offload, stage, "parallel.offload", "parallel.zero_stage")
    return ParallelSpec(tp, stage, precision, offload, checkpointing)


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
    if not isinstance(entrypoint, str) or entrypoint.count(":") != 1 or not all(entrypoint.split(":")):
        raise v.invalid(field_name, "module:function, e.g. hybrid.models.gpt:train", entrypoint)
    module_name, fn_name = entrypoint.split(":")
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
