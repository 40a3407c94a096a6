"""The NVMe swap store: one rank's optimizer states in a file on the node's local disk, a sub-group at a time.

``SwapStore(path, numels, fields)`` creates ``path`` (its directory too), preallocates it to the size
``hybrid.plan.swap_layout`` gives (``os.posix_fallocate``, so a disk too small fails here, at the start, and not
in the middle of a step) and holds ``buffers`` reusable host buffers of one record each (pinned with
``pin_memory`` where CUDA is available). Record g holds, for sub-group g of ``numels[g]`` elements, one fp32
array per name of ``fields`` (``("master", "exp_avg", "exp_avg_sq")`` for AdamW). ``close()`` removes the file
(and its directory when the store made it or it is a job's swap directory, once empty); so does the store's finalizer, and the launcher
removes a job's whole swap directory from every node when the job ends (``launch.ray.node_files``), which
covers ranks killed without a chance to clean up.

``sweep(groups=None, read=True, write=True)`` is how records are used: it yields ``(g, views)`` for each
sub-group in ``groups`` (default all, in order), ``views`` a dict of fp32 tensors, one per field, in a host
buffer. While the caller works on g, the read of the next sub-group is in flight, and once the caller moves on
g is written back while the next is worked on (double buffering: with the default three buffers, a read, a
step and a write at once). ``read=False`` starts every record as the buffer left it (the caller fills it:
initialising, loading a checkpoint); ``write=False`` leaves the file as it was (saving a checkpoint, reading
back). The views are valid until the caller takes the next record; a caller that stops early (an exception in
its loop, ``break``) should close the generator (``contextlib.closing``) so that the ops in flight are waited
for at once -- the record it held is then not written. The I/O runs in a small thread pool with
``os.preadv``/``os.pwritev`` (they release the GIL) straight into the buffers, with ``O_DIRECT`` where the
filesystem takes it (no second copy in the page cache) and buffered I/O where it does not (tmpfs before Linux
6.6, some network filesystems). ``read_range`` / ``write_range`` read and store any element range of one field of
one record, between sweeps, through a second, buffered descriptor (the optimizer's first values and checkpoints,
a parameter piece at a time). ``rank_swap_file(path, rank)`` names a rank's file under the offload path: the
launcher's job id (``HYBRID_JOB_ID``) or, outside the launcher, this process's id (and a number where another
store of this process holds that name: several engines in one process).

Any error of the disk -- full (``ENOSPC``, also while preallocating), a quota, the file-size limit, an I/O
error, a file cut short -- raises ``SwapError``, a ``JobError`` (the job fails, exit 1, no restart: it would
only repeat) whose one sentence names the file, what failed and the fix; the store is broken from then on
(every later call raises the same error). The store never touches checkpoints: they keep their own files, so
the last one saved stays intact. ``bytes_read`` and ``bytes_written`` count the data moved.
"""

from __future__ import annotations

import ctypes
import errno
import os
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from hybrid.config.units import human_bytes
from hybrid.errors import JobError
from hybrid.plan.swap_layout import ALIGN, SWAP_BUFFERS, SWAP_DIR_PREFIX, SwapLayout, swap_file, swap_layout

MAX_IO = 1 << 30  # bytes per preadv/pwritev call (Linux moves at most ~2 GiB per call); a multiple of ALIGN
THREADS = 2  # a read and a write in flight at once

_REASONS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
            errno.EFBIG: "the file size limit (ulimit -f) is reached", errno.EIO: "an I/O error",
            errno.EROFS: "the filesystem is read-only", errno.EACCES: "permission denied",
            errno.EPERM: "permission denied"}
_FIX_SPACE = ("free space on that disk or point the offload path (zero.offload_optimizer.path, or the cluster "
              "file's cluster.nvme_path) at a larger local disk")
_FIXES = {errno.ENOSPC: _FIX_SPACE, errno.EDQUOT: _FIX_SPACE,
          errno.EFBIG: "raise the file size limit (ulimit -f) for the job",
          errno.EROFS: "point the offload path at a writable local disk",
          errno.EACCES: "point the offload path at a directory the job may write",
          errno.EPERM: "point the offload path at a directory the job may write"}


