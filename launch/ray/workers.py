"""The rank actors: one ``RankActor`` (a ``RankWorker``) per rank, placed so every TP group lies inside one node.

``WorkerGroup.start()`` reserves a placement group with one bundle per node (``STRICT_SPREAD``: no two
bundles on one Ray node), starts ``ranks_per_node`` actors in each bundle, then asks every actor which
Ray node (and GPU) it landed on and assigns ranks node by node (``assign_ranks``) -- bundle order is never
trusted; inside a node local ranks follow the GPU ids Ray gave the actors.
``setup()`` makes rank 0's node the rendezvous (its IP and a port free there; on the embedded cluster a
file instead, see ``Rendezvous``), and every actor joins the default process group and builds the (dp, tp)
mesh; every group gets the job's collective timeout, so a hung or dead peer turns into an error on the
ranks waiting for it instead of a hang.

Each rank's environment is torchrun's (``rank_env``): RANK, WORLD_SIZE, LOCAL_RANK (its index among the
job's ranks on its node), LOCAL_WORLD_SIZE, GROUP_RANK = NODE_RANK, GROUP_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT. With GPUs, Ray Train's convention (``cuda_devices``): the actors of a node share
CUDA_VISIBLE_DEVICES listing all the node's GPUs given to the job and rank LOCAL_RANK uses
``cuda:LOCAL_RANK``, so NCCL sees its peers' GPUs and can use NVLink peer to peer; with
``isolate_gpus`` each actor keeps only its own GPU (``cuda:0``). The default group is
``"cpu:gloo,cuda:nccl"`` on GPUs (``hybrid.comm.mesh.init_default_group``), gloo without.

``probe()`` measures the rank's links and compute for ``hybrid probe`` (``hybrid.runtime.probe``).
``run()`` calls the entrypoint on every rank with a ``hybrid.runtime.train.Context`` whose reports the actor
buffers until the driver drains them; what the entrypoint raises reaches the driver as ``hybrid.errors.RankFailed``,
with the kind of failure the rank decided (``rank_failed``); ``drain()`` also returns the rank's collective heartbeat
(``hybrid.comm.heartbeat``) and step, from which the driver names the rank its peers timed out waiting for.
``shutdown()`` kills every actor and frees the placement group.
Each actor starts with the job's ``runtime_env`` (``launch.ray.runtime_env``) and, once it knows its rank,
names it in Ray's log prefix: what a rank prints reaches the driver as ``(rank N pid=...) ...``.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections import defaultdict
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Optional

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybrid.comm import heartbeat
from hybrid.errors import RankFailed
from hybrid.runtime.failure import failure_kind
from hybrid.runtime.train import JobSettings
from launch.ray.probe import live_nodes
from launch.ray.cluster import gcs_lost, within

log = logging.getLogger(__name__)

NVML_SAMPLE_INTERVAL_S = 2.0
TEARDOWN_CALLS_S = 5.0  # killing the actors and removing the placement group: milliseconds when the GCS answers


def _free_nodes(bundle: dict) -> str:
    """How many live nodes have ``bundle`` free now, and how many could hold it at all."""
    try:
        nodes = live_nodes()
        free = ray._private.state.available_resources_per_node()  # node id -> what is unreserved now
    except Exception:  # noqa: BLE001 -- a description only
        return "the cluster's state could not be read"
    fits = lambda have: all(have.get(k, 0.0) >= v for k, v in bundle.items())  # noqa: E731
    capable = sum(1 for n in nodes if fits(n.get("Resources", {})))
    idle = sum(1 for n in nodes if fits(free.get(n["NodeID"], {})))
    return f"{idle} of the {len(nodes)} live nodes have that free now, {capable} have it at all"


class PlacementFailed(RuntimeError):
    """The Ray cluster could not host the requested ranks."""


class SetupFailed(RuntimeError):
    """A rank's ``setup`` (joining the process group, building the mesh) failed: which rank, and the error."""

    def __init__(self, placement: Optional["RankPlacement"], error: Exception):
        super().__init__(str(error))
        self.placement, self.error = placement, error


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: rank 0's node address and a port free there (a TCPStore, and MASTER_ADDR/PORT
    of every rank), or, when ``store_file`` is set, a file every rank can reach (a FileStore: the embedded
    cluster, whose nodes all share this machine's disk)."""

    address: Optional[str] = None
    port: Optional[int] = None
    store_file: Optional[str] = None


@dataclass(frozen=True)
class RankPlacement:
    rank: int
    node_id: str
    ip: str
    node_index: int  # position of the node in rank order: ranks node_index*ranks_per_node ...
    pid: int = 0  # the actor's process id on its node
    local_rank: int = 0  # index among the job's ranks on this node
    gpu_ids: tuple = ()  # the GPU ids Ray assigned to this actor (as strings)


def _gpu_key(gpu_id: str) -> tuple:
    """Sort GPU ids numerically where they are numbers (Ray's usual ids), else as text (UUIDs)."""
    return (0, int(gpu_id), "") if str(gpu_id).isdigit() else (1, 0, str(gpu_id))


def assign_ranks(node_ids: list[str], ranks_per_node: int, ips: Optional[list[str]] = None,
                 gpu_ids: Optional[list[list[str]]] = None) -> list[int]:
    """Rank of each actor (by index) so that every node's actors hold consecutive ranks.

    Nodes are ordered by (IP, node id) and actors inside a node by their first GPU id, then their index,
    so the result does not depend on which bundle went where and local rank i holds the node's i-th GPU.
    Raises ``PlacementFailed`` unless every node holds exactly ``ranks_per_node`` actors.
    """
    ips = ips or [""] * len(node_ids)
    gpu_ids = gpu_ids or [[] for _ in node_ids]
    by_node: dict[str, list[int]] = defaultdict(list)
    for index, node in enumerate(node_ids):
        by_node[node].append(index)
    for members in by_node.values():
        members.sort(key=lambda i: (_gpu_key(gpu_ids[i][0]) if gpu_ids[i] else (2, 0, ""), i))
    for node, members in by_node.items():
        if len(members) != ranks_per_node:
            raise PlacementFailed(f"Ray placed {len(members)} rank actors on node {node[:12]} where "
                                  f"{ranks_per_node} were expected; TP groups would straddle nodes.")
    first_index = {node: members[0] for node, members in by_node.items()}
    order = sorted(by_node, key=lambda node: (ips[first_index[node]], node))
    ranks = [0] * len(node_ids)
    for node_index, node in enumerate(order):
        for local, actor in enumerate(by_node[node]):
            ranks[actor] = node_index * ranks_per_node + local
    return ranks


def rank_env(p: RankPlacement, world_size: int, nodes: int, ranks_per_node: int, master_addr: str,
             master_port: int) -> dict:
    """torchrun's environment for the rank at placement ``p``."""
    return dict(RANK=str(p.rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(p.local_rank),
                LOCAL_WORLD_SIZE=str(ranks_per_node), GROUP_RANK=str(p.node_index), NODE_RANK=str(p.node_index),
                GROUP_WORLD_SIZE=str(nodes), MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))


def cuda_devices(p: RankPlacement, node_ranks: list[RankPlacement], isolate: bool) -> tuple[str, str]:
    """``(CUDA_VISIBLE_DEVICES, device)`` for the rank at ``p``, whose node holds ``node_ranks``.

    Shared (Ray Train's convention): every rank of the node sees all the node's GPUs given to the job,
    sorted, and uses the position of its own GPU there -- its local rank, as ``assign_ranks`` orders local
    ranks by GPU id. Isolated: it sees only its own GPU, ``cuda:0``.
    """
    if not p.gpu_ids:
        raise PlacementFailed(f"rank {p.rank} was given no GPU by Ray; check cluster.gpus_per_node against "
                              "`ray status`.")
    own = str(p.gpu_ids[0])
    if isolate:
        return own, "cuda:0"
    visible = sorted({str(g) for q in node_ranks for g in q.gpu_ids}, key=_gpu_key)
    return ",".join(visible), f"cuda:{visible.index(own)}"


class RankWorker:
    """One rank (the actor ``RankActor`` runs it). Ray calls its methods on two threads, ``run()`` training
    while ``drain()`` answers the driver, and which thread runs a call is Ray's choice: CUDA's current device
    is per thread, so ``setup()`` and ``run()``, the calls that do the rank's CUDA work, first bind the rank's
    device on the thread they run on (``hybrid.comm.device.bind_thread``)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._reports: list[dict] = []
        self._stop = threading.Event()
        self._rank = -1
        self._mesh = None
        self._device = "cpu"
        self._sampler = None
        self._ctx = None

    def __repr__(self) -> str:
        # Ray prefixes the lines this actor prints with its repr: "(rank 3 pid=..., ip=...)".
        return f"rank {self._rank}" if self._rank >= 0 else "RankWorker"

    def where(self) -> dict:
        """The Ray node id, IP, process id and assigned GPU ids of this actor."""
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "pid": os.getpid(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def free_port(self) -> int:
        """A TCP port free on this node's address, for the rendezvous."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            return s.getsockname()[1]

    def setup(self, rank: int, world_size: int, tp: int, rendezvous: "Rendezvous", env: dict, device: str,
              cuda_visible: Optional[str], timeout_s: float, sample_nvml: bool) -> dict:
        """Take the rank's environment, join the default process group as ``rank`` on ``device`` and build
        the (dp, tp) mesh."""
        if cuda_visible is not None:  # before anything initializes CUDA in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible
        os.environ.update(env)
        import torch
        import torch.distributed as dist

        from hybrid.comm.mesh import build_mesh, init_default_group
        from hybrid.comm.device import bind_thread

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        self._rank, self._device = rank, device
        bind_thread(device)
        name_rank_in_logs(rank)
        timeout = timedelta(seconds=timeout_s)
        store = dist.FileStore(rendezvous.store_file, world_size) if rendezvous.store_file else None
        init_default_group(torch.device(device), rank, world_size, timeout, store=store)
        self._mesh = build_mesh(tp, timeout=timeout)  # a hung or dead peer raises after timeout_s, not 30 min
        heartbeat.reset()
        if sample_nvml:
            from hybrid.plan.monitor import Sampler

            self._sampler = Sampler(NVML_SAMPLE_INTERVAL_S).start()
        return {"rank": rank, "dp_rank": self._mesh.dp_rank, "tp_rank": self._mesh.tp_rank, "device": device,
                **self.where()}

    def run(self, entrypoint: str, model_config_path: str, settings: JobSettings, working_dir: Optional[str] = None):
        """Run the entrypoint on this rank; returns what it returns (must be picklable)."""
        import yaml

        from hybrid.comm.device import bind_thread
        from hybrid.runtime.train import Context
        from launch.ray.runtime_env import localize_shipped
        from launch.spec import resolve_entrypoint

        bind_thread(self._device)  # maybe not the thread setup() ran on
        here = os.getcwd()  # the copy of the job's working_dir on this node, when one was shipped
        local_path = (lambda path: localize_shipped(path, working_dir, here)) if working_dir else None
        local_config = local_path(model_config_path) if local_path else model_config_path
        try:
            fn = resolve_entrypoint(entrypoint, working_dir=here if working_dir else None, check_shadowing=False)
            with open(local_config) as f:
                model_config = yaml.safe_load(f)
            self._ctx = Context(self._mesh, model_config, settings, model_config_path=local_config,
                                rank=self._rank, world_size=int(os.environ["WORLD_SIZE"]), device=self._device,
                                reporter=self._report, stop_requested=self._stop.is_set,
                                model_config_origin=model_config_path, local_path=local_path)
            return _sendable(fn(self._ctx), entrypoint, self._rank)
        except SystemExit as exit_:
            if exit_.code in (None, 0):  # success, as torchrun takes it
                return None
            raise rank_failed(exit_) from exit_
        except BaseException as err:  # noqa: BLE001 -- every failure goes to the driver with its kind
            raise rank_failed(err) from err

    def drain(self) -> dict:
        """Reports buffered since the last drain, the NVML samples of this node (local rank 0 only), and
        the rank's heartbeat (collectives entered, the one it is inside, its step)."""
        with self._lock:
            reports, self._reports = self._reports, []
        samples = []
        if self._sampler is not None:
            samples = [asdict(s) for s in self._sampler.samples[-1:]]
        beat = {**heartbeat.snapshot(), "step": self._ctx.step if self._ctx is not None else 0}
        return {"rank": self._rank, "reports": reports, "nvml": samples, "heartbeat": beat}

    def request_stop(self) -> None:
        self._stop.set()

    def probe(self, precision: str) -> dict:
        """This rank's link and compute figures for ``hybrid probe`` (``hybrid.runtime.probe.measure_rank``); every
        rank calls it at once, after ``setup``."""
        from hybrid.runtime.probe import measure_rank

        return measure_rank(self._rank, int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"]),
                            self._device, precision)

    def close(self) -> None:
        import torch.distributed as dist

        for stream in (sys.stdout, sys.stderr):  # so the log monitor forwards all of it before the kill
            stream.flush()
        if self._sampler is not None:
            self._sampler.stop()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _report(self, record: dict) -> None:
        with self._lock:
            self._reports.append(record)


# two threads: run() trains while drain() answers the driver
RankActor = ray.remote(max_concurrency=2, max_restarts=0)(RankWorker)


def rank_failed(err: BaseException) -> RankFailed:
    """What the driver gets when the entrypoint raised ``err``: its kind, decided here
    (``hybrid.runtime.failure.failure_kind``), and an error that reaches the driver whole. ``SystemExit`` and
    ``KeyboardInterrupt`` become a ``RuntimeError`` saying so (Ray would report the worker dying without
    the code, or a cancelled task); an exception the driver could not rebuild (an ``__init__`` with other
    arguments than its args: Ray would report "Failed to deserialize exception" instead of the cause) becomes
    a ``RuntimeError`` with its type and message, its traceback printed to this rank's log."""
    kind = failure_kind(err)
    if isinstance(err, SystemExit):
        error = RuntimeError(f"the entrypoint called sys.exit({err.code!r})")
    elif isinstance(err, KeyboardInterrupt):
        error = RuntimeError(f"the entrypoint raised KeyboardInterrupt({', '.join(map(repr, err.args))})")
    elif _round_trips(err):
        error = err
    else:
        traceback.print_exception(err)
        error = RuntimeError(f"{type(err).__name__}: {err}")
    return RankFailed(kind, error)


def _round_trips(err: BaseException) -> bool:
    """Whether the driver can unpickle ``err`` (Ray sends a rank's exception pickled)."""
    try:
        ray.cloudpickle.loads(ray.cloudpickle.dumps(err))
        return True
    except Exception:  # noqa: BLE001 -- any failure means the driver would get none of it
        return False


def _sendable(result, entrypoint: str, rank: int):
    """``result``, or None (with a warning on this rank's output) where it cannot reach the driver: the
    training is done by then, and failing the job over its return value would also retry it."""
    try:
        ray.cloudpickle.dumps(result)
        return result
    except Exception as err:  # noqa: BLE001 -- whatever the pickler says, the job itself succeeded
        print(f"warning: rank {rank}: the return value of {entrypoint} cannot be sent to the driver "
              f"({type(err).__name__}: {err}); it is dropped (return plain data: numbers, strings, lists, dicts)",
              flush=True)
        return None


def name_rank_in_logs(rank: int) -> None:
    """Make Ray's log monitor prefix this process's stdout and stderr lines with ``(rank N ...)``.

    Ray takes an actor's prefix from its ``__repr__`` once, when the actor is created -- before the rank is
    known -- and from a marker line the worker writes to its output files; writing that marker again
    renames the actor for every line after it (the monitor drops the marker itself).
    """
    try:
        from ray._private.ray_constants import LOG_PREFIX_ACTOR_NAME
    except ImportError:  # a Ray without the marker: lines keep the generic prefix
        return
    for stream in (sys.stdout, sys.stderr):
        print(f"{LOG_PREFIX_ACTOR_NAME}rank {rank}", file=stream, flush=True)


class WorkerGroup:
    """``nodes × ranks_per_node`` rank actors on a placement group; use ``start``, ``setup``, ``run``,
    ``drain`` and always ``shutdown``."""

    def __init__(self, nodes: int, ranks_per_node: int, use_gpus: bool, env: Optional[dict] = None,
                 shared_dir: Optional[str] = None, runtime_env: Optional[dict] = None,
                 isolate_gpus: bool = False):
        self.nodes, self.ranks_per_node, self.use_gpus = nodes, ranks_per_node, use_gpus
        self.isolate_gpus = isolate_gpus
        self.shared_dir = shared_dir  # when set, rendezvous through a FileStore there
        self.env = {"OMP_NUM_THREADS": "1", **(env or {})}
        self.runtime_env = dict(runtime_env or {})  # beside env_vars: working_dir, excludes
        self.pg = None
        self.actors: list = []  # in rank order once started
        self.placement: list[RankPlacement] = []

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def backend(self) -> str:
        return "nccl" if self.use_gpus else "gloo"

    def start(self, timeout_s: float) -> list[RankPlacement]:
        bundle = {"CPU": self.ranks_per_node, **({"GPU": self.ranks_per_node} if self.use_gpus else {})}
        self.pg = placement_group([dict(bundle) for _ in range(self.nodes)], strategy="STRICT_SPREAD",
                                  name="hybrid-ranks")
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s)
        if not ready:
            raise PlacementFailed(f"the Ray cluster could not reserve {self.nodes} separate nodes with {bundle} "
                                  f"each within {timeout_s:.0f} s ({_free_nodes(bundle)}); other jobs may hold "
                                  "them or a node is gone: check cluster.nodes and gpus_per_node against "
                                  "`ray status`, or wait longer with job.placement_timeout_s.")
        actors = []
        for node in range(self.nodes):
            for _ in range(self.ranks_per_node):
                actors.append(RankActor.options(
                    num_cpus=1, num_gpus=1 if self.use_gpus else 0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=node),
                    runtime_env={"env_vars": self.env, **self.runtime_env},
                ).remote())
        self.actors = actors  # so shutdown() kills them even if placement checks fail below
        where = ray.get([a.where.remote() for a in actors], timeout=timeout_s)
        gpu_ids = [w["gpu_ids"] for w in where]
        ranks = assign_ranks([w["node_id"] for w in where], self.ranks_per_node, [w["ip"] for w in where], gpu_ids)
        order = sorted(range(len(actors)), key=lambda i: ranks[i])
        self.actors = [actors[i] for i in order]
        self.placement = [RankPlacement(rank=ranks[i], node_id=where[i]["node_id"], ip=where[i]["ip"],
                                        node_index=ranks[i] // self.ranks_per_node, pid=where[i]["pid"],
                                        local_rank=ranks[i] % self.ranks_per_node, gpu_ids=tuple(gpu_ids[i]))
                          for i in order]
        return self.placement

    def rendezvous(self) -> Rendezvous:
        """Rank 0's address and a port free there (MASTER_ADDR/PORT, which every rank gets), and on the
        embedded cluster the file the ranks actually meet through."""
        port = ray.get(self.actors[0].free_port.remote())
        store_file = os.path.join(self.shared_dir, "store") if self.shared_dir is not None else None
        return Rendezvous(address=self.placement[0].ip, port=port, store_file=store_file)

    def setup(self, tp: int, timeout_s: float, sample_nvml: bool = False) -> list[dict]:
        """Rendezvous (at rank 0's node, or in the shared directory) and build every rank's mesh."""
        rendezvous = self.rendezvous()
        log.info("rendezvous %s (%s)", rendezvous, self.backend)
        refs = []
        for actor, p in zip(self.actors, self.placement):
            env = rank_env(p, self.world_size, self.nodes, self.ranks_per_node, rendezvous.address, rendezvous.port)
            visible, device = None, "cpu"
            if self.use_gpus:
                node_ranks = [q for q in self.placement if q.node_index == p.node_index]
                visible, device = cuda_devices(p, node_ranks, self.isolate_gpus)
            refs.append(actor.setup.remote(p.rank, self.world_size, tp, rendezvous, env, device, visible, timeout_s,
                                           sample_nvml and p.local_rank == 0))
        try:
            return ray.get(refs, timeout=timeout_s + 60)
        except ray.exceptions.RayError as err:
            raise SetupFailed(self._first_failed(refs), err) from err

    def _first_failed(self, refs: list) -> Optional["RankPlacement"]:
        """The placement of the lowest rank whose finished ``setup`` raised (None if none has yet)."""
        for placement, ref in zip(self.placement, refs):
            if ray.wait([ref], timeout=0)[0]:
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.RayError:
                    return placement
        return None

    def run(self, entrypoint: str, model_config_path: str, settings: JobSettings,
            working_dir: Optional[str] = None) -> list:
        """Start the entrypoint on every rank; returns one object ref per rank (rank order). ``working_dir``
        is the driver's path of the shipped directory (paths inside it map to each rank's copy)."""
        return [actor.run.remote(entrypoint, model_config_path, settings, working_dir) for actor in self.actors]

    def drain(self, timeout_s: float = 30.0) -> list[dict]:
        """Every rank's reports and NVML samples since the last drain (ranks that died are skipped)."""
        if gcs_lost():
            return []
        drained = []
        deadline = time.monotonic() + timeout_s  # one wait for all ranks, not one per rank
        for ref in [actor.drain.remote() for actor in self.actors]:
            try:
                drained.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                continue
        return drained

    def request_stop(self) -> None:
        for actor in self.actors:
            actor.request_stop.remote()

    def shutdown(self, graceful: bool = True) -> None:
        """Close every rank's process group (if ``graceful``), kill the actors and free the placement group.

        With the connection to the cluster gone (a Ray Client session that dropped) there is nothing to
        call: the cluster reclaims a lost session's actors and placement group itself, and a Ray call now
        would start a new driver that attaches to whatever cluster it finds on this machine."""
        if not ray.is_initialized() or gcs_lost():  # nothing is reachable, and the nodes are stopped by pid
            self.actors, self.pg = [], None
            return
        if graceful and self.actors:
            try:
                ray.get([a.close.remote() for a in self.actors], timeout=30)
            except Exception:  # a dead or hung rank: killing below is enough
                pass
        actors, pg = self.actors, self.pg

        def release():
            for actor in actors:
                ray.kill(actor, no_restart=True)
            if pg is not None:
                remove_placement_group(pg)

        try:
            released = within(release, TEARDOWN_CALLS_S, name="ray-teardown")
        except ConnectionError:  # the session dropped while tearing down: the cluster reclaims the rest
            released = True
        if not released and gcs_lost():
            log.warning("the embedded Ray cluster's GCS is gone (killed from outside); its nodes are stopped by pid")
        elif not released:
            log.warning("the Ray cluster did not release the job's actors and placement group within %.0f s; "
                        "going on without it", TEARDOWN_CALLS_S)
        self.actors, self.pg = [], None
