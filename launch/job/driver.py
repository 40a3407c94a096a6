"""The driver of ``hybrid launch``: cluster → probe → plan → rank actors → progress → summary.

``launch(spec)`` connects to (or starts) the Ray cluster, probes every node, builds the plan, prints it,
and runs the job; whatever happens, every actor is killed and an embedded cluster torn down. ``run_job``
runs attempts until one succeeds or ``job.max_failures`` restarts are used up; ``run_attempt`` is one
start of all ranks: placement, rendezvous, the entrypoint on every rank, reports polled into the
progress display. A rank whose actor dies or raises stops the attempt at once: the whole worker group is
killed (no rank is left to hang in a collective), a new one is started, and every rank resumes from the
latest complete checkpoint (``hybrid.runtime.train.run_steps`` does the resuming); the display says which rank on
which node failed, why, and from which step the ranks restart. Each failed rank's ``FailureKind`` is data:
decided by the rank itself (``hybrid.runtime.failure``, carried by ``hybrid.errors.RankFailed``), or ``DIED``
when Ray reports its process gone (``kind_of``); no error text is searched here. The failure blamed is the
root cause: a dead process before a rank's own exception before a collective that failed because of its
peer (``PEER``). When no rank raised an error of its own, the ranks' collective heartbeats
(``hybrid.comm.heartbeat``, drained with the reports) decide: a rank that stopped entering collectives well
before its peers timed out, and is behind all of them, is the hung rank they were waiting for and is named
instead of its victims (``attribute``; ``HUNG``). A ``USER_ERROR`` (a ``UserError`` raised on a rank: a bad
model config, say) is not retried (exit 2), nor is a ``JOB_ERROR`` (training diverged: ``NonFiniteError``),
which fails the job (exit 1).

On GPUs every rank runs with NCCL's flight recorder on (``TORCH_FR_BUFFER_SIZE``, the current name of
``TORCH_NCCL_TRACE_BUFFER_SIZE``) and dumps it when a collective times out (``TORCH_NCCL_DUMP_ON_TIMEOUT``)
into ``<checkpoint dir>/nccl-flight-recorder/rank_<R>`` (``TORCH_FR_DUMP_TEMP_FILE``; torch's default
``/tmp/nccl_trace_rank_<R>`` without a checkpoint directory). Each dump is a
pickled dict whose ``entries`` list the rank's last collectives with their ``collective_seq_id``, ``state``
(scheduled / started / completed) and ``time_discovered_started_ns``; the rank whose last ``started``
sequence number is below its peers' never entered the collective they hang in. Reading them needs no
driver code beyond loading the files (``python -m torch.distributed.flight_recorder.fr_trace <dir> -p rank_``
does it and prints that mismatch); the heartbeats give the same answer without the files, on gloo too.

Every rank starts with ``launch.ray.runtime_env`` (job.working_dir shipped, job.env set); every completed step
goes to ``launch.job.metrics.MetricsWriter`` (run_dir/metrics.jsonl), and the summary ends with the loss against
the entrypoint's reference and where the metrics and the ranks' full logs are.

Memory (``launch.planning.memory_loop``): the display shows the plan's predicted memory against what the ranks
measure; a rank that runs out of memory (``OUT_OF_MEMORY``: ``torch.OutOfMemoryError``, on CPU raised by the
ranks' budget check) makes the driver re-plan from the measured figures (``launch.planning.replan``) and restart
every rank from the latest checkpoint with the new plan, at most ``job.max_replans`` times, without using up
``job.max_failures``; the figures go to ``run_dir/memory.json``.

Time (``launch.planning.time_plan``): the plan is the fastest layout that fits by the time model, fed by
``run_dir/probe.json`` where ``hybrid probe`` (or ``hybrid launch --probe``) measured the links; every
metrics line carries the layout's predicted step time beside the measured one, the summary compares the
two, and ``run_dir/time.json`` keeps them for ``hybrid plan --measured``.

Nodes (``launch.job.elastic``, with ``failure.elastic``): a failed attempt whose node is gone and not back
within ``grace_s`` resumes on a plan for the nodes alive (the global batch kept), not counted as a failure, as
is a rank's process dying in set-up on a node where no rank of the job got through set-up yet; while
an attempt runs, nodes that joined stop it at its next checkpoint and the job resumes on a larger plan; each
resize is a record and a line; too few nodes end the job (``JobFailed``).

Failures reach the user as ``JobFailed``: one sentence naming the rank, its node and the cause (the CLI
exits 1); the rank's traceback is logged.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional, TextIO

import ray

from hybrid.comm import heartbeat
from hybrid.checkpoint import layout
from hybrid.errors import FailureKind, RankFailed, UserError, first_line, reworded
from hybrid.runtime.train import JobSettings
from hybrid.config.units import count
from launch.planning import memory_loop, replan
from launch.ray import cluster as ray_cluster
from launch.job import signals
from launch.job.elastic import Elastic, NotEnoughNodes
from launch.job.display import Progress
from launch.job.log_forwarding import LogActivity
from launch.job import rank_traceback
from launch.job.metrics import (MetricsWriter, link_line, ray_log_dir, summary_lines, time_record,
                                write_time_record)
from launch.planning.model_size import ModelFacts, model_facts
from launch.planning.nvme_space import check_nvme_space
from launch.planning.plan import LaunchPlan, build_plan, format_plan
from launch.ray.node_files import remove_swap_files
from launch.ray.probe import probe_nodes
from launch.ray.runtime_env import client_runtime_env, runtime_env, ship
from launch.spec import LaunchSpec
from launch.ray.workers import PlacementFailed, RankPlacement, SetupFailed, WorkerGroup

log = logging.getLogger(__name__)

POLL_S = 0.5
GRACE_S = 5.0  # after a rank's collective failed, how long to wait for the failure that caused it
LAST_DRAIN_S = 3.0  # on an interrupt, how long to wait for the reports the ranks still buffer


class JobFailed(Exception):
    """The job did not finish; the message is one sentence saying which rank failed and how."""


@dataclass(frozen=True)
class Failure:
    """Why an attempt failed: the rank and node it started on (None when it was no one rank's), and how."""

    rank: Optional[int]
    node: Optional[int]
    cause: str

    def sentence(self) -> str:
        if self.rank is None:
            return self.cause
        return f"rank {self.rank} on node {self.node} failed ({self.cause})"


@dataclass
class AttemptOutcome:
    ok: bool
    results: dict[int, Any] = field(default_factory=dict)  # rank -> what the entrypoint returned
    failure: Optional[Failure] = None  # set when not ok
    retryable: bool = True
    user_error: Optional[UserError] = None
    placement: list[RankPlacement] = field(default_factory=list)
    oom: bool = False  # the blamed rank ran out of memory (torch.OutOfMemoryError, or over its budget)
    died: bool = False  # the blamed rank's process died (its node may be gone: launch.job.elastic)
    placement_failed: bool = False  # Ray could not reserve the nodes (too few left: launch.job.elastic)
    set_up: bool = False  # every rank got through set-up (the entrypoint started on all of them)
    setup_death_nodes: tuple = ()  # a rank's process died before every rank was set up: the Ray nodes it may
    # have been on (its own where known, else all of the attempt's)


@dataclass
class JobResult:
    plan: LaunchPlan
    results: dict[int, Any]
    placement: list[RankPlacement]
    history: list[dict]  # per completed step: launch.job.metrics.step_entry (also in run_dir/metrics.jsonl)
    last_reports: dict[int, dict]  # rank -> its final report
    attempts: int
    wall_s: float
    failures: list[str] = field(default_factory=list)  # one sentence per failed attempt
    resumed_from: Optional[int] = None  # the checkpoint step the final attempt started from
    replans: list[str] = field(default_factory=list)  # the re-plan line of each out-of-memory restart
    resizes: list[dict] = field(default_factory=list)  # launch.job.elastic's record of each resize


def launch(spec: LaunchSpec, stream: Optional[TextIO] = None, measure_links: bool = False) -> JobResult:
    """Run the job of ``spec`` end to end on the cluster it names (printing to ``stream``, default stdout)."""
    stream = stream or sys.stdout  # looked up per call: stdout may have been replaced since import
    facts = model_facts(spec)  # the model config and the model's own hook are checked before Ray starts
    cluster = spec.cluster
    where = (f"starting an embedded Ray cluster: {count(cluster.nodes, 'node')} x {count(cluster.gpus_per_node, 'rank')} on "
             f"{ray_cluster.LOOPBACK}" if cluster.is_local else
             f"connecting to Ray at {cluster.address} (cluster.connect_timeout_s = {cluster.connect_timeout_s:g} s)")
    print(where, file=stream, flush=True)
    with ray_cluster.connect(cluster, keep_logs=kept_logs_dir(spec), client_runtime_env=client_runtime_env(spec)) \
            as connected:
        print(connected.line(), file=stream, flush=True)
        return plan_and_run(spec, stream, facts=facts, measure_links=measure_links)


def kept_logs_dir(spec: LaunchSpec):
    """Where an embedded cluster's session logs are kept after it is torn down (the run directory), or None
    for a cluster that outlives the job (its own session directory keeps them)."""
    from launch.ray.embedded_processes import KEPT_LOGS

    return spec.job.run_dir / KEPT_LOGS if spec.cluster.is_local and spec.job.run_dir is not None else None


def plan_and_run(spec: LaunchSpec, stream: TextIO = sys.stdout, tty: Optional[bool] = None,
                 facts: Optional[ModelFacts] = None, measure_links: bool = False) -> JobResult:
    """Probe the connected Ray cluster, plan, print the plan and run the job (``facts``: the model's, when
    already measured). The time model takes the links and rates ``hybrid probe`` measured: measured now with
    ``measure_links`` (``hybrid launch --probe``), else ``job.run_dir``'s ``probe.json`` when one was made for
    this cluster's shape and device kind."""
    reports = probe_nodes(nvme_path=spec.cluster.nvme_path)
    figures = measured_links(spec, reports, measure_links, stream)
    plan = build_plan(spec, reports, facts, probe=figures)
    if figures is not None and figures.get("quick"):  # an embedded cluster: a few real steps set the time's level
        plan = calibrated_by_trial(plan, reports, facts, figures, stream)
    print(format_plan(plan), file=stream, flush=True)
    check_nvme_space(plan, reports)  # the swap files of NVMe offload fit every machine's disk, before any rank
    return run_job(plan, stream, tty=tty)


def measured_links(spec: LaunchSpec, reports, measure: bool, stream: TextIO) -> Optional[dict]:
    """``probe.json``'s figures for the plan (see ``plan_and_run``), or None."""
    from launch.planning.plan import _memory_from_probes
    from launch.planning.probe_figures import read_probe, write_probe
    from launch.ray.rank_probe import run_probe

    if spec.job.run_dir is None:
        return None
    use_gpus = _memory_from_probes(spec, reports)[0]
    if measure:
        print("probing the links and compute rates on the rank actors (hybrid probe)", file=stream, flush=True)
        figures = run_probe(spec, use_gpus)
        write_probe(spec.job.run_dir, figures)
        return figures
    figures = read_probe(spec.job.run_dir, spec)
    if figures is not None and (figures.get("device") == "cpu") == bool(use_gpus):
        return None  # made on other devices (CPU ranks then, GPUs now, or the other way)
    from launch.planning.probe_local import calibrate_local, calibration_line, wanted

    if figures is None and wanted(spec, use_gpus):  # an embedded cluster: this machine's figures, not the tables'
        figures = calibrate_local(spec)
        print(calibration_line(figures), file=stream, flush=True)
    return figures


def calibrated_by_trial(plan: LaunchPlan, reports, facts, figures: dict, stream: TextIO) -> LaunchPlan:
    """``plan`` again with every predicted step scaled by a trial of its layout (``launch.planning.trial_local``),
    or ``plan`` itself where there is no time model or the trial gave no figure."""
    from launch.planning.trial_local import run_trial, step_factor, trial_line

    choice = replan.initial_choice(plan)
    predicted = replan.predicted_cost(plan, choice)
    if predicted is None:
        return plan
    trial = run_trial(plan.spec, settings_for(plan, choice), plan.layout.tp)
    print(trial_line(trial, predicted.step_s, predicted.layout.label), file=stream, flush=True)
    if trial is None:
        return plan
    figures = dict(figures, step_factor=step_factor(trial, predicted.step_s),
                   trial=f"{trial['steps']} steps of {predicted.layout.label} timed here")
    return build_plan(plan.spec, reports, facts, probe=figures)


def settings_for(plan: LaunchPlan, choice: Optional[replan.Choice] = None) -> JobSettings:
    """The ranks' settings for ``plan`` run as ``choice`` (a re-plan's; default the plan's own). On CPU the
    ranks' memory budget is the declared ``cluster.gpu_memory_gb`` when ``cluster.enforce_memory_budget`` is
    set (else none: there the declared figure only plans); on GPUs each rank reads its GPU's."""
    job = plan.spec.job
    enforce = plan.spec.cluster.enforce_memory_budget
    budget = None if plan.use_gpus or not enforce else replan.budget_bytes(plan)
    settings = JobSettings(steps=job.steps, micro_batch=job.micro_batch, stage=plan.stage,
                           precision=plan.spec.parallel.precision, seed=job.seed,
                           checkpoint_dir=str(job.checkpoint.dir) if job.checkpoint.dir else None,
                           checkpoint_every=job.checkpoint.every, checkpoint_keep_last=job.checkpoint.keep_last,
                           checkpoint_every_seconds=job.checkpoint.every_seconds,
                           checkpoint_async=job.checkpoint.async_,
                           offload=plan.plan.offload, activation_checkpointing=plan.plan.activation_checkpointing,
                           memory_budget_bytes=budget, tp_plan=plan.spec.parallel.tp_plan,
                           nvme_path=str(plan.spec.cluster.nvme_path) if plan.spec.cluster.nvme_path else None)
    settings = (choice or replan.initial_choice(plan)).settings(settings)
    return dataclasses.replace(settings, zero_links=replan.plan_links(plan, settings.stage))


def run_job(plan: LaunchPlan, stream: TextIO = sys.stdout, tty: Optional[bool] = None) -> JobResult:
    """Attempts until one succeeds; at most ``1 + job.max_failures`` failed ones, each resuming every rank
    from the latest checkpoint, plus at most ``job.max_replans`` out-of-memory restarts with a new plan
    (``launch.planning.replan``), which do not count as failures."""
    spec = plan.spec
    attempts = 1 + spec.job.max_failures
    started = time.perf_counter()
    metrics = MetricsWriter(spec.job.run_dir)
    progress = Progress(spec.job.steps, spec.cluster.world_size, stream, tty=tty, on_step=metrics.write)
    progress.begin_at(latest_checkpoint_step(spec.job.checkpoint.dir, None) or 0)
    failures: list[str] = []
    loop = memory_loop.MemoryLoop(plan, progress)
    predict_time(plan, loop.choice, progress)
    start = replan.start_note(plan)
    if start is not None:
        progress.note(start)
    elastic = Elastic(spec, progress, metrics)
    attempt = 0
    try:
        while True:
            attempt += 1
            outcome = run_attempt(plan, progress, loop.choice, watch=elastic.watch(plan))
            if outcome.set_up:
                elastic.set_up_on([p.node_id for p in outcome.placement])
            loop.record_attempt(outcome.ok)
            if not outcome.ok and outcome.oom:
                failures.append(outcome.failure.sentence())
                try:
                    line = loop.replan(outcome.failure.rank, latest_checkpoint_step(spec.job.checkpoint.dir,
                                                                                    progress.checkpoint_step))
                except replan.NothingFits as err:
                    raise JobFailed(str(err)) from None
                progress.restart(loop.resume_step or 0)
                progress.note(line)
                predict_time(plan, loop.choice, progress)
                attempt -= 1  # a re-plan is not a failed attempt
                continue
            if outcome.ok and elastic.fired and reached_step(progress) < spec.job.steps:  # stopped to grow
                step = latest_checkpoint_step(spec.job.checkpoint.dir, progress.checkpoint_step) or 0
                reached = reached_step(progress)
                progress.restart(step)
                bigger = elastic.grown(plan, step, reached)
                if bigger is not None:
                    plan, loop = switch_plan(bigger, progress)
                    attempt -= 1  # a resize is not a failed attempt
                    continue
            if outcome.ok:
                progress.close()
                wall = time.perf_counter() - started
                print(progress.summary(outcome.placement, wall), file=stream, flush=True)
                logs = kept_logs_dir(spec) or ray_log_dir()
                for line in summary_lines(outcome.results, progress.history, metrics, str(logs), progress.saves):
                    print(line, file=stream, flush=True)
                if any("dp_inter_bytes" in e for e in progress.history):  # run_steps' reports carry them
                    traffic = link_line(progress.history, *replan.link_theory(plan, loop.choice))
                    if traffic is not None:
                        print(traffic, file=stream, flush=True)
                return JobResult(plan, outcome.results, outcome.placement, progress.history, progress.last,
                                 attempt, wall, failures, progress.resumed_from, loop.lines, elastic.records)
            if outcome.user_error is not None:
                raise outcome.user_error
            failure = outcome.failure.sentence()
            failures.append(failure)
            if elastic.enabled and (outcome.retryable or outcome.placement_failed):
                step = latest_checkpoint_step(spec.job.checkpoint.dir, progress.checkpoint_step)
                reached = reached_step(progress)
                progress.restart(step or 0)
                try:
                    placed = [p.node_id for p in outcome.placement] or list(outcome.setup_death_nodes)
                    smaller = elastic.after_failure(plan, failure, outcome.died or outcome.placement_failed,
                                                    placed, step or 0, reached,
                                                    checkpoint_name(spec.job.checkpoint.dir, step),
                                                    setup_death_nodes=outcome.setup_death_nodes)
                except NotEnoughNodes as err:
                    raise JobFailed(f"{failure}; {err}") from None
                if smaller is not None:
                    if smaller is not plan:
                        plan, loop = switch_plan(smaller, progress)
                    attempt -= 1  # a resize, or a node not ready yet, is not a failed attempt
                    continue
            if not outcome.retryable:
                raise JobFailed(failure)
            if attempt == attempts:
                raise JobFailed(out_of_restarts(failure, attempt, spec.job.max_failures))
            step = latest_checkpoint_step(spec.job.checkpoint.dir, progress.checkpoint_step)
            progress.restart(step or 0)
            progress.note(restart_line(failure, step, spec.job.checkpoint.dir is not None, attempt + 1, attempts))
    finally:
        progress.close()
        metrics.close()
        loop.save()
        save_time(plan, loop.choice, progress)


def reached_step(progress: Progress) -> int:
    """The furthest step any rank reported in the running attempt (complete or not)."""
    return max([e["step"] for e in progress.history] + list(progress.pending) + [0])


def checkpoint_name(run_dir, step: Optional[int]) -> Optional[str]:
    """How a sentence names the checkpoint of ``step`` (None without one)."""
    if step is None:
        return None
    return f"step {step} in {run_dir}"


def switch_plan(plan: LaunchPlan, progress: Progress) -> tuple[LaunchPlan, memory_loop.MemoryLoop]:
    """Run ``plan`` from the next attempt on (a resize): the display counts its ranks, the memory loop and the
    time prediction start afresh on it."""
    progress.world_size = plan.spec.cluster.world_size
    loop = memory_loop.MemoryLoop(plan, progress)
    predict_time(plan, loop.choice, progress)
    return plan, loop


def predict_time(plan: LaunchPlan, choice: replan.Choice, progress: Progress) -> None:
    """Give the display the time model's step time of ``plan`` run as ``choice`` (none without a model)."""
    cost = replan.predicted_cost(plan, choice)
    progress.predicted_step_s = cost.step_s if cost is not None else None
    progress.predicted_layout = cost.layout.label if cost is not None else ""


def save_time(plan: LaunchPlan, choice: replan.Choice, progress: Progress) -> None:
    """``run_dir/time.json`` (``launch.job.metrics.time_record``) when the run was predicted and measured."""
    from launch.planning.time_plan import time_dict

    cost = replan.predicted_cost(plan, choice)
    if cost is None or plan.spec.job.run_dir is None or not progress.history:
        return
    lay = cost.layout
    layout = {"nodes": lay.nodes, "gpus_per_node": lay.gpus_per_node, "tp": lay.tp, "stage": lay.stage,
              "micro_batch": lay.micro_batch, "accumulation": lay.accumulation,
              "activation_checkpointing": lay.activation_checkpointing, "offload": lay.offload,
              "precision": lay.precision}
    history = [e for e in progress.history if e.get("predicted_step_s") == cost.step_s]
    record = time_record(layout, cost.as_dict(), history, time_dict(plan.time).get("hardware", {}))
    if record["measured_step_s"] is not None:
        write_time_record(plan.spec.job.run_dir, record)


def restart_line(failure: str, step: Optional[int], checkpoints: bool, attempt: int, attempts: int) -> str:
    """What the progress display says when a failed attempt is followed by another."""
    if step is not None:
        origin = f"checkpoint step {step}"
    else:
        origin = "step 0 (no checkpoint yet)" if checkpoints else "step 0 (job.checkpoint is not set)"
    return f"{failure}; restarting all ranks from {origin} (attempt {attempt} of {attempts})"


def out_of_restarts(failure: str, attempt: int, max_failures: int) -> str:
    """The one sentence a job ends with when its last allowed attempt failed."""
    if max_failures == 0:
        return f"{failure}; job.max_failures is 0, so the job was not restarted"
    return (f"{failure} on attempt {attempt} of {attempt}, and job.max_failures ({max_failures}) allows no "
            f"more restarts")


def latest_checkpoint_step(run_dir, reported: Optional[int]) -> Optional[int]:
    """The step the next attempt resumes from: the newest complete checkpoint in ``run_dir`` as the driver
    sees it (one machine, or a shared filesystem), or the newest a rank reported, whichever is later."""
    seen = [] if reported is None else [reported]
    if run_dir is not None:
        seen += [entry.step for entry in layout.scan(run_dir) if entry.complete]
    return max(seen) if seen else None


def run_attempt(plan: LaunchPlan, progress: Progress, choice: Optional[replan.Choice] = None,
                watch=None) -> AttemptOutcome:
    """Start every rank, run the entrypoint (as ``choice``: a re-plan's; default the plan's own), poll
    reports until all ranks return or one fails; ``watch()``, polled meanwhile, turning True asks the ranks to
    stop (``launch.job.elastic``: nodes joined, a checkpoint was saved)."""
    spec = plan.spec
    # On the embedded cluster the ranks meet through a file, not a TCPStore: torch's store client connects
    # over a v4-mapped IPv6 socket and then asks the DNS server for the name of ::ffff:127.0.0.1.
    env = runtime_env(spec)
    env["env_vars"]["HYBRID_JOB_ID"] = plan.job_id
    if spec.cluster.address.startswith("ray://"):  # the working dir went with the job at connect time
        env = {"env_vars": env["env_vars"]}
    else:
        env = ship(env)
    shared_dir = tempfile.mkdtemp(prefix="hybrid-rendezvous-") if spec.cluster.is_local else None
    group = WorkerGroup(spec.cluster.nodes, spec.cluster.gpus_per_node, bool(plan.use_gpus),
                        env=env.pop("env_vars"), shared_dir=shared_dir, runtime_env=env,
                        isolate_gpus=spec.job.isolate_gpus)
    graceful = False
    logs = LogActivity()
    try:
        try:
            placement = group.start(spec.job.placement_timeout_s)
            group.setup(plan.layout.tp, spec.job.collective_timeout_s, sample_nvml=bool(plan.use_gpus))
            progress.note(describe_placement(placement))
        except PlacementFailed as err:
            return AttemptOutcome(False, failure=Failure(None, None, str(err)), retryable=False, placement_failed=True)
        except SetupFailed as err:
            return setup_failed(err.error, err.placement, group.placement, attempt_nodes(group))
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as err:
            return setup_failed(err, None, group.placement, attempt_nodes(group))
        refs = group.run(spec.job.entrypoint, str(spec.job.config), settings_for(plan, choice),
                         working_dir=str(spec.job.working_dir) if spec.job.working_dir else None)
        outcome = _collect(group, refs, progress, spec.job.collective_timeout_s, watch, spec.job.run_dir)
        logs.settle()  # the ranks' last lines reach the terminal before the summary and the teardown
        outcome.placement, outcome.set_up = placement, True
        graceful = outcome.ok
        return outcome
    except ConnectionError as err:  # Ray Client: the session to the cluster dropped
        return AttemptOutcome(False, failure=Failure(None, None, f"the connection to the Ray cluster at "
                                                     f"{spec.cluster.address} was lost ({err})"), retryable=False)
    finally:
        logs.close()
        group.shutdown(graceful=graceful)
        remove_swap_files(spec, plan.job_id)  # a rank killed with its swap file open left it behind
        if shared_dir is not None:
            shutil.rmtree(shared_dir, ignore_errors=True)


def setup_failed(err: Exception, where: Optional[RankPlacement], placement: list[RankPlacement],
                 nodes: list[str]) -> AttemptOutcome:
    """The attempt that failed before every rank was set up, blamed on the rank at ``where`` (None: no one
    rank's -- an actor that died starting, before the ranks were placed). A process that died (``DIED``) names
    the nodes it may have been on, ``where``'s or else all the attempt's ``nodes``: ``launch.job.elastic`` may
    take them for nodes not ready to run ranks rather than a failure of the job."""
    if where is not None:
        failure = Failure(where.rank, where.node_index, f"setting up the rank failed: {cause_of(err, where.pid)}")
    else:
        failure = Failure(None, None, f"setting up the ranks failed: {cause_of(err)}")
    died = kind_of(err) is FailureKind.DIED
    suspects = (where.node_id,) if where is not None else tuple(nodes)
    return AttemptOutcome(False, failure=failure, placement=placement, died=died,
                          setup_death_nodes=suspects if died else ())


def attempt_nodes(group: WorkerGroup) -> list[str]:
    """The Ray nodes of an attempt's ranks: where they were placed, else where its placement group reserved
    them (none when it reserved nothing, or the cluster cannot say)."""
    if group.placement:
        return [p.node_id for p in group.placement]
    if group.pg is None:
        return []
    try:
        reserved = ray.util.placement_group_table(group.pg).get("bundles_to_node_id", {})
    except Exception:  # noqa: BLE001 -- only which nodes to suspect: none then
        return []
    return [node for _, node in sorted(reserved.items()) if node]


def describe_placement(placement: list[RankPlacement]) -> str:
    """One line: which ranks landed on which Ray node."""
    nodes: dict[int, list[RankPlacement]] = {}
    for p in placement:
        nodes.setdefault(p.node_index, []).append(p)
    parts = [f"ranks {','.join(str(p.rank) for p in ps)} on Ray node {ps[0].node_id[:8]} ({ps[0].ip})"
             for _, ps in sorted(nodes.items())]
    return "placed  " + "; ".join(parts)


def _collect(group: WorkerGroup, refs: list, progress: Progress, timeout_s: float, watch=None,
             run_dir=None) -> AttemptOutcome:
    """Poll the ranks' results and reports until every rank returned or one failed; once ``watch()`` turns True
    the ranks are asked to stop (each returns before its next step).

    When one fails, the others are asked to stop; failures arriving within ``GRACE_S`` are weighed too,
    because a rank whose process died is often reported after the peers it left stuck in a collective.
    """
    pending = {ref: rank for rank, ref in enumerate(refs)}
    results: dict[int, Any] = {}
    failures: list[tuple[int, Exception]] = []  # (rank, error) in the order they arrived
    beats: dict[int, dict] = {}  # rank -> its last heartbeat (kept for ranks that died since)
    stopping = False
    try:
        while pending and not failures:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=POLL_S)
            _drain(group, progress, beats)
            failures = _take(ready, pending, results)
            if watch is not None and not stopping and watch():
                stopping = True
                group.request_stop()
    except KeyboardInterrupt:  # the steps the ranks reported since the last poll (a checkpoint's) are kept
        _last_drain(group, progress)
        raise
    if not failures:
        _drain(group, progress)
        return AttemptOutcome(True, results=results)
    failed_at = time.time()
    group.request_stop()
    deadline = time.monotonic() + GRACE_S
    while pending and all(kind_of(e) is FailureKind.PEER for _, e in failures) and time.monotonic() < deadline:
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=POLL_S)
        failures += _take(ready, pending, results)
    _drain(group, progress, beats)
    rank, kind, err = attribute(failures, beats, failed_at, timeout_s)
    where = {p.rank: p for p in group.placement}.get(rank)
    node = where.node_index if where else None
    if kind is FailureKind.HUNG:
        cause = hung_cause(rank, failures, beats, failed_at, timeout_s)
        log.error("rank %d %s", rank, cause)
        return AttemptOutcome(False, failure=Failure(rank, node, cause))
    failure = Failure(rank, node, cause_of(err, where.pid if where else None))
    error = rank_error(err)
    if kind is FailureKind.USER_ERROR:  # one sentence is the whole story: no traceback (it stays in the rank's log)
        log.debug("rank %d failed:\n%s", rank, err)
        return AttemptOutcome(False, failure=failure, user_error=reworded(error, f"rank {rank}: {error}"))
    if kind is FailureKind.JOB_ERROR:  # e.g. diverged, disk full: a restart would repeat it; the sentence says all
        log.debug("rank %d failed:\n%s", rank, err)
        cause = rank_traceback.pointing(str(error), rank_traceback.keep(run_dir, rank, err))
        return AttemptOutcome(False, failure=Failure(rank, node, cause), retryable=False)
    log.error("rank %d failed:\n%s", rank, err)
    return AttemptOutcome(False, failure=failure, oom=kind is FailureKind.OUT_OF_MEMORY, died=kind is FailureKind.DIED)