_OPEN: set = set()  # swap files this process's stores hold open (a second engine in one process gets its own)


def rank_swap_file(path, rank: int) -> Path:
    """Where rank ``rank`` keeps its swap file under the offload ``path`` (``hybrid.plan.swap_layout.swap_file``):
    in the directory of the launcher's job (``HYBRID_JOB_ID``), else of this process; ``rank<r>.swap``, or
    ``rank<r>.<k>.swap`` while this process's stores already hold that one open (several engines in one process)."""
    first = swap_file(path, os.environ.get("HYBRID_JOB_ID") or f"pid{os.getpid()}", rank)
    candidate, k = first, 0
    while str(candidate) in _OPEN:
        k += 1
        candidate = first.with_name(f"rank{int(rank)}.{k}.swap")
    return candidate


class SwapError(JobError):
    """The swap file could not be created, read or written; the message is one sentence naming it."""


class _ShortFile(OSError):
    """A read found the file shorter than its records (cut short behind the store's back)."""


def swap_error(path: Path, action: str, err: OSError, detail: str = "") -> SwapError:
    """The one sentence of a failed ``action`` (created, read, written) on the swap file at ``path``."""
    if isinstance(err, _ShortFile):
        return SwapError(f"the optimizer states' swap file {path} could not be read: it ends before its last "
                         f"record (was it truncated or replaced while the job ran?); keep other processes off "
                         f"the offload path and restart the job from its last checkpoint.")
    code = err.errno if isinstance(err.errno, int) else None
    name = errno.errorcode.get(code, "error") if code is not None else type(err).__name__
    reason = _REASONS.get(code, err.strerror or str(err))
    fix = _FIXES.get(code, "check the disk behind the offload path (dmesg, smartctl) or point the path at another "
                           "local disk")
    return SwapError(f"the optimizer states' swap file {path} could not be {action} ({reason}, {name}{detail}); "
                     f"{fix}.")


def _free_bytes(directory: Path) -> Optional[int]:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class _Buffer:
    """One reusable host buffer of ``size`` bytes starting at an ``ALIGN``-aligned address (direct I/O needs
    it), with the memoryview the I/O threads read into and write from."""

    def __init__(self, size: int, pin_memory: bool):
        self.raw = torch.empty(size + ALIGN, dtype=torch.uint8, pin_memory=pin_memory)
        start = -self.raw.data_ptr() % ALIGN
        self.bytes = self.raw[start:start + size]
        self.view = memoryview((ctypes.c_ubyte * size).from_address(self.bytes.data_ptr())).cast("B")
        self.write: Optional[Future] = None  # the write-back in flight from this buffer

    def fields(self, names: Sequence[str], numel: int) -> dict:
        floats = self.bytes[:len(names) * numel * 4].view(torch.float32)
        return {name: floats[k * numel:(k + 1) * numel] for k, name in enumerate(names)}


def _transfer(call, fd: int, view: memoryview, offset: int) -> None:
    """All of ``view`` through ``call`` (``os.preadv`` / ``os.pwritev``) at ``offset``, in ``MAX_IO`` pieces."""
    done, total = 0, len(view)
    while done < total:
        moved = call(fd, [view[done:done + min(MAX_IO, total - done)]], offset + done)
        if moved == 0:
            raise _ShortFile(errno.EIO, "the file ends early")
        done += moved


def _close_file(fds: tuple, path: Path, made_dir: Optional[Path], pool: ThreadPoolExecutor) -> None:
    """The store's cleanup (also its finalizer): stop the threads, close and remove the file (and the directory
    the store made, when empty)."""
    pool.shutdown(wait=True)
    _OPEN.discard(str(path))
    for fd in dict.fromkeys(fds):
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        path.unlink()
    except OSError:
        pass
    if made_dir is not None:
        try:
            made_dir.rmdir()
        except OSError:
            pass


