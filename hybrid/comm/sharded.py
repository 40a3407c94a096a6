"""The collectives of one ZeRO shard group: flat or in two levels (inside the node, then across), exact or int8.

``ShardCollectives`` has the calls the engine makes on its shard group, with ``Comm``'s signatures:

* ``reduce_scatter(output, input)``: ``output`` is this rank's shard of ``input`` (``rank`` is the shard it
  owns, its *position*), which receives the sum (``average``: the mean) of every rank's ``input`` there;
* ``all_gather(output, input)``: ``output`` receives every rank's shard, ``input`` being this rank's;
* ``all_reduce(tensor)``: the whole tensor over the group (any order: flat).

Flat (no ``intra``): each is one collective over the shard group, whose group rank is the position.

Hierarchical (``intra``, ``inter``: the shard group's ranks on this node, and those with this rank's local index
on every node; ``hybrid.plan.links.ShardTopology``): with k ranks per node on m nodes, the rank at local index l
on the n-th node owns shard ``l·m + n``, so a unit of U elements splits into k node parts of U/k, part l being
the shards of every node's l-th rank. A reduce-scatter is the intra-node reduce-scatter of the whole input (rank
l keeps the node's sum of part l), then the inter-node reduce-scatter of part l (rank n keeps its shard); an
all-gather is the inter-node all-gather of the shards into part l, then the intra-node all-gather of the parts.
Only U/k per rank crosses nodes, in k parallel groups, and no level permutes data.

Quantized (``gather_block`` / ``reduce_block``: int8 blocks, ``hybrid.comm.quantize``): the collective that
crosses nodes (the only one, when flat) moves int8 values and their scales instead: an all-gather gathers every
rank's packed shard and unpacks all of them (this rank's too, so every rank computes with the same values); a
reduce-scatter packs each destination's chunk, exchanges them by all-to-all, and sums the unpacked chunks it
receives in fp32. The inside-the-node level stays exact. ``gather_error`` / ``reduce_error`` hold the error of
the values this rank quantized (its own chunk, as it came back).

Async calls return a handle whose ``wait()`` finishes the op: it waits for the first level, runs the second
(or unpacks), and returns once ``output`` holds the result. Every rank waits its handles in the same order (the
engine does), so the second levels, issued inside ``wait``, pair up across ranks.
"""

from __future__ import annotations

from typing import Optional

import torch

from hybrid.comm.collectives import Comm, traffic_report
from hybrid.comm.quantize import QuantError, pack, packed_bytes, unpack
from hybrid.comm.transport import DONE


class Then:
    """A handle: waits for ``first`` (a handle, or None), then calls ``finish()`` once."""

    def __init__(self, first, finish):
        self._first, self._finish, self._done = first, finish, False

    def wait(self) -> bool:
        if not self._done:
            self._done = True
            if self._first is not None:
                self._first.wait()
            self._finish()
        return True

    def is_completed(self) -> bool:
        return self._done


def _finished(handle, async_op: bool):
    if async_op:
        return handle
    handle.wait()
    return DONE


class CommSet:
    """Bookkeeping over a set of ``Comm`` objects (``comms``, each once): their traffic, reset, buffers."""

    def report(self) -> dict:
        return traffic_report(self.comms)

    def reset(self) -> None:
        for comm in self.comms:
            comm.reset()

    def buffer_tensors(self) -> list:
        return [t for comm in self.comms for t in comm.buffer_tensors()]


