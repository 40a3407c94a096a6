"""The rank's model-state tensors for one stage, and the parameters re-bound as views of them.

What this rank holds (Ψ trainable elements, N DP ranks, ``dtype`` the model precision):

| stage | parameters                         | gradients                  | fp32 master            |
|-------|------------------------------------|----------------------------|------------------------|
| 0     | full flat buffer                   | full flat buffer           | full (bf16 only)       |
| 1     | full flat buffer                   | full flat buffer           | own shard (bf16 only)  |
| 2     | full flat buffer                   | own shard                  | own shard (bf16 only)  |
| 3     | own shard + one full buffer per unit, storage freed while released | own shard | own shard (bf16 only) |

With ``dtype == float32`` the master *is* the parameter storage (the owned part of the flat buffer, or the
stage-3 shard), so no copy is kept -- unless the optimizer is offloaded (``host`` given): then the fp32
master and a copy of the gradient shard (``host_grad``, gradient dtype) live in host memory -- views of the
rank's one host arena (``arena``, ``host_arena``) when given, pinned when ``pin_memory`` and the device is
CUDA -- and the parameter shard on the device receives the updates. With ``nvme`` (offload to NVMe) only the
gradient copy is in host memory (the arena holds just it): the master is in the optimizer's swap file, ``write``
hands its values to ``master_sink`` and ``unit_master`` is a placeholder of the right length. The
optimizer state lives in ``optimizer.FlatOptimizer`` (on the same device as the master). Gradient
buffers are in ``grad_dtype`` (``zero.reduce_dtype``: fp32 for a bf16 model that reduces in fp32). Every trainable parameter's
``.data`` becomes a view of the full flat buffer (stages 0-2) or of its unit's full buffer (stage 3); its
original storage is dropped. Padding stays zero everywhere.

Values arrive parameter by parameter (``needed_range`` says which elements of a parameter this rank
stores, ``write`` puts fp32 values there), so a model built on the meta device is materialized straight
into the buffers: no rank ever holds a full copy of a unit it does not keep. ``bind_unit`` then points the
parameters at their views; at stage 3 the unit's full buffer exists only while the views are made, then
its storage is freed (the gatherer brings it back).
"""

from __future__ import annotations

from contextlib import nullcontext as _nullcontext
from typing import Callable, Optional

import torch

from hybrid.zero.optimizer import Piece
from hybrid.plan.layout import FlatLayout
from hybrid.config.stage_policy import StagePolicy


