"""Block-wise int8 quantization of the chunks a collective moves, and the error it makes (ZeRO++'s qwZ / qgZ).

A tensor of n chunks of c elements (one chunk per rank of the collective) is packed as n rows of
``c + 4·ceil(c / block)`` bytes: the c values as int8, then one fp32 scale per block of ``block`` elements
(``hybrid.plan.links.quantized_bytes``). Symmetric: a block's scale is its largest magnitude / 127 and each value
is rounded to the nearest multiple of it, so the error of one value is at most half a scale and a block of zeros
stays zeros. A chunk's blocks never straddle chunks, so a rank can unpack what it receives from each peer alone.
c must be a multiple of 4 (the scales are read in place as fp32): ``hybrid.plan.layout`` pads every unit to a
multiple of ``n_shards · align`` elements, which makes every chunk one.

``QuantError`` sums, on the device, the squared error of the values a rank quantized and got back and their
squared norm, so ``relative()`` is the step's relative quantization error, read once per step (a host sync).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LEVELS = 127  # int8, symmetric


def packed_bytes(chunk: int, block: int) -> int:
    """Bytes of one packed chunk of ``chunk`` values."""
    return chunk + 4 * (-(-chunk // block))


def pack(chunks: torch.Tensor, block: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``chunks`` (n x c, any float dtype) quantized into ``out`` (n x ``packed_bytes(c)`` uint8, made if None)."""
    n, c = chunks.shape
    blocks = -(-c // block)
    if c % 4:
        raise ValueError(f"a quantized chunk must hold a multiple of 4 values, got {c}")
    values = F.pad(chunks.float(), (0, blocks * block - c)).view(n, blocks, block)
    scale = values.abs().amax(dim=-1).div_(LEVELS)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = values.div_(scale.unsqueeze(-1)).round_().clamp_(-LEVELS, LEVELS).to(torch.int8)
    if out is None:
        out = torch.empty(n, c + 4 * blocks, dtype=torch.uint8, device=chunks.device)
    out[:, :c].copy_(q.view(n, blocks * block)[:, :c].view(torch.uint8))
    out[:, c:].copy_(scale.view(torch.uint8).view(n, 4 * blocks))
    return out


def unpack(packed: torch.Tensor, chunk: int, block: int) -> torch.Tensor:
    """The fp32 values (n x ``chunk``) of ``packed`` (n x ``packed_bytes(chunk)`` uint8)."""
    n = packed.shape[0]
    blocks = -(-chunk // block)
    scale = packed[:, chunk:].contiguous().view(torch.float32)
    q = F.pad(packed[:, :chunk].view(torch.int8).float(), (0, blocks * block - chunk)).view(n, blocks, block)
    return q.mul_(scale.unsqueeze(-1)).view(n, blocks * block)[:, :chunk]


def relative_error(sums: tuple | None) -> float | None:
    """sqrt(error^2 / value^2) of ``QuantError.sums()`` (0 for values all zero; None for none)."""
    if sums is None:
        return None
    err, ref = sums
    return (err / ref) ** 0.5 if ref > 0 else 0.0


class QuantError:
    """Squared quantization error and squared norm of the values a rank sent, summed on the device."""

    def __init__(self):
        self._sums = None  # (error^2, value^2) in float64

    def add(self, exact: torch.Tensor, received: torch.Tensor) -> None:
        """``received``: ``exact``'s values after a round trip through int8."""
        exact = exact.reshape(-1).double()
        sums = torch.stack([(received.reshape(-1).double() - exact).square().sum(), exact.square().sum()])
        self._sums = sums if self._sums is None else self._sums + sums

    def sums(self) -> tuple | None:
        """``(sum error^2, sum value^2)`` since the last reset (a host sync); None when nothing was quantized."""
        if self._sums is None:
            return None
        err, ref = (float(x) for x in self._sums.tolist())
        return err, ref

    def relative(self) -> float | None:
        """sqrt(sum error^2 / sum value^2) since the last reset; None when nothing was quantized."""
        return relative_error(self.sums())

    def reset(self) -> None:
        self._sums = None