class SwapStore:
    """One rank's swap file and its record buffers (see the module docstring)."""

    def __init__(self, path, numels: Sequence[int], fields: Sequence[str], *, buffers: int = SWAP_BUFFERS,
                 pin_memory: bool = False, direct: Optional[bool] = None):
        if buffers < 2:
            raise ValueError(f"a swap store needs at least 2 buffers (one being read while one is used), got {buffers}")
        self.path = Path(path)
        self.fields = tuple(fields)
        self.layout: SwapLayout = swap_layout(numels, len(self.fields))
        self.bytes_read = self.bytes_written = 0
        self._error: Optional[SwapError] = None
        self._buffers: list = []
        made_dir = self._make_dir()
        self.fd, self.direct = self._open(direct)
        # element ranges (checkpoints, the first values) go through a buffered descriptor: any offset, any length
        self._range_fd = os.open(self.path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0)) if self.direct else self.fd
        pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="hybrid-swap")
        _OPEN.add(str(self.path))
        self._finalizer = weakref.finalize(self, _close_file, (self.fd, self._range_fd), self.path, made_dir, pool)
        self._pool = pool
        try:
            self._reserve()
            pin = bool(pin_memory) and torch.cuda.is_available()
            self._buffers = [_Buffer(self.layout.largest_slot, pin) for _ in range(buffers)]
        except BaseException:
            self.close()
            raise

    # -- creation -------------------------------------------------------------------------------------
    def _make_dir(self) -> Optional[Path]:
        """Create the file's directory (and its parents); the directory itself when this made it."""
        parent = self.path.parent
        existed = parent.is_dir()
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise swap_error(self.path, "created", err) from None
        # the job's directory of swap files (or one this made) goes with its last file
        return parent if not existed or parent.name.startswith(SWAP_DIR_PREFIX) else None

    def _open(self, direct: Optional[bool]) -> tuple:
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        o_direct = getattr(os, "O_DIRECT", 0)
        if direct is not False and o_direct:
            try:
                return os.open(self.path, flags | o_direct, 0o600), True
            except OSError as err:
                if direct or err.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise swap_error(self.path, "created", err) from None
        try:
            return os.open(self.path, flags, 0o600), False
        except OSError as err:
            raise swap_error(self.path, "created", err) from None

    def _reserve(self) -> None:
        """Allocate the whole file now, so that a disk too small fails before the first step."""
        size = self.layout.file_bytes
        free = _free_bytes(self.path.parent)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(self.fd, 0, size)
            else:
                os.ftruncate(self.fd, size)
        except OSError as err:
            if err.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):  # a filesystem without it
                os.ftruncate(self.fd, size)
                return
            detail = "" if free is None else f": it needs {human_bytes(size)} and {human_bytes(free)} were free"
            raise swap_error(self.path, "created", err, detail) from None

    # -- records --------------------------------------------------------------------------------------
    def sweep(self, groups: Optional[Sequence[int]] = None, read: bool = True,
              write: bool = True) -> Iterator[tuple]:
        """``(g, views)`` for each sub-group of ``groups`` (see the module docstring)."""
        self._check()
        order = list(range(len(self.layout.records))) if groups is None else [int(g) for g in groups]
        for g in order:
            if not 0 <= g < len(self.layout.records):
                raise IndexError(f"sub-group {g} is not in this swap file ({len(self.layout.records)} records)")
        return self._sweep(order, read, write)

    def _sweep(self, order: list, read: bool, write: bool) -> Iterator[tuple]:
        held: list = []  # buffers holding a record being read or used
        current = upcoming = None
        try:
            upcoming = self._start(order[0], read, held) if order else None
            for i, g in enumerate(order):
                current, upcoming = upcoming, None
                if i + 1 < len(order):  # the next read runs while this record is used
                    upcoming = self._start(order[i + 1], read, held)
                buf, reading = current[1], current[2]
                if reading is not None:
                    self._wait(reading, "read")
                yield g, buf.fields(self.fields, self.layout.records[g].numel)
                if write:
                    buf.write = self._pool.submit(self._io, os.pwritev, buf, g)
                    self.bytes_written += self.layout.records[g].payload
                held.remove(buf)
                current = None
            self._drain()
        finally:
            for pending in (current, upcoming):
                if pending is not None and pending[2] is not None:
                    pending[2].exception()  # let a read in flight land before its buffer is reused
            self._drain(quiet=self._error is not None)  # stopped early: the writes already queued still count

    def _start(self, g: int, read: bool, held: list) -> tuple:
        """Take a buffer (one whose write-back is done, waiting for the oldest) and start reading ``g``."""
        free = [b for b in self._buffers if b not in held]
        idle = [b for b in free if b.write is None or b.write.done()]
        buf = idle[0] if idle else free[0]
        if buf.write is not None:
            self._wait(buf.write, "written")
            buf.write = None
        held.append(buf)
        reading = None
        if read:
            reading = self._pool.submit(self._io, os.preadv, buf, g)
            self.bytes_read += self.layout.records[g].payload
        return g, buf, reading

    def _io(self, call, buf: _Buffer, g: int) -> None:
        record = self.layout.records[g]
        _transfer(call, self.fd, buf.view[:record.slot], record.offset)

    def _wait(self, future: Future, action: str) -> None:
        err = future.exception()
        if err is not None:
            self._fail(swap_error(self.path, action, err) if isinstance(err, OSError) else err)

    def _drain(self, quiet: bool = False) -> None:
        """Wait for every write-back in flight (``quiet``: after an error, raising none)."""
        for buf in self._buffers:
            if buf.write is None:
                continue
            future, buf.write = buf.write, None
            if quiet:
                future.exception()
            else:
                self._wait(future, "written")

    def _fail(self, error: BaseException) -> None:
        if isinstance(error, SwapError) and self._error is None:
            self._error = error
        raise error

    def _check(self) -> None:
        if self._error is not None:
            raise self._error
        if not self._finalizer.alive:
            raise ValueError(f"the swap store {self.path} is closed")

    # -- element ranges ---------------------------------------------------------------------------------
    def read_range(self, g: int, field: str, lo: int, out: torch.Tensor) -> None:
        """Elements ``[lo, lo + out.numel())`` of field ``field`` of record ``g`` into the fp32 tensor ``out``
        (contiguous, on the host); not while a sweep is running."""
        self._range_io(os.preadv, g, field, lo, out, "read")

    def write_range(self, g: int, field: str, lo: int, values: torch.Tensor) -> None:
        """Store the fp32 ``values`` (contiguous, on the host) as elements ``[lo, lo + values.numel())`` of field
        ``field`` of record ``g``; not while a sweep is running."""
        self._range_io(os.pwritev, g, field, lo, values, "written")

    def _range_io(self, call, g: int, field: str, lo: int, tensor: torch.Tensor, action: str) -> None:
        self._check()
        record, n = self.layout.records[g], tensor.numel()
        if tensor.dtype != torch.float32 or not tensor.is_contiguous() or lo < 0 or lo + n > record.numel:
            raise ValueError(f"record {g} field {field}: [{lo}, {lo + n}) of {record.numel} fp32 elements")
        if n == 0:
            return
        offset = record.offset + (self.fields.index(field) * record.numel + lo) * 4
        view = memoryview((ctypes.c_ubyte * (n * 4)).from_address(tensor.data_ptr())).cast("B")
        try:
            _transfer(call, self._range_fd, view, offset)
        except OSError as err:
            self._fail(swap_error(self.path, action, err))
        if call is os.preadv:
            self.bytes_read += n * 4
        else:
            self.bytes_written += n * 4

    # -- accounting and cleanup -----------------------------------------------------------------------
    @property
    def host_bytes(self) -> int:
        """Host bytes of the record buffers (``SwapLayout.buffer_bytes``)."""
        return sum(b.raw.numel() for b in self._buffers)

    def tensors(self) -> list:
        """The record buffers, for memory reports."""
        return [b.raw for b in self._buffers]

    def close(self) -> None:
        """Wait for the I/O in flight, then close and remove the file (idempotent)."""
        if self._finalizer.alive:
            self._drain(quiet=True)
            self._finalizer()

    def __enter__(self) -> "SwapStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
