"""Elastic data parallelism's pure parts (``launch.job.elastic``, ``failure.elastic`` in ``launch.spec``): the spec
of a resized job, the plan search on the nodes left, the record and its display line, the sentence of a job
with too few nodes, metrics.jsonl's resize line, the data order's independence of the DP split, and a rank's
process that died in set-up taken for its node's failure (once per node that ran no rank of the job)."""

import io

import numpy as np
import pytest
import torch
from ray.exceptions import RayActorError

from hybrid.data import MarkovTokens, TokenFile
from hybrid.data.tokens import TokenFileMeta, metadata_path
from hybrid.errors import ConfigError
from launch.job.display import Progress
from launch.job.driver import setup_failed
from launch.job.elastic import (Elastic, choice_of, global_batch, plan_on, resize_line, resize_record, resized_spec,
                                smallest_that_fits, too_few_sentence)
from launch.job.metrics import MetricsWriter, read_metrics
from launch.planning.model_size import model_facts
from launch.planning.plan import build_plan
from launch.ray.workers import RankPlacement, SetupFailed
from tests.launch.elastic_cases import GLOBAL_BATCH, cpu_reports, job_spec, stage_changing_memory_gb


def test_failure_elastic_is_read_and_checked_against_cluster_nodes():
    spec = job_spec(3, elastic={"min_nodes": 2})
    assert (spec.failure.elastic.min_nodes, spec.max_nodes, spec.failure.elastic.grace_s) == (2, 3, 10.0)
    assert job_spec(3).failure.elastic is None and job_spec(3, elastic={"max_nodes": 5}).max_nodes == 5
    for elastic, sentence in (({"min_nodes": 4}, "failure.elastic.min_nodes is 4, more than cluster.nodes = 3"),
                              ({"max_nodes": 2}, "failure.elastic.max_nodes is 2, fewer than cluster.nodes = 3"),
                              ({"min": 2}, "failure.elastic.min is not a known setting"),
                              ({"grace_s": -1}, "failure.elastic.grace_s must be a number from 0")):
        with pytest.raises(ConfigError, match=sentence.replace(".", r"\.")):
            job_spec(3, elastic=elastic)


def test_a_resized_spec_keeps_tp_and_the_global_batch_and_raises_the_accumulation():
    spec = job_spec(3, elastic={"min_nodes": 1})
    two = resized_spec(spec, 2, 1, GLOBAL_BATCH)
    assert (two.cluster.nodes, two.parallel.tp, two.job.global_batch, two.job.micro_batch_auto) == (2, 1, 12, False)
    assert (two.max_nodes, two.failure.elastic.min_nodes) == (3, 1)
    plan = build_plan(two, cpu_reports(2))
    assert (plan.layout.dp, plan.micro_batch, plan.accumulation) == (2, 2, 3)
    # 10 sequences over 5 DP ranks: 2 rows each, divided by micro-batch 2; over 2 ranks 5 rows: the plan chooses
    assert resized_spec(spec, 5, 1, 10).job.micro_batch_auto is False
    assert resized_spec(spec, 2, 1, 10).job.micro_batch_auto is True


def test_losing_a_node_changes_the_stage_and_the_line_says_why():
    spec = job_spec(3, stage_changing_memory_gb(), elastic={"min_nodes": 2})
    facts = model_facts(spec)
    before = build_plan(spec, cpu_reports(3), facts)
    after, refused = plan_on(before, 2, cpu_reports(2), facts)
    assert refused == {} and after.spec.cluster.nodes == 2
    old, new = choice_of(before), choice_of(after)
    assert old["stage"] == 1 and new["stage"] >= 2 and global_batch(after) == global_batch(before) == GLOBAL_BATCH
    assert new["micro_batch"] * new["accumulation"] == GLOBAL_BATCH // 2
    record = resize_record(before, after, "1 node lost", 6, 8, now=0.0)
    assert record["steps_computed_twice"] == [7, 8] and record["resumed_from"] == 6
    line = resize_line(record)
    assert line.startswith(f"resize 3 -> 2 nodes (1 node lost): resuming from checkpoint step 6 with dp 3 -> 2, "
                           f"stage 1 -> {new['stage']}")
    assert "global batch 12 kept; steps 7-8 computed twice; plan: " in line
    assert "stage 1 needs" in record["plan_reason"] and record["plan_reason"] in line  # the memory model says why


def test_no_plan_below_min_nodes_and_the_smallest_count_that_fits():
    spec = job_spec(3, elastic={"min_nodes": 3})
    facts = model_facts(spec)
    plan = build_plan(spec, cpu_reports(3), facts)
    assert plan_on(plan, 2, cpu_reports(2), facts) == (None, {})
    assert smallest_that_fits(plan, 2, cpu_reports(2), facts) == 3
    sentence = too_few_sentence(2, ["abc at 127.0.0.1", "def at 127.0.0.1"], 3, 3, {}, "step 6 in /runs/x")
    assert sentence == ("2 usable nodes left (abc at 127.0.0.1, def at 127.0.0.1), below failure.elastic.min_nodes = "
                        "3; the smallest count that would run it is 3; checkpoint step 6 in /runs/x is intact")
    # a global batch that does not split over the nodes left: the next count down that takes it
    odd = job_spec(3, elastic={"min_nodes": 1}, global_batch=9, micro_batch=1)
    odd_plan = build_plan(odd, cpu_reports(3), facts)
    smaller, refused = plan_on(odd_plan, 2, cpu_reports(2), facts)
    assert smaller.spec.cluster.nodes == 1 and list(refused) == [2] and "job.global_batch is 9" in refused[2]


