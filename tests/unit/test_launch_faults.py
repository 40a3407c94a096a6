"""The driver's fault-tolerance decisions without Ray running: which failure is blamed, what the restart
and final lines say, which checkpoint step a restart resumes from, and how the progress display handles
checkpoint events and restarts."""

import io

from ray.exceptions import RayActorError, RayTaskError

from hybrid.errors import ConfigError, FailureKind
from launch.job.display import Progress
from launch.job.driver import (Failure, cause_of, kind_of, latest_checkpoint_step, out_of_restarts, restart_line,
                               root_cause)
from launch.ray.workers import rank_failed


def _task_error(exc: Exception) -> RayTaskError:
    """What the driver gets for a rank whose entrypoint raised ``exc``: the kind the rank decided, with it."""
    return RayTaskError("run", "Traceback (most recent call last): ...", rank_failed(exc)).as_instanceof_cause()


def test_the_dead_process_is_blamed_before_its_own_exception_before_its_peers_symptoms():
    peer = _task_error(RuntimeError("[/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"))
    timeout = _task_error(RuntimeError("[/gloo/unbound_buffer.cc:78] Timed out waiting 2000ms for recv"))
    own = _task_error(ValueError("bad batch"))
    died = RayActorError()
    K = FailureKind
    assert [kind_of(e) for e in (peer, timeout, own, died)] == [K.PEER, K.PEER, K.RAISED, K.DIED]
    assert root_cause([(0, peer), (3, own), (2, died)]) == (2, died)
    assert root_cause([(0, peer), (3, own), (1, own)]) == (3, own)  # ties: the earliest
    assert root_cause([(1, timeout), (0, peer)]) == (1, timeout)
    assert cause_of(peer) == "RuntimeError: Connection closed by peer [127.0.0.1]:1"  # gloo's [file:line] dropped
    assert cause_of(own) == "ValueError: bad batch"
    assert cause_of(_task_error(ConfigError("model.hidden is -1; give a positive integer."))).startswith(
        "ConfigError: model.hidden is -1")
    assert cause_of(died, pid=42).startswith("its process (pid 42) died: ")


def test_failure_restart_and_final_sentences():
    failure = Failure(2, 1, "its process (pid 42) died: Worker unexpectedly exits").sentence()
    assert failure == "rank 2 on node 1 failed (its process (pid 42) died: Worker unexpectedly exits)"
    assert Failure(None, None, "setting up the ranks failed: x").sentence() == "setting up the ranks failed: x"
    assert restart_line(failure, 20, True, 2, 3) == f"{failure}; restarting all ranks from checkpoint step 20 (attempt 2 of 3)"
    assert restart_line(failure, None, True, 2, 2).endswith("from step 0 (no checkpoint yet) (attempt 2 of 2)")
    assert restart_line(failure, None, False, 2, 2).endswith("from step 0 (job.checkpoint is not set) (attempt 2 of 2)")
    assert out_of_restarts(failure, 3, 2) == f"{failure} on attempt 3 of 3, and job.max_failures (2) allows no more restarts"
    assert out_of_restarts(failure, 1, 0) == f"{failure}; job.max_failures is 0, so the job was not restarted"
    for sentence in (restart_line(failure, 5, True, 2, 2), out_of_restarts(failure, 2, 1)):
        assert "\n" not in sentence


def test_the_restart_step_is_the_newest_complete_checkpoint_seen_or_reported(tmp_path):
    assert latest_checkpoint_step(None, None) is None and latest_checkpoint_step(None, 15) == 15
    assert latest_checkpoint_step(tmp_path, None) is None  # no checkpoints/ yet
    for name, complete in (("step-000010", True), ("step-000020", False), (".tmp-step-000030", False)):
        d = tmp_path / "checkpoints" / name
        d.mkdir(parents=True)
        if complete:
            for f in ("COMPLETE", "hybrid.json", ".metadata"):
                (d / f).write_text("x")
    assert latest_checkpoint_step(tmp_path, None) == 10  # an unmarked or temporary directory never counts
    assert latest_checkpoint_step(tmp_path, 5) == 10 and latest_checkpoint_step(tmp_path, 15) == 15


def _step(step, rank, loss):
    return {"rank": rank, "step": step, "loss": loss, "step_time_s": 0.1, "tokens": 100, "tp_rank": 0,
            "memory": {"params": 1, "grads": 1, "optimizer": 1}}


