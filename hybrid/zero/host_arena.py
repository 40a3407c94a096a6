"""One host allocation per rank for the offloaded optimizer, carved into the tensors that live there.

With ``zero.offload_optimizer.device: cpu`` a rank keeps its fp32 master shard, the host copy of its gradient
shard and the optimizer's state buffers in host memory. They are views of one arena of exactly
``hybrid.plan.layout.host_arena_bytes`` bytes -- the memory model's host figure
(``hybrid.plan.memory.offload_bytes``) -- handed out in that order by ``take``. With ``device: nvme`` the master
and the state are records of the swap file (``hybrid.zero.nvme``), so the arena holds the gradient copy alone
(``host_arena_bytes(..., nvme=True)``, the gradient part of ``hybrid.plan.memory.nvme_offload_bytes``; the swap
store's record buffers are its own).

Pinned (``pin``: offload from a CUDA device with ``pin_memory``) the arena is registered with CUDA as it is
(``cudaHostRegister``), so device<->host copies into it can be non-blocking; torch's caching host allocator
(``pin_memory=True``) would round each buffer up to a power of two instead. Where registering fails the
arena falls back to that allocator, rounded up but pinned.
"""

from __future__ import annotations

import weakref

import torch


class HostArena:
    def __init__(self, nbytes: int, pin: bool = False):
        self.nbytes = int(nbytes)
        self.pinned = False
        self._storage = torch.empty(self.nbytes, dtype=torch.uint8)
        if pin:
            self._storage = self._pin(self._storage)
        self.used = 0

    def _pin(self, storage: torch.Tensor) -> torch.Tensor:
        self.pinned = True
        if not self.nbytes:
            return storage
        ptr = storage.data_ptr()
        try:
            cudart = torch.cuda.cudart()
            registered = int(cudart.cudaHostRegister(ptr, self.nbytes, 0)) == 0
        except (RuntimeError, AttributeError, TypeError):
            registered = False
        if registered:
            weakref.finalize(self, cudart.cudaHostUnregister, ptr)  # self holds the storage: it outlives this
            return storage
        # registering refused (e.g. a container's locked-memory limit): torch's pinned allocator, rounded up
        return torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The next ``numel`` elements of ``dtype``, zeroed."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        start = -(-self.used // itemsize) * itemsize
        end = start + int(numel) * itemsize
        if end > self.nbytes:
            raise RuntimeError(f"the host arena of {self.nbytes} bytes has no room for {numel} more {dtype} elements "
                               f"({self.used} bytes taken); its size and its tensors must follow the same rule "
                               "(hybrid.plan.layout.host_arena_bytes)")
        self.used = end
        out = self._storage[start:end].view(dtype)
        out.zero_()
        return out

    def tensors(self) -> list:
        """The arena itself (one storage), for memory accounting."""
        return [self._storage]
