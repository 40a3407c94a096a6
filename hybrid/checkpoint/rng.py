"""One rank's random-number-generator states as bytes, so a restarted rank draws what it would have drawn.

Covers Python's ``random``, NumPy's global generator, torch's CPU generator and, when CUDA is in use, the
generator of the rank's CUDA device (``hybrid.comm.device.rank_cuda_device``: named, not the calling
thread's current device, which on a thread that never set one is ``cuda:0``). The bytes are a pickle
written and read only by this module.
"""

from __future__ import annotations

import pickle
import random

import torch

from hybrid.comm.device import rank_cuda_device

try:
    import numpy as np
except ImportError:  # numpy is a dependency, but the RNG capture must not be the thing that needs it
    np = None


def capture() -> bytes:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(rank_cuda_device())
    return pickle.dumps(state)


def restore(blob: bytes) -> None:
    state = pickle.loads(blob)
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], rank_cuda_device())