def test_progress_orders_checkpoint_lines_after_their_step_and_forgets_steps_after_a_resume():
    out = io.StringIO()
    progress = Progress(total_steps=4, world_size=2, stream=out, tty=False)
    progress.add({"rank": 0, "reports": [_step(1, 0, 3.0), _step(2, 0, 2.0),
                                         {"rank": 0, "step": 2, "checkpoint_saved": 2, "checkpoint": "ck/step-2"},
                                         _step(3, 0, 1.5)]})
    assert out.getvalue() == ""  # rank 1 has reported nothing yet
    progress.add({"rank": 1, "reports": [_step(1, 1, 3.0), _step(2, 1, 2.0)]})
    assert out.getvalue().splitlines()[-1] == "checkpoint step 2 saved: ck/step-2"
    assert progress.checkpoint_step == 2 and [h["step"] for h in progress.history] == [1, 2]

    progress.restart(2)  # the attempt died during step 3; its half-reported step is dropped
    progress.add({"rank": 1, "reports": [{"rank": 1, "step": 2, "resumed_from": 2, "checkpoint": "ck/step-2"}]})
    progress.add({"rank": 0, "reports": [{"rank": 0, "step": 2, "resumed_from": 2, "checkpoint": "ck/step-2"},
                                         _step(3, 0, 1.25)]})
    progress.add({"rank": 1, "reports": [_step(3, 1, 1.25)]})
    lines = out.getvalue().splitlines()
    assert "resumed from checkpoint step 2 (ck/step-2); continuing at step 3" in lines
    assert lines[-1].startswith("step 3/4  loss 1.2500")
    assert [(h["step"], h["loss"]) for h in progress.history] == [(1, 3.0), (2, 2.0), (3, 1.25)]
    assert progress.resumed_from == 2

    done = Progress(total_steps=4, world_size=1, stream=io.StringIO(), tty=False)
    done.add({"rank": 0, "reports": [{"rank": 0, "step": 4, "resumed_from": 4, "checkpoint": "ck/step-4"}]})
    assert "resumed from checkpoint step 4 (ck/step-4); nothing left to train" in done.stream.getvalue()
    shown = Progress(total_steps=4, world_size=1, stream=io.StringIO(), tty=False)
    shown.add({"rank": 0, "reports": [{"rank": 0, "step": 2, "resumed_from": 2, "checkpoint": "ck/step-2",
                                       "skipped_checkpoints": ["step-000003 (corrupt: __0_0.distcp)"]}]})
    shown.add({"rank": 0, "reports": [{"rank": 0, "step": 0, "checkpoint_warning": "no good checkpoint in ck"}]})
    assert shown.stream.getvalue().splitlines() == [
        "resumed from checkpoint step 2 (ck/step-2, skipping the damaged or unfinished step-000003 (corrupt: "
        "__0_0.distcp)); continuing at step 3", "warning: no good checkpoint in ck"]


def _step_lines(text: str) -> list[int]:
    return [int(line.split()[1].split("/")[0]) for line in text.splitlines() if line.startswith("step ")]


def test_a_restart_shows_the_dead_ranks_unreported_steps_up_to_the_checkpoint_once_in_order():
    out = io.StringIO()
    progress = Progress(total_steps=8, world_size=2, stream=out, tty=False)
    saved = {"rank": 0, "step": 5, "checkpoint_saved": 5, "checkpoint": "ck/step-5"}
    progress.add({"rank": 1, "reports": [_step(s, 1, 9.0 - s) for s in (1, 2, 3)]})  # then rank 1 is killed
    progress.add({"rank": 0, "reports": [_step(s, 0, 9.0 - s) for s in (1, 2, 3, 4, 5)] + [saved, _step(6, 0, 3.0)]})
    assert _step_lines(out.getvalue()) == [1, 2, 3]  # steps 4.. wait for rank 1's reports, which died with it

    progress.restart(5)
    progress.note("rank 1 on node 0 failed (...); restarting all ranks from checkpoint step 5 (attempt 2 of 2)")
    lines = out.getvalue().splitlines()
    assert _step_lines(out.getvalue()) == [1, 2, 3, 4, 5]
    assert lines[3] == "step 4/8  loss 5.0000  1,000 tokens/s  model states/rank 3 B  (1 of 2 ranks reported)"
    assert lines[4].startswith("step 5/8") and lines[5] == "checkpoint step 5 saved: ck/step-5"
    assert lines[6].startswith("rank 1 on node 0 failed")
    assert [h["step"] for h in progress.history] == [1, 2, 3, 4, 5]  # step 6 runs again

    for rank in (0, 1):
        progress.add({"rank": rank, "reports": [{"rank": rank, "step": 5, "resumed_from": 5, "checkpoint": "ck/step-5"}]
                      + [_step(s, rank, 1.0) for s in (6, 7, 8)]})
    assert _step_lines(out.getvalue()) == list(range(1, 9))
    assert [h["step"] for h in progress.history] == list(range(1, 9))