def _take(ready: list, pending: dict, results: dict) -> list[tuple[int, Exception]]:
    """Move the ``ready`` refs out of ``pending``: results into ``results``; returns the failures."""
    failures = []
    for ref in ready:
        rank = pending.pop(ref)
        try:
            results[rank] = ray.get(ref)
        except ray.exceptions.RayError as err:
            failures.append((rank, err))
    return failures


def _last_drain(group: WorkerGroup, progress: Progress) -> None:
    """On an interrupt: what the ranks still buffer (a few seconds at most; anything that fails is lost)."""
    with signals.ignored():  # a second Ctrl-C must not cut this short
        try:
            for drained in group.drain(timeout_s=LAST_DRAIN_S):
                progress.add(drained)
        except Exception:  # a cluster going down: what did not arrive is lost
            pass


def _drain(group: WorkerGroup, progress: Progress, beats: Optional[dict] = None) -> None:
    for drained in group.drain():
        progress.add(drained)
        if beats is not None and drained.get("heartbeat"):
            beats[drained["rank"]] = drained["heartbeat"]


def kind_of(err: Exception) -> FailureKind:
    """The kind of a rank's failure as Ray reported it: ``DIED`` when its process is gone, else the kind the
    rank decided and sent (``hybrid.errors.RankFailed``); ``RAISED`` for an error that came without one."""
    if isinstance(err, ray.exceptions.RayActorError):
        return FailureKind.DIED
    report = getattr(err, "cause", None)
    return report.kind if isinstance(report, RankFailed) else FailureKind.RAISED


