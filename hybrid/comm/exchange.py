"""gloo's collectives of CPU tensors, by faster algorithms with the same results: a transport on top of the
group's own (``ProcessGroupTransport``), which carries what this one does not.

gloo's own reduce-scatter copies its whole input and all-reduces it, and its all-gather is several times
slower than one broadcast per rank (bench/RESULTS.md). So, for CPU tensors:

* a reduce-scatter whose output is this rank's slice of the input (how the engine always calls it) is a
  pairwise exchange: every rank sends each peer that peer's slice and adds the slices it receives into its
  own, so each rank moves (N-1)/N of the input, half of what an all-reduce moves (the other slices of the
  input keep this rank's values; callers never read them);
* an all-gather into a contiguous output is one async broadcast per rank into the output's chunks;
* an all-reduce (sum or mean) of ``all_reduce_min_numel`` elements or more is the exchange followed by that
  all-gather (a 98M-parameter stage-0 step 1540 -> 1314 ms on 2 ranks); smaller ones, and other reductions,
  stay gloo's, which was as fast at 4M elements and keeps no receive buffers.

The exchange goes in slices of ``width`` elements per peer with ``slots`` slices in flight, as the plan's
arithmetic ``shape(numel, N) -> (width, slices, slots)`` says (``hybrid.comm.collectives``' thresholds and
``_exchange_shape``, which the memory model shares, given when the transport is chosen). Its receive buffers
are kept for later calls in a ``BufferPool`` of ``cap_numel`` elements (the buffers in use and kept
together, while handles are waited in launch order; a call that would pass the cap starts in its handle's
``wait`` instead, unless none is in use).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from hybrid.comm.buffer_pool import BufferPool
from hybrid.comm.transport import DONE, AllDone, Relay, Transport, averaged, is_own_slice

_TAGS = 1 << 24  # p2p tags cycle through this many (every rank issues the same sequence)


class ExchangeTransport(Relay):
    def __init__(self, fallback: Transport, group, rank: int, size: int, *, cap_numel: int,
                 shape: Callable[[int, int], tuple], all_reduce_min_numel: int):
        super().__init__(fallback)
        self.group, self.rank, self.size = group, rank, size  # group None: the default group
        self.pool = BufferPool(cap_numel)  # the exchange's receive buffers, reused by later calls
        self.shape = shape
        self._all_reduce_min_numel = all_reduce_min_numel
        self._ranks = None  # global ranks of the group
        self._tag = 0

    def all_reduce(self, tensor, *, op=None, average=False, async_op=False):
        if op is not None or not tensor.is_contiguous() or tensor.numel() < self._all_reduce_min_numel:
            return self.fallback.all_reduce(tensor, op=op, average=average, async_op=async_op)
        work = _ExchangeAllReduce(self, tensor)
        if not async_op:
            work.wait()
        return averaged(work, tensor, average, self.size, async_op)

    def reduce_scatter(self, output, input, *, average=False, async_op=False):
        if not is_own_slice(output, input, self.rank):
            return self.fallback.reduce_scatter(output, input, average=average, async_op=async_op)
        work = _PairwiseReduceScatter(self, input, average)
        if not async_op:
            work.wait()
        return work if async_op else DONE

    def all_gather(self, output, input, *, async_op=False):
        if not output.is_contiguous():
            return self.fallback.all_gather(output, input, async_op=async_op)
        work = self.broadcast_gather(output, input)
        if not async_op:
            work.wait()
        return work if async_op else DONE

    def broadcast_gather(self, output: torch.Tensor, input: torch.Tensor) -> AllDone:
        """All-gather as one async broadcast per rank into the chunks of ``output``."""
        chunks = output.view(-1).tensor_split(self.size)
        own = chunks[self.rank]
        if own.data_ptr() != input.data_ptr():
            own.copy_(input.reshape(-1))
        return AllDone([dist.broadcast(chunk, src=self.global_rank(r), group=self.group, async_op=True)
                        for r, chunk in enumerate(chunks)])

    def buffer_tensors(self) -> list:
        return self.pool.kept() + self.fallback.buffer_tensors()

    def close(self) -> None:
        self.pool.clear()
        self.fallback.close()

    def global_rank(self, rank_in_group: int) -> int:
        if self._ranks is None:
            self._ranks = (dist.get_process_group_ranks(self.group) if self.group is not None
                           else list(range(self.size)))
        return self._ranks[rank_in_group]

    def next_tag(self) -> int:
        self._tag = (self._tag + 1) % _TAGS
        return self._tag


class _PairwiseReduceScatter:
    """Reduce-scatter by pairwise exchange. ``input`` is cut into N parts (``tensor_split``: sizes differ by at
    most one); peer q gets part q from this rank and this rank receives its own part from every peer, in
    slices of ``width`` elements with ``slots`` in flight, and adds them into its part in rank order. The
    first slices are posted at construction (unless the receive buffers in use are at the cap), the rest by
    ``wait``."""

    def __init__(self, transport: ExchangeTransport, input: torch.Tensor, average: bool):
        self._t, self._average = transport, average
        self._parts = input.view(-1).tensor_split(transport.size)
        self._own = self._parts[transport.rank]
        self._peers = [q for q in range(transport.size) if q != transport.rank]
        self._width, self._n_slices, self._slots = transport.shape(input.numel(), transport.size)
        self._recv: list = []
        self._posted: list = []  # (slice index, works)
        self._next = 0
        self._done = self._n_slices == 0
        if not self._done and transport.pool.may_take(self._slots * (transport.size - 1) * self._width):
            self._start()

    @property
    def output(self) -> torch.Tensor:
        return self._own

    def _start(self) -> None:
        numel, pool = (self._t.size - 1) * self._width, self._t.pool
        self._recv = [pool.take(numel, self._own.dtype, self._own.device) for _ in range(self._slots)]
        for _ in self._recv:
            self._post()

    def _cut(self, part: torch.Tensor, k: int) -> torch.Tensor:
        # a part is cut every `width` elements: the slice length when there are several, the whole part when one
        return part[k * self._width:(k + 1) * self._width]

    def _post(self) -> None:
        k = self._next
        self._next += 1
        t, works = self._t, []
        tag = t.next_tag()
        mine = self._cut(self._own, k).numel()
        for q, buf in self._peer_parts(k):
            peer = t.global_rank(q)
            send = self._cut(self._parts[q], k)
            if send.numel():
                works.append(dist.isend(send, peer, group=t.group, tag=tag))
            if mine:
                works.append(dist.irecv(buf[:mine], peer, group=t.group, tag=tag))
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
                out.div_(self._t.size)
            if self._next < self._n_slices:
                self._post()
        for buf in self._recv:
            self._t.pool.give(buf)
        self._recv = []
        self._done = True
        return True

    def _peer_parts(self, k: int) -> list:
        """``(peer, its receive part)`` of the buffer slice ``k`` uses."""
        buf = self._recv[k % len(self._recv)]
        return [(q, buf[j * self._width:(j + 1) * self._width]) for j, q in enumerate(self._peers)]


class _ExchangeAllReduce:
    """All-reduce (sum) as the pairwise reduce-scatter, then one broadcast per rank of its reduced part (the
    all-gather of ``ExchangeTransport.broadcast_gather``), started by ``wait``."""

    def __init__(self, transport: ExchangeTransport, tensor: torch.Tensor):
        self._t, self._tensor = transport, tensor
        self._scatter = _PairwiseReduceScatter(transport, tensor, average=False)
        self._done = False

    def wait(self) -> bool:
        if not self._done:
            self._scatter.wait()
            self._t.broadcast_gather(self._tensor, self._scatter.output).wait()
            self._done = True
        return True
