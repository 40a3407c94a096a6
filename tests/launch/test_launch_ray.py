"""The launcher on a real embedded Ray cluster (2 nodes × 2 ranks, loopback only; the package's, conftest.py).

Checks rank placement against what the ranks themselves see (their Ray node, their real process groups
and those groups' collective timeout), training at the stage the planner picks from a small declared GPU
memory (3), and that no socket of the driver or any Ray process reaches a non-loopback address. Fault
tolerance, on a token file: a worker process SIGKILLed mid-run (after its first checkpoint) is restarted
with every other rank from the latest checkpoint, and the job ends with weights bit-identical to an
uninterrupted run's (at the default stage, 1), the display shows every step exactly once, in order, each
checkpoint line right after its step, and metrics.jsonl holds every step once; a rank that keeps failing
uses up max_failures and ends as one sentence naming rank, node and cause; a rank that never joins a
collective (or sleeps past the collective timeout) becomes a timeout error naming that rank, not a hang and
not one of its victims. Every rank gets torchrun's variables, and the mesh's node index and local rank are
the real placement, for tp = 1 and tp = 2.
"""
import io
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import ray
import torch

from hybrid import checkpoint
from hybrid.data.prepare import prepare
from hybrid.plan.memory import GB
from hybrid.plan.planner import choose_stage
from launch.ray import cluster as ray_cluster
from launch.job import signals
from launch.job.driver import JobFailed, plan_and_run
from launch.job.metrics import METRICS_FILE
from launch.planning.plan import build_plan
from launch.spec import parse_spec
from tests.launch.conftest import HANGUP_IGNORED_AT_START
from tests.launch.netcheck import LoopbackAudit, NetWatch, descendants, is_loopback, peers, socket_inodes

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NODES, RANKS_PER_NODE = 2, 2


# tp 2 unless a test asks for auto: these tests count the collectives of TP 2 x DP 2 (tp auto weighs 1 and 2 by
# time, test_ranks_sit_on_nodes_by_tp_group_... runs it)
def make_spec(entrypoint="hybrid.models.gpt:train", steps=30, gpu_memory_gb=80.0, stage="auto", tp=2,
              ranks_per_node=RANKS_PER_NODE, **job):
    return parse_spec({
        "cluster": {"address": "local", "nodes": NODES, "gpus_per_node": ranks_per_node,
                    "gpu_memory_gb": gpu_memory_gb},
        "job": {"entrypoint": entrypoint, "config": "configs/gpt-tiny.yaml", "steps": steps, "micro_batch": 8,
                "collective_timeout_s": 60, **job},
        "parallel": {"tp": tp, "zero_stage": stage, "precision": "fp32"},
    }, base_dir=ROOT)


# The embedded cluster every in-process launch test of this package shares: tests/launch/conftest.py.


def assert_loopback_only(watch, audit):
    watch.sample()
    assert watch.samples > 1 and watch.connected_seen > 0, "the watcher saw no connection at all"
    assert not watch.violations, f"non-loopback peers: {watch.violations} from {watch.culprits}"
    assert not audit.violations, f"driver connected to {audit.violations}"


def test_the_network_watchers_can_see_a_non_loopback_peer():
    audit = LoopbackAudit.install()
    watch = NetWatch(os.getpid())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        audit.active = True
        s.connect(("192.0.2.1", 9))  # UDP connect: sets the peer, sends nothing
        audit.active = False
        watch.sample()
    assert ("udp", "192.0.2.1") in watch.violations
    assert ("192.0.2.1", 9) in audit.violations
    audit.violations.clear()
    assert is_loopback("127.0.0.1") and is_loopback("::1") and not is_loopback("10.0.0.1")


def test_address_auto_of_another_process_would_never_find_this_embedded_cluster(cluster):
    address = ray._private.worker.global_worker.node.gcs_address
    assert ray_cluster.is_embedded(address)  # its processes carry our marks
    elsewhere = {k: v for k, v in os.environ.items() if k != "RAY_TMPDIR"}  # another process's environment
    assert ray_cluster.recorded_address(elsewhere) != address  # it never recorded itself where `auto` looks
    assert os.environ["RAY_TMPDIR"].split(os.sep)[-1].startswith(ray_cluster.EMBEDDED_PREFIX)


