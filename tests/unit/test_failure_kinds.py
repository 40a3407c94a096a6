"""Failure kinds decided on the rank from the exception itself (``hybrid.runtime.failure.failure_kind``), sent to
the driver with the error (``launch.ray.workers.rank_failed``, pickled as Ray pickles it) and read there as
data (``launch.job.driver``): the blamed rank, the sentence, retry or not, re-plan or not. The collective
failures of a real gloo world whose peer exits or comes late are tests/dist/test_failure_kinds.py's."""

import os
import pickle
import sys

import pytest
import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from hybrid.comm import heartbeat
from hybrid.errors import ConfigError, FailureKind, RankFailed
from hybrid.plan.budget import MemoryMeter
from hybrid.runtime.failure import failure_kind
from hybrid.runtime.train import loss_of
from hybrid.zero.clip import NonFiniteGuard
from launch.ray.workers import rank_failed

K = FailureKind


def _raised(call):
    """The exception ``call()`` raises (as the rank actor catches it: any BaseException)."""
    try:
        call()
    except BaseException as err:  # noqa: BLE001 -- SystemExit and KeyboardInterrupt included, as on a rank
        return err
    raise AssertionError("nothing was raised")


def _exit():
    sys.exit(3)


def _interrupt():
    raise KeyboardInterrupt("signal 2")


def _diverge():
    guard = NonFiniteGuard(max_consecutive=2)
    guard.skip(float("nan"))
    guard.skip(float("inf"))


def _over_budget():
    meter = MemoryMeter("cpu", budget_bytes=2**20)
    meter.check({**meter.measure(), "peak_bytes": 2**21})


def _shm_peer_gone():
    """shm's doorbell ringing a peer whose end of the pipe is closed: its process is gone."""
    from datetime import timedelta

    from hybrid.comm.shm import _Doorbell

    own_read, own_write = os.pipe()
    peer_read, peer_write = os.pipe()
    os.close(peer_read)
    bell = _Doorbell(0, own_read, own_write, {1: peer_write}, {1: os.getpid()}, timedelta(seconds=1),
                     "dp shared-memory collective", [0, 1])
    try:
        bell.ring(1, "all_reduce")
    finally:
        bell.close()


def _gloo_peer_closed():
    """What gloo raises on a rank whose peer closed the connection (its exact text, from a real run)."""
    raise RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                       "[127.0.0.1]:50609")


def _wrapped_by_the_entrypoint():
    try:
        _gloo_peer_closed()
    except RuntimeError as err:
        raise RuntimeError("step 3 failed") from err


def _user_error_after_a_peer_failure():
    try:
        _gloo_peer_closed()
    except RuntimeError:
        raise ConfigError("model.hidden is -1; give a positive integer.")


def test_each_kind_is_decided_on_the_rank_from_the_exception_it_raised():
    cases = {
        _exit: K.EXITED,
        _interrupt: K.INTERRUPTED,
        (lambda: loss_of("no loss")): K.USER_ERROR,  # TrainError
        _diverge: K.JOB_ERROR,  # NonFiniteError
        _over_budget: K.OUT_OF_MEMORY,  # torch.OutOfMemoryError from the budget check
        _shm_peer_gone: K.PEER,  # marked where it is raised, not read from its text
        _gloo_peer_closed: K.PEER,
        _wrapped_by_the_entrypoint: K.PEER,  # the collective's failure it was raised from
        _user_error_after_a_peer_failure: K.USER_ERROR,  # the error's own type first
        (lambda: torch.ones(2) @ torch.ones(3)): K.RAISED,  # a RuntimeError of the rank's own
        (lambda: [][1]): K.RAISED,
    }
    for call, kind in cases.items():
        err = _raised(call)
        assert failure_kind(err) is kind, (err, kind)
    shm = _raised(_shm_peer_gone)
    assert type(shm) is RuntimeError and str(shm) == (
        "dp shared-memory collective: global rank 1 (rank 1) of the group exited during a collective")
    assert heartbeat.lost_peer(shm) and not heartbeat.lost_peer(RuntimeError("a rank of its own"))
    assert not heartbeat.lost_peer(ValueError("Connection closed by peer"))  # not what gloo or NCCL raise


def _sent(err: BaseException) -> RayTaskError:
    """What the driver's ``ray.get`` raises for a rank whose entrypoint raised ``err``: the actor's
    ``rank_failed(err)`` through Ray's pickling, wrapped as Ray wraps a task's exception."""
    report = ray.cloudpickle.loads(ray.cloudpickle.dumps(rank_failed(err)))
    return RayTaskError("run", "Traceback (most recent call last): ...", report).as_instanceof_cause()


