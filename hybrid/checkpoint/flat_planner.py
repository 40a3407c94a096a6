"""DCP planners for *flat pieces*: a rank holds elements ``[offset, offset + n)`` of a 1-D tensor.

A ZeRO shard is an arbitrary contiguous range of a parameter's flattened elements -- not a ``torch.chunk``
of it, so neither DTensor placements nor a ShardedTensor (which wants every rank to agree on one
non-overlapping layout) describe it directly. These planners teach the stock DCP planners that one fact:

* ``FlatSavePlanner(pieces)``: ``pieces[key] = (offset, global_numel)``; the state dict holds the local
  1-D tensor under ``key``. Each piece becomes one SHARD write item of the global tensor. Identical
  pieces on several ranks (DP-replicated state, ZeRO stage 0) share one ``(key, offset)`` index, so DCP's
  own de-duplication writes them once; DCP's global-plan validation rejects pieces that overlap otherwise.
  After the save, ``final_plan`` holds the items this rank wrote. A piece is a view of a larger flat
  buffer, which DCP's writer would clone (it copies any tensor smaller than its storage, and holds every
  copy until the file is written: the whole shard again); a CPU piece is handed over as a zero-copy alias
  with a storage of its own size (``exact_storage``), so saving costs no memory.
* ``FlatLoadPlanner(offsets)``: the state dict holds the local 1-D tensor to fill under ``key``;
  DCP reads exactly the overlap of ``[offset, offset + n)`` with every saved piece, so any new layout
  (another DP size, another stage) loads from any saved one.

Both take ``swapped``: keys whose piece lives elsewhere (an NVMe swap file: ``hybrid.zero.optimizer.SwappedRange``)
and stands in the state dict as a ``placeholder`` of its length; saving reads it when the writer gets to its
item (``read()``), loading reads into a buffer of each read item's length and stores it (``write(offset,
values)``), so neither holds more than one piece.

Every other state-dict value (plain tensors, picklable objects) goes through the stock behaviour.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


def _piece_chunk(offset: int, local: torch.Tensor) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size([offset]), sizes=torch.Size([local.numel()]))


def exact_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or (a contiguous CPU view of a larger storage) an alias of the same bytes whose
    storage is exactly its size."""
    if (tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0
            or tensor.untyped_storage().nbytes() == tensor.nbytes):
        return tensor
    raw = tensor.detach().reshape(-1).view(torch.uint8).numpy()  # numpy wraps the bytes, no copy
    return torch.from_numpy(raw).view(tensor.dtype).view(tensor.shape)


def placeholder(numel: int) -> torch.Tensor:
    """An fp32 1-D tensor of ``numel`` elements holding one value (no memory): stands in the state dict for a
    piece whose values come from elsewhere (``swapped``)."""
    return torch.zeros(1, dtype=torch.float32).expand(int(numel))


class FlatSavePlanner(DefaultSavePlanner):
    def __init__(self, pieces: Mapping[str, tuple[int, int]], swapped: Optional[Mapping[str, Any]] = None):
        super().__init__()
        self.pieces = dict(pieces)
        self.swapped = dict(swapped or {})

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = [item for item in plan.items if item.index.fqn not in self.pieces]
        for key, (offset, total) in self.pieces.items():
            local = self.state_dict[key]
            items.append(WriteItem(
                index=MetadataIndex(key, [offset]),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=_piece_chunk(offset, local),
                                            properties=TensorProperties.create_from_tensor(local),
                                            size=torch.Size([total])),
            ))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def finish_plan(self, new_plan):
        self.final_plan = super().finish_plan(new_plan)  # what this rank writes (its files' checksums)
        return self.final_plan

    def lookup_object(self, index: MetadataIndex):
        if index.fqn in self.swapped:  # read when the writer gets to it: one piece in memory at a time
            return self.swapped[index.fqn].read()
        if index.fqn in self.pieces:
            return exact_storage(self.state_dict[index.fqn])
        return super().lookup_object(index)


class FlatLoadPlanner(DefaultLoadPlanner):
    def __init__(self, offsets: Mapping[str, int], swapped: Optional[Mapping[str, Any]] = None):
        super().__init__()
        self.offsets = dict(offsets)
        self.swapped = dict(swapped or {})

    def create_local_plan(self) -> LoadPlan:
        others = {k: v for k, v in self.state_dict.items() if k not in self.offsets}
        plan = create_default_local_load_plan(others, self.metadata)
        items = list(plan.items)
        for key, offset in self.offsets.items():
            saved = self.metadata.state_dict_metadata.get(key)
            if saved is None:
                raise RuntimeError(f"Missing key in checkpoint state_dict: {key}.")
            local = self.state_dict[key]
            if offset < 0 or offset + local.numel() > saved.size.numel():
                raise ValueError(f"{key}: piece [{offset}, {offset + local.numel()}) lies outside the saved "
                                 f"tensor of {saved.size.numel()} elements")
            items += create_read_items_for_chunk_list(key, saved, [_piece_chunk(offset, local)])
        return LoadPlan(items)

    def resolve_tensor(self, read_item) -> torch.Tensor:
        if read_item.dest_index.fqn in self.swapped:  # a buffer of this read's length, stored by commit_tensor
            return torch.empty(tuple(read_item.lengths), dtype=torch.float32)
        return super().resolve_tensor(read_item)

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        swapped = self.swapped.get(read_item.dest_index.fqn)
        if swapped is not None:
            swapped.write(int(read_item.dest_offsets[0]), tensor)
            return
        super().commit_tensor(read_item, tensor)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.offsets:
            return self.state_dict[index.fqn]  # read items' offsets are relative to this piece
        return super().lookup_tensor(index)
