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
(how the engine always calls it) is a pairwise exchange -- every rank sends each peer that peer's slice and
adds the slices it receives into its own, so each rank moves (N-1)/N of the input, half of what an
all-reduce moves (the other slices of the input are left as they were; callers never read them) -- and an
all-gather is one async broadcast per rank into the output's chunks. The exchange goes in slices of at most
``EXCHANGE_NUMEL`` elements per peer, two in flight, so its receive buffers stay bounded whatever the unit.

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


EXCHANGE_NUMEL = 1 << 21  # elements per peer per slice of the pairwise reduce-scatter (8 MB in fp32)
_TAGS = 1 << 24             # p2p tags cycle through this many (every rank issues the same sequence)


class _PairwiseReduceScatter:
    """Reduce-scatter by pairwise exchange (gloo): peer q gets slice q of ``input`` from this rank and this
    rank receives its own slice from every peer, in slices of ``EXCHANGE_NUMEL`` with two in flight; the
    received parts are added into ``output`` (this rank's slice of ``input``) in rank order. The first two
    slices are posted at construction, the rest by ``wait``."""

    def __init__(self, comm: "Comm", output: torch.Tensor, input: torch.Tensor, average: bool):
        self._comm, self._out, self._average = comm, output, average
        self._chunks = input.view(-1).chunk(comm.size)
        n = output.numel()
        self._bounds = [(lo, min(n, lo + EXCHANGE_NUMEL)) for lo in range(0, n, EXCHANGE_NUMEL)]
        width = min(n, EXCHANGE_NUMEL)
        self._recv = [[torch.empty(width, dtype=output.dtype, device=output.device) for _ in range(comm.size)]
                      for _ in range(min(2, len(self._bounds)))]
        self._posted: list = []  # (slice index, works)
        self._next = 0
        self._done = False
        for _ in self._recv:
            self._post()

    def _post(self) -> None:
        k, (lo, hi) = self._next, self._bounds[self._next]
        self._next += 1
        comm, rank, works = self._comm, self._comm.rank, []
        tag = comm._next_tag()
        bufs = self._recv[k % len(self._recv)]
        for q in range(comm.size):
            if q != rank:
                peer = comm.global_rank(q)
                works.append(dist.isend(self._chunks[q][lo:hi], peer, group=comm.group, tag=tag))
                works.append(dist.irecv(bufs[q][:hi - lo], peer, group=comm.group, tag=tag))
        self._posted.append((k, works))

    def wait(self) -> bool:
        if self._done:
            return True
        while self._posted:
            k, works = self._posted.pop(0)
            for w in works:
                w.wait()
            lo, hi = self._bounds[k]
            out = self._out[lo:hi]
            bufs = self._recv[k % len(self._recv)]
            for q in range(self._comm.size):
                if q != self._comm.rank:
                    out.add_(bufs[q][:hi - lo])
            if self._average:
                out.div_(self._comm.size)
            if self._next < len(self._bounds):
                self._post()
        self._recv = []
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
        self._ranks = None  # global ranks of the group, for the broadcast all-gather and the exchange
        self._tag = 0

    def global_rank(self, rank_in_group: int) -> int:
        if self._ranks is None:
            self._ranks = (dist.get_process_group_ranks(self.group) if self.group is not None
                           else list(range(self.size)))
        return self._ranks[rank_in_group]

    def _next_tag(self) -> int:
        self._tag = (self._tag + 1) % _TAGS
        return self._tag

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
                work = _PairwiseReduceScatter(self, output, input, average)
                if not async_op:
                    work.wait()
                return work if async_op else _Done()
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
        chunks = output.view(-1).chunk(self.size)
        own = chunks[self.rank]
        if own.data_ptr() != input.data_ptr():
            own.copy_(input.reshape(-1))
        return _AllDone([dist.broadcast(chunk, src=self.global_rank(r), group=self.group, async_op=True)
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
