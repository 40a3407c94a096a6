"""The driver of ``hybrid launch``: cluster → probe → plan → rank actors → progress → summary.

``launch(spec)`` connects to (or starts) the Ray cluster, probes every node, builds the plan, prints it,
and runs the job; whatever happens, every actor is killed and an embedded cluster torn down. ``run_job``
runs attempts until one succeeds or ``job.max_failures`` restarts are used up; ``run_attempt`` is one
start of all ranks: placement, rendezvous, the entrypoint on every rank, reports polled into the
progress display. A rank that fails stops the attempt at once (the other ranks are killed, not left to
hang in a collective). A ``UserError`` raised on a rank (a bad model config, say) is not retried.

Failures reach the user as ``JobFailed`` (one sentence; the CLI exits 1); the rank's traceback is logged.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional, TextIO

import ray

from hybrid.errors import PlanError, UserError
from hybrid.train import JobSettings
from launch import ray_cluster
from launch.display import Progress
from launch.plan import LaunchPlan, build_plan, format_plan
from launch.probe import probe_nodes
from launch.spec import LaunchSpec
from launch.workers import PlacementFailed, RankPlacement, WorkerGroup

log = logging.getLogger(__name__)

POLL_S = 0.5


class JobFailed(Exception):
    """The job did not finish; the message is one sentence saying which rank failed and how."""


@dataclass
class AttemptOutcome:
    ok: bool
    results: dict[int, Any] = field(default_factory=dict)  # rank -> what the entrypoint returned
    failure: str = ""  # one sentence when not ok
    retryable: bool = True
    user_error: Optional[UserError] = None
    placement: list[RankPlacement] = field(default_factory=list)


@dataclass
class JobResult:
    plan: LaunchPlan
    results: dict[int, Any]
    placement: list[RankPlacement]
    history: list[dict]  # per completed step: step, loss, tokens_per_s, model_state_bytes
    last_reports: dict[int, dict]  # rank -> its final report
    attempts: int
    wall_s: float


def launch(spec: LaunchSpec, stream: TextIO = sys.stdout) -> JobResult:
    """Run the job of ``spec`` end to end on the cluster it names."""
    where = (f"starting an embedded Ray cluster: {spec.cluster.nodes} nodes x {spec.cluster.gpus_per_node} ranks "
             f"on {ray_cluster.LOOPBACK}" if spec.cluster.is_local else f"connecting to Ray at {spec.cluster.address}")
    print(where, file=stream, flush=True)
    with ray_cluster.connect(spec.cluster):
        return plan_and_run(spec, stream)


def plan_and_run(spec: LaunchSpec, stream: TextIO = sys.stdout, tty: Optional[bool] = None) -> JobResult:
    """Probe the connected Ray cluster, plan, print the plan and run the job."""
    reports = probe_nodes()
    plan = build_plan(spec, reports)
    print(format_plan(plan), file=stream, flush=True)
    if plan.plan.offload:
        raise PlanError("the model fits only with optimizer states offloaded to CPU, which the engine does not "
                        "do; add nodes (cluster.nodes) or use GPUs with more memory.")
    return run_job(plan, stream, tty=tty)


def settings_for(plan: LaunchPlan) -> JobSettings:
    job = plan.spec.job
    return JobSettings(steps=job.steps, micro_batch=job.micro_batch, stage=plan.stage,
                       precision=plan.spec.parallel.precision, seed=job.seed,
                       checkpoint_dir=str(job.checkpoint.dir) if job.checkpoint.dir else None,
                       checkpoint_every=job.checkpoint.every, checkpoint_keep_last=job.checkpoint.keep_last,
                       offload=plan.plan.offload)


def run_job(plan: LaunchPlan, stream: TextIO = sys.stdout, tty: Optional[bool] = None) -> JobResult:
    """Attempts until one succeeds; at most ``1 + job.max_failures`` of them."""
    spec = plan.spec
    attempts = 1 + spec.job.max_failures
    started = time.perf_counter()
    for attempt in range(1, attempts + 1):
        progress = Progress(spec.job.steps, spec.cluster.world_size, stream, tty=tty)
        outcome = run_attempt(plan, progress)
        progress.close()
        if outcome.ok:
            wall = time.perf_counter() - started
            print(progress.summary(outcome.placement, wall), file=stream, flush=True)
            return JobResult(plan, outcome.results, outcome.placement, progress.history, progress.last, attempt, wall)
        if outcome.user_error is not None:
            raise outcome.user_error
        if not outcome.retryable or attempt == attempts:
            tried = f" after {attempt} attempts" if attempt > 1 else ""
            raise JobFailed(f"{outcome.failure}{tried}")
        progress.note(f"attempt {attempt} of {attempts} failed: {outcome.failure}; restarting all ranks")
    raise AssertionError("unreachable")


def run_attempt(plan: LaunchPlan, progress: Progress) -> AttemptOutcome:
    """Start every rank, run the entrypoint, poll reports until all ranks return or one fails."""
    spec = plan.spec
    # On the embedded cluster the ranks meet through a file, not a TCPStore: torch's store client connects
    # over a v4-mapped IPv6 socket and then asks the DNS server for the name of ::ffff:127.0.0.1.
    shared_dir = tempfile.mkdtemp(prefix="hybrid-rendezvous-") if spec.cluster.is_local else None
    group = WorkerGroup(spec.cluster.nodes, spec.cluster.gpus_per_node, bool(plan.use_gpus), env=_rank_env(spec),
                        shared_dir=shared_dir)
    graceful = False
    try:
        try:
            placement = group.start()
            group.setup(plan.layout.tp, spec.job.collective_timeout_s, sample_nvml=bool(plan.use_gpus))
            progress.note(describe_placement(placement))
        except PlacementFailed as err:
            return AttemptOutcome(False, failure=str(err), retryable=False)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as err:
            return AttemptOutcome(False, failure=_describe(err, "setting up the ranks"), placement=group.placement)
        refs = group.run(spec.job.entrypoint, str(spec.job.config), settings_for(plan))
        outcome = _collect(group, refs, progress)
        outcome.placement = placement
        graceful = outcome.ok
        return outcome
    finally:
        group.shutdown(graceful=graceful)
        if shared_dir is not None:
            shutil.rmtree(shared_dir, ignore_errors=True)


def describe_placement(placement: list[RankPlacement]) -> str:
    """One line: which ranks landed on which Ray node."""
    nodes: dict[int, list[RankPlacement]] = {}
    for p in placement:
        nodes.setdefault(p.node_index, []).append(p)
    parts = [f"ranks {','.join(str(p.rank) for p in ps)} on Ray node {ps[0].node_id[:8]} ({ps[0].ip})"
             for _, ps in sorted(nodes.items())]
    return "placed  " + "; ".join(parts)


def _collect(group: WorkerGroup, refs: list, progress: Progress) -> AttemptOutcome:
    pending = {ref: rank for rank, ref in enumerate(refs)}
    results: dict[int, Any] = {}
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=POLL_S)
        for drained in group.drain():
            progress.add(drained)
        for ref in ready:
            rank = pending.pop(ref)
            try:
                results[rank] = ray.get(ref)
            except ray.exceptions.RayError as err:
                group.request_stop()
                cause = getattr(err, "cause", None)
                log.error("rank %d failed:\n%s", rank, err)
                if isinstance(cause, UserError):
                    return AttemptOutcome(False, failure=f"rank {rank}: {cause}",
                                          user_error=type(cause)(f"rank {rank}: {cause}"))
                return AttemptOutcome(False, failure=_describe(err, f"rank {rank}"))
    for drained in group.drain():
        progress.add(drained)
    return AttemptOutcome(True, results=results)


def _describe(err: Exception, where: str) -> str:
    """One sentence for a Ray error: what failed and the original exception's message."""
    if isinstance(err, ray.exceptions.RayActorError):
        return f"{where}: its worker process died ({str(err).splitlines()[0][:200]}); see the Ray logs above"
    if isinstance(err, ray.exceptions.GetTimeoutError):
        return f"{where}: timed out waiting for the ranks; check the Ray logs above"
    cause = getattr(err, "cause", None)
    if cause is not None:
        first = str(cause).strip().splitlines()[0][:300] if str(cause).strip() else ""
        return f"{where} failed with {type(cause).__name__}: {first} (traceback above)"
    return f"{where} failed: {str(err).strip().splitlines()[0][:300]}"


def _rank_env(spec: LaunchSpec) -> dict:
    """Environment for every rank actor: one BLAS thread per rank, the driver's import path, and on the
    embedded cluster gloo bound to the loopback interface."""
    paths = [os.getcwd()] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)),
           # torch's deprecation notices from every rank would bury the progress lines
           "PYTHONWARNINGS": "ignore::FutureWarning"}
    if spec.cluster.is_local:
        env.update(GLOO_SOCKET_IFNAME="lo", MASTER_ADDR=ray_cluster.LOOPBACK)
    return env
