"""launch.signals: handlers a library resets beneath Python are installed again."""

import ctypes
import signal

from launch import signals


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
