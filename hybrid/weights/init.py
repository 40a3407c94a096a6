"""Layout-independent parameter initializers: any range of a parameter's values, drawn on its own.

An initializer (``Normal``, ``Uniform``, ``Constant``) attached to a parameter with ``set_initializer``
defines the parameter's *full* (single-process, TP-unsharded) values as a function of ``(seed, key)``
alone, where ``key`` is the parameter's name (``Initializer.key`` when the model stamped one, else its
qualified name in the model being initialized). The flattened full tensor is cut into chunks of
``CHUNK`` elements; chunk ``c`` is drawn with its own generator, seeded from ``(seed, key, c)``. So any
range of elements can be produced by drawing only the chunks it touches: a DP rank of a stage-3 engine
draws its shard (O(shard) work), a TP rank its slice, and every layout gets bit-identical values.

``local_values(init, seed, key, full_shape, tp_dim, tp_rank, tp, lo, hi)`` returns elements ``[lo, hi)``
of the flattened TP-local slice (``full.chunk(tp, tp_dim)[tp_rank]``), via ``read_local_range``, the one
mapping from local ranges to ranges of the full tensor (also used to stream weights from files).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import torch

CHUNK = 1 << 16
_INIT_ATTR = "_hybrid_initializer"


@dataclass(frozen=True)
class Initializer:
    # the name the values are seeded by; None: the qualified name at init time
    key: Optional[str] = field(default=None, kw_only=True)

    random = False

    def draw_chunk(self, n: int, generator: Optional[torch.Generator]) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class Normal(Initializer):
    std: float = 0.02
    mean: float = 0.0
    random = True

    def draw_chunk(self, n, generator):
        return torch.empty(n, dtype=torch.float32).normal_(self.mean, self.std, generator=generator)


@dataclass(frozen=True)
class Uniform(Initializer):
    low: float = -1.0
    high: float = 1.0
    random = True

    def draw_chunk(self, n, generator):
        return torch.empty(n, dtype=torch.float32).uniform_(self.low, self.high, generator=generator)


@dataclass(frozen=True)
class Constant(Initializer):
    value: float = 0.0

    def draw_chunk(self, n, generator):
        return torch.full((n,), float(self.value), dtype=torch.float32)


def set_initializer(param: torch.Tensor, init: Initializer) -> torch.Tensor:
    setattr(param, _INIT_ATTR, init)
    return param


def get_initializer(param: torch.Tensor) -> Optional[Initializer]:
    return getattr(param, _INIT_ATTR, None)


def stamp_keys(module: torch.nn.Module) -> None:
    """Fix every initializer's key to the parameter's name in ``module``, so wrapping ``module`` in
    another model does not change its values."""
    for name, p in module.named_parameters():
        init = get_initializer(p)
        if init is not None and init.key is None:
            set_initializer(p, replace(init, key=name))


def chunk_seed(seed: int, key: str, chunk: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{key}:{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2 ** 63 - 1)


def full_values(init: Initializer, seed: int, key: str, full_numel: int, lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of the flattened full tensor (fp32, CPU)."""
    if hi <= lo:
        return torch.empty(0, dtype=torch.float32)
    if not init.random:
        return init.draw_chunk(hi - lo, None)
    first, last = lo // CHUNK, (hi - 1) // CHUNK
    parts = []
    for c in range(first, last + 1):
        start = c * CHUNK
        n = min(CHUNK, full_numel - start)  # always the whole chunk: a shorter draw gives other values
        values = init.draw_chunk(n, torch.Generator().manual_seed(chunk_seed(seed, key, c)))
        parts.append(values[max(lo, start) - start:min(hi, start + n) - start])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def read_local_range(read_full: Callable[[int, int], torch.Tensor], full_shape: Sequence[int],
                     tp_dim: Optional[int], tp_rank: int, tp: int, lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of the flattened TP slice ``full.chunk(tp, tp_dim)[tp_rank]``.

    ``read_full(a, b)`` returns elements ``[a, b)`` of the flattened full tensor; it is asked for one
    range, at most ``tp`` times longer than ``hi - lo`` plus one row.
    """
    if hi <= lo:
        return torch.empty(0, dtype=torch.float32)
    if tp_dim is None or tp == 1:
        return read_full(lo, hi)
    shape = list(full_shape)
    if shape[tp_dim] % tp:
        raise ValueError(f"dimension {tp_dim} of size {shape[tp_dim]} does not split into {tp} TP slices")
    inner = math.prod(shape[tp_dim + 1:])
    local_row = shape[tp_dim] // tp * inner      # local elements per index of the outer dims
    full_row = shape[tp_dim] * inner
    skip = tp_rank * local_row                  # where this rank's slice starts inside a full row
    first, last = lo // local_row, (hi - 1) // local_row
    if first == last:  # one contiguous piece of the full tensor
        base = first * full_row + skip + lo - first * local_row
        return read_full(base, base + hi - lo)
    rows = read_full(first * full_row, (last + 1) * full_row).view(last + 1 - first, full_row)
    local = rows[:, skip:skip + local_row].reshape(-1)
    return local[lo - first * local_row:hi - first * local_row]


def local_values(init: Initializer, seed: int, key: str, full_shape: Sequence[int], tp_dim: Optional[int],
                 tp_rank: int, tp: int, lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of this TP rank's flattened slice of the parameter ``init`` describes."""
    numel = math.prod(full_shape)
    return read_local_range(lambda a, b: full_values(init, seed, key, numel, a, b), full_shape, tp_dim,
                            tp_rank, tp, lo, hi)
