"""Pretrained weights streamed from files, tensor by tensor and range by range.

``open_weights(path)`` opens a consolidated state dict: a ``.pt`` file (``torch.load(mmap=True,
weights_only=True)``: tensors stay on disk until a range of them is read), a ``.safetensors`` file (read
lazily with the ``safetensors`` package, rows at a time), or a Hugging Face ``save_pretrained`` directory:
sharded safetensors listed by ``model.safetensors.index.json`` (its ``weight_map``: tensor name -> shard
file), or one ``model.safetensors``. ``WeightsFile.read(name, lo, hi)`` returns elements ``[lo, hi)`` of the
flattened tensor as fp32 (a bf16 or fp16 file is upcast), touching only the rows that hold them, so a rank
that owns a shard (or a TP slice, via ``hybrid.weights.init.read_local_range``) never reads the whole model
into memory. Of a sharded directory a reader keeps one shard file open at a time, opened when a tensor of it
is first read: a rank maps only the shard files holding rows it needs, and at most one at once.

``WeightsFile.check(expected)`` matches names strictly before anything is trained: a missing, unexpected
or wrongly shaped tensor is one ``CheckpointError`` naming it (and listing up to five others). Keys that
``aliases`` names (a tied parameter's other name) may be present or absent. The names are the file's
keys: ``hybrid.weights.sources`` gives the model's names as a file holds them (a transformers model's
renamed keys: ``hybrid.weights.hf_keys``), so an error names the key as it is, or would be, in the file.
Any file that cannot be read (truncated, not a state dict, a pickle of something other than tensors) is one
sentence too; ``weights_only`` is never weakened. Of a directory, an index that is not JSON or has no
``weight_map``, a shard file it names that is not there, and a tensor it lists that its shard does not hold
are each one sentence, found when the directory is opened (every shard's header is read then; no tensor
data).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable, Mapping, Optional

import torch

from hybrid.errors import CheckpointError, first_line, listing

SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
INDEX = "model.safetensors.index.json"  # a save_pretrained directory's list of shards (transformers' name)
SINGLE = "model.safetensors"            # a save_pretrained directory's one file, when the model fits one shard


def _first_line(err: Exception) -> str:
    return first_line(err, type(err).__name__, 200)


class WeightsFile:
    """One weights file (or directory: ``what``); ``shapes`` maps every tensor name in it to its shape."""

    what = "weights file"

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
            raise CheckpointError(f"{self.what} {self.path} has no tensor {missing[0]!r}, which the model needs"
                                  + (f" (missing too: {listing(missing[1:])})" if len(missing) > 1 else "")
                                  + "; load a file saved from this model (hybrid checkpoint consolidate).")
        if extra:
            raise CheckpointError(f"{self.what} {self.path} has a tensor {extra[0]!r} that the model does not "
                                  "have" + (f" (also: {listing(extra[1:])})" if len(extra) > 1 else "")
                                  + "; load a file saved from this model or rename its keys.")
        if wrong:
            n = wrong[0]
            raise CheckpointError(f"{self.what} {self.path} holds {n!r} with shape {list(self.shapes[n])} but "
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


class ShardedSafetensors(WeightsFile):
    """A ``save_pretrained`` directory of sharded safetensors, listed by its ``INDEX``."""

    what = "weights directory"

    def __init__(self, directory: Path):
        index = directory / INDEX
        self._where = _weight_map(index)  # tensor name -> shard file name
        shapes = {}
        for shard, names in _by_shard(self._where).items():
            path = directory / shard
            if not path.is_file():
                more = f" and {len(names) - 1} more tensor{'s' if len(names) > 2 else ''}" if len(names) > 1 else ""
                raise CheckpointError(f"{index} puts {names[0]!r}{more} in {shard}, which "
                                      f"{'is not a file' if path.exists() else 'does not exist'} there; copy that "
                                      "shard into the directory or save the model again (save_pretrained).")
            with SafetensorsWeights(path) as opened:  # its header only: names, shapes, offsets checked
                absent = [n for n in names if n not in opened.shapes]
                if absent:
                    raise CheckpointError(f"{index} puts {absent[0]!r} in {shard}, which does not hold it"
                                          + (f" (nor {listing(absent[1:])})" if len(absent) > 1 else "")
                                          + "; the index and the shards are of different saves: save the model "
                                          "again (save_pretrained).")
                shapes.update({n: opened.shapes[n] for n in names})
        super().__init__(directory, shapes)
        self._open: Optional[SafetensorsWeights] = None  # the one shard open now

    def read(self, name, lo, hi, dtype=torch.float32):
        path = self.path / self._where[name]
        if self._open is None or self._open.path != path:
            self.close()  # one shard mapped at a time: its pages leave the process with it
            self._open = SafetensorsWeights(path)
        return self._open.read(name, lo, hi, dtype)

    def close(self):
        if self._open is not None:
            self._open.close()
            self._open = None


def _weight_map(index: Path) -> dict:
    """The ``weight_map`` of a safetensors index file (name -> shard file name), checked."""
    try:
        doc = json.loads(index.read_text(encoding="utf-8"))
    except OSError as err:
        raise CheckpointError(f"weights index {index} cannot be read ({err.strerror or err}); make it readable "
                              "by this user.") from None
    except (ValueError, RecursionError) as err:  # JSONDecodeError, bad UTF-8
        raise CheckpointError(f"weights index {index} is not valid JSON ({_first_line(err)}); save the model again "
                              "(save_pretrained) or restore the file.") from None
    where = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(where, dict) or not where:
        raise CheckpointError(f"weights index {index} has no weight_map (a mapping of tensor names to shard "
                              "files); save the model again (save_pretrained) or restore the file.")
    bad = next((k for k, v in where.items() if not isinstance(v, str) or not v or Path(v).name != v), None)
    if bad is not None:
        raise CheckpointError(f"weights index {index} maps {bad!r} to {where[bad]!r}, which is not the name of a "
                              "file in its directory; save the model again (save_pretrained).")
    return where


def _by_shard(where: dict) -> dict:
    """Shard file name -> the tensor names the index puts there, in the index's order."""
    out: dict = {}
    for name, shard in where.items():
        out.setdefault(shard, []).append(name)
    return out


def weights_location(path) -> Path:
    """The file ``open_weights(path)`` reads first: ``path`` itself, or a directory's ``INDEX`` (else its
    ``SINGLE`` file); one ``CheckpointError`` sentence when there is none. Reads nothing: a launcher checks a
    config's weights path with it before any rank starts."""
    p = Path(path)
    if p.is_dir():
        for name in (INDEX, SINGLE):
            if (p / name).is_file():
                return p / name
        raise CheckpointError(f"weights file {p} is a directory without {INDEX} or {SINGLE}; give a directory "
                              "written by save_pretrained (safetensors) or a consolidated .pt or .safetensors "
                              "file.")
    if not p.is_file():
        raise CheckpointError(f"weights file {p} does not exist; give a consolidated .pt or .safetensors file or a "
                              "save_pretrained directory.")
    return p


def open_weights(path) -> WeightsFile:
    """The weights at ``path`` (a ``.safetensors`` file, else a torch file; or a ``save_pretrained``
    directory), opened lazily."""
    found = weights_location(path)
    if found.name == INDEX:  # the directory, or its index named
        return ShardedSafetensors(found.parent)
    if found.suffix == ".safetensors":
        return SafetensorsWeights(found)
    return TorchWeights(found)
