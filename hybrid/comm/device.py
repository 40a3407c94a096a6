"""Which device a thread's CUDA work goes to.

CUDA's current device is per thread (``cudaSetDevice``; torch's ``torch.cuda.set_device`` and
``current_device`` follow it), so a rank whose work runs on several threads -- Ray's rank actor answers the
driver on one thread while ``run()`` trains on another, either of them possibly one that never set a device
-- must make its device current on every thread that does CUDA work, or that work lands on ``cuda:0``.

* ``bind_thread(device)``: make ``device`` current on the calling thread (CUDA: ``torch.cuda.set_device``;
  a CPU device changes nothing in torch) and record it for this thread. Every thread that does a rank's work
  calls it first.
* ``thread_device()``: what the calling thread was bound to, or None.
* ``rank_cuda_device()``: the CUDA device this rank works on, from any thread: the calling thread's binding,
  else the device the default process group was bound to (``hybrid.comm.mesh.init_default_group``), else
  CUDA's current device of this thread.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

_bound = threading.local()


def bind_thread(device) -> torch.device:
    """Make ``device`` the calling thread's current device (see the module docstring); returns it."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _bound.device = device
    return device


def thread_device() -> Optional[torch.device]:
    """The device the calling thread was bound to by ``bind_thread``, or None."""
    return getattr(_bound, "device", None)


def rank_cuda_device() -> torch.device:
    """The CUDA device of this rank (CUDA must be available): the thread's binding, else the default group's
    bound device, else CUDA's current device of this thread."""
    bound = thread_device()
    if bound is not None and bound.type == "cuda":
        return _indexed(bound)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        group_device = getattr(dist.group.WORLD, "bound_device_id", None)
        if group_device is not None and group_device.type == "cuda":
            return _indexed(group_device)
    return torch.device("cuda", torch.cuda.current_device())


def _indexed(device: torch.device) -> torch.device:
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