def test_a_launch_that_resumes_and_fails_before_any_report_lists_no_earlier_launchs_steps():
    """A job run again resumes from checkpoint 6 of an earlier launch; its first attempt fails before rank 0
    reports the resume: the restart must not print steps 1-6 as lost with the failed attempt's ranks."""
    out = io.StringIO()
    progress = Progress(total_steps=8, world_size=2, stream=out, tty=False)
    progress.begin_at(6)
    progress.restart(6)
    assert _step_lines(out.getvalue()) == [] and progress.history == []
    for rank in (0, 1):
        progress.add({"rank": rank, "reports": [{"rank": rank, "step": 6, "resumed_from": 6, "checkpoint": "ck"}]
                      + [_step(s, rank, 1.0) for s in (7, 8)]})
    assert _step_lines(out.getvalue()) == [7, 8]


def test_steps_after_the_checkpoint_run_again_replace_their_history_entry_without_a_second_line():
    out = io.StringIO()
    progress = Progress(total_steps=4, world_size=1, stream=out, tty=False)
    progress.add({"rank": 0, "reports": [_step(1, 0, 4.0), _step(2, 0, 3.0),
                                         {"rank": 0, "step": 2, "checkpoint_saved": 2, "checkpoint": "ck/step-2"},
                                         _step(3, 0, 2.0)]})
    assert out.getvalue().splitlines()[2] == "checkpoint step 2 saved: ck/step-2"  # right after step 2's line
    progress.restart(2)
    progress.add({"rank": 0, "reports": [_step(3, 0, 2.5), _step(4, 0, 1.0)]})
    assert _step_lines(out.getvalue()) == [1, 2, 3, 4]
    assert [(h["step"], h["loss"]) for h in progress.history] == [(1, 4.0), (2, 3.0), (3, 2.5), (4, 1.0)]
    summary = progress.summary([], 1.0)
    assert "steps 4/4" in summary and "loss 4.0000 (step 1) -> 1.0000 (step 4)" in summary


class _Group:
    """A WorkerGroup stand-in for the driver's polling loop: one buffered step report per drain."""

    def __init__(self):
        self.drains = 0

    def drain(self, timeout_s=30.0):
        self.drains += 1
        return [{"rank": 0, "reports": [_step(self.drains, 0, 1.0)], "nvml": [], "heartbeat": {}}]


def test_an_interrupt_keeps_the_reports_the_ranks_still_buffer(monkeypatch):
    """SIGINT right after a checkpoint: the steps reported since the last poll reach the display (and
    metrics.jsonl) before the job ends, so no later run is missing them."""
    import pytest

    import launch.job.driver as job

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt("signal 2")

    monkeypatch.setattr(job.ray, "wait", interrupted)
    seen = []
    progress = Progress(5, 1, io.StringIO(), tty=False, on_step=seen.append)
    group = _Group()
    with pytest.raises(KeyboardInterrupt):
        job._collect(group, ["ref"], progress, timeout_s=60)
    assert group.drains == 1 and [entry["step"] for entry in seen] == [1]


