"""The rank's device is bound on the thread that runs the rank's work.

Ray runs a rank actor's calls on two threads (``run()`` trains while ``drain()`` answers the driver), and
CUDA's current device is per thread: ``RankWorker.run`` must bind the rank's device on whichever thread it
runs on, not rely on the thread ``setup()`` ran on. Checked without a GPU through the real code path: the
entrypoint, called by ``run()`` on a fresh thread, reports that thread and what ``hybrid.comm.device``
recorded for it.
"""

import threading

from hybrid.comm.device import bind_thread, thread_device
from hybrid.runtime.train import JobSettings
from launch.ray.workers import RankWorker


def report_thread(ctx):
    """The entrypoint: the thread it runs on and the device bound there."""
    return {"thread": threading.get_ident(), "bound": str(thread_device()), "device": str(ctx.device)}


def _on_new_thread(fn):
    out = {}

    def body():
        out["thread"] = threading.get_ident()
        out["result"] = fn()

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out["thread"], out["result"]


def test_run_binds_the_rank_device_on_the_thread_it_runs_on(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    config = tmp_path / "model.yaml"
    config.write_text("{}\n")
    worker = RankWorker()
    # what setup() leaves behind (setup itself needs Ray's runtime context and a process group)
    worker._rank, worker._device = 0, "cpu"
    settings = JobSettings(steps=1, micro_batch=1, stage=0)
    thread, result = _on_new_thread(lambda: worker.run(f"{__name__}:report_thread", str(config), settings))
    assert result == {"thread": thread, "bound": "cpu", "device": "cpu"}
    assert thread != threading.get_ident() and thread_device() is None  # this thread was never bound


def test_a_binding_belongs_to_the_thread_that_made_it():
    thread, seen = _on_new_thread(lambda: (bind_thread("cpu"), thread_device())[1])
    assert str(seen) == "cpu" and thread_device() is None
    _, elsewhere = _on_new_thread(thread_device)
    assert elsewhere is None
