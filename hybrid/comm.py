"""The one place collectives are called.

`Comm` wraps a process group (the DP group, the TP group, or the world) and counts the *logical* bytes
each collective moves, using the accounting of the ZeRO paper (``shared/seed/zero-stages.txt``):

* all-reduce of a tensor X counts ``2·|X|`` (a reduce-scatter plus an all-gather),
* reduce-scatter counts the full input ``|X|``,
* all-gather counts the full output ``|X|``,
* broadcast counts ``|X|``.

It also counts the collectives themselves, per op kind (``report()["all_gather_calls"]``, ...).

A group of size 1 moves nothing: the call is a no-op (all-gather / reduce-scatter become copies) and
nothing is counted. Async ops return a handle with ``.wait()`` in every case, so callers never branch on
the group size.

Callers that want a mean pass ``average=True``: on NCCL that is ``ReduceOp.AVG`` inside the collective;
gloo has no AVG, so there the sum is divided by the group size here.

gloo's own reduce-scatter copies its whole input and all-reduces it, and its all-gather is several times
slower than one broadcast per rank (bench/RESULTS.md). On CPU tensors (gloo) two faster equivalents are
used, with the same logical byte counts: a reduce-scatter whose output is this rank's slice of the input
(how the engine always calls it) is an in-place all-reduce of the input (the other slices then hold sums
too; callers never read them), and an all-gather is one async broadcast per rank into the output's chunks.

Every collective issued is recorded in ``hybrid.heartbeat`` (entered, and inside it until it returns), so
the launcher can tell which rank its peers were waiting for when they time out.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

import torch
import torch.distributed as dist

from hybrid import heartbeat


class _Done:
    """Handle for an op that completed synchronously (or needed no communication)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _AverageOnWait:
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


class _AllDone:
    """Handle for several async ops: ``wait`` waits for each."""

    def __init__(self, works: list):
        self._works = works

    def wait(self) -> bool:
        for w in self._works:
            w.wait()
        return True


def _is_own_slice(output: torch.Tensor, input: torch.Tensor, rank: int) -> bool:
    """``output`` is ``input.view(-1)[rank·n:(rank+1)·n]`` (same storage, both contiguous)."""
    return (output.is_contiguous() and input.is_contiguous()
            and output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr()
            and output.storage_offset() == input.storage_offset() + rank * output.numel())


class Comm:
    """Collectives over one process group, with byte counters per op kind."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None, name: str = "dp"):
        self.name = name
        self.group = group
        self.native_avg = False  # the backend averages in the collective (NCCL's ReduceOp.AVG)
        if dist.is_available() and dist.is_initialized():
            self.size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
            self.native_avg = str(dist.get_backend(group)).lower() == "nccl"
        else:
            self.size, self.rank = 1, 0
        self.bytes: Counter = Counter()
        self.calls: Counter = Counter()
        self._ranks = None  # global ranks of the group, for the broadcast all-gather

    # -- accounting -------------------------------------------------------------------------------
    def _count(self, op: str, nbytes: int) -> None:
        self.bytes[op] += int(nbytes)
        self.calls[op] += 1

    def report(self) -> dict:
        """Logical bytes per op kind since the last reset, plus ``total``; and how many collectives of each
        kind were issued (``<op>_calls``), plus ``total_calls``. Every value is a plain number."""
        ops = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
        out = {op: 0 for op in ops}
        out.update(self.bytes)
        out["total"] = sum(self.bytes.values())
        for op in sorted(set(ops) | set(self.calls)):
            out[f"{op}_calls"] = self.calls[op]
        out["total_calls"] = sum(self.calls.values())
        return out

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    # -- collectives ------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, *, average: bool = False, op=None, async_op: bool = False):
        if self.size == 1:
            return _Done()
        self._count("all_reduce", 2 * _nbytes(tensor))
        if average and op is None and self.native_avg:
            op, average = dist.ReduceOp.AVG, False
        with heartbeat.collective(f"{self.name}.all_reduce"):
            work = dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        if not average:
            return work if async_op else _Done()
        if async_op:
            return _AverageOnWait(work, tensor, self.size)
        tensor.div_(self.size)
        return _Done()

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, average: bool = False,
                       async_op: bool = False):
        """``output`` (numel = input.numel() / size) receives this rank's reduced slice of ``input``."""
        if input.numel() != output.numel() * self.size:
            raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected "
                             f"{output.numel()} x {self.size}")
        if self.size == 1:
            output.copy_(input)
            return _Done()
        self._count("reduce_scatter", _nbytes(input))
        op = dist.ReduceOp.SUM
        if average and self.native_avg:
            op, average = dist.ReduceOp.AVG, False
        with heartbeat.collective(f"{self.name}.reduce_scatter"):
            if input.device.type == "cpu" and _is_own_slice(output, input, self.rank):
                work = dist.all_reduce(input, op=op, group=self.group, async_op=async_op)
            else:
                work = dist.reduce_scatter_tensor(output, input, op=op, group=self.group, async_op=async_op)
        if not average:
            return work if async_op else _Done()
        if async_op:
            return _AverageOnWait(work, output, self.size)
        output.div_(self.size)
        return _Done()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False):
        """``output`` (numel = input.numel() * size) receives every rank's ``input``, in rank order."""
        if output.numel() != input.numel() * self.size:
            raise ValueError(f"all_gather: output has {output.numel()} elements, expected "
                             f"{input.numel()} x {self.size}")
        if self.size == 1:
            output.copy_(input)
            return _Done()
        self._count("all_gather", _nbytes(output))
        with heartbeat.collective(f"{self.name}.all_gather"):
            if output.device.type == "cpu" and output.is_contiguous():
                work = self._broadcast_gather(output, input)
                if not async_op:
                    work.wait()
            else:
                work = dist.all_gather_into_tensor(output, input, group=self.group, async_op=async_op)
        return work if async_op else _Done()

    def _broadcast_gather(self, output: torch.Tensor, input: torch.Tensor) -> _AllDone:
        """All-gather as one async broadcast per rank into the chunks of ``output`` (gloo: faster)."""
        if self._ranks is None:
            self._ranks = (dist.get_process_group_ranks(self.group) if self.group is not None
                           else list(range(self.size)))
        chunks = output.view(-1).chunk(self.size)
        own = chunks[self.rank]
        if own.data_ptr() != input.data_ptr():
            own.copy_(input.reshape(-1))
        return _AllDone([dist.broadcast(chunk, src=self._ranks[r], group=self.group, async_op=True)
                         for r, chunk in enumerate(chunks)])

    def broadcast(self, tensor: torch.Tensor, src_rank_in_group: int = 0, *, async_op: bool = False):
        if self.size == 1:
            return _Done()
        self._count("broadcast", _nbytes(tensor))
        src = dist.get_global_rank(self.group, src_rank_in_group) if self.group is not None else src_rank_in_group
        with heartbeat.collective(f"{self.name}.broadcast"):
            work = dist.broadcast(tensor, src=src, group=self.group, async_op=async_op)
        return work if async_op else _Done()

    def barrier(self) -> None:
        if self.size > 1:
            with heartbeat.collective(f"{self.name}.barrier"):
                dist.barrier(group=self.group)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
