"""The one place collectives are called.

`Comm` wraps a process group (the DP group, the TP group, or the world) and counts the *logical* bytes
each collective moves, using the accounting of the ZeRO paper (``shared/seed/zero-stages.txt``):

* all-reduce of a tensor X counts ``2·|X|`` (a reduce-scatter plus an all-gather),
* reduce-scatter counts the full input ``|X|``,
* all-gather counts the full output ``|X|``,
* broadcast counts ``|X|``,
* all-to-all counts its input ``|X|`` (what a reduce-scatter of it would count).

Each count is also split by link (``hybrid.plan.links.split``): given ``nodes``, the node of each rank of the
group, the share a ring over the group sends across node boundaries is counted ``inter``, the rest ``intra``
(``report()["inter"]``, ``["intra"]``, and ``<op>_inter`` per op kind). Without ``nodes`` the group is taken
to be on one node.

It also counts the collectives themselves, per op kind (``report()["all_gather_calls"]``, ...), and records
every collective issued in ``hybrid.comm.heartbeat`` (entered, and inside it until it returns), so the
launcher can tell which rank its peers were waiting for when they time out. Both happen here, in
``Comm._carrying``, the same whichever transport carries the bytes.

A group of size 1 moves nothing: the call is a no-op (all-gather / reduce-scatter become copies) and
nothing is counted (``Comm.solo``). With ``HYBRID_FORCE_COLLECTIVES=1`` (``collectives_forced``, read when a
``Comm`` is made) a group of one issues every collective for real instead, through torch.distributed on the
group, and counts it: a sum over one rank is the identity, so results do not change, and one GPU then runs
NCCL's all-gather, reduce-scatter and all-reduce on every path a multi-GPU job takes. Callers that skip work
which only exists to communicate ask ``comm.solo``, never the size. Async ops return a handle with
``.wait()`` in every case, so callers never branch on the group size. Callers that want a mean pass
``average=True`` (NCCL averages in the collective; on gloo the sum is divided by the group size).

The bytes move by transports (``hybrid.comm.transport``), chosen once, when the ``Comm`` is made, for its
group (`GroupTransports`):

* tensors not on the CPU: torch.distributed on the group (``ProcessGroupTransport``, NCCL or gloo);
* CPU tensors, on a group whose backend has gloo: the faster gloo algorithms of ``ExchangeTransport``
  (pairwise-exchange reduce-scatter, one broadcast per rank for an all-gather, and both for all-reduces of
  ``EXCHANGE_MIN_NUMEL`` elements or more), handing the rest to the group's own collectives;
* and on a gloo group, above that, ``SharedMemoryTransport`` for CPU tensors of ``SHM_MIN_BYTES`` or more
  where every rank is on this host (which it learns collectively at its first call, and falls back to the
  exchange for good where they are not). The connection is one per group, shared by every ``Comm`` over it.

The thresholds (``EXCHANGE_*``, ``SHM_MIN_BYTES``) are read when the transports are chosen. ``Comm.close``
releases what they keep; a group's shared-memory connection is closed when no open ``Comm`` holds it, or
once ``destroy_process_group`` has removed the group (``hybrid.comm.shm_transport``).
"""

from __future__ import annotations

import os
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from hybrid.comm import heartbeat
from hybrid.comm.exchange import ExchangeTransport
from hybrid.comm.process_group import ProcessGroupTransport
from hybrid.comm.shm_transport import SharedMemoryTransport
from hybrid.comm.transport import Closed, Solo, Transport
from hybrid.plan import layout as _layout
from hybrid.plan.links import inter_fraction
from hybrid.plan.layout import EXCHANGE_MIN_NUMEL, EXCHANGE_NUMEL, EXCHANGE_SLICES, SHM_MIN_BYTES
from hybrid.plan.layout import exchange_numel  # noqa: F401  (hybrid.comm's name for the memory model's figure)
from hybrid.errors import ConfigError


# broadcast_many packs tensors below this many elements into one buffer per dtype (a copy in and out);
# larger ones are worth their own collective and no copy.
COALESCE_MAX_NUMEL = 1 << 20


# The thresholds and buffer sizes are layout arithmetic (hybrid.plan.layout: the memory model counts the same
# buffers); a Comm reads them from this module when it chooses its transports, so a test may set them here.


FORCE_COLLECTIVES_ENV = "HYBRID_FORCE_COLLECTIVES"


