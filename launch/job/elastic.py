"""Elastic data parallelism (``failure.elastic``): a lost node shrinks the job, a node that comes back grows it.

The driver (``launch.job.driver.run_job``) hands every failed attempt to ``Elastic.after_failure``. When the
Ray cluster then has fewer usable nodes than the plan (a node that can hold ``cluster.gpus_per_node`` ranks:
``usable_nodes``) and none comes back within ``failure.elastic.grace_s``, the job is re-planned on the nodes
alive (``plan_on``): the spec a user would write for that size (``resized_spec``: ``cluster.nodes`` lowered,
``parallel.tp`` kept, ``job.global_batch`` kept -- so DP is smaller and the rows per DP rank larger, as more
gradient accumulation where ``job.micro_batch`` still divides them, else a micro-batch the plan chooses) goes
through the whole planner again (``launch.planning.plan.build_plan``: the memory and time models choose the
stage, activation checkpointing, offload and micro-batch; the measured-memory loop starts afresh on the new
plan). The largest node count from the nodes alive down to ``min_nodes`` whose plan builds is taken; every
rank resumes from the last complete checkpoint. The data order does not depend on the DP split: a step's
global batch is the same rows in the same order whatever its DP x accumulation split
(``hybrid.data.MarkovTokens.batch`` / ``TokenFile.batch`` slice one global batch per step), and the step
counter and the LR schedule's position come from the checkpoint (the ranks' RNG states only at an unchanged size:
``hybrid.checkpoint.sharded`` seeds each DP rank afresh from ``job.seed`` at another), so every step after a
resize equals a by-hand resume of that checkpoint at the new size with the same global batch.

A rank whose process died before every rank was set up (``setup_death_nodes``: its node, or the attempt's
nodes where Ray did not say which) is a node's failure too: Ray may report that node gone a moment later (then
it is lost, as above); if the nodes stay alive and some of them ran no rank of this job yet (a node that just
joined: its first worker died loading torch in the tests), the job restarts at the same size without counting
the attempt against ``job.max_failures`` -- once per node (``excuses``), so that a node that keeps killing
ranks still uses the restarts up.

While an attempt runs, ``Elastic.watch`` checks every ``GROW_CHECK_S`` whether more usable nodes than the plan
holds (up to ``max_nodes``) are alive and a larger plan builds; once so, the next checkpoint a rank saves
stops the attempt (``request_stop``) and the job resumes from it on the larger plan. The steps the ranks ran
past that checkpoint before the stop reached them are computed twice and recorded.

Each resize is one record (``resize_record``: time, nodes before and after, the plan before and after, why,
the checkpoint resumed and the steps computed twice) in ``run_dir/resizes.jsonl`` and in ``metrics.jsonl``
(``launch.job.metrics.MetricsWriter.event``), and one line in the display (``resize_line``). Fewer usable
nodes than ``min_nodes``, or a model that no longer fits on the nodes left, ends the job
(``NotEnoughNodes``, exit 1): one sentence naming the nodes left, the smallest count that would do and the
checkpoint that stays intact.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from hybrid.config.units import count
from hybrid.errors import ConfigError, JobError, PlanError
from launch.planning import replan
from launch.planning.model_size import ModelFacts, model_facts
from launch.planning.plan import LaunchPlan, build_plan
from launch.spec import LaunchSpec

RESIZES_FILE = "resizes.jsonl"
POLL_S = 0.5
GROW_CHECK_S = 2.0  # how often a running attempt asks Ray whether nodes joined
DEATH_SETTLE_S = 5.0  # after a rank's process died: how long Ray may take to report its node gone
MORE_NODES_SEARCHED = 64  # beyond max_nodes, when looking for the smallest count that would fit


class NotEnoughNodes(JobError):
    """Too few nodes are left for the job (below ``min_nodes``, or the model does not fit on them)."""


# ------------------------------------------------------------------------------------------- pure decisions


def global_batch(plan: LaunchPlan) -> int:
    """The sequences per optimizer step over all DP ranks of ``plan``: what every resize keeps."""
    return plan.rows * plan.layout.dp


def resized_spec(spec: LaunchSpec, nodes: int, tp: int, batch: int) -> LaunchSpec:
    """``spec`` as a user would write it for ``nodes`` nodes: TP degree ``tp`` and the global batch ``batch``
    kept; ``job.micro_batch`` kept where it divides the rows per DP rank (more accumulation), else chosen by the
    plan. The elastic bounds stay those of the original spec."""
    dp = nodes * spec.cluster.gpus_per_node // tp
    job = spec.job
    keep_micro = not job.micro_batch_auto and dp and batch % dp == 0 and (batch // dp) % job.micro_batch == 0
    job = dataclasses.replace(job, global_batch=batch, micro_batch_auto=not keep_micro)
    cluster = dataclasses.replace(spec.cluster, nodes=nodes)
    parallel = dataclasses.replace(spec.parallel, tp=tp)
    failure = spec.failure
    if failure.elastic is not None:
        elastic = failure.elastic
        failure = dataclasses.replace(failure, elastic=dataclasses.replace(
            elastic, min_nodes=min(elastic.min_nodes, nodes), max_nodes=max(spec.max_nodes, nodes)))
    return dataclasses.replace(spec, cluster=cluster, job=job, parallel=parallel, failure=failure)


def plan_on(plan: LaunchPlan, available: int, reports: Optional[Sequence], facts: ModelFacts,
            build: Callable = build_plan) -> tuple[Optional[LaunchPlan], dict]:
    """The plan for the most nodes from ``min(available, max_nodes)`` down to ``min_nodes`` whose plan builds
    (the global batch splits, the model fits), and each refused count's reason; ``(None, reasons)`` when none
    does. ``reports``: the probes of the nodes alive (None: declared facts)."""
    spec, batch = plan.spec, global_batch(plan)
    low = spec.failure.elastic.min_nodes if spec.failure.elastic is not None else spec.cluster.nodes
    refused: dict = {}
    for nodes in range(min(available, spec.max_nodes), low - 1, -1):
        try:
            return build(resized_spec(spec, nodes, plan.layout.tp, batch), _reports_for(reports, nodes), facts), refused
        except (PlanError, ConfigError) as err:
            refused[nodes] = str(err)
    return None, refused


def smallest_that_fits(plan: LaunchPlan, available: int, reports: Optional[Sequence], facts: ModelFacts,
                       build: Callable = build_plan) -> Optional[int]:
    """The fewest nodes above ``available`` on which the job's plan builds (nodes like the ones alive), or None
    when none up to ``max_nodes`` + ``MORE_NODES_SEARCHED`` does."""
    spec, batch = plan.spec, global_batch(plan)
    for nodes in range(max(available + 1, 1), spec.max_nodes + MORE_NODES_SEARCHED + 1):
        try:
            build(resized_spec(spec, nodes, plan.layout.tp, batch), _reports_for(reports, nodes), facts)
            return nodes
        except (PlanError, ConfigError):
            continue
    return None


def _reports_for(reports: Optional[Sequence], nodes: int) -> Optional[list]:
    """``nodes`` probe reports: those given, padded with copies of the first (nodes like the ones alive)."""
    if reports is None or not reports:
        return None
    reports = list(reports)
    return reports + [reports[0]] * max(0, nodes - len(reports))


def choice_of(plan: LaunchPlan) -> dict:
    """What a resize may change, as a record's ``plan``: the layout the ranks run (``replan.initial_choice``: the
    planner's, or the rung above it that the complete memory prediction starts at)."""
    choice = replan.initial_choice(plan)
    return {"nodes": plan.spec.cluster.nodes, "tp": plan.layout.tp, "dp": plan.layout.dp, "stage": choice.stage,
            "micro_batch": choice.micro_batch, "accumulation": choice.accumulation,
            "activation_checkpointing": choice.activation_checkpointing, "offload": choice.offload,
            "global_batch": global_batch(plan)}


