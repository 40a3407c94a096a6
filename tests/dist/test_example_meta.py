"""The README's meta-device example runs as printed: stage 3 on 2 gloo ranks, same weights as one process."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_the_meta_stage3_example_trains_and_matches_materialize():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "meta_stage3.py")], cwd=ROOT, capture_output=True,
                         text=True, timeout=240, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                                                      "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "initial weights equal hybrid.materialize: True" in out.stdout
    assert "'source': 'init'" in out.stdout
