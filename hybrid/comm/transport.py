"""What a transport is: the interface every way of moving tensors between the ranks of a group implements.

A ``Comm`` (``hybrid.comm.collectives``) chooses its group's transports once, when it is made, and counts
the bytes and records the heartbeat of every call itself; a transport only moves data. The transports are
``ProcessGroupTransport`` (torch.distributed on the group: NCCL or gloo), ``ExchangeTransport`` (faster gloo
algorithms for CPU tensors) and ``SharedMemoryTransport`` (CPU tensors between the ranks of one host); the
last two are `Relay`s: each carries the calls it is made for and hands every other one, unchanged, to the
transport below it. `Solo` is a group of one that moves nothing (a ``Comm`` forced to communicate,
``HYBRID_FORCE_COLLECTIVES=1``, gives its group of one ``ProcessGroupTransport`` instead).

Contract of every transport:

* Every call is collective: each rank of the group issues the same calls, of the same sizes, in the same
  order.
* ``async_op=False``: the call has finished when it returns (it returns `DONE`). ``async_op=True``: it
  returns a handle whose ``wait()`` returns once the result is in place.
* ``average=True``: the result is the mean over the group instead of the sum.
* ``all_reduce(tensor, op=...)``: ``op`` is a ``torch.distributed.ReduceOp`` (``None``: the sum, or the
  mean).
* ``reduce_scatter(output, input)``: ``output`` (``input.numel() / N`` elements) receives this rank's reduced
  part of ``input``. When ``output`` is that part of ``input`` itself (`is_own_slice`, how the engine calls
  it), the other parts of ``input`` may be left holding anything: callers never read them.
* ``all_gather(output, input)``: ``output.view(-1).tensor_split(N)[q]`` receives rank q's ``input``.
* ``broadcast(tensor, src)``: ``src`` is a rank in the group.
* ``all_to_all(output, input)``: ``output.view(-1).tensor_split(N)[q]`` receives part ``rank`` of rank q's
  ``input`` (torch.distributed's, on the group, unless a transport carries it otherwise).
* ``buffer_tensors()``: what the transport keeps between calls (for memory reports); ``close()`` releases
  it, and the transport is not used again.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch


class Done:
    """Handle for an op that completed synchronously (or needed no communication)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE = Done()


class AllDone:
    """Handle for several async ops: ``wait`` waits for each."""

    def __init__(self, works: list):
        self._works = works

    def wait(self) -> bool:
        for w in self._works:
            w.wait()
        return True


class AverageOnWait:
    """Wraps an async handle so the tensor is divided by the group size once the op has finished."""

    def __init__(self, work, tensor: torch.Tensor, size: int):
        self._work, self._tensor, self._size = work, tensor, size
        self._done = False

    def wait(self) -> bool:
        if not self._done:
            self._work.wait()
            self._tensor.div_(self._size)
            self._done = True
        return True


def averaged(work, tensor: torch.Tensor, average: bool, size: int, async_op: bool):
    """The handle to return for ``work``, a summing op into ``tensor`` (``None``, or finished, when not
    ``async_op``), dividing ``tensor`` by ``size`` once it has finished when ``average``."""
    if not average:
        return work if async_op else DONE
    if async_op:
        return AverageOnWait(work, tensor, size)
    tensor.div_(size)
    return DONE


def is_own_slice(output: torch.Tensor, input: torch.Tensor, rank: int) -> bool:
    """``output`` is ``input.view(-1)[rank·n:(rank+1)·n]`` (same storage, both contiguous)."""
    return (output.is_contiguous() and input.is_contiguous()
            and output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr()
            and output.storage_offset() == input.storage_offset() + rank * output.numel())


class Transport(ABC):
    """Moves tensors between the ranks of one process group (see the module docstring for the contract)."""

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, *, op=None, average: bool = False, async_op: bool = False):
        ...

    @abstractmethod
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, average: bool = False,
                       async_op: bool = False):
        ...

    @abstractmethod
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False):
        ...

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False):
        ...

    @abstractmethod
    def barrier(self) -> None:
        ...

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False):
        """``output.view(-1).tensor_split(N)[q]`` receives part ``rank`` of rank q's ``input``."""
        raise NotImplementedError(f"{type(self).__name__} has no all-to-all")

    def buffer_tensors(self) -> list:
        return []

    def close(self) -> None:
        pass


class Relay(Transport):
    """A transport that carries some calls itself and hands every other one, unchanged, to ``fallback`` (the
    transport below it). ``buffer_tensors`` and ``close`` cover the transports below too."""

    def __init__(self, fallback: Transport):
        self.fallback = fallback

    def all_reduce(self, tensor, *, op=None, average=False, async_op=False):
        return self.fallback.all_reduce(tensor, op=op, average=average, async_op=async_op)

    def reduce_scatter(self, output, input, *, average=False, async_op=False):
        return self.fallback.reduce_scatter(output, input, average=average, async_op=async_op)

    def all_gather(self, output, input, *, async_op=False):
        return self.fallback.all_gather(output, input, async_op=async_op)

    def broadcast(self, tensor, src, *, async_op=False):
        return self.fallback.broadcast(tensor, src, async_op=async_op)

    def barrier(self) -> None:
        self.fallback.barrier()

    def all_to_all(self, output, input, *, async_op=False):
        return self.fallback.all_to_all(output, input, async_op=async_op)

    def buffer_tensors(self) -> list:
        return self.fallback.buffer_tensors()

    def close(self) -> None:
        self.fallback.close()


class Solo(Transport):
    """A group of one: nothing moves. A reduction leaves the tensor as it is (the sum, mean or max of one
    value); a reduce-scatter or all-gather copies ``input`` into ``output``."""

    def all_reduce(self, tensor, *, op=None, average=False, async_op=False):
        return DONE

    def reduce_scatter(self, output, input, *, average=False, async_op=False):
        output.copy_(input)
        return DONE

    def all_gather(self, output, input, *, async_op=False):
        output.copy_(input)
        return DONE

    def broadcast(self, tensor, src, *, async_op=False):
        return DONE

    def all_to_all(self, output, input, *, async_op=False):
        output.copy_(input)
        return DONE

    def barrier(self) -> None:
        pass


class Closed(Transport):
    """What a closed ``Comm`` holds: every call is an error."""

    def __init__(self, name: Optional[str] = None):
        self._name = name

    def _refuse(self, *args, **kwargs):
        raise RuntimeError(f"a collective on the closed Comm {self._name!r}")

    all_reduce = reduce_scatter = all_gather = broadcast = barrier = all_to_all = _refuse
