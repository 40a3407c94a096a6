"""Collectives between the CPU ranks of one host, through shared memory.

gloo moves a CPU tensor from one process to another on the same machine through loopback TCP: the sender's
kernel copies it into a socket, the receiver's copies it out, and a 16 MB fp32 all-reduce between two ranks
took ~14 ms on the bench machine. A `ShmGroup` maps a small region of every rank of the group into every rank
(an anonymous ``memfd``, opened by the peers through ``/proc/<pid>/fd``) and moves data with plain tensor
copies and adds (~4 ms for the same all-reduce); a doorbell -- one pipe per rank, a 12-byte message per peer
-- orders the steps (~15 us, where a gloo barrier took ~150 us).

Contract:

* ``ShmGroup.connect(group)`` is collective over ``group`` (every rank calls it at the same point in its
  sequence of collectives; it uses the group's own gloo collectives twice) and returns a group on every
  rank or ``None`` on every rank: ``None`` when the group is not a gloo group of 2+ ranks all on this host
  (same boot and PID namespace, checked by reading a random cookie back through the mapping), when the
  regions cannot be allocated, or when any rank has ``HYBRID_SHM_COLLECTIVES=0``. Nothing has a name in
  any file system: a rank killed at any point leaves nothing behind.
* ``reduce_scatter(input, average)``: this rank's part of ``input`` (``input.view(-1).tensor_split(N)``'s
  entry ``rank``) receives the sum (or mean) over the ranks; the other parts keep this rank's values.
* ``all_gather(output, input)``: ``output.view(-1).tensor_split(N)`` receives every rank's ``input``.
* ``all_reduce(tensor)``: the sum, in place (a reduce-scatter, then an all-gather of the reduced parts).
* ``close()``: closes this rank's doorbell (a peer inside a collective then sees it gone) and drops the
  mapped regions; the group is not used again (``hybrid.comm.shm_transport`` decides when).

Each call has finished when it returns. Every rank must issue the same calls, of the same sizes, in the same
order, as for any collective; each doorbell message carries a signature of its collective (kind, dtype,
element count), so ranks that do not are an error, not mixed data. Data goes in slices of one slot
(``SLICE_BYTES / (N-1)``) per peer through two alternating buffers, so one ring per slice suffices: a rank
writes buffer ``b`` again only two rings later, after every peer has rung the ring between, which it does only
after reading ``b``. A peer that exits (or a doorbell that stays quiet past the group's timeout) raises
``RuntimeError`` instead of a hang, marked ``FailureKind.PEER`` (the launcher blames the peer).

Each rank's region is two buffers of ``SLICE_BYTES`` (2 MiB at every N); a rank's resident memory also counts
the pages it reads of its peers' regions (`resident_bytes`).
"""

from __future__ import annotations

import os
import secrets
import select
import socket
import struct
import time
import weakref
import zlib
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from hybrid.errors import FailureKind, of_kind

# the transport's sizes are layout arithmetic (the memory model counts them too); shm.resident_bytes is still
# a name for the figure, and the transport sizes its buffers from shm.SLICE_BYTES (a test may set it)
from hybrid.plan.layout import SLICE_BYTES, region_bytes, resident_bytes, slot_bytes  # noqa: F401

ENV_SWITCH = "HYBRID_SHM_COLLECTIVES"  # 0 / false / off / no turns the shared-memory path off (gloo instead)
# How a rank says that a peer, not itself, broke a collective (``_peer_error``: the launcher blames the peer)
PEER_EXITED = "of the group exited during a collective"
PEER_LATE = "did not reach the collective within the group's timeout"
_MSG = struct.Struct("<III")  # sender, ring number, signature of the collective
_POLL_MS = 500  # how often a waiting rank checks that its peers are alive
_DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's default for gloo groups