# Stage 3 from a declared budget; the default choice (stage 1 at 80 GB) trains in the kill test's reference
# run and in tests/launch/test_launch_cli.py.
def test_while_the_embedded_cluster_runs_a_hangup_is_the_launchers_interrupt_as_ctrl_c_is(cluster):
    """Ray's node starts and ``ray.init`` install signal handlers of their own; the launcher takes SIGINT,
    SIGTERM and SIGHUP back (``launch.job.signals``), so a closed terminal stops the job as Ctrl-C does
    (test_group_signal.py's INT case: exit 130, everything torn down)."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    assert handlers[signal.SIGINT] is handlers[signal.SIGTERM] is signals._raise_interrupt, handlers
    # under nohup (SIGHUP ignored before anything started) the hangup stays ignored, as nohup asks
    hup = signal.SIG_IGN if HANGUP_IGNORED_AT_START else signals._raise_interrupt
    assert handlers[signal.SIGHUP] is hup, handlers


@pytest.mark.parametrize("gpu_memory_gb, expected_stage", [(0.0025, 3)])
def test_auto_stage_follows_the_planner_and_training_converges_with_ranks_placed_by_tp_group(
        cluster, gpu_memory_gb, expected_stage):
    """The training job is also the tp = auto case of placement (``_assert_placed_by_tp_group``): the ranks
    that trained report, after their last step, where they ran. One job for both: each starts every rank."""
    spec = make_spec(entrypoint="tests.launch.entrypoints:train_then_where", steps=30, gpu_memory_gb=gpu_memory_gb,
                     tp="auto")
    offline = build_plan(spec)  # what the planner predicts from the declared facts
    memory_only = offline.memory_plan  # the guide's choice at the default TP degree and micro-batch
    predicted = choose_stage(offline.params, 2, 2, gpu_memory_gb * GB, precision="fp32",
                             activation_bytes=memory_only.activation_bytes,
                             checkpointed_activation_bytes=memory_only.checkpointed_activation_bytes).stage
    assert predicted == memory_only.stage == expected_stage
    out = io.StringIO()
    result = plan_and_run(spec, out, tty=False)  # the fastest layout that fits, which the run's plan says
    stage = offline.stage
    assert result.plan.stage == stage and result.plan.memory_source == "declared"
    assert (result.plan.layout.tp, result.plan.micro_batch) == (offline.layout.tp, offline.micro_batch)
    assert "no GPUs in the Ray cluster" in out.getvalue() and f"ZeRO-{stage}" in out.getvalue()
    assert all(r["train"]["stage"] == stage for r in result.results.values())
    losses = [h["loss"] for h in result.history]
    assert len(losses) == 30 and losses[-1] < losses[0] - 1.5, losses
    tp = result.plan.layout.tp  # auto: the fastest of 1 and 2 for the GPT's TP layers
    _assert_placed_by_tp_group(result, [result.results[r]["where"] for r in range(4)], tp)
    last = result.last_reports
    if tp == 2:  # the TP ranks of a group see the same data, so report the same loss
        assert last[0]["loss"] == pytest.approx(last[1]["loss"]) and last[2]["loss"] == pytest.approx(last[3]["loss"])
    # every step's ZeRO bytes per link (hybrid.runtime.link_metrics), and the summary beside the theory; at
    # tp 1 or 2 every DP group spans both nodes
    assert all(h["dp_inter_bytes"] > 0 and h["dp_intra_bytes"] >= 0 for h in result.history)
    assert "ZeRO traffic per GPU and step (median of 27 steps): across nodes " in out.getvalue()
    assert_loopback_only(*cluster)


def test_failures_beyond_max_failures_end_in_one_sentence_naming_rank_node_and_cause_and_a_sys_exit_its_code(
        cluster, tmp_path):
    """Attempt 1: rank 1 raises, and the job restarts (job.max_failures = 1); attempt 2: rank 1 calls
    sys.exit(3), which Ray alone would report as 'Worker exits unexpectedly' (and KeyboardInterrupt as a
    cancelled task), and the job ends naming the code. One job for both: each attempt starts every rank, one
    per node (what fails and restarts is a rank among others; the hang cases below keep four)."""
    out = io.StringIO()
    with pytest.raises(JobFailed) as info:
        plan_and_run(make_spec(entrypoint="tests.launch.entrypoints:fail_then_exit_on_rank_1", max_failures=1,
                               tp=1, ranks_per_node=1, env={"FAILED_ONCE": str(tmp_path / "failed-once")}),
                     out, tty=False)
    raised = "rank 1 on node 1 failed (RuntimeError: rank one is broken on purpose)"
    assert f"{raised}; restarting all ranks from step 0 (job.checkpoint is not set) (attempt 2 of 2)" in out.getvalue()
    exited = "rank 1 on node 1 failed (RuntimeError: the entrypoint called sys.exit(3))"
    assert str(info.value) == f"{exited} on attempt 2 of 2, and job.max_failures (1) allows no more restarts"
    # actors and the placement group are released (asynchronously, so allow Ray a moment)
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU") != NODES * RANKS_PER_NODE and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == NODES * RANKS_PER_NODE
    assert_loopback_only(*cluster)


def test_nodes_held_by_another_job_fail_after_the_placement_timeout_in_one_sentence(cluster):
    from ray.util.placement_group import placement_group, remove_placement_group

    held = placement_group([{"CPU": RANKS_PER_NODE}], name="another-job")  # one node's CPUs, taken
    ray.get(held.ready(), timeout=30)
    try:
        started = time.monotonic()
        with pytest.raises(JobFailed) as info:
            plan_and_run(make_spec(steps=1, placement_timeout_s=1), io.StringIO(), tty=False)
        assert time.monotonic() - started < 60  # not the 120 s default
        message = str(info.value)
        assert "\n" not in message and re.match(
            rf"the Ray cluster could not reserve {NODES} separate nodes with \{{'CPU': {RANKS_PER_NODE}\}} each "
            r"within 1 s \(1 of the \d live nodes have that free now, 2 have it at all\).*job\.placement_timeout_s",
            message), message
    finally:
        remove_placement_group(held)
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU") != NODES * RANKS_PER_NODE and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == NODES * RANKS_PER_NODE


def test_a_rank_that_never_joins_a_collective_is_a_timeout_not_a_hang(cluster):
    started = time.monotonic()
    with pytest.raises(JobFailed) as info:
        plan_and_run(make_spec(entrypoint="tests.launch.entrypoints:hang_on_rank_1", collective_timeout_s=2),
                     io.StringIO(), tty=False)
    assert time.monotonic() - started < 60  # not torch's default timeout of 30 minutes
    message = str(info.value)
    # the hung rank is named, not one of the ranks whose collectives timed out waiting for it
    assert re.fullmatch(r"rank 1 on node 0 failed \(hung: it entered no collective for [0-9.]+ s, longer than "
                        r"job.collective_timeout_s = 2 s, in step 1 after 0 collectives \(its peers reached 2\), "
                        r"while rank\(s\) 0, 2, 3 timed out waiting for it\); "
                        r"job.max_failures is 0, so the job was not restarted", message), message


@pytest.mark.parametrize("entrypoint", ["sleep_past_timeout_on_rank_1", "sleep_past_timeout_on_rank_1_shm"])
def test_a_peer_sleeping_past_the_collective_timeout_is_named_as_the_cause(cluster, entrypoint):
    started = time.monotonic()
    with pytest.raises(JobFailed) as info:
        plan_and_run(make_spec(entrypoint=f"tests.launch.entrypoints:{entrypoint}",
                               collective_timeout_s=2), io.StringIO(), tty=False)
    assert time.monotonic() - started < 60  # well before the sleeper (SLEEP_S = 120 s) would wake up
    message = str(info.value)
    assert "\n" not in message
    assert re.fullmatch(r"rank 1 on node 0 failed \(hung: it entered no collective for [0-9.]+ s, longer than "
                        r"job.collective_timeout_s = 2 s, in step 3 after 4 collectives \(its peers reached 6\), "
                        r"while rank\(s\) 0, 2, 3 timed out waiting for it\); "
                        r"job.max_failures is 0, so the job was not restarted", message), message


def test_ranks_sit_on_nodes_by_tp_group_with_torchruns_environment_and_the_mesh_knows_it(cluster):
    """tp = 1; tp = auto (2: gpus_per_node, for the GPT's TP layers) is the auto-stage training job's."""
    result = plan_and_run(make_spec(entrypoint="tests.launch.entrypoints:where", steps=1, tp=1),
                          io.StringIO(), tty=False)
    _assert_placed_by_tp_group(result, [result.results[r] for r in range(4)], 1)
    assert_loopback_only(*cluster)


def _assert_placed_by_tp_group(result, out: list[dict], degree: int) -> None:
    """``out``: each rank's ``tests.launch.entrypoints.placement``, in rank order, for a job at TP ``degree``."""
    nodes = list(dict.fromkeys(o["node_id"] for o in out))  # Ray nodes in rank order
    assert len(nodes) == NODES
    assert [p.node_id for p in result.placement] == [o["node_id"] for o in out]
    master_port = out[0]["env"]["MASTER_PORT"]
    assert master_port.isdigit()
    for r, o in enumerate(out):
        assert o["rank"] == r and o["sum"] == 4.0 and o["device"] == "cpu"  # all-reduce over DP, TP: every rank
        node = nodes.index(o["node_id"])  # where the rank really runs ...
        local = [q["rank"] for q in out if q["node_id"] == o["node_id"]].index(r)
        assert (node, local) == (r // 2, r % 2)
        assert o["env"] == {"RANK": str(r), "WORLD_SIZE": "4", "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": "2",
                            "NODE_RANK": str(node), "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": "2",
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master_port}, r
        assert (o["node_index"], o["local_rank"], o["tp"]) == (node, local, degree), r  # ... is what the mesh says
        # TP groups: consecutive ranks inside one node; DP groups: every degree-th rank
        assert o["tp_group"] == list(range(r - r % degree, r - r % degree + degree))
        assert o["dp_group"] == list(range(r % degree, 4, degree))
        assert {out[m]["node_id"] for m in o["tp_group"]} == {o["node_id"]}, "a TP group straddles nodes"
        # job.collective_timeout_s reaches the default group and the mesh's dp and tp groups alike
        assert o["timeouts_s"] == [60.0, 60.0, 60.0]


def _kill_after_first_checkpoint(run_dir: Path, rank: int, done: threading.Event, killed: dict) -> None:
    """Wait for the first complete checkpoint of ``run_dir``, then SIGKILL ``rank``'s worker process."""
    while not done.is_set():
        if checkpoint.latest(run_dir) is not None:
            pid = int((run_dir / "pids" / f"rank{rank}").read_text())
            killed.update(pid=pid, after=checkpoint.latest(run_dir).name, at=time.monotonic())
            os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.02)


def _token_file_config(tmp_path: Path) -> Path:
    """gpt-tiny reading a token file prepared from two of this repository's files."""
    prepare([ROOT / "README.md", ROOT / "hybrid" / "runtime" / "train.py"], tmp_path / "data" / "corpus.bin")
    path = tmp_path / "model.yaml"
    path.write_text((ROOT / "configs" / "gpt-tiny.yaml").read_text() + "data: data/corpus.bin\n")
    return path


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]