class FlatState:
    def __init__(self, layout: FlatLayout, policy: StagePolicy, rank: int, dtype: torch.dtype, device,
                 persistent: frozenset = frozenset(), host=None, pin_memory: bool = False,
                 grad_dtype: Optional[torch.dtype] = None, arena=None, nvme: bool = False):
        self.layout, self.policy, self.dtype, self.device = layout, policy, dtype, device
        self.grad_dtype = grad_dtype or dtype
        self.rank = rank if layout.n_shards > 1 else 0
        self.persistent = frozenset(persistent)
        self.host = None if host is None else torch.device(host)
        self.pin_memory = bool(pin_memory) and host is not None and torch.device(device).type == "cuda"
        self.separate_master = dtype != torch.float32 or self.host is not None
        self.master_device = self.host if self.host is not None else device
        kw = dict(dtype=dtype, device=device)
        self.flat_params: Optional[torch.Tensor] = None   # full parameters (stages 0-2)
        self.param_shard: Optional[torch.Tensor] = None   # sharded parameters (stage 3)
        self.unit_full: list = []                          # stage 3: one gather buffer per unit
        if policy.shard_params:
            self.param_shard = torch.zeros(layout.shard_numel, **kw)
            self.unit_full = [torch.zeros(u.numel, **kw) if u.index in self.persistent else None
                              for u in layout.units]
        else:
            self.flat_params = torch.zeros(layout.full_numel, **kw)
        # NVMe (with ``host``): the master lives in the optimizer's swap file; ``master_sink(pos, values)`` takes
        # the values written here, and the pieces' master views are placeholders the optimizer binds per record
        self.nvme = bool(nvme) and self.host is not None
        self.master_sink: Optional[Callable[[int, torch.Tensor], None]] = None
        keeps_master = self.separate_master and not self.nvme
        self.arena = arena  # offload: the rank's one host allocation (``host_arena.HostArena``)
        if self.host is not None and arena is not None:  # carved in ``host_arena_bytes``' order
            self.master = arena.take(layout.shard_numel, torch.float32) if keeps_master else None
            self.host_grad = arena.take(layout.shard_numel, self.grad_dtype)
        else:
            self.master = (torch.zeros(layout.shard_numel, dtype=torch.float32, device=self.master_device,
                                       pin_memory=self.pin_memory) if keeps_master else None)
            self.host_grad = (torch.zeros(layout.shard_numel, dtype=self.grad_dtype, device=self.host,
                                          pin_memory=self.pin_memory)
                              if self.host is not None else None)
        cuda = self.host is not None and torch.device(device).type == "cuda"
        self._copy_stream = torch.cuda.Stream(device=device) if cuda else None
        gkw = dict(dtype=self.grad_dtype, device=device)
        if policy.shard_grads:
            self.flat_grad, self.grad_shard = None, torch.zeros(layout.shard_numel, **gkw)
        else:
            self.flat_grad, self.grad_shard = torch.zeros(layout.full_numel, **gkw), None

    # -- views by unit --------------------------------------------------------------------------------
    def _own(self, u: int) -> tuple:
        unit = self.layout.units[u]
        lo, hi = unit.shard_range(self.rank)
        return unit, lo, hi

    def unit_params(self, u: int) -> torch.Tensor:
        """The full parameters of unit ``u`` (stage 3: its gather buffer)."""
        if self.policy.shard_params:
            return self.unit_full[u]
        unit = self.layout.units[u]
        return self.flat_params[unit.full_offset:unit.full_offset + unit.numel]

    def unit_param_shard(self, u: int) -> torch.Tensor:
        """This rank's part of unit ``u``'s parameters, in the model dtype."""
        unit, lo, hi = self._own(u)
        if self.policy.shard_params:
            return self.param_shard[unit.shard_offset:unit.shard_offset + unit.shard_numel]
        return self.flat_params[unit.full_offset + lo:unit.full_offset + hi]

    def unit_master(self, u: int) -> torch.Tensor:
        """fp32 master weights of this rank's part of unit ``u`` (a view of the parameters in fp32 mode)."""
        if not self.separate_master:
            return self.unit_param_shard(u)
        unit = self.layout.units[u]
        if self.nvme:  # no values here: a placeholder of the right length (one element, repeated)
            return torch.zeros(1, dtype=torch.float32, device=self.master_device).expand(unit.shard_numel)
        return self.master[unit.shard_offset:unit.shard_offset + unit.shard_numel]

    def unit_grad_shard(self, u: int) -> torch.Tensor:
        """This rank's (reduced, once backward is done) gradients of unit ``u``."""
        unit, lo, hi = self._own(u)
        if self.policy.shard_grads:
            return self.grad_shard[unit.shard_offset:unit.shard_offset + unit.shard_numel]
        return self.flat_grad[unit.full_offset + lo:unit.full_offset + hi]

    def pieces(self, group_of: list) -> list:
        """One optimizer ``Piece`` per parameter piece this rank owns (``group_of[param]``: its group)."""
        out = []
        for pc in self.layout.owned_pieces(self.rank):
            unit = self.layout.units[pc.unit]
            local = pc.shard_pos - unit.shard_offset
            cut = slice(local, local + pc.numel)
            grad = (self.host_grad[pc.shard_pos:pc.shard_pos + pc.numel] if self.host_grad is not None
                    else self.unit_grad_shard(pc.unit)[cut])
            out.append(Piece(self.unit_master(pc.unit)[cut], grad, pc.shard_pos,
                             self.unit_param_shard(pc.unit)[cut] if self.separate_master else None, group_of[pc.param],
                             pc.param))
        return out

    @torch.no_grad()
    def copy_grads_to_host(self, u: Optional[int] = None) -> None:
        """Offload: copy the reduced gradient shard of unit ``u`` (every unit when None) to ``host_grad``.
        From a CUDA device the copy runs on a side stream (after the work queued so far), so it overlaps
        the rest of backward; ``wait_host_grads`` before the host reads them."""
        units = range(len(self.layout.units)) if u is None else (u,)
        stream = self._copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else _nullcontext():
            for k in units:
                unit = self.layout.units[k]
                self.host_grad[unit.shard_offset:unit.shard_offset + unit.shard_numel].copy_(
                    self.unit_grad_shard(k), non_blocking=self.pin_memory)

    def wait_host_grads(self) -> None:
        """Block until every gradient copy to the host has landed (a no-op off CUDA)."""
        if self._copy_stream is not None:
            self._copy_stream.synchronize()

    # -- filling --------------------------------------------------------------------------------------
    def _keeps_full(self, u: int) -> bool:
        return not self.policy.shard_params or u in self.persistent

    def needed_range(self, i: int) -> tuple:
        """``[lo, hi)`` of parameter ``i``'s flattened elements this rank stores (its owned range at stage 3)."""
        unit, _ = self.layout.locate(i)
        if self._keeps_full(unit.index):
            return 0, self.layout.numels[i]
        start, end, _ = self.layout.owned_range(i, self.rank)
        return start, end

    @torch.no_grad()
    def write(self, i: int, lo: int, values: torch.Tensor) -> None:
        """Store fp32 ``values`` as elements ``[lo, lo + len)`` of parameter ``i`` wherever this rank keeps them."""
        hi = lo + values.numel()
        unit, slot = self.layout.locate(i)
        if self._keeps_full(unit.index):
            full = self.unit_params(unit.index)
            full[slot.offset + lo:slot.offset + hi].copy_(values)
        start, end, pos = self.layout.owned_range(i, self.rank)
        a, b = max(start, lo), min(end, hi)
        if a >= b:
            return
        at = pos + a - start
        if self.param_shard is not None:
            self.param_shard[at:at + b - a].copy_(values[a - lo:b - lo])
        if self.master is not None:
            self.master[at:at + b - a].copy_(values[a - lo:b - lo])
        elif self.master_sink is not None:
            self.master_sink(at, values[a - lo:b - lo])

    # -- binding --------------------------------------------------------------------------------------
    @torch.no_grad()
    def bind_unit(self, u: int, shapes: list, bind: Callable[[int, torch.Tensor], None]) -> list:
        """Call ``bind(param index, view)`` for every parameter of unit ``u``; returns the ``(index, view)``
        pairs. At stage 3 a released unit's buffer is allocated only for this and freed right after."""
        unit = self.layout.units[u]
        if self.policy.shard_params and self.unit_full[u] is None:
            self.unit_full[u] = torch.empty(unit.numel, dtype=self.dtype, device=self.device)
        full = self.unit_params(u)
        views = [(s.param, full[s.offset:s.offset + s.numel].view(shapes[s.param])) for s in unit.slots]
        for i, view in views:
            bind(i, view)
        if not self._keeps_full(u):
            full.untyped_storage().resize_(0)
        return views

    # -- accounting -----------------------------------------------------------------------------------
    def tensors(self) -> dict:
        """The tensors behind each memory category (deduplicated by storage by the caller)."""
        params = [self.param_shard] if self.policy.shard_params else [self.flat_params]
        grads = [self.grad_shard if self.policy.shard_grads else self.flat_grad]
        optimizer = [self.master] if self.master is not None else []
        if self.host is None:
            return {"params": params, "grads": grads, "optimizer": optimizer}
        return {"params": params, "grads": grads, "optimizer": [], "host_optimizer": optimizer,
                "host_grads": [self.host_grad]}
