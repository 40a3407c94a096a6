"""One rank's random-number-generator states as bytes, so a restarted rank draws what it would have drawn.

Covers Python's ``random``, NumPy's global generator, torch's CPU generator and, when CUDA is in use, the
generator of the rank's CUDA device (``hybrid.comm.device.rank_cuda_device``: named, not the calling
thread's current device, which on a thread that never set one is ``cuda:0``). The bytes are a pickle
written and read only by this module; torch's states go into it as plain bytes (a pickled tensor would carry
its storage's memory address, so two saves of the same state would differ), and a tensor, as checkpoints
written before held, is read too.
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
    state = {"python": random.getstate(), "torch": _raw(torch.get_rng_state())}
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = _raw(torch.cuda.get_rng_state(rank_cuda_device()))
    return pickle.dumps(state)


def _raw(state: torch.Tensor) -> bytes:
    return state.numpy().tobytes()


def _tensor(state) -> torch.Tensor:
    return state if isinstance(state, torch.Tensor) else torch.frombuffer(bytearray(state), dtype=torch.uint8)


def restore(blob: bytes) -> None:
    state = pickle.loads(blob)
    random.setstate(state["python"])
    torch.set_rng_state(_tensor(state["torch"]))
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_tensor(state["cuda"]), rank_cuda_device())