def rank_error(err: Exception) -> Optional[BaseException]:
    """The exception a rank's entrypoint raised, as the rank sent it (None for a process that died)."""
    report = getattr(err, "cause", None)
    return report.error if isinstance(report, RankFailed) else None


def blame_order(kind: FailureKind) -> int:
    """How telling a failure of ``kind`` is about the root cause, most first: its process died (0), it raised
    an error of its own, whatever its kind (1), one of its collectives failed because of a peer (2: a dead or
    stuck peer's doing)."""
    return {FailureKind.DIED: 0, FailureKind.PEER: 2}.get(kind, 1)


def own_error(kind: FailureKind) -> bool:
    """Whether a failure of ``kind`` is the rank's own doing (not its death, not a peer's)."""
    return blame_order(kind) == 1


def root_cause(failures: list[tuple[int, Exception]]) -> tuple[int, Exception]:
    """The failure that most likely started it all: a dead process, else a rank's own exception, else the
    first failed collective; ties go to the earliest."""
    return min(failures, key=lambda f: blame_order(kind_of(f[1])))


def attribute(failures: list[tuple[int, Exception]], beats: dict[int, dict], now: float,
              timeout_s: float) -> tuple[int, FailureKind, Optional[Exception]]:
    """The rank to blame, the kind of its failure and its error (None when it is ``HUNG``: it raised nothing).

    A rank's own exception is always the cause. Otherwise (peers' collectives failed, processes died,
    as NCCL's watchdog kills a rank whose collective timed out) the heartbeats may name the rank the
    others were waiting for (``hybrid.comm.heartbeat.hung_rank``); a rank so named that failed itself (its
    process died, say) is blamed with its own failure.
    """
    rank, err = root_cause(failures)
    kind = kind_of(err)
    if own_error(kind):
        return rank, kind, err
    hung = heartbeat.hung_rank(beats, now, timeout_s)
    if hung is None or hung == rank:
        return rank, kind, err
    err = dict(failures).get(hung)
    return hung, FailureKind.HUNG if err is None else kind_of(err), err


