"""Pretrained weights streamed from one file, tensor by tensor and range by range.

``open_weights(path)`` opens a consolidated state dict: a ``.pt`` file (``torch.load(mmap=True,
weights_only=True)``: tensors stay on disk until a range of them is read) or a ``.safetensors`` file
(read lazily with the ``safetensors`` package, rows at a time). ``WeightsFile.read(name, lo, hi)``
returns elements ``[lo, hi)`` of the flattened tensor as fp32, touching only the rows that hold them, so
a rank that owns a shard (or a TP slice, via ``hybrid.weights.init.read_local_range``) never reads the
whole model into memory.

``WeightsFile.check(expected)`` matches names strictly before anything is trained: a missing, unexpected
or wrongly shaped tensor is one ``CheckpointError`` naming it (and listing up to five others). Keys that
``aliases`` names (a tied parameter's other name) may be present or absent. Any file that cannot be read
(truncated, not a state dict, a pickle of something other than tensors) is one sentence too; ``weights_only``
is never weakened.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Mapping

import torch

from hybrid.errors import CheckpointError, first_line, listing

SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")


def _first_line(err: Exception) -> str:
    return first_line(err, type(err).__name__, 200)


class WeightsFile:
    """One weights file; ``shapes`` maps every tensor name in it to its shape."""

    def __init__(self, path: Path, shapes: dict):
        self.path, self.shapes = path, shapes

    def read(self, name: str, lo: int, hi: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Elements ``[lo, hi)`` of tensor ``name`` flattened, as ``dtype`` (fp32 unless the model's tensor is
        an integer or fp64 one, which keeps its values exactly)."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def check(self, expected: Mapping[str, tuple], aliases: Iterable[str] = ()) -> None:
        """Raise one ``CheckpointError`` unless the file holds exactly ``expected`` (name -> full shape);
        ``aliases`` may be present or not."""
        optional = set(aliases)
        missing = [n for n in expected if n not in self.shapes]
        extra = [n for n in self.shapes if n not in expected and n not in optional]
        wrong = [n for n in expected if n in self.shapes and tuple(self.shapes[n]) != tuple(expected[n])]
        if missing:
            raise CheckpointError(f"weights file {self.path} has no tensor {missing[0]!r}, which the model needs"
                                  + (f" (missing too: {listing(missing[1:])})" if len(missing) > 1 else "")
                                  + "; load a file saved from this model (hybrid checkpoint consolidate).")
        if extra:
            raise CheckpointError(f"weights file {self.path} has a tensor {extra[0]!r} that the model does not "
                                  "have" + (f" (also: {listing(extra[1:])})" if len(extra) > 1 else "")
                                  + "; load a file saved from this model or rename its keys.")
        if wrong:
            n = wrong[0]
            raise CheckpointError(f"weights file {self.path} holds {n!r} with shape {list(self.shapes[n])} but "
                                  f"the model's is {list(expected[n])}"
                                  + (f" (also wrong: {listing(wrong[1:])})" if len(wrong) > 1 else "")
                                  + "; load weights of the same model configuration.")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TorchWeights(WeightsFile):
    def __init__(self, path: Path):
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as err:  # truncated zip, unsafe pickle, not a torch file: all one sentence
            raise CheckpointError(f"weights file {path} cannot be read as a torch state dict "
                                  f"({_first_line(err)}); give a file written by torch.save or "
                                  "hybrid checkpoint consolidate.") from None
        if not isinstance(state, Mapping):
            raise CheckpointError(f"weights file {path} holds a {type(state).__name__}, not a state dict "
                                  "(a mapping of names to tensors).")
        bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise CheckpointError(f"weights file {path} holds a {type(state[bad[0]]).__name__} under "
                                  f"{str(bad[0])!r}, not a tensor; give a plain state dict of tensors.")
        self._state = state
        super().__init__(path, {str(k): tuple(v.shape) for k, v in state.items()})

    def read(self, name, lo, hi, dtype=torch.float32):
        flat = self._state[name].reshape(-1)
        return flat[lo:hi].to(dtype, copy=True)


class SafetensorsWeights(WeightsFile):
    def __init__(self, path: Path):
        try:
            from safetensors import safe_open
        except ImportError:  # pragma: no cover - a dependency of the package
            raise CheckpointError("reading .safetensors needs the safetensors package; pip install "
                                  "safetensors.") from None
        try:
            self._file = safe_open(str(path), framework="pt", device="cpu")
            shapes = {name: tuple(self._file.get_slice(name).get_shape()) for name in self._file.keys()}
        except Exception as err:
            raise CheckpointError(f"weights file {path} cannot be read as safetensors ({_first_line(err)}); "
                                  "give a complete .safetensors file.") from None
        super().__init__(path, shapes)

    def read(self, name, lo, hi, dtype=torch.float32):
        shape = self.shapes[name]
        try:
            if len(shape) == 0:
                return self._file.get_tensor(name).reshape(-1)[lo:hi].to(dtype, copy=True)
            row = math.prod(shape[1:])
            first, last = lo // row, (hi - 1) // row
            rows = self._file.get_slice(name)[first:last + 1].reshape(-1)
            return rows[lo - first * row:hi - first * row].to(dtype, copy=True)
        except Exception as err:
            raise CheckpointError(f"weights file {self.path} is damaged: reading {name!r} failed "
                                  f"({_first_line(err)}).") from None

    def close(self):
        self._file = None


def open_weights(path) -> WeightsFile:
    """The weights file at ``path`` (``.safetensors``, else a torch file), opened lazily."""
    p = Path(path)
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        raise CheckpointError(f"weights file {p} {what}; give a consolidated .pt or .safetensors file.")
    if p.suffix == ".safetensors":
        return SafetensorsWeights(p)
    return TorchWeights(p)