def plan_reason(plan: LaunchPlan) -> str:
    """Why ``plan`` runs as it does: the line of a start above the planner's choice, else the planner's reason."""
    if replan.initial_choice(plan) != replan.planned_choice(plan):
        return replan.start_note(plan)
    return plan.plan.reason


def resize_record(before: LaunchPlan, after: LaunchPlan, why: str, resume_step: int, reached_step: int,
                  now: Optional[float] = None) -> dict:
    """One resize: when, the nodes before and after, both plans, why, and the steps computed twice (those after
    the checkpoint resumed, up to the step the ranks had reached). ``step`` is the checkpoint resumed (where the
    record sits among metrics.jsonl's steps)."""
    return {"event": "resize", "time": time.time() if now is None else now, "step": resume_step,
            "nodes_before": before.spec.cluster.nodes, "nodes_after": after.spec.cluster.nodes, "why": why,
            "plan_before": choice_of(before), "plan": choice_of(after), "plan_reason": plan_reason(after),
            "resumed_from": resume_step, "steps_computed_twice": list(range(resume_step + 1, reached_step + 1))}


def resize_line(record: dict) -> str:
    """The display's one line for a resize record."""
    old, new = record["plan_before"], record["plan"]
    changes = [f"dp {old['dp']} -> {new['dp']}"]
    for key, name in (("stage", "stage"), ("micro_batch", "micro-batch"), ("accumulation", "accumulation")):
        if old[key] != new[key]:
            changes.append(f"{name} {old[key]} -> {new[key]}")
    for key, name in (("activation_checkpointing", "activation checkpointing"), ("offload", "offload")):
        if old[key] != new[key]:
            changes.append(f"{name} {'on' if new[key] else 'off'}")
    twice = record["steps_computed_twice"]
    redo = (f"steps {twice[0]}-{twice[-1]} computed twice" if len(twice) > 1 else
            f"step {twice[0]} computed twice" if twice else "no step computed twice")
    return (f"resize {record['nodes_before']} -> {record['nodes_after']} nodes ({record['why']}): resuming from "
            f"checkpoint step {record['resumed_from']} with {', '.join(changes)}, global batch {new['global_batch']} "
            f"kept; {redo}; plan: {record['plan_reason']}")


