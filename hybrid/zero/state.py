"""The rank's model-state tensors for one stage, and the parameters re-bound as views of them.

What this rank holds (Ψ trainable elements, N DP ranks, ``dtype`` the model precision):

| stage | parameters                         | gradients                  | fp32 master            |
|-------|------------------------------------|----------------------------|------------------------|
| 0     | full flat buffer                   | full flat buffer           | full (bf16 only)       |
| 1     | full flat buffer                   | full flat buffer           | own shard (bf16 only)  |
| 2     | full flat buffer                   | own shard                  | own shard (bf16 only)  |
| 3     | own shard + one full buffer per unit, storage freed while released | own shard | own shard (bf16 only) |

With ``dtype == float32`` the master *is* the parameter storage (the owned part of the flat buffer, or the
stage-3 shard), so no copy is kept. The Adam moments live in ``ShardedAdamW``. Every trainable parameter's
``.data`` becomes a view of the full flat buffer (stages 0-2) or of its unit's full buffer (stage 3); its
original storage is dropped. Padding stays zero everywhere.
"""

from __future__ import annotations

from typing import Optional

import torch

from hybrid.zero.optimizer import Segment
from hybrid.zero.partition import FlatLayout


class FlatState:
    def __init__(self, params: list, layout: FlatLayout, stage: int, rank: int, dtype: torch.dtype, device):
        self.params, self.layout, self.stage, self.dtype, self.device = params, layout, stage, dtype, device
        self.rank = rank if layout.n_shards > 1 else 0
        self.separate_master = dtype != torch.float32
        kw = dict(dtype=dtype, device=device)
        self.flat_params: Optional[torch.Tensor] = None   # stages 0-2
        self.param_shard: Optional[torch.Tensor] = None   # stage 3
        self.unit_full: list = []                          # stage 3
        if stage < 3:
            self.flat_params = torch.zeros(layout.full_numel, **kw)
        else:
            self.param_shard = torch.zeros(layout.shard_numel, **kw)
        self.master = (torch.zeros(layout.shard_numel, dtype=torch.float32, device=device)
                       if self.separate_master else None)
        if stage < 2:
            self.flat_grad, self.grad_shard = torch.zeros(layout.full_numel, **kw), None
        else:
            self.flat_grad, self.grad_shard = None, torch.zeros(layout.shard_numel, **kw)
        self._bind()

    # -- views by unit --------------------------------------------------------------------------------
    def _own(self, u: int) -> tuple:
        unit = self.layout.units[u]
        lo, hi = unit.shard_range(self.rank)
        return unit, lo, hi

    def unit_params(self, u: int) -> torch.Tensor:
        """The full parameters of unit ``u`` (stage 3: its gather buffer)."""
        if self.stage == 3:
            return self.unit_full[u]
        unit = self.layout.units[u]
        return self.flat_params[unit.full_offset:unit.full_offset + unit.numel]

    def unit_param_shard(self, u: int) -> torch.Tensor:
        """This rank's part of unit ``u``'s parameters, in the model dtype."""
        unit, lo, hi = self._own(u)
        if self.stage == 3:
            return self.param_shard[unit.shard_offset:unit.shard_offset + unit.shard_numel]
        return self.flat_params[unit.full_offset + lo:unit.full_offset + hi]

    def unit_master(self, u: int) -> torch.Tensor:
        """fp32 master weights of this rank's part of unit ``u`` (a view of the parameters in fp32 mode)."""
        if not self.separate_master:
            return self.unit_param_shard(u)
        unit = self.layout.units[u]
        return self.master[unit.shard_offset:unit.shard_offset + unit.shard_numel]

    def unit_grad_shard(self, u: int) -> torch.Tensor:
        """This rank's (reduced, once backward is done) gradients of unit ``u``."""
        unit, lo, hi = self._own(u)
        if self.stage >= 2:
            return self.grad_shard[unit.shard_offset:unit.shard_offset + unit.shard_numel]
        return self.flat_grad[unit.full_offset + lo:unit.full_offset + hi]

    def segments(self) -> list:
        return [Segment(self.unit_master(u), self.unit_grad_shard(u), unit.shard_offset,
                        self.unit_param_shard(u) if self.separate_master else None)
                for u, unit in enumerate(self.layout.units)]

    # -- binding --------------------------------------------------------------------------------------
    @torch.no_grad()
    def _bind(self) -> None:
        for unit in self.layout.units:
            full32 = torch.zeros(unit.numel, dtype=torch.float32, device=self.device)
            for slot in unit.slots:
                full32[slot.offset:slot.offset + slot.numel].copy_(self.params[slot.param].detach().reshape(-1))
            lo, hi = unit.shard_range(self.rank)
            if self.separate_master:
                self.unit_master(unit.index).copy_(full32[lo:hi])
            if self.stage == 3:
                full = full32 if self.dtype == torch.float32 else full32.to(self.dtype)
                self.unit_full.append(full)
                self.unit_param_shard(unit.index).copy_(full[lo:hi])
            else:
                full = self.unit_params(unit.index)
                full.copy_(full32)
            for slot in unit.slots:
                p = self.params[slot.param]
                p.data = full[slot.offset:slot.offset + slot.numel].view(p.shape)

    # -- accounting -----------------------------------------------------------------------------------
    def tensors(self) -> dict:
        """The tensors behind each memory category (deduplicated by storage by the caller)."""
        params = [self.flat_params] if self.stage < 3 else [self.param_shard]
        grads = [self.flat_grad if self.stage < 2 else self.grad_shard]
        optimizer = [self.master] if self.separate_master else []
        return {"params": params, "grads": grads, "optimizer": optimizer}
