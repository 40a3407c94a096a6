"""`bench/compare.py --quick` runs end to end: hybrid at stages 0 and 3 against DDP, FSDP2, (when importable)
DeepSpeed and the one-process compute floor on a tiny GPT, with agreeing losses and hybrid's traffic on the
seed's ratios (else exit 1), and the summary's hybrid / floor ratio at both stages."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _deepspeed_importable() -> bool:
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    return subprocess.run([sys.executable, "-c", "import deepspeed"], env=env, capture_output=True).returncode == 0


@pytest.mark.timeout(240)
def test_quick_benchmark_runs_and_agrees():
    env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1")
    proc = subprocess.run([sys.executable, "bench/compare.py", "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    table = proc.stdout
    for stage in (0, 3):
        assert f"| hybrid | {stage} |" in table
    assert "| DDP | 0 |" in table
    assert "| FSDP2 fully_shard | 3 |" in table
    assert ("| DeepSpeed ZeRO | 3 |" in table) == _deepspeed_importable()
    assert "stage 3: 1.500x (seed 1.5x)" in table
    assert "| compute floor (1 process, no collectives) (*) | any |" in table
    assert "| hybrid time / floor |" in table
    for stage, target in ((0, "1.05"), (3, "1.15")):
        assert re.search(rf"^\| {stage} \| [0-9.]+ \| <= {target}: (yes|no \([0-9.]+\)) \|", table, re.M)