def too_few_sentence(alive: int, names: list, low: int, smallest: Optional[int], refused: dict,
                     checkpoint: Optional[str]) -> str:
    """The one sentence a job ends with when the nodes left cannot run it."""
    left = f"{count(alive, 'usable node')} left" + (f" ({', '.join(names)})" if names else "")
    if alive < low:
        why = f"below failure.elastic.min_nodes = {low}"
    else:
        refusal = refused[max(refused)].rstrip(".") if refused else None  # the count nearest the nodes left
        why = f"on which the job does not fit ({refusal})" if refusal else "too few for the job"
    need = (f"the smallest count that would run it is {smallest}" if smallest is not None else
            "no node count up to failure.elastic.max_nodes would run it")
    kept = f"; checkpoint {checkpoint} is intact" if checkpoint else ""
    return f"{left}, {why}; {need}{kept}"


# ------------------------------------------------------------------------------------------- Ray side


def usable_nodes(gpus_per_node: int, use_gpus: bool) -> list[dict]:
    """The alive Ray nodes that can hold one node's ranks (``gpus_per_node`` CPUs, and GPUs with ``use_gpus``)."""
    from launch.ray.probe import live_nodes

    need = {"CPU": gpus_per_node, **({"GPU": gpus_per_node} if use_gpus else {})}
    return [n for n in live_nodes() if all(n.get("Resources", {}).get(k, 0) >= x for k, x in need.items())]


def _node_name(node: dict) -> str:
    return f"{node['NodeID'][:8]} at {node.get('NodeManagerAddress', '?')}"