def test_a_dropped_cluster_session_makes_no_ray_call_at_teardown(monkeypatch):
    """Ray Client lost: a Ray call would start a new driver that joins any cluster on the machine."""
    import launch.ray.workers as workers

    calls = []
    monkeypatch.setattr(workers.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(workers.ray, "kill", lambda *a, **k: calls.append("kill"))
    monkeypatch.setattr(workers, "remove_placement_group", lambda pg: calls.append("remove_placement_group"))
    group = workers.WorkerGroup.__new__(workers.WorkerGroup)
    group.actors, group.pg = ["actor"], "pg"
    group.shutdown(graceful=True)
    assert calls == [] and group.actors == [] and group.pg is None


class _TwoArgError(Exception):
    def __init__(self, what, code):  # pickling passes only args=(message,): unpickling raises TypeError
        super().__init__(f"{what} failed with {code}")


def test_an_exception_the_driver_cannot_unpickle_is_sent_as_its_type_and_message():
    from launch.ray.workers import _round_trips

    assert _round_trips(ValueError("plain")) and _round_trips(ConfigError("a sentence"))
    assert not _round_trips(_TwoArgError("download", 3))
    odd = _task_error(_TwoArgError("download", 3))
    assert kind_of(odd) is FailureKind.RAISED and cause_of(odd) == "RuntimeError: _TwoArgError: download failed with 3"


def test_a_teardown_call_is_waited_for_until_it_returns_times_out_or_the_gcs_is_gone(monkeypatch):
    """A GCS killed from outside (systemd's control-group kill, Slurm's scancel) stops answering before its
    process is gone, and Ray's placement-group removal then waits forever: the teardown goes on without it."""
    import subprocess
    import threading
    import time

    import pytest

    from launch.ray import cluster as ray_cluster

    assert ray_cluster.within(lambda: None, timeout_s=5)
    with pytest.raises(ConnectionError):
        ray_cluster.within(lambda: (_ for _ in ()).throw(ConnectionError("session dropped")), timeout_s=5)

    forever = threading.Event()
    start = time.monotonic()
    assert not ray_cluster.within(forever.wait, timeout_s=0.5)
    assert time.monotonic() - start < 3

    gone = subprocess.Popen(["true"])
    gone.wait()
    monkeypatch.setattr(ray_cluster, "_gcs_pid", gone.pid)  # an embedded GCS that died
    assert ray_cluster.gcs_lost()
    start = time.monotonic()
    assert not ray_cluster.within(forever.wait, timeout_s=60)
    assert time.monotonic() - start < 3
    monkeypatch.setattr(ray_cluster, "_gcs_pid", None)  # a cluster this process did not start
    assert not ray_cluster.gcs_lost()
    forever.set()


def test_with_the_embedded_gcs_gone_the_teardown_makes_no_ray_call(monkeypatch):
    import launch.ray.workers as workers

    calls = []
    monkeypatch.setattr(workers, "gcs_lost", lambda: True)
    monkeypatch.setattr(workers.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(workers.ray, "kill", lambda *a, **k: calls.append("kill"))
    monkeypatch.setattr(workers, "remove_placement_group", lambda pg: calls.append("remove_placement_group"))
    group = workers.WorkerGroup.__new__(workers.WorkerGroup)
    group.actors, group.pg = ["actor"], "pg"
    assert group.drain(timeout_s=5) == []
    group.shutdown(graceful=True)
    assert calls == [] and group.actors == [] and group.pg is None


def test_every_user_and_job_error_reaches_the_driver_whole_whatever_its_constructor_takes():
    """A rank's exception travels pickled; one whose ``__init__`` takes other arguments than its message (a
    damaged checkpoint's: directory, problem, fix) came back as an unpickling error, so the driver saw a
    RuntimeError (exit 1, retried) instead of the user's sentence (exit 2)."""
    import pickle
    from pathlib import Path

    import hybrid.checkpoint.lock  # noqa: F401 -- defines CheckpointLocked
    import hybrid.runtime.train  # noqa: F401 -- defines TrainError
    from hybrid.checkpoint.integrity import UNREADABLE, CheckpointDamaged, CheckpointUnreadable, Problem
    from hybrid.errors import JobError, UserError, reworded
    from launch.ray.workers import _round_trips

    def every(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from every(sub)

    odd = {CheckpointDamaged: CheckpointDamaged(Path("/ckpt/step-000006"), Problem("corrupt", "x.distcp"), "fix it."),
           CheckpointUnreadable: CheckpointUnreadable(Path("/ckpt/step-000006"), Problem(UNREADABLE, "x.distcp"))}
    ours = ("hybrid", "launch")  # Ray derives RayTaskError(...) classes of its own from ours: not ours to test
    classes = {c for c in (UserError, JobError, *every(UserError), *every(JobError)) if c.__module__.startswith(ours)}
    assert CheckpointUnreadable in classes and len(classes) >= 12
    for cls in classes:
        err = odd.get(cls) or cls("a sentence naming the field and the fix.")
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is cls and str(back) == str(err) and vars(back) == vars(err), cls
        assert _round_trips(err), cls
    unreadable = odd[CheckpointUnreadable]
    prefixed = reworded(unreadable, f"rank 1: {unreadable}")
    assert type(prefixed) is CheckpointUnreadable and prefixed.problem == unreadable.problem
    assert str(prefixed) == f"rank 1: {unreadable}"


def test_a_steps_loss_comes_exact_from_any_one_ranks_job_loss():
    """A rank of run_steps reports the DP mean of the loss (``job_loss``): a step flushed at a restart with a
    dead rank's reports lost shows the job's loss, not the mean of the survivors' own losses."""
    from launch.job.metrics import step_entry

    records = {r: {**_step(3, r, loss), "dp_rank": r, "job_loss": 2.5} for r, loss in ((0, 2.0), (1, 3.0), (3, 2.0))}
    assert step_entry(3, records)["loss"] == 2.5 and step_entry(3, records)["ranks_reported"] == 3
    own = {r: {**_step(3, r, loss), "dp_rank": r} for r, loss in ((0, 2.0), (1, 3.0))}  # an own loop's reports
    assert step_entry(3, own)["loss"] == 2.5