def test_the_kind_and_the_error_reach_the_driver_whole():
    from launch.job.driver import cause_of, kind_of, rank_error

    exited = _sent(_raised(_exit))
    assert kind_of(exited) is K.EXITED and cause_of(exited) == "RuntimeError: the entrypoint called sys.exit(3)"
    interrupted = _sent(_raised(_interrupt))
    assert kind_of(interrupted) is K.INTERRUPTED
    assert cause_of(interrupted) == "RuntimeError: the entrypoint raised KeyboardInterrupt('signal 2')"
    user = _sent(_raised(lambda: loss_of("no loss")))
    assert kind_of(user) is K.USER_ERROR and type(rank_error(user)).__name__ == "TrainError"
    assert cause_of(user).startswith("TrainError: the model's forward returned str with no scalar loss")
    peer = _sent(_raised(_gloo_peer_closed))
    assert kind_of(peer) is K.PEER
    assert cause_of(peer) == "RuntimeError: Connection closed by peer [127.0.0.1]:50609"  # gloo's [file:line] dropped
    # the driver reads kinds, never text: an error that came without one is the rank's own
    unreported = RayTaskError("run", "...", RuntimeError("Connection closed by peer")).as_instanceof_cause()
    assert kind_of(unreported) is K.RAISED and kind_of(RayActorError()) is K.DIED
    report = rank_failed(_raised(_over_budget))
    back = pickle.loads(pickle.dumps(report))
    assert type(back) is RankFailed and back.kind is K.OUT_OF_MEMORY and str(back) == str(report)


class _Placed:
    def __init__(self, rank):
        self.rank, self.node_index, self.pid = rank, rank // 2, 1000 + rank


class _FailedGroup:
    """A WorkerGroup stand-in whose ranks have all finished (``ray.get`` of their refs answers)."""

    placement = [_Placed(r) for r in range(4)]

    def drain(self, timeout_s=30.0):
        return []

    def request_stop(self):
        pass


def _outcome(monkeypatch, answers: dict):
    """The driver's decision when rank r's ``run`` answered ``answers[r]`` (an exception: it failed)."""
    import launch.job.driver as job

    monkeypatch.setattr(job.ray, "wait", lambda refs, **kw: (list(refs), []))

    def get(ref, **kw):
        if isinstance(answers[ref], BaseException):
            raise answers[ref]
        return answers[ref]

    monkeypatch.setattr(job.ray, "get", get)
    return job._collect(_FailedGroup(), list(range(4)), progress=_NoProgress(), timeout_s=60)


class _NoProgress:
    def add(self, drained):
        pass


def test_the_driver_decides_on_the_kinds(monkeypatch):
    ok = {"rank": 0}
    peer = _sent(_raised(_gloo_peer_closed))
    died = RayActorError()
    # a dead process is the cause of its peers' failed collectives; a retry follows
    out = _outcome(monkeypatch, {0: peer, 1: ok, 2: died, 3: peer})
    assert (out.failure.rank, out.failure.node, out.retryable, out.oom) == (2, 1, True, False)
    assert out.failure.cause.startswith("its process (pid 1002) died")
    # a rank's own error before its peers'
    out = _outcome(monkeypatch, {0: peer, 1: _sent(ValueError("bad batch")), 2: peer, 3: ok})
    assert out.failure.sentence() == "rank 1 on node 0 failed (ValueError: bad batch)" and out.retryable
    # a user error: its one sentence, exit 2, no retry
    out = _outcome(monkeypatch, {0: peer, 1: ok, 2: _sent(_raised(lambda: loss_of("no loss"))), 3: ok})
    assert type(out.user_error).__name__ == "TrainError" and str(out.user_error).startswith(
        "rank 2: the model's forward returned str with no scalar loss")
    # a job error: its sentence, no retry
    out = _outcome(monkeypatch, {0: ok, 1: ok, 2: ok, 3: _sent(_raised(_diverge))})
    assert not out.retryable and out.failure.sentence().startswith(
        "rank 3 on node 1 failed (the global gradient norm was inf for 2 consecutive steps")
    # out of memory: a re-plan
    out = _outcome(monkeypatch, {0: ok, 1: _sent(_raised(_over_budget)), 2: ok, 3: ok})
    assert out.oom and out.failure.rank == 1 and out.failure.cause.startswith("OutOfMemoryError: measured ")
    # sys.exit: named with its code
    out = _outcome(monkeypatch, {0: ok, 1: _sent(_raised(_exit)), 2: ok, 3: ok})
    assert out.failure.sentence() == "rank 1 on node 0 failed (RuntimeError: the entrypoint called sys.exit(3))"


@pytest.mark.parametrize("kind", list(FailureKind))
def test_every_kind_travels_as_itself(kind):
    report = RankFailed(kind, RuntimeError("x"))
    back = ray.cloudpickle.loads(ray.cloudpickle.dumps(report))
    assert back.kind is kind and FailureKind(kind.value) is kind