class ShardCollectives(CommSet):
    def __init__(self, flat: Comm, intra: Optional[Comm] = None, inter: Optional[Comm] = None, *,
                 gather_block: Optional[int] = None, reduce_block: Optional[int] = None):
        if (intra is None) != (inter is None):
            raise ValueError("a hierarchical shard group needs both its intra- and its inter-node comm")
        self.flat, self.intra, self.inter = flat, intra, inter
        self.size = flat.size
        self.rank = flat.rank if intra is None else intra.rank * inter.size + inter.rank  # the shard owned
        self.gather_block, self.reduce_block = gather_block, reduce_block
        self.gather_error, self.reduce_error = QuantError(), QuantError()

    @property
    def hierarchical(self) -> bool:
        return self.intra is not None

    @property
    def comms(self) -> list:
        return [c for c in (self.flat, self.intra, self.inter) if c is not None]

    def _across(self) -> Comm:
        """The comm of the level that crosses nodes: the inter-node one, or the shard group itself."""
        return self.inter if self.hierarchical else self.flat

    def _node_part(self, tensor: torch.Tensor) -> torch.Tensor:
        """Hierarchical: this rank's node part of ``tensor`` (its local index's)."""
        k = self.intra.size
        return tensor.view(-1).tensor_split(k)[self.intra.rank] if k > 1 else tensor.view(-1)

    # -- the collectives --------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, *, average: bool = False, op=None, async_op: bool = False):
        return self.flat.all_reduce(tensor, average=average, op=op, async_op=async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False):
        if self.size == 1 or (not self.hierarchical and self.gather_block is None):
            return self.flat.all_gather(output, input, async_op=async_op)
        part = self._node_part(output) if self.hierarchical else output.view(-1)
        across = self._across()
        if self.gather_block is None:
            first = across.all_gather(part, input, async_op=True)
            finish_part = _nothing
        else:
            first, finish_part = self._quantized_gather(across, part, input)
        if not self.hierarchical:
            return _finished(Then(first, finish_part), async_op)

        def second():
            finish_part()
            self.intra.all_gather(output, part)
        return _finished(Then(first, second), async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, average: bool = False,
                       async_op: bool = False):
        if self.size == 1:
            return self.flat.reduce_scatter(output, input, average=average, async_op=async_op)
        if not self.hierarchical:
            if self.reduce_block is None:
                return self.flat.reduce_scatter(output, input, average=average, async_op=async_op)
            return _finished(self._quantized_reduce(self.flat, output, input.view(-1), average), async_op)
        part = self._node_part(input)
        first = self.intra.reduce_scatter(part, input, average=average, async_op=True)

        def second():
            if self.reduce_block is None:
                self.inter.reduce_scatter(output, part, average=average)
            else:
                self._quantized_reduce(self.inter, output, part, average).wait()
        return _finished(Then(first, second), async_op)

    # -- int8 ------------------------------------------------------------------------------------------
    def _quantized_gather(self, comm: Comm, part: torch.Tensor, input: torch.Tensor) -> tuple:
        """Start gathering every rank's packed ``input`` over ``comm``; returns (handle, finish), finish
        unpacking them into ``part`` (``comm.size`` chunks)."""
        n, chunk, block = comm.size, input.numel(), self.gather_block
        width = packed_bytes(chunk, block)
        received = torch.empty(n, width, dtype=torch.uint8, device=input.device)
        own = received[comm.rank]
        pack(input.reshape(1, -1), block, out=own.view(1, width))
        handle = comm.all_gather(received, own, async_op=True)

        def finish():
            values = unpack(received, chunk, block)
            self.gather_error.add(input, values[comm.rank])
            part.view(n, chunk).copy_(values)
        return handle, finish

    def _quantized_reduce(self, comm: Comm, output: torch.Tensor, input: torch.Tensor, average: bool) -> Then:
        """Reduce-scatter ``input`` over ``comm`` by an all-to-all of its packed chunks; ``output`` is this rank's
        chunk of it (``comm.rank``)."""
        n, chunk, block = comm.size, output.numel(), self.reduce_block
        chunks = input.view(n, chunk)
        sent = pack(chunks, block)
        received = torch.empty_like(sent)
        handle = comm.all_to_all(received, sent, async_op=True)

        def finish():
            values = unpack(received, chunk, block)
            self.reduce_error.add(chunks[comm.rank], values[comm.rank])
            total = values.sum(dim=0)
            if average:
                total.div_(n)
            output.copy_(total.view_as(output))
        return Then(handle, finish)



def _nothing() -> None:
    pass