@pytest.mark.extended  # make test-all's (CI time): see the README
def test_a_killed_worker_restarts_all_ranks_from_the_checkpoint_and_ends_bit_identical(cluster, tmp_path):
    """On a token file: a worker SIGKILLed after the first checkpoint is restarted with every rank from that
    checkpoint; the job ends with fp32 weights bit-identical to an uninterrupted run's (the same plan), every
    step is shown once, and both runs' metrics.jsonl hold every step exactly once with the same losses (the
    failed attempt's lines after the checkpoint were replaced).

    Over 20 s: three starts of four rank actors (the reference, the attempt killed after its first checkpoint,
    the restart); 20 steps with a checkpoint every 5 leave the kill a checkpoint to resume from and steps after
    it to compare."""
    steps, every = 20, 5
    config = str(_token_file_config(tmp_path))
    ref_dir, killed_dir = tmp_path / "ref", tmp_path / "killed"
    job = dict(steps=steps, config=config, checkpoint={"dir": str(killed_dir), "every": every, "keep_last": 2})
    reference = plan_and_run(make_spec(**{**job, "checkpoint": {**job["checkpoint"], "dir": str(ref_dir)}}),
                             io.StringIO(), tty=False)
    stage = reference.plan.stage  # the plan's choice: the killed run plans the same
    assert all(r["stage"] == stage for r in reference.results.values())
    assert reference.results[0]["reference_loss"]["name"] == "unigram entropy of the data"
    done, killed = threading.Event(), {}
    killer = threading.Thread(target=_kill_after_first_checkpoint, args=(killed_dir, 2, done, killed))
    killer.start()
    out = io.StringIO()
    started = time.monotonic()
    try:
        result = plan_and_run(make_spec(entrypoint="tests.launch.entrypoints:train_recording_pid", max_failures=1,
                                        **job), out, tty=False)
    finally:
        done.set()
        killer.join()
    text = out.getvalue()
    assert killed, "the job finished before its first checkpoint was seen"
    assert result.attempts == 2, text
    restart = re.search(rf"rank 2 on node 1 failed \(its process \(pid {killed['pid']}\) died: [^\n]*\); "
                        r"restarting all ranks from checkpoint step (\d+) \(attempt 2 of 2\)", text)
    assert restart, text
    resumed = int(restart.group(1))
    assert resumed % every == 0 and every <= resumed < steps and result.resumed_from == resumed
    assert f"resumed from checkpoint step {resumed} " in text and f"checkpoint step {steps} saved" in text

    # every step shown exactly once, in order, also those the killed rank never reported; each checkpoint
    # line right after its step's line; the history holds every step once, with the reference's losses
    lines = text.splitlines()
    shown = [int(m.group(1)) for m in (re.match(r"step +(\d+)/", line) for line in lines) if m]
    assert shown == list(range(1, steps + 1)), text
    for i, line in enumerate(lines):
        saved = re.match(r"checkpoint step (\d+) saved", line)
        if saved:
            assert re.match(rf"step +{saved.group(1)}/", lines[i - 1]), text
    losses = {h["step"]: h["loss"] for h in reference.history}
    assert sorted(losses) == list(range(1, steps + 1))
    assert [h["step"] for h in result.history] == list(range(1, steps + 1))
    for h in result.history:  # every rank reports the DP mean: exact from any one report, even a partial step's
        assert h["loss"] == losses[h["step"]], h
    # final consolidated weights bit-identical to the uninterrupted run's
    got, got_dir, got_doc = checkpoint.consolidate(killed_dir)
    want, _, _ = checkpoint.consolidate(ref_dir)
    assert got_doc["step"] == steps and got_dir.name == f"step-{steps:06d}"
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    # metrics.jsonl: every step once, the reference's losses
    ref_rows, killed_rows = _metrics(ref_dir), _metrics(killed_dir)
    assert [r["step"] for r in ref_rows] == [r["step"] for r in killed_rows] == list(range(1, steps + 1))
    assert [r["loss"] for r in killed_rows] == [r["loss"] for r in ref_rows]
    assert all(r["throughput_unit"] == "tokens/s" and r["lr"] == 5e-3 and r["grad_norm"] > 0 for r in killed_rows)
    assert f"metrics {killed_dir / METRICS_FILE}" in text
    print(f"kill test: reference run {reference.wall_s:.1f} s; killed run {result.wall_s:.1f} s "
          f"(killed pid {killed['pid']} after {killed['after']}, {killed['at'] - started:.1f} s in; resumed "
          f"from step {resumed})")
    assert_loopback_only(*cluster)