def hung_cause(rank: int, failures: list[tuple[int, Exception]], beats: dict[int, dict], now: float,
               timeout_s: float) -> str:
    """Why rank ``rank`` is blamed though it raised nothing: what its heartbeat showed against its peers'."""
    beat = beats[rank]
    victims = ", ".join(str(r) for r in sorted({r for r, _ in failures}))
    ahead = max(b["entered"] for r, b in beats.items() if r != rank)
    return (f"hung: it entered no collective for {now - beat['last']:.1f} s, longer than job.collective_timeout_s "
            f"= {timeout_s:g} s, in step {beat.get('step', 0) + 1} after {beat['entered']} collectives (its peers "
            f"reached {ahead}), while rank(s) {victims} timed out waiting for it")


def cause_of(err: Exception, pid: Optional[int] = None) -> str:
    """A short cause for a Ray error: how the process (``pid``) died, or the original exception and its
    first line."""
    if isinstance(err, ray.exceptions.RayActorError):
        return f"its process{f' (pid {pid})' if pid else ''} died: {_death_detail(str(err))}"
    if isinstance(err, ray.exceptions.GetTimeoutError):
        return "timed out waiting for the ranks; check the Ray logs above"
    cause = rank_error(err) or getattr(err, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {_first_line(cause)}"
    return _first_line(err)


def _first_line(err: Exception) -> str:
    return first_line(err, "no message", 300)


def _death_detail(text: str) -> str:
    match = re.search(r"Worker exit detail: (.*?)(?:\.\s|$)", text, re.S)
    if match:
        return match.group(1).strip().replace("\n", " ")[:200]
    return first_line(text, limit=200)