def test_a_resize_line_in_metrics_jsonl_sits_after_the_checkpoint_and_the_next_steps_follow(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    for step in range(1, 6):
        writer.write({"step": step, "loss": float(step)})
    writer.event({"event": "resize", "step": 3, "nodes_before": 3, "nodes_after": 2})
    for step in (4, 5):
        writer.write({"step": step, "loss": step + 0.5})
    entries = read_metrics(tmp_path / "metrics.jsonl")
    assert [(e["step"], e.get("event"), e.get("loss")) for e in entries] == [
        (1, None, 1.0), (2, None, 2.0), (3, None, 3.0), (3, "resize", None), (4, None, 4.5), (5, None, 5.5)]


@pytest.mark.parametrize("dp, rows", [(1, 12), (2, 6), (3, 4), (4, 3), (6, 2)])
def test_a_steps_rows_are_the_same_sequences_in_the_same_order_whatever_the_dp_split(tmp_path, dp, rows):
    """The global batch of a step, read rank by rank (and each rank's micro-batches in order), is one sequence
    of rows whatever the DP x rows split: the Markov chain's and a token file's."""
    markov = MarkovTokens(64, 8, seed=3)
    path = tmp_path / "tokens.bin"
    tokens = (np.arange(4000) % 50).astype(np.uint16)
    tokens.tofile(path)
    metadata_path(path).write_text(TokenFileMeta("uint16", 50, len(tokens)).to_json())
    for stream in (markov, TokenFile(path, seq_len=8, seed=3)):
        for step in (0, 5):
            whole = torch.cat(stream.batch(step, GLOBAL_BATCH, 0, 1), dim=1)
            split = torch.cat([torch.cat(stream.batch(step, rows, r, dp), dim=1) for r in range(dp)])
            assert torch.equal(split, whole)


def test_a_model_that_fits_on_no_count_left_names_the_refusal_and_the_smallest_count_that_fits():
    spec = job_spec(3, 0.0014, elastic={"min_nodes": 1})  # ZeRO-3 with checkpointing fits 3 nodes, not 2 or 1
    facts = model_facts(spec)
    plan = build_plan(spec, cpu_reports(3), facts)
    assert plan.stage == 3
    smaller, refused = plan_on(plan, 2, cpu_reports(2), facts)
    assert smaller is None and sorted(refused) == [1, 2]
    smallest = smallest_that_fits(plan, 2, cpu_reports(2), facts)
    sentence = too_few_sentence(2, ["abc at 127.0.0.1"], 1, smallest, refused, "step 3 in /runs/x")
    assert sentence.startswith("2 usable nodes left (abc at 127.0.0.1), on which the job does not fit (134,912 "
                               "parameters do not fit on 2 GPUs")
    assert sentence.endswith("; the smallest count that would run it is 3; checkpoint step 3 in /runs/x is intact")
    assert ".;" not in sentence and ".)" not in sentence


def test_a_rank_process_that_died_in_set_up_names_its_nodes_and_nodes_new_to_the_job_are_excused_once(tmp_path):
    """The flake of the real-Ray test: a rank's process died before the ranks were set up, on a node that had
    just joined the cluster (its first worker failed to load torch). The driver's outcome names the nodes it may
    have been on (its own where the rank is known, else all of the attempt's); an error a rank raised names
    none. The job does not count it against job.max_failures where a node among them ran no rank of the job
    yet, once per node."""
    placement = [RankPlacement(rank=r, node_id=f"node{r}", ip="127.0.0.1", node_index=r, pid=100 + r)
                 for r in range(3)]
    nodes = [p.node_id for p in placement]
    died = setup_failed(RayActorError(), placement[2], placement, nodes)
    assert (died.ok, died.died, died.setup_death_nodes, died.set_up, died.retryable) == (False, True, ("node2",),
                                                                                         False, True)
    assert died.failure.sentence().startswith("rank 2 on node 2 failed (setting up the rank failed: its process "
                                              "(pid 102) died")
    starting = setup_failed(RayActorError(), None, [], nodes)  # an actor died before the ranks were placed
    assert (starting.died, starting.setup_death_nodes) == (True, ("node0", "node1", "node2"))
    assert starting.failure.sentence().startswith("setting up the ranks failed: its process died")
    raised = setup_failed(TimeoutError("rendezvous timed out"), placement[1], placement, nodes)
    assert (raised.died, raised.setup_death_nodes) == (False, ())

    spec = job_spec(3, elastic={"min_nodes": 2})
    elastic = Elastic(spec, Progress(10, 3, io.StringIO(), tty=False), MetricsWriter(tmp_path, tensorboard=False))
    elastic.set_up_on(["node0", "node1"])
    assert elastic.excuses(["node1"]) == []  # ranks of the job ran there: its death is the job's failure
    assert elastic.excuses(["node0", "node1", "node2"]) == ["node2"]  # new to the job: not ready yet
    assert elastic.excuses(["node2"]) == [] and elastic.excuses(nodes) == []  # once: restarts get used up
