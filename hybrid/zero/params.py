"""Parameter gathering: the post-step all-gather (stages 1-3) and stage 3's gather/release around modules.

``all_gather_units`` refreshes full parameters from their updated shards, unit by unit, asynchronously,
with at most ``max_inflight_numel`` elements in flight.

``ParamGatherer`` (stage 3). Each unit owns a full-length buffer whose *storage* is freed (resized to 0
bytes) while the unit is released, so a gather (resize + all-gather from the shards) brings every view of
it back to life in place, including views autograd saved in forward. While released, a parameter's
``.data`` is an empty tensor (shape ``(0,)``, as in DeepSpeed), so a stray read fails loudly instead of
touching freed memory; a gather points it back at its view of the unit. Units of persistent parameters
(``numel < param_persistence_threshold``) are never released and never gathered in forward/backward.

* Forward: a pre-forward hook on every module that directly owns sharded parameters gathers its units and
  prefetches the units of the modules that ran next in the previous forward, up to
  ``prefetch_numel`` elements; the post-forward hook releases them (reference-counted, so nested or
  repeated use is safe) and hooks the module's outputs so that the first gradient reaching them (before
  the module's own backward runs) gathers the units again, prefetching in reverse forward order.
* Backward: a unit is released as soon as all its parameters have accumulated their gradients
  (``release_after_backward``, called by the gradient reducer), or at ``end_backward``.

All DP ranks must run the same modules in the same order (as in every ZeRO-3 implementation), since each
gather is a collective. A module's forward may read only its own parameters (direct ones, including a tied
parameter registered on it) and its submodules' parameters inside their own forward.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from hybrid.comm import Comm
from hybrid.zero.partition import FlatLayout


def all_gather_units(comm: Comm, units: list, full_of: Callable, shard_of: Callable, max_inflight_numel: int) -> None:
    """All-gather ``shard_of(u)`` from every rank into ``full_of(u)`` for each unit ``u``."""
    inflight, numel = [], 0
    for u in units:
        full = full_of(u)
        if inflight and numel + full.numel() > max_inflight_numel:
            for h in inflight:
                h.wait()
            inflight, numel = [], 0
        inflight.append(comm.all_gather(full, shard_of(u), async_op=True))
        numel += full.numel()
    for h in inflight:
        h.wait()


class ParamGatherer:
    def __init__(self, comm: Comm, layout: FlatLayout, full: list, shard_of: Callable, persistent: set,
                 module_units: dict, prefetch_numel: int, views: list):
        self.comm, self.layout, self.full, self.shard_of = comm, layout, full, shard_of
        self._views = views  # unit -> [(parameter, its view of the unit's buffer)]
        self._empty = torch.empty(0, dtype=full[0].dtype, device=full[0].device)
        self.persistent = set(persistent)
        self.module_units = module_units  # module -> tuple of non-persistent unit indices it reads
        self.prefetch_numel = prefetch_numel
        self._ready: set = set(self.persistent)  # every other unit starts released (storage freed)
        for u in range(len(layout.units)):
            if u not in self.persistent:
                for param, _ in views[u]:
                    param.data = self._empty
        self._pending: dict = {}          # unit -> async handle
        self._refs = defaultdict(int)     # forward references
        self._in_backward: set = set()    # units gathered for backward, not yet done
        self._trace: list = []            # modules in the order the current forward ran them
        self._prev_trace: list = []
        self._cursor = 0                  # backward position in _trace
        for module in module_units:
            module.register_forward_pre_hook(self._pre_forward)
            module.register_forward_hook(self._post_forward)

    # -- gather / release -----------------------------------------------------------------------------
    def _nbytes(self, u: int) -> int:
        return self.layout.units[u].numel * self.full[u].element_size()

    def issue(self, u: int) -> None:
        """Start gathering unit ``u`` unless it is already gathered or on its way."""
        if u in self._ready or u in self._pending:
            return
        full = self.full[u]
        full.untyped_storage().resize_(self._nbytes(u))
        self._pending[u] = self.comm.all_gather(full, self.shard_of(u), async_op=True)
        for param, view in self._views[u]:
            param.data = view

    def wait(self, u: int) -> None:
        handle = self._pending.pop(u, None)
        if handle is not None:
            handle.wait()
            self._ready.add(u)

    def release(self, u: int) -> None:
        if u in self.persistent:
            return
        self.wait(u)
        self._ready.discard(u)
        for param, _ in self._views[u]:
            param.data = self._empty
        self.full[u].untyped_storage().resize_(0)

    def gathered_units(self) -> list:
        return sorted((self._ready | set(self._pending)) - self.persistent)

    def release_all(self) -> None:
        for u in self.gathered_units():
            self.release(u)

    def _prefetch(self, modules) -> None:
        budget = self.prefetch_numel
        for module in modules:
            for u in self.module_units[module]:
                numel = self.layout.units[u].numel
                if numel > budget:
                    return
                budget -= numel
                self.issue(u)

    # -- forward --------------------------------------------------------------------------------------
    def begin_forward(self) -> None:
        self._prev_trace, self._trace = self._trace, []

    def end_forward(self) -> None:
        """Release what was gathered (or prefetched) in forward and is not held for backward."""
        self._refs.clear()  # every module's forward has returned (or raised)
        for u in self.gathered_units():
            if self._refs[u] == 0 and u not in self._in_backward:
                self.release(u)
        self._cursor = len(self._trace)

    def _pre_forward(self, module: nn.Module, args) -> None:
        units = self.module_units[module]
        position = len(self._trace)
        self._trace.append(module)
        for u in units:
            self._refs[u] += 1
            self.issue(u)
        prev = self._prev_trace
        if position < len(prev) and prev[position] is module:
            self._prefetch(prev[position + 1:])
        for u in units:
            self.wait(u)

    def _post_forward(self, module: nn.Module, args, output) -> None:
        units = self.module_units[module]
        if torch.is_grad_enabled():
            leaves = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
            tensors = [t for t in leaves if t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda grads, m=module: self._pre_backward(m), mode="any")
            elif not leaves:  # an output we cannot see into: keep the units gathered through backward
                self._in_backward.update(units)
        for u in units:
            self._refs[u] -= 1
            if self._refs[u] == 0 and u not in self._in_backward:
                self.release(u)

    # -- backward -------------------------------------------------------------------------------------
    def _pre_backward(self, module: nn.Module) -> None:
        units = self.module_units[module]
        for u in units:
            self._in_backward.add(u)
            self.issue(u)
        j = next((k for k in range(min(self._cursor, len(self._trace)) - 1, -1, -1)
                  if self._trace[k] is module), None)
        if j is not None:
            self._cursor = j
            self._prefetch(reversed(self._trace[:j]))
        for u in units:
            self.wait(u)

    def release_after_backward(self, u: int) -> None:
        """All gradients of unit ``u`` are in: its full parameters are no longer needed."""
        self._in_backward.discard(u)
        if self._refs[u] == 0:
            self.release(u)

    def end_backward(self) -> None:
        self._in_backward.clear()
        for u in self.gathered_units():
            if self._refs[u] == 0:
                self.release(u)
        self._cursor = len(self._trace)
