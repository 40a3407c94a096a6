"""Naming the hung rank from the ranks' collective heartbeats: ``hybrid.comm.heartbeat`` counting what a process
enters, ``hung_rank`` picking the rank its peers waited for (and nobody when the heartbeats cannot tell),
and the driver's ``attribute`` preferring a rank's own exception over any heartbeat."""

import threading

from ray.exceptions import RayActorError, RayTaskError

from hybrid.comm import heartbeat
from hybrid.errors import FailureKind
from launch.job.driver import attribute, hung_cause
from launch.ray.workers import rank_failed


def _beat(entered, last, step=0, inside=None):
    return {"entered": entered, "inside": inside, "since": None if inside is None else last, "last": last,
            "step": step}


def test_collective_counts_entries_and_marks_the_process_inside_until_it_returns():
    heartbeat.reset()
    seen = {}
    with heartbeat.collective("dp.all_reduce"):
        seen.update(heartbeat.snapshot())
    try:
        with heartbeat.collective("tp.all_gather"):
            raise RuntimeError("Timed out waiting")
    except RuntimeError:
        pass
    after = heartbeat.snapshot()
    assert seen["entered"] == 1 and seen["inside"] == "dp.all_reduce" and seen["since"] is not None
    assert after["entered"] == 2 and after["inside"] is None and after["since"] is None
    reader = threading.Thread(target=heartbeat.snapshot)  # the actor's drain thread reads it
    reader.start()
    reader.join()


def test_the_rank_behind_everyone_and_idle_past_half_the_timeout_is_the_hung_one():
    now, timeout = 100.0, 2.0
    beats = {0: _beat(5, 99.9), 1: _beat(4, 97.0), 2: _beat(6, 99.9), 3: _beat(6, 99.9, inside="dp.all_reduce")}
    assert heartbeat.hung_rank(beats, now, timeout) == 1
    # steps count before collectives: a rank a step behind is behind whatever it entered
    assert heartbeat.hung_rank({0: _beat(3, 90.0, step=1), 1: _beat(9, 99.0, step=2)}, now, timeout) == 0
    # nobody stands out: a tie, a laggard that was busy a moment ago, one inside a collective, one rank
    assert heartbeat.hung_rank({0: _beat(4, 90.0), 1: _beat(4, 90.0), 2: _beat(6, 99.0)}, now, timeout) is None
    assert heartbeat.hung_rank({0: _beat(4, 99.5), 1: _beat(6, 99.9)}, now, timeout) is None
    assert heartbeat.hung_rank({0: _beat(4, 90.0, inside="tp.all_reduce"), 1: _beat(6, 99.9)}, now, timeout) is None
    assert heartbeat.hung_rank({0: _beat(0, 0.0)}, now, timeout) is None


def _task_error(exc):
    """What the driver gets for a rank whose entrypoint raised ``exc`` (its kind decided on the rank)."""
    return RayTaskError("run", "Traceback ...", rank_failed(exc)).as_instanceof_cause()


def test_attribution_names_the_hung_rank_not_its_victims_but_never_over_a_ranks_own_error():
    now, timeout = 100.0, 2.0
    beats = {0: _beat(5, 99.9), 1: _beat(4, 97.0), 2: _beat(6, 99.9), 3: _beat(6, 99.9)}
    timeouts = [(r, _task_error(RuntimeError("[pair.cc:1] Timed out waiting 2000ms for recv"))) for r in (0, 2, 3)]
    K = FailureKind
    assert attribute(timeouts, beats, now, timeout) == (1, K.HUNG, None)
    assert hung_cause(1, timeouts, beats, now, timeout) == (
        "hung: it entered no collective for 3.0 s, longer than job.collective_timeout_s = 2 s, in step 1 after "
        "4 collectives (its peers reached 6), while rank(s) 0, 2, 3 timed out waiting for it")
    # NCCL's watchdog kills the victims: dead processes, yet the hung rank is still named
    died = [(0, RayActorError()), (2, RayActorError())]
    assert attribute(died, beats, now, timeout) == (1, K.HUNG, None)
    # the hung rank itself died: blamed with its death
    dead_hung = RayActorError()
    assert attribute(timeouts + [(1, dead_hung)], beats, now, timeout) == (1, K.DIED, dead_hung)
    # a rank that raised on its own is the cause whatever the heartbeats say
    own = _task_error(ValueError("bad batch"))
    assert attribute(timeouts + [(3, own)], beats, now, timeout) == (3, K.RAISED, own)
    # heartbeats that cannot tell leave the usual root cause
    even = {r: _beat(6, 99.9) for r in range(4)}
    assert attribute(timeouts, even, now, timeout) == (0, K.PEER, timeouts[0][1])
