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
slower than one broadcast per rank (bench/RESULTS.md). On CPU tensors (gloo) faster equivalents are used,
with the same logical byte counts:

* a reduce-scatter whose output is this rank's slice of the input (how the engine always calls it) is a
  pairwise exchange: every rank sends each peer that peer's slice and adds the slices it receives into its
  own, so each rank moves (N-1)/N of the input, half of what an all-reduce moves (the other slices of the
  input keep this rank's values; callers never read them);
* an all-gather is one async broadcast per rank into the output's chunks;
* an all-reduce (sum) of ``EXCHANGE_MIN_NUMEL`` elements or more is the exchange followed by that
  all-gather (a 98M-parameter stage-0 step 1540 -> 1314 ms on 2 ranks); smaller ones stay gloo's, which
  was as fast at 4M elements and keeps no receive buffers.

The exchange goes in slices of at most ``EXCHANGE_NUMEL`` elements per peer, ``EXCHANGE_SLICES`` in
flight; its receive buffers are kept for later calls in a ``BufferPool`` (``Comm.buffer_tensors()``), and
in use and kept together stay within ``exchange_cap_numel(N)`` elements while handles are waited in launch
order.

When every rank of a gloo group is on this host, CPU tensors of ``SHM_MIN_BYTES`` or more go through
shared memory instead (``hybrid.comm.shm``: an all-reduce, reduce-scatter or all-gather of 16 MB between
two ranks in ~5 ms where gloo took ~14 ms, the exchange ~6-13 ms); the group connects at its first such call
(collectively: every rank makes the same calls) and falls back to the paths above for good when the ranks
cannot share memory.

Every collective issued is recorded in ``hybrid.comm.heartbeat`` (entered, and inside it until it returns), so
the launcher can tell which rank its peers were waiting for when they time out.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

import torch
import torch.distributed as dist

from hybrid.comm import heartbeat
from hybrid.comm.buffer_pool import BufferPool
from hybrid.comm.shm import ShmGroup
from hybrid.plan.layout import (EXCHANGE_MIN_NUMEL, EXCHANGE_NUMEL, EXCHANGE_SLICES, SHM_MIN_BYTES, exchange_cap_numel,
                                exchange_numel, exchange_shape)


# broadcast_many packs tensors below this many elements into one buffer per dtype (a copy in and out);
# larger ones are worth their own collective and no copy.
COALESCE_MAX_NUMEL = 1 << 20


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


_shm_groups: dict = {}  # process group -> its ShmGroup, or None where the ranks cannot share memory
_TAGS = 1 << 24             # p2p tags cycle through this many (every rank issues the same sequence)


class _PairwiseReduceScatter:
    """Reduce-scatter by pairwise exchange (gloo). ``input`` is cut into N parts (``tensor_split``: sizes
    differ by at most one); peer q gets part q from this rank and this rank receives its own part from every
    peer, in slices of ``EXCHANGE_NUMEL`` with ``EXCHANGE_SLICES`` in flight, and adds them into its part
    in rank order. The first slices are posted at construction (unless the receive buffers in use are at
    the cap), the rest by ``wait``."""

    def __init__(self, comm: "Comm", input: torch.Tensor, average: bool):
        self._comm, self._average = comm, average
        self._parts = input.view(-1).tensor_split(comm.size)
        self._own = self._parts[comm.rank]
        self._peers = [q for q in range(comm.size) if q != comm.rank]
        self._width, self._n_slices, self._slots = exchange_shape(input.numel(), comm.size, EXCHANGE_NUMEL,
                                                                   EXCHANGE_SLICES)
        self._recv: list = []
        self._posted: list = []  # (slice index, works)
        self._next = 0
        self._done = self._n_slices == 0
        if not self._done and comm.exchange_pool.may_take(self._slots * (comm.size - 1) * self._width):
            self._start()

    @property
    def output(self) -> torch.Tensor:
        return self._own

    def _start(self) -> None:
        numel, pool = (self._comm.size - 1) * self._width, self._comm.exchange_pool
        self._recv = [pool.take(numel, self._own.dtype, self._own.device) for _ in range(self._slots)]
        for _ in self._recv:
            self._post()

    @staticmethod
    def _cut(part: torch.Tensor, k: int) -> torch.Tensor:
        return part[k * EXCHANGE_NUMEL:(k + 1) * EXCHANGE_NUMEL]

    def _post(self) -> None:
        k = self._next
        self._next += 1
        comm, works = self._comm, []
        tag = comm._next_tag()
        mine = self._cut(self._own, k).numel()
        for q, buf in self._peer_parts(k):
            peer = comm.global_rank(q)
            send = self._cut(self._parts[q], k)
            if send.numel():
                works.append(dist.isend(send, peer, group=comm.group, tag=tag))
            if mine:
                works.append(dist.irecv(buf[:mine], peer, group=comm.group, tag=tag))
        self._posted.append((k, works))

    def wait(self) -> bool:
        if self._done:
            return True
        if not self._recv:  # deferred at launch: the buffers in use were at the cap
            self._start()
        while self._posted:
            k, works = self._posted.pop(0)
            for w in works:
                w.wait()
            out = self._cut(self._own, k)
            for _, buf in self._peer_parts(k):
                out.add_(buf[:out.numel()])
            if self._average:
                out.div_(self._comm.size)
            if self._next < self._n_slices:
                self._post()
        for buf in self._recv:
            self._comm.exchange_pool.give(buf)
        self._recv = []
        self._done = True
        return True

    def _peer_parts(self, k: int) -> list:
        """``(peer, its receive part)`` of the buffer slice ``k`` uses."""
        buf = self._recv[k % len(self._recv)]
        return [(q, buf[j * self._width:(j + 1) * self._width]) for j, q in enumerate(self._peers)]


class _ExchangeAllReduce:
    """All-reduce (sum) on gloo as the pairwise reduce-scatter, then one broadcast per rank of its reduced
    part (the all-gather of ``Comm._broadcast_gather``), started by ``wait``."""

    def __init__(self, comm: "Comm", tensor: torch.Tensor):
        self._comm, self._tensor = comm, tensor
        self._scatter = _PairwiseReduceScatter(comm, tensor, average=False)
        self._done = False

    def wait(self) -> bool:
        if not self._done:
            self._scatter.wait()
            self._comm._broadcast_gather(self._tensor, self._scatter.output).wait()
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
            # "nccl", or "cpu:gloo,cuda:nccl" (hybrid.comm.mesh's groups): AVG for CUDA tensors, which NCCL moves
            self.native_avg = "nccl" in str(dist.get_backend(group)).lower()
        else:
            self.size, self.rank = 1, 0
        self.bytes: Counter = Counter()
        self.calls: Counter = Counter()
        self._ranks = None  # global ranks of the group, for the broadcast all-gather and the exchange
        self._tag = 0
        # The exchange's receive buffers, reused by later calls (a layout's units come in a few sizes); a
        # call that would pass the cap starts in its handle's wait() instead (unless none is in use).
        self.exchange_pool = BufferPool(exchange_cap_numel(self.size, EXCHANGE_NUMEL, EXCHANGE_SLICES))
        self._shm: Optional[ShmGroup] = None
        self._shm_tried = False

    def _shared_memory(self, tensor: torch.Tensor) -> Optional[ShmGroup]:
        """The group's shared-memory transport for ``tensor`` (CPU, contiguous, ``SHM_MIN_BYTES`` or more, a
        dtype that adds), connecting at the first such call; ``None`` where it does not apply."""
        if (tensor.device.type != "cpu" or not tensor.is_contiguous() or _nbytes(tensor) < SHM_MIN_BYTES
                or tensor.dtype == torch.bool or tensor.is_complex()):
            return None
        if not self._shm_tried:
            self._shm_tried = True
            group = self.group if self.group is not None else dist.group.WORLD
            _forget_destroyed_groups()
            if group not in _shm_groups:  # one transport per group, shared by every Comm over it
                _shm_groups[group] = ShmGroup.connect(group, label=f"{self.name} shared-memory collective")
            self._shm = _shm_groups[group]
        return self._shm

    def global_rank(self, rank_in_group: int) -> int:
        if self._ranks is None:
            self._ranks = (dist.get_process_group_ranks(self.group) if self.group is not None
                           else list(range(self.size)))
        return self._ranks[rank_in_group]

    def _next_tag(self) -> int:
        self._tag = (self._tag + 1) % _TAGS
        return self._tag

    def buffer_tensors(self) -> list:
        """The buffers this comm keeps between calls (for memory reports): the exchange's receive buffers and
        this rank's shared-memory region."""
        return self.exchange_pool.kept() + ([self._shm.own_region()] if self._shm else [])

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
        if average and op is None and self.native_avg and tensor.is_cuda:
            op, average = dist.ReduceOp.AVG, False
        with heartbeat.collective(f"{self.name}.all_reduce"):
            shm = self._shared_memory(tensor) if op is None else None
            if shm:
                shm.all_reduce(tensor)
                work = _Done()
            elif (op is None and tensor.device.type == "cpu" and tensor.is_contiguous()
                    and tensor.numel() >= EXCHANGE_MIN_NUMEL):
                work = _ExchangeAllReduce(self, tensor)
                if not async_op:
                    work.wait()
            else:
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
        if average and self.native_avg and input.is_cuda:
            op, average = dist.ReduceOp.AVG, False
        with heartbeat.collective(f"{self.name}.reduce_scatter"):
            if input.device.type == "cpu" and _is_own_slice(output, input, self.rank):
                shm = self._shared_memory(input)
                if shm:
                    shm.reduce_scatter(input, average)
                    return _Done()
                work = _PairwiseReduceScatter(self, input, average)
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
            shm = self._shared_memory(output)
            if shm:
                shm.all_gather(output, input)
                work = _Done()
            elif output.device.type == "cpu" and output.is_contiguous():
                work = self._broadcast_gather(output, input)
                if not async_op:
                    work.wait()
            else:
                work = dist.all_gather_into_tensor(output, input, group=self.group, async_op=async_op)
        return work if async_op else _Done()

    def _broadcast_gather(self, output: torch.Tensor, input: torch.Tensor) -> _AllDone:
        """All-gather as one async broadcast per rank into the chunks of ``output`` (gloo: faster)."""
        chunks = output.view(-1).tensor_split(self.size)
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

    def broadcast_many(self, tensors, src_rank_in_group: int = 0) -> None:
        """Every tensor of ``tensors`` from ``src_rank_in_group``, in place: tensors under
        ``COALESCE_MAX_NUMEL`` elements packed into one broadcast per dtype and device (a model's hundreds of
        BatchNorm statistics are one collective, not hundreds), larger ones broadcast as they are; a tensor
        listed twice moves once. Counted as one broadcast per collective issued, of the bytes it moves."""
        if self.size == 1:
            return
        packs, works, seen = {}, [], set()
        for t in tensors:
            if id(t) in seen:
                continue
            seen.add(id(t))
            if t.numel() >= COALESCE_MAX_NUMEL and t.is_contiguous():
                works.append(self.broadcast(t, src_rank_in_group, async_op=True))
            elif t.numel():
                packs.setdefault((t.dtype, t.device), []).append(t)
        flats = []
        for pack in packs.values():
            flat = torch.cat([t.reshape(-1) for t in pack])
            works.append(self.broadcast(flat, src_rank_in_group, async_op=True))
            flats.append((flat, pack))
        for work in works:
            work.wait()
        if self.rank == src_rank_in_group:
            return
        with torch.no_grad():
            for flat, pack in flats:
                offset = 0
                for t in pack:
                    t.copy_(flat[offset:offset + t.numel()].view(t.shape))
                    offset += t.numel()

    def barrier(self) -> None:
        if self.size > 1:
            with heartbeat.collective(f"{self.name}.barrier"):
                dist.barrier(group=self.group)

    def extremes(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(elementwise max, elementwise min) of ``values`` (a 1-D float tensor, the same length on every rank)
        over the group, from one MAX all-reduce of ``values`` and ``-values``: equal when every rank holds
        the same values."""
        if self.size == 1:
            return values, values
        both = torch.cat([values, -values])
        self.all_reduce(both, op=dist.ReduceOp.MAX)
        return both[:len(values)], -both[len(values):]


def _forget_destroyed_groups() -> None:
    """Drop the transports of groups ``destroy_process_group`` has removed (their doorbells close)."""
    live = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", None)
    if live is not None:
        for group in [g for g in _shm_groups if g not in live]:
            del _shm_groups[group]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
