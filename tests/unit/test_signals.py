"""launch.job.signals: handlers a library resets beneath Python are installed again."""

import ctypes
import signal

import pytest

from launch.job import signals


def _ignored_by_the_kernel(sig: int) -> bool:
    with open("/proc/self/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return bool(mask & (1 << (sig - 1)))


def test_reassert_restores_an_ignore_that_a_library_reset_beneath_python():
    """ray.shutdown() resets SIGTERM to the default action in C (measured with Ray 2.60): a SIGTERM during
    the rest of the teardown then killed the launcher (exit 143) and left the embedded cluster running."""
    with signals.ignored():
        assert _ignored_by_the_kernel(signal.SIGTERM)
        ctypes.CDLL(None).signal(signal.SIGTERM, 0)  # SIG_DFL, as Ray's logging shutdown does
        assert not _ignored_by_the_kernel(signal.SIGTERM) and signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        signals.reassert()
        assert _ignored_by_the_kernel(signal.SIGTERM)
    assert not _ignored_by_the_kernel(signal.SIGTERM)


def test_an_interrupt_python_swallows_is_delivered_again():
    """A clean-clone CI run: SIGTERM landed while logging's at-fork hook ran (Ray starting a node through
    subprocess); Python printed "Exception ignored in: _releaseLock" and the launcher went on starting the
    cluster. A ``__del__`` swallows an exception the same way."""
    import os
    import time

    class SignalsWhileCollected:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs, and raises, inside this __del__
                pass

    raised_at = None
    with pytest.raises(KeyboardInterrupt):
        with signals.as_interrupt(signal.SIGTERM):
            SignalsWhileCollected()  # collected at once
            raised_at = "after __del__"
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                time.sleep(0.01)
            raised_at = "never"
    assert raised_at == "after __del__"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL

    import sys
    import threading

    hooks = []  # off the main thread nothing is installed: no handler, and no hook another thread could restore

    def off_main():
        with signals.as_interrupt(signal.SIGTERM):
            hooks.append(sys.unraisablehook)

    worker = threading.Thread(target=off_main)
    worker.start()
    worker.join()
    assert hooks == [sys.unraisablehook]


@pytest.mark.slow  # a CLI process importing torch: not in the fast tier (make test-fast)
def test_a_command_exits_130_on_sighup_and_a_group_without_its_command_is_one_line(capsys):
    """Before, only SIGTERM was an interrupt at the top: a hangup killed a command with status 129."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from launch.cli import main

    waiting = ("import sys, time, click\n"
               "from launch.cli import cli, main\n"
               "@cli.command('wait')\n"
               "def wait():\n"
               "    print('waiting', flush=True)\n"
               "    time.sleep(60)\n"
               "sys.exit(main(['wait']))\n")
    for sig in (signal.SIGHUP,):  # SIGINT and SIGTERM: the launch tests send them to hybrid launch
        proc = subprocess.Popen([sys.executable, "-c", waiting], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
                                env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        try:
            assert proc.stdout.readline() == "waiting\n"
            time.sleep(0.2)
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
            proc.wait()
        assert proc.returncode == 130 and err.strip() == "interrupted", (sig, proc.returncode, err)

    assert main(["checkpoint"]) == 2
    captured = capsys.readouterr()
    assert captured.out.startswith("Usage: hybrid checkpoint") and captured.err == (
        "error: hybrid checkpoint needs a command: consolidate or inspect (see hybrid checkpoint COMMAND --help).\n")