class Elastic:
    """One run's elastic state: the size to keep, the records written, the grow watch of the running attempt."""

    def __init__(self, spec: LaunchSpec, progress, metrics, facts: Optional[ModelFacts] = None):
        self.spec, self.progress, self.metrics = spec, progress, metrics
        self.options = spec.failure.elastic
        self.facts = facts
        self.records: list[dict] = []
        self._grow: Optional[LaunchPlan] = None  # the larger plan a running attempt may stop for
        self._fired = False  # the running attempt's watch asked it to stop for ``_grow``
        self._seen: dict[int, Optional[LaunchPlan]] = {}  # usable node count -> the plan it allows (grow)
        self._set_up_on: set[str] = set()  # Ray nodes where this job's ranks got through set-up
        self._excused: set[str] = set()  # Ray nodes whose set-up death was not counted as a failure

    @property
    def enabled(self) -> bool:
        return self.options is not None

    @property
    def fired(self) -> bool:
        """Whether the running attempt's watch asked its ranks to stop (to grow at its checkpoint)."""
        return self._fired

    def _facts(self) -> ModelFacts:
        if self.facts is None:
            self.facts = model_facts(self.spec)
        return self.facts

    def _probe(self):
        from launch.ray.probe import probe_nodes

        return probe_nodes(nvme_path=self.spec.cluster.nvme_path)

    def _usable(self, plan: LaunchPlan) -> list[dict]:
        return usable_nodes(plan.spec.cluster.gpus_per_node, bool(plan.use_gpus))

    # -- shrinking

    def set_up_on(self, node_ids: Sequence[str]) -> None:
        """Every rank of an attempt got through set-up on ``node_ids``."""
        self._set_up_on.update(node_ids)

    def excuses(self, node_ids: Sequence[str]) -> list[str]:
        """The nodes among ``node_ids`` (alive, where a rank's process died before every rank was set up) that
        make it the nodes' failure, not the job's: those where no rank of this job got through set-up and none
        was excused before (each node is excused once); none: the job's failure."""
        new = [n for n in dict.fromkeys(node_ids) if n not in self._set_up_on and n not in self._excused]
        self._excused.update(new)
        return new

    def after_failure(self, plan: LaunchPlan, failure: str, failure_died: bool, lost_ids: Sequence[str],
                      resume_step: int, reached_step: int, checkpoint: Optional[str],
                      setup_death_nodes: Sequence[str] = ()) -> Optional[LaunchPlan]:
        """After a failed attempt (``failure``: its sentence): the smaller plan to resume on when nodes were lost
        and did not come back within ``grace_s``; ``plan`` itself to restart at the same size without counting
        a failure (a rank's process died before set-up ended on one of ``setup_death_nodes``, alive, and
        ``excuses`` them); None to restart at the same size. Raises ``NotEnoughNodes``."""
        nodes = plan.spec.cluster.nodes
        usable = self._usable(plan)
        if failure_died and len(usable) >= nodes:  # Ray may report the node gone a moment after its ranks
            deadline = time.monotonic() + DEATH_SETTLE_S
            while len(usable) >= nodes and time.monotonic() < deadline and self._placed_alive(usable, lost_ids):
                time.sleep(POLL_S)
                usable = self._usable(plan)
        if len(usable) >= nodes:
            new = self.excuses(setup_death_nodes) if setup_death_nodes else []
            if new:
                origin = f"checkpoint {checkpoint}" if checkpoint else "step 0"
                where = ", ".join(n[:8] for n in new)
                self.progress.note(f"{failure}; Ray {'node' if len(new) == 1 else 'nodes'} {where} alive but new "
                                   f"to the job (no rank of it ran there yet: not ready); restarting all ranks "
                                   f"from {origin} on {count(nodes, 'node')}, not counted against "
                                   "job.max_failures")
                return plan
            return None
        lost = len(usable)
        self.progress.note(f"{failure}; {count(nodes - lost, 'node')} of {nodes} lost; waiting up to "
                           f"failure.elastic.grace_s = {self.options.grace_s:g} s for "
                           f"{'it' if nodes - lost == 1 else 'them'} to come back")
        deadline = time.monotonic() + self.options.grace_s
        while len(usable) < nodes and time.monotonic() < deadline:
            time.sleep(POLL_S)
            usable = self._usable(plan)
        if len(usable) >= nodes:
            self.progress.note(f"{count(nodes - lost, 'node')} came back within failure.elastic.grace_s = "
                               f"{self.options.grace_s:g} s; restarting at {count(nodes, 'node')}")
            return None
        gone = nodes - len(usable)
        why = f"{count(gone, 'node')} lost, not back within failure.elastic.grace_s = {self.options.grace_s:g} s"
        return self._resize(plan, usable, why, resume_step, reached_step, checkpoint)

    @staticmethod
    def _placed_alive(usable: list[dict], placed_ids: Sequence[str]) -> bool:
        """Whether every node the attempt's ranks were placed on is still listed alive."""
        alive = {n["NodeID"] for n in usable}
        return all(i in alive for i in placed_ids)

    def _resize(self, plan: LaunchPlan, usable: list[dict], why: str, resume_step: int, reached_step: int,
                checkpoint: Optional[str]) -> LaunchPlan:
        reports = self._probe()
        new, refused = plan_on(plan, len(usable), reports, self._facts())
        if new is None:
            low = self.options.min_nodes
            smallest = smallest_that_fits(plan, len(usable), reports, self._facts())
            raise NotEnoughNodes(too_few_sentence(len(usable), [_node_name(n) for n in usable], low, smallest,
                                                  refused, checkpoint))
        self.record(resize_record(plan, new, why, resume_step, reached_step))
        return new

    def record(self, record: dict) -> None:
        """Keep ``record``: ``run_dir/resizes.jsonl``, metrics.jsonl and one display line."""
        self.records.append(record)
        run_dir = self.spec.job.run_dir
        if run_dir is not None:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            with open(Path(run_dir) / RESIZES_FILE, "a") as f:
                f.write(json.dumps(record) + "\n")
        self.metrics.event(record)
        self.progress.note(resize_line(record))

    # -- growing

    def watch(self, plan: LaunchPlan) -> Optional[Callable[[], bool]]:
        """For a running attempt of ``plan``: a poll that turns True once more nodes than the plan's are usable, a
        larger plan builds on them, and a checkpoint was saved since they joined (None: the plan is at
        ``max_nodes``, or not elastic)."""
        self._grow, self._fired = None, False
        if not self.enabled or plan.spec.cluster.nodes >= self.spec.max_nodes:
            return None
        state = {"next": 0.0, "since": None}

        def poll() -> bool:
            now = time.monotonic()
            if state["since"] is None and now >= state["next"]:
                state["next"] = now + GROW_CHECK_S
                bigger = self._larger(plan)
                if bigger is not None:
                    self._grow = bigger
                    state["since"] = self.progress.checkpoint_step or 0
            since = state["since"]
            self._fired = since is not None and (self.progress.checkpoint_step or 0) > since
            return self._fired

        return poll

    def _larger(self, plan: LaunchPlan) -> Optional[LaunchPlan]:
        """The plan on more nodes than ``plan``'s, where more are usable now and one builds; else None."""
        usable = len(self._usable(plan))
        if usable <= plan.spec.cluster.nodes:
            return None
        if usable not in self._seen:
            new, _ = plan_on(plan, usable, self._probe(), self._facts())
            self._seen[usable] = new if new is not None and new.spec.cluster.nodes > plan.spec.cluster.nodes else None
        return self._seen[usable]

    def grown(self, plan: LaunchPlan, resume_step: int, reached_step: int) -> Optional[LaunchPlan]:
        """After an attempt the watch stopped: the larger plan (its record kept), or None when it did not stop."""
        bigger, fired, self._grow, self._fired = self._grow, self._fired, None, False
        if bigger is None or not fired:
            return None
        joined = bigger.spec.cluster.nodes - plan.spec.cluster.nodes
        self.record(resize_record(plan, bigger, f"{count(joined, 'node')} joined", resume_step, reached_step))
        return bigger