def _enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def _host_key() -> Optional[str]:
    """What ranks that open each other's memory through ``/proc/<pid>/fd`` have in common."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return "|".join((socket.gethostname(), boot, os.readlink("/proc/self/ns/pid")))
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _peer_error(message: str) -> RuntimeError:
    """A collective's error that a peer caused, not this rank: marked ``FailureKind.PEER`` (the launcher then
    looks for the peer that caused it)."""
    return of_kind(RuntimeError(message), FailureKind.PEER)


def _group_timeout(group) -> timedelta:
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # an older or other backend object: torch's default
        return _DEFAULT_TIMEOUT


class _Doorbell:
    """A barrier over the group: ``ring(signature)`` tells every peer this rank has reached its next ring and
    waits until every peer has reached it too. A message is (sender, ring number, signature of the collective
    the ring belongs to); a peer may be one ring ahead. Ranks whose signatures differ for the same ring issued
    different collectives: an error here, where gloo would have refused the sizes, not mixed data."""

    def __init__(self, rank: int, read_fd: int, own_write_fd: int, write_fds: dict, pids: dict,
                 timeout: timedelta, label: str, global_ranks: list):
        self._rank, self._read_fd, self._own_write_fd = rank, read_fd, own_write_fd
        self._global = global_ranks
        self._write_fds, self._pids = write_fds, pids
        self._timeout_s, self._label = timeout.total_seconds(), label
        self._rings = 0
        self._arrived = {q: [] for q in write_fds}  # signatures of the rings each peer reached, not yet passed
        self._pending = b""
        self._poll = select.poll()
        self._poll.register(read_fd, select.POLLIN)
        _open_doorbells.add(self)

    def ring(self, signature: int, what: str) -> None:
        self._rings += 1
        msg = _MSG.pack(self._rank, self._rings % (1 << 32), signature)
        for q, fd in self._write_fds.items():
            try:
                os.write(fd, msg)
            except BrokenPipeError:  # its read end closed: the peer is gone
                raise _peer_error(f"{self._label}: {self._who(q)} {PEER_EXITED}") from None
        deadline = None
        while any(not sigs for sigs in self._arrived.values()):
            if self._poll.poll(_POLL_MS):
                self._read()
                continue
            late = [q for q, sigs in self._arrived.items() if not sigs]
            gone = [q for q in late if not _alive(self._pids[q])]
            if gone:
                raise _peer_error(f"{self._label}: {self._who(gone[0])} {PEER_EXITED}")
            deadline = deadline or time.monotonic() + self._timeout_s
            if time.monotonic() > deadline:
                raise _peer_error(f"{self._label}: {self._who(late[0])} {PEER_LATE} ({self._timeout_s:.0f} s)")
        for q, sigs in self._arrived.items():
            if sigs.pop(0) != signature:
                raise RuntimeError(f"{self._label}: {self._who(q)} issued a different collective than this "
                                   f"rank's {what}; every rank must issue the same collectives, of the same "
                                   "sizes, in the same order")

    def _who(self, q: int) -> str:
        return f"global rank {self._global[q]} (rank {q})"

    def _read(self) -> None:
        data = self._pending + os.read(self._read_fd, 4096)
        whole = len(data) - len(data) % _MSG.size
        for q, _, signature in _MSG.iter_unpack(data[:whole]):
            self._arrived[q].append(signature)
        self._pending = data[whole:]

    def close(self) -> None:
        """Close every pipe end (idempotent: an fd number is never closed twice, it may be another file's by then)."""
        _open_doorbells.discard(self)
        _close_all((self._read_fd, self._own_write_fd, *self._write_fds.values()))
        self._read_fd = self._own_write_fd = None
        self._write_fds = {}

    __del__ = close


_open_doorbells: "weakref.WeakSet[_Doorbell]" = weakref.WeakSet()
# A forked child (a DataLoader worker) must not keep a rank's doorbell open: peers would not see it go.
os.register_at_fork(after_in_child=lambda: [bell.close() for bell in list(_open_doorbells)])


class ShmGroup:
    """Shared-memory collectives over one process group of ranks on this host (see the module docstring)."""

    def __init__(self, rank: int, size: int, regions: list, doorbell: _Doorbell):
        self.rank, self.size = rank, size
        self._regions = regions  # uint8 tensors, one per rank of the group (this rank's own included)
        self._bell = doorbell
        self._slices = 0  # slices moved so far: their parity picks the buffer
        self._slot_bytes = slot_bytes(size, SLICE_BYTES)

    # -- set-up -----------------------------------------------------------------------------------
    @classmethod
    def connect(cls, group, label: str = "shm") -> Optional["ShmGroup"]:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if size < 2 or str(dist.get_backend(group)).lower() != "gloo":
            return None
        own = _OwnMemory.create(region_bytes(size, SLICE_BYTES)) if _enabled() else None
        opened = None
        try:
            everyone = [None] * size
            dist.all_gather_object(everyone, (_host_key(), own.describe() if own else None), group=group)
            keys = {key for key, _ in everyone}
            if None in keys or len(keys) != 1 or any(desc is None for _, desc in everyone):
                return None
            opened = _open_peers(rank, [desc for _, desc in everyone], own)
            agreed = [None] * size
            dist.all_gather_object(agreed, opened is not None, group=group)
            if not all(agreed):
                return None
            regions, bell_fds = opened
            pids = {q: desc["pid"] for q, (_, desc) in enumerate(everyone) if q != rank}
            bell = _Doorbell(rank, own.read_fd, own.write_fd, bell_fds, pids, _group_timeout(group), label,
                             dist.get_process_group_ranks(group))
            own.read_fd = own.write_fd = None  # the doorbell owns them now
            opened = None
            return cls(rank, size, regions, bell)
        finally:
            if opened:
                _close_all(opened[1].values())
            if own:
                own.release()

    def own_region(self) -> torch.Tensor:
        return self._regions[self.rank]

    def close(self) -> None:
        """Close the doorbell (a peer still in a collective sees this rank gone) and drop the mapped regions
        (unmapped once no tensor views them); the group is not used again."""
        self._bell.close()
        self._regions = []

    @property
    def closed(self) -> bool:
        return not self._regions

    # -- slots ------------------------------------------------------------------------------------
    def _slot(self, owner: int, buf: int, slot: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        start = (buf * (self.size - 1) + slot) * self._slot_bytes
        return self._regions[owner][start:start + numel * dtype.itemsize].view(dtype)

    def _reader_slot(self, writer: int, reader: int) -> int:
        """The slot of ``writer``'s region that holds what ``reader`` reads in a reduce-scatter."""
        return reader if reader < writer else reader - 1

    def _next_buffer(self) -> int:
        buf = self._slices % 2
        self._slices += 1
        return buf

    # -- collectives ------------------------------------------------------------------------------
    def reduce_scatter(self, input: torch.Tensor, average: bool = False) -> torch.Tensor:
        parts = input.view(-1).tensor_split(self.size)
        own, dtype = parts[self.rank], input.dtype
        width = self._slot_bytes // dtype.itemsize
        peers = [q for q in range(self.size) if q != self.rank]
        signature, what = _signature("reduce_scatter", input)
        for lo in range(0, parts[0].numel(), width):
            buf = self._next_buffer()
            for q in peers:
                send = parts[q][lo:lo + width]
                self._slot(self.rank, buf, self._reader_slot(self.rank, q), dtype, send.numel()).copy_(send)
            self._bell.ring(signature, what)
            out = own[lo:lo + width]
            for q in peers:
                out.add_(self._slot(q, buf, self._reader_slot(q, self.rank), dtype, out.numel()))
        if average:
            own.div_(self.size)
        return own

    def all_gather(self, output: torch.Tensor, input: Optional[torch.Tensor] = None) -> None:
        chunks = output.view(-1).tensor_split(self.size)
        own, dtype = chunks[self.rank], output.dtype
        if input is not None and own.data_ptr() != input.data_ptr():
            own.copy_(input.reshape(-1))
        width = self._slot_bytes // dtype.itemsize
        signature, what = _signature("all_gather", output)
        for lo in range(0, chunks[0].numel(), width):
            buf = self._next_buffer()
            mine = own[lo:lo + width]
            self._slot(self.rank, buf, 0, dtype, mine.numel()).copy_(mine)
            self._bell.ring(signature, what)
            for q in range(self.size):
                if q != self.rank:
                    dst = chunks[q][lo:lo + width]
                    dst.copy_(self._slot(q, buf, 0, dtype, dst.numel()))

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.reduce_scatter(tensor)
        self.all_gather(tensor)


def _signature(kind: str, tensor: torch.Tensor) -> tuple:
    """(32-bit signature, description) of a collective over ``tensor``: equal on ranks issuing the same one."""
    what = f"{kind} of {tensor.numel()} {str(tensor.dtype).replace('torch.', '')} elements"
    return zlib.crc32(what.encode()), what


class _OwnMemory:
    """This rank's region (an anonymous ``memfd``: no name anywhere, gone with the last process that maps it)
    and its doorbell pipe; peers open both through ``/proc/<pid>/fd``."""

    def __init__(self, memfd: int, region: torch.Tensor, read_fd: int, write_fd: int, cookie: bytes):
        self.memfd, self.region, self.read_fd, self.write_fd, self.cookie = memfd, region, read_fd, write_fd, cookie

    @classmethod
    def create(cls, nbytes: int) -> Optional["_OwnMemory"]:
        memfd = read_fd = write_fd = None
        try:
            memfd = os.memfd_create("hybrid-shm", os.MFD_CLOEXEC)
            os.posix_fallocate(memfd, 0, nbytes)  # no room: an error now, not a SIGBUS on first touch
            region = torch.from_file(f"/proc/self/fd/{memfd}", shared=True, size=nbytes, dtype=torch.uint8)
            read_fd, write_fd = os.pipe()  # this rank keeps a writer: its own reads never see end-of-file
            cookie = secrets.token_bytes(16)
            region[:16].copy_(torch.frombuffer(bytearray(cookie), dtype=torch.uint8))
            return cls(memfd, region, read_fd, write_fd, cookie)
        except (OSError, RuntimeError, AttributeError):  # AttributeError: no os.memfd_create (not Linux)
            _close_all((memfd, read_fd, write_fd))
            return None

    def describe(self) -> dict:
        return dict(pid=os.getpid(), memfd=self.memfd, bell=self.write_fd, cookie=self.cookie,
                    nbytes=self.region.numel())

    def release(self) -> None:
        """Close what no one needs once the peers have opened theirs (the mapping stays valid)."""
        _close_all((self.memfd, self.read_fd, self.write_fd))
        self.memfd = self.read_fd = self.write_fd = None


def _open_peers(rank: int, descs: list, own: _OwnMemory) -> Optional[tuple]:
    """Map every peer's region and open its doorbell for writing; ``None`` (all closed) if any fails or any
    cookie does not read back (not the peer's memory)."""
    regions, fds = [], {}
    try:
        for q, desc in enumerate(descs):
            if q == rank:
                regions.append(own.region)
                continue
            proc = f"/proc/{desc['pid']}/fd"
            region = torch.from_file(f"{proc}/{desc['memfd']}", shared=True, size=desc["nbytes"], dtype=torch.uint8)
            if bytes(region[:16].tolist()) != desc["cookie"]:
                raise OSError(f"rank {q}'s region does not read back")
            regions.append(region)
            fds[q] = os.open(f"{proc}/{desc['bell']}", os.O_WRONLY | os.O_CLOEXEC)
        return regions, fds
    except Exception:  # noqa: BLE001 -- any failure to share memory means gloo, agreed on by every rank
        _close_all(fds.values())
        return None


def _close_all(fds) -> None:
    """Close every fd of ``fds`` that is not None, whatever state each is in."""
    for fd in fds:
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