def collectives_forced() -> bool:
    """Whether ``HYBRID_FORCE_COLLECTIVES`` asks groups of one rank to issue their collectives for real ("1";
    unset, empty or "0": no). The one place the switch is read."""
    value = os.environ.get(FORCE_COLLECTIVES_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ConfigError(f"{FORCE_COLLECTIVES_ENV} is {value!r}; set it to 1 (groups of one rank issue their "
                          "collectives for real) or 0 (they skip them), or unset it.")
    return value == "1"


def _exchange_shape(numel: int, size: int) -> tuple:
    """``hybrid.plan.layout.exchange_shape`` with this module's slice size and slices in flight."""
    return _layout.exchange_shape(numel, size, EXCHANGE_NUMEL, EXCHANGE_SLICES)


def exchange_cap_numel(size: int) -> int:
    """``hybrid.plan.layout.exchange_cap_numel`` with this module's slice size and slices in flight."""
    return _layout.exchange_cap_numel(size, EXCHANGE_NUMEL, EXCHANGE_SLICES)


@dataclass(frozen=True)
class GroupTransports:
    """The transports a Comm chose for its group: ``cpu`` carries CPU tensors, ``own`` (torch.distributed on
    the group) every other tensor, and what the CPU transports hand down."""

    cpu: Transport
    own: Transport

    def for_tensor(self, tensor: torch.Tensor) -> Transport:
        return self.cpu if tensor.device.type == "cpu" else self.own

    def buffer_tensors(self) -> list:
        return self.cpu.buffer_tensors()

    def close(self) -> None:
        self.cpu.close()
        self.own.close()


def _choose_transports(group, name: str) -> GroupTransports:
    """The transports of ``group`` (``None``: the default group), from its backend and size and the
    thresholds as they are now. A group of one (forced to communicate: ``collectives_forced``) gets
    torch.distributed on the group for every tensor, the transport a GPU tensor takes in any group."""
    backend, rank, size = str(dist.get_backend(group)).lower(), dist.get_rank(group), dist.get_world_size(group)
    own = ProcessGroupTransport(group, backend, size)
    cpu: Transport = own
    if size == 1:
        return GroupTransports(cpu=own, own=own)
    if "gloo" in backend:
        cpu = ExchangeTransport(cpu, group, rank, size, cap_numel=exchange_cap_numel(size), shape=_exchange_shape,
                                all_reduce_min_numel=EXCHANGE_MIN_NUMEL)
    if backend == "gloo":  # only a group that is gloo alone (ShmGroup.connect checks it too)
        cpu = SharedMemoryTransport(cpu, group, rank, size, min_bytes=SHM_MIN_BYTES,
                                    label=f"{name} shared-memory collective")
    return GroupTransports(cpu=cpu, own=own)


class Comm:
    """Collectives over one process group, with byte counters per op kind."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None, name: str = "dp",
                 nodes: Optional[Sequence[int]] = None):
        self.name = name
        self.group = group
        initialized = dist.is_available() and dist.is_initialized()
        if initialized:
            self.size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
        else:
            self.size, self.rank = 1, 0
        if nodes is not None and len(nodes) != self.size:
            raise ValueError(f"Comm {name!r}: nodes names {len(nodes)} ranks, the group has {self.size}")
        self.nodes = tuple(nodes) if nodes is not None else (0,) * self.size
        self._inter = float(inter_fraction(len(set(self.nodes)), self.size))
        # True: this Comm moves nothing (a group of one not forced to communicate); what exists only to
        # communicate may be skipped. Decided once, here, with the transports.
        self.solo = self.size == 1 and not (initialized and collectives_forced())
        self.bytes: Counter = Counter()
        self.inter_bytes: Counter = Counter()
        self.calls: Counter = Counter()
        # Chosen once, here; a collective only takes ``cpu`` or ``own`` by where its tensor is.
        solo = Solo()
        self.transports = GroupTransports(cpu=solo, own=solo) if self.solo else _choose_transports(group, name)

    def close(self) -> None:
        """Release what this Comm's transports keep between calls: the exchange's buffers, and its hold on the
        group's shared-memory connection (closed once no Comm holds it; the next to need one connects again,
        collectively, so every rank closes the same Comms at the same point). Collectives on a closed Comm
        are an error."""
        self.transports.close()
        closed = Closed(self.name)
        self.transports = GroupTransports(cpu=closed, own=closed)

    def buffer_tensors(self) -> list:
        """The buffers this comm's transports keep between calls (for memory reports): the exchange's receive
        buffers and this rank's shared-memory region."""
        return self.transports.buffer_tensors()

    # -- accounting -------------------------------------------------------------------------------
    @contextmanager
    def _carrying(self, op: str, nbytes: Optional[int]) -> Iterator[None]:
        """Around every collective, whichever transport carries it: ``op`` and its logical ``nbytes`` counted
        (``None``: a barrier, not counted) and the heartbeat inside it until the transport returns. A solo
        Comm moves nothing and records nothing."""
        if self.solo:
            yield
            return
        if nbytes is not None:
            self.bytes[op] += int(nbytes)
            self.inter_bytes[op] += int(nbytes) * self._inter
            self.calls[op] += 1
        with heartbeat.collective(f"{self.name}.{op}"):
            yield

    def report(self) -> dict:
        """Logical bytes per op kind since the last reset, plus ``total``; how many collectives of each kind
        were issued (``<op>_calls``), plus ``total_calls``; and the bytes by link: ``inter`` (across nodes) and
        ``intra`` in all, ``<op>_inter`` per op kind. Every value is a plain number."""
        return traffic_report([self])

    def reset(self) -> None:
        self.bytes.clear()
        self.inter_bytes.clear()
        self.calls.clear()

    # -- collectives ------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, *, average: bool = False, op=None, async_op: bool = False):
        with self._carrying("all_reduce", 2 * _nbytes(tensor)):
            return self.transports.for_tensor(tensor).all_reduce(tensor, op=op, average=average,
                                                                 async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, average: bool = False,
                       async_op: bool = False):
        """``output`` (numel = input.numel() / size) receives this rank's reduced slice of ``input``."""
        if input.numel() != output.numel() * self.size:
            raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected "
                             f"{output.numel()} x {self.size}")
        with self._carrying("reduce_scatter", _nbytes(input)):
            return self.transports.for_tensor(input).reduce_scatter(output, input, average=average,
                                                                    async_op=async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False):
        """``output`` (numel = input.numel() * size) receives every rank's ``input``, in rank order."""
        if output.numel() != input.numel() * self.size:
            raise ValueError(f"all_gather: output has {output.numel()} elements, expected "
                             f"{input.numel()} x {self.size}")
        with self._carrying("all_gather", _nbytes(output)):
            return self.transports.for_tensor(output).all_gather(output, input, async_op=async_op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False):
        """``output.view(-1).tensor_split(N)[q]`` receives part ``rank`` of rank q's ``input`` (equal parts)."""
        if input.numel() != output.numel() or input.numel() % self.size:
            raise ValueError(f"all_to_all: input has {input.numel()} elements and output {output.numel()}; both "
                             f"must be the same multiple of {self.size}")
        with self._carrying("all_to_all", _nbytes(input)):
            return self.transports.for_tensor(input).all_to_all(output, input, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src_rank_in_group: int = 0, *, async_op: bool = False):
        with self._carrying("broadcast", _nbytes(tensor)):
            return self.transports.for_tensor(tensor).broadcast(tensor, src_rank_in_group, async_op=async_op)

    def broadcast_many(self, tensors, src_rank_in_group: int = 0) -> None:
        """Every tensor of ``tensors`` from ``src_rank_in_group``, in place: tensors under
        ``COALESCE_MAX_NUMEL`` elements packed into one broadcast per dtype and device (a model's hundreds of
        BatchNorm statistics are one collective, not hundreds), larger ones broadcast as they are; a tensor
        listed twice moves once. Counted as one broadcast per collective issued, of the bytes it moves."""
        if self.solo:
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
        with self._carrying("barrier", None):
            self.transports.own.barrier()

    def extremes(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(elementwise max, elementwise min) of ``values`` (a 1-D float tensor, the same length on every rank)
        over the group, from one MAX all-reduce of ``values`` and ``-values``: equal when every rank holds
        the same values."""
        if self.solo:
            return values, values
        both = torch.cat([values, -values])
        self.all_reduce(both, op=dist.ReduceOp.MAX)
        return both[:len(values)], -both[len(values):]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")  # always in a report; all_to_all once used


def traffic_report(comms) -> dict:
    """``Comm.report()`` of several comms together (an engine's DP group and the groups its options cut it
    into): bytes, calls and bytes by link summed per op kind."""
    nbytes, inter, calls = Counter(), Counter(), Counter()
    for comm in comms:
        nbytes.update(comm.bytes)
        inter.update(comm.inter_bytes)
        calls.update(comm.calls)
    out = {op: 0 for op in OPS}
    out.update(nbytes)
    out["total"] = sum(nbytes.values())
    for op in sorted(set(OPS) | set(calls)):
        out[f"{op}_calls"] = calls[op]
    out["total_calls"] = sum(calls.values())
    for op in sorted(set(OPS) | set(inter)):
        out[f"{op}_inter"] = inter[op]
    out["inter"] = sum(inter.values())
    out["intra"] = out["total"] - out["inter"]
    return out
