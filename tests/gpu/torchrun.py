"""Start ``tests.gpu.worker`` on N local GPUs with torchrun (static rendezvous on loopback, no Ray) and
return what rank 0 wrote. Every group issues its collectives for real, a group of one rank too
(``HYBRID_FORCE_COLLECTIVES=1``): on one GPU the parity cases run NCCL's all-gather, reduce-scatter and
all-reduce on every path a multi-GPU job takes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from hybrid.comm.collectives import FORCE_COLLECTIVES_ENV

ROOT = Path(__file__).resolve().parents[2]


def require_gpus(n: int) -> str | None:
    """Why a test needing ``n`` GPUs cannot run here, or None when it can."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU: torch.cuda.is_available() is False on this machine"
    if torch.cuda.device_count() < n:
        return f"needs {n} CUDA GPUs, this machine has {torch.cuda.device_count()}"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(nproc: int, out_dir: Path, *worker_args: str, timeout_s: float = 600) -> dict:
    """``torchrun --nproc_per_node nproc -m tests.gpu.worker OUT ...``; the parsed JSON of rank 0."""
    out = out_dir / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           "-m", "tests.gpu.worker", str(out), "--checkpoint-dir", str(out_dir / "checkpoints"), *worker_args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           FORCE_COLLECTIVES_ENV: "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"torchrun failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    result = json.loads(out.read_text())
    for case, error in result.get("errors", {}).items():  # shown with the tests that find the case missing
        print(f"tests.gpu.worker: case {case!r} raised:\n{error}")
    return result
