"""The NVMe swap file's arithmetic (pure: no torch, plain numbers), shared by the store and the memory model.

With the optimizer offloaded to NVMe (``zero.offload_optimizer: {device: nvme, path: ...}``) each rank keeps
the fp32 arrays of its shard that the optimizer steps -- the master weights and every per-element state key
(``exp_avg`` and ``exp_avg_sq`` for Adam(W)): its ``fields`` -- in one file on the node's local disk instead
of host memory (``hybrid.zero.nvme.SwapStore``). The shard is stepped in *sub-groups* (``zero.sub_group_size``
elements at most: the engine's are its optimizer batches, ``hybrid.zero.optimizer``, which hold only owned
elements and, with non-fp32 gradients, at most ``layout.CONVERT_NUMEL``; the planner's ``sub_group_numels`` cut
the whole shard evenly, an upper bound of the host buffers); each sub-group is one *record* of the file:

    record g = field 0 of its n_g elements, then field 1, ... (fp32, end to end), padded to ``ALIGN`` bytes

and records lie end to end in sub-group order, each starting at a multiple of ``ALIGN`` bytes (the page size
and the common NVMe logical block: what direct I/O needs of offsets and lengths). A record passes through a
host buffer of its padded size; ``SWAP_BUFFERS`` of them (the sub-group being stepped, the next being read,
the previous being written) are what the store holds in host memory, each one slot of the largest record
plus ``ALIGN`` bytes so that it can start on an aligned address. A job's files are
``<path>/hybrid-swap-<job id>/rank<r>.swap`` (``swap_file``), so that the launcher can remove a job's whole
directory from every node (``swap_dir``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

ALIGN = 4096  # bytes: records start at, and are padded to, a multiple of this
FP32 = 4
SWAP_BUFFERS = 3  # host buffers: one record stepped, the next being read, the previous being written
ADAM_FIELDS = 3  # fp32 master, exp_avg, exp_avg_sq: 12 bytes per element on disk
SWAP_DIR_PREFIX = "hybrid-swap-"  # a job's swap files: <offload path>/hybrid-swap-<job id>/rank<r>.swap


def swap_dir(path, job_id: str) -> Path:
    """The directory of job ``job_id``'s swap files under the offload path (what the launcher removes from every
    node when the job ends)."""
    return Path(path) / f"{SWAP_DIR_PREFIX}{job_id}"


def swap_file(path, job_id: str, rank: int) -> Path:
    """Rank ``rank``'s swap file of job ``job_id`` under the offload path."""
    return swap_dir(path, job_id) / f"rank{int(rank)}.swap"


def align_up(n: int, multiple: int = ALIGN) -> int:
    return -(-int(n) // multiple) * multiple


@dataclass(frozen=True)
class Record:
    """One sub-group's place in the swap file."""

    group: int
    numel: int    # elements of each field
    offset: int   # bytes from the start of the file (a multiple of ALIGN)
    payload: int  # bytes of data: fields x numel x 4
    slot: int     # bytes the record occupies: payload padded to ALIGN


@dataclass(frozen=True)
class SwapLayout:
    """Where every record lies (``records``), the file's size and the largest record's slot."""

    fields: int
    records: tuple
    file_bytes: int
    largest_slot: int

    def buffer_bytes(self, buffers: int = SWAP_BUFFERS) -> int:
        """Host bytes of ``buffers`` record buffers (each one slot, plus ``ALIGN`` to align its start)."""
        return buffers * (self.largest_slot + ALIGN) if self.records else 0


def swap_layout(numels: Sequence[int], fields: int) -> SwapLayout:
    """The layout of a swap file holding ``fields`` fp32 arrays of each sub-group of ``numels`` elements."""
    if fields < 1 or any(int(n) < 1 for n in numels):
        raise ValueError(f"a swap file needs at least one field and non-empty sub-groups, got fields={fields}, "
                         f"numels={list(numels)[:8]}")
    records, offset = [], 0
    for g, n in enumerate(numels):
        payload = fields * int(n) * FP32
        slot = align_up(payload)
        records.append(Record(g, int(n), offset, payload, slot))
        offset += slot
    return SwapLayout(fields, tuple(records), offset, max((r.slot for r in records), default=0))


def sub_group_numels(shard_numel: int, sub_group_size: int) -> list:
    """A shard of ``shard_numel`` elements cut into sub-groups of at most ``sub_group_size``, in order."""
    shard_numel, size = int(shard_numel), int(sub_group_size)
    return [min(size, shard_numel - lo) for lo in range(0, shard_numel, size)]


def swap_file_bytes(shard_numel: int, sub_group_size: int, fields: int = ADAM_FIELDS) -> int:
    """Bytes of one rank's swap file for a shard of ``shard_numel`` elements (0 for an empty shard)."""
    numels = sub_group_numels(shard_numel, sub_group_size)
    return swap_layout(numels, fields).file_bytes if numels else 0


def swap_buffer_bytes(shard_numel: int, sub_group_size: int, fields: int = ADAM_FIELDS,
                      buffers: int = SWAP_BUFFERS) -> int:
    """Host bytes the store's record buffers take for such a shard: ``buffers`` slots of the largest
    sub-group (``min(sub_group_size, shard_numel)`` elements), each with room to align its start."""
    numel = min(int(shard_numel), int(sub_group_size))
    if numel < 1:
        return 0
    return buffers * (align_up(fields * numel * FP32) + ALIGN)
