"""A checkpoint written as a Hugging Face ``save_pretrained`` directory, streamed a tensor at a time.

``consolidate_hf(path, out_dir, max_shard_size=..., config=None)`` writes the single-process weights of the
checkpoint ``consolidate`` would read (the same verification, the same refusals: a damaged checkpoint, a
non-finite value) as transformers' sharded safetensors::

    OUT_DIR/model-00001-of-00003.safetensors   (metadata {"format": "pt"}, as save_pretrained writes)
    OUT_DIR/model-00002-of-00003.safetensors
    OUT_DIR/model-00003-of-00003.safetensors
    OUT_DIR/model.safetensors.index.json       ({"metadata": {"total_size", "total_parameters"}, "weight_map"})
    OUT_DIR/config.json                        (when the model has one)

which ``from_pretrained(OUT_DIR)`` and ``hybrid.initialize(..., weights=OUT_DIR)`` load. Values are the fp32
masters (frozen parameters and buffers as ``consolidate`` exports them). A tied tensor is written once,
under its first name (the input embedding's: save_pretrained leaves ``lm_head.weight`` out the same way).

Each tensor is written under the key ``save_pretrained`` writes it under (``hybrid.weights.hf_keys``: GPT-NeoX's
``lm_head.weight`` as ``embed_out.weight``), asked of transformers for the model the config describes, built
on meta: the first of the config's ``architectures``, ``AutoModelForCausalLM`` (what an ``hf:`` model
config trains) and ``AutoModel`` whose state-dict names are the checkpoint's (``Exported.names_from`` says
which). Without such a model (no transformers config, another model's config, no transformers installed)
the names are the checkpoint's own.

Tensors are ordered by the key they are written under with numbers compared as numbers (``layers.2`` before
``layers.10``, roughly the model's order) and cut into shards as ``save_pretrained`` cuts them: in order, a
new shard when the next tensor would pass ``max_shard_size`` (default 5 GB), a larger tensor alone in its
own.

It streams: the shards are planned from the manifest's shapes and dtypes, so each shard file's safetensors
header (names, dtypes, shapes, byte offsets) is written first; then each tensor is read from the checkpoint
(one DCP load), checked and its bytes appended before the next is read. The process holds one tensor (and
the piece DCP is reading into it), never a shard's worth, never the model.

``config.json`` comes from ``config`` (a config.json, or the directory holding one), else from the
checkpoint's model config when it is a transformers config (it has a ``model_type``; or a ``model:``
section, or an ``hf: {config: ...}`` mapping or absolute path, of one); else none is written. Its dtype is
set to float32, what the files hold. A config that ties the word embeddings when the checkpoint has no tied
tensor is refused (from_pretrained would tie the trained head away).

Before anything is read, ``out_dir`` is checked: outside every checkpoint directory, not a file, not a
directory with something in it, and its parent writable (a temporary directory ``.OUT_DIR.tmp-PID`` is made
beside it). Everything is written there and renamed to ``out_dir`` at the end; on any failure it is removed,
so ``out_dir`` is either complete or absent. Errors are one ``CheckpointError`` sentence.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Union

import torch
from torch.distributed.checkpoint import FileSystemReader

from hybrid.checkpoint import layout, offline
from hybrid.errors import CheckpointError, first_line
from hybrid.weights.files import INDEX
from hybrid.weights.hf_keys import checkpoint_keys

SHARD = "model-{:05d}-of-{:05d}.safetensors"
CONFIG = "config.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # huggingface_hub's default; small shards keep the export's memory small
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = "a size such as 5GB, 500MB or 2000000 (bytes)"
# safetensors' names of the dtypes a state dict holds (its format specification)
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
           torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


@dataclass(frozen=True)
class Written:
    """One tensor of the checkpoint and the key it is written under."""

    key: str
    tensor: offline.SavedTensor

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes


@dataclass(frozen=True)
class Exported:
    """What ``consolidate_hf`` wrote."""

    out_dir: Path
    shards: tuple  # the shard files' names, in order
    tensors: int
    parameters: int  # trainable and frozen, a tied one once (the index's total_parameters)
    total_size: int  # bytes of tensor data (the index's total_size)
    config_from: Optional[str]  # where config.json came from; None: none was written
    checkpoint: Path
    manifest: dict
    names_from: Optional[str] = None  # the transformers class whose checkpoint keys were written; None: the names

    @property
    def files(self) -> tuple:
        """Every file written, shards first."""
        return self.shards + (INDEX,) + ((CONFIG,) if self.config_from else ())


def parse_size(value: Union[int, str], field: str = "max_shard_size") -> int:
    """Bytes from an int or transformers' spelling: ``5GB``, ``500MB``, ``20KB``, ``2GiB``, ``2000000``."""
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = value, ""
    else:
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not match or match.group(2).upper() not in _UNITS:
            raise CheckpointError(f"{field} must be {_SIZE}, got {value!r}.")
        number, unit = float(match.group(1)), match.group(2).upper()
    size = int(number * _UNITS[unit])
    if size < 1:
        raise CheckpointError(f"{field} must be {_SIZE} of at least 1 byte, got {value!r}.")
    return size


def natural_key(name: str) -> tuple:
    """Sort key of a tensor name with its numbers compared as numbers (``layers.2`` before ``layers.10``)."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def plan_shards(tensors: list, max_shard_size: int) -> list[list]:
    """``tensors`` (each with ``nbytes``) cut into shards as save_pretrained cuts a state dict: in order, a new
    shard when the next tensor would pass ``max_shard_size``, so a tensor larger than it is alone in its own
    (save_pretrained puts that one aside and goes on filling the shard before it; here the order is kept)."""
    shards: list = []
    current: list = []
    size = 0
    for t in tensors:
        if current and size + t.nbytes > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current:
        shards.append(current)
    return shards


def read_config(path: Union[str, os.PathLike]) -> dict:
    """The transformers config at ``path`` (a config.json, or the directory holding one), checked."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / CONFIG
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise CheckpointError(f"the model config {path} cannot be read ({err.strerror or err}); give the "
                              f"model's {CONFIG} (or the directory holding it).") from None
    except (ValueError, RecursionError) as err:
        raise CheckpointError(f"the model config {path} is not valid JSON ({first_line(err)}); give the model's "
                              f"{CONFIG} as save_pretrained wrote it.") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("model_type"), str):
        raise CheckpointError(f"the model config {path} is not a transformers config (it has no model_type); "
                              f"give the model's {CONFIG} as save_pretrained wrote it.")
    return doc


def config_of_checkpoint(doc: Mapping) -> tuple[Optional[dict], Optional[str]]:
    """``(config, where it came from)`` of a checkpoint's manifest ``doc`` when its model config is, or names,
    a transformers config; ``(None, None)`` when it is not a Hugging Face model's."""
    saved = doc.get("model_config")
    if not isinstance(saved, Mapping):
        return None, None
    if isinstance(saved.get("model_type"), str):
        return dict(saved), "the checkpoint's model config"
    model = saved.get("model")
    if isinstance(model, Mapping) and isinstance(model.get("model_type"), str):
        return dict(model), "the checkpoint's model config (model:)"
    hf = saved.get("hf")
    config = hf.get("config") if isinstance(hf, Mapping) else None
    if isinstance(config, Mapping) and isinstance(config.get("model_type"), str):
        return dict(config), "the checkpoint's model config (hf.config)"
    if isinstance(config, str):
        path = Path(config).expanduser()
        if not path.is_absolute() or not path.exists():
            where = "is relative to a model config file the checkpoint does not record" if not path.is_absolute() \
                else "does not exist here"
            raise CheckpointError(f"the checkpoint's model config names hf.config {config!r}, which {where}; name "
                                  f"the model's {CONFIG} with --config (config= in Python).")
        return read_config(path), str(path)
    return None, None


def hf_names(config: Optional[Mapping], doc: Mapping) -> tuple[dict, Optional[str]]:
    """``(name -> the key save_pretrained writes it under, the transformers class asked)`` for every state-dict
    name of the checkpoint's manifest ``doc``, of the model ``config`` (a transformers config.json's
    mapping) describes; ``({}, None)`` (every name its own) without such a model (the module docstring)."""
    names = _state_names(doc)
    model = _model_with_names(config, names) if config is not None else None
    if model is None:
        return {}, None
    return checkpoint_keys(model, sorted(names)), type(model).__name__


def _state_names(doc: Mapping) -> set:
    """Every state-dict name the checkpoint's manifest ``doc`` holds (a tied tensor's aliases too)."""
    return {*doc["params"], *doc.get("frozen", {}), *doc.get("buffers", {}), *doc.get("aliases", {})}


def _model_with_names(config: Mapping, names: set):
    """The transformers model ``config`` describes, built on meta, whose state-dict names are ``names``: of the
    config's ``architectures``, ``AutoModelForCausalLM`` and ``AutoModel``, the first that builds with them;
    None when none does (or transformers is not installed)."""
    try:
        import transformers
    except ImportError:
        return None
    try:
        built = transformers.AutoConfig.for_model(config["model_type"])
        hf_config = type(built).from_dict(dict(config))
    except Exception:  # a model_type this transformers does not know, or a config it cannot take
        return None
    makers = [getattr(transformers, a, None) for a in config.get("architectures") or () if isinstance(a, str)]
    makers = [m for m in makers if isinstance(m, type)]
    makers += [transformers.AutoModelForCausalLM.from_config, transformers.AutoModel.from_config]
    for make in makers:
        try:
            with torch.device("meta"):
                model = make(hf_config)
        except Exception:  # not a model of this config (an encoder has no causal LM head)
            continue
        if set(model.state_dict()) == names:
            return model
    return None


def consolidate_hf(path: layout.PathLike, out_dir: layout.PathLike, *,
                   max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
                   config: Optional[Union[str, os.PathLike, Mapping[str, Any]]] = None) -> Exported:
    """Write the checkpoint ``path`` names (as ``consolidate`` reads it) to ``out_dir`` as a save_pretrained
    directory (see the module docstring); ``config``: the model's config.json (a path, or the config as a
    mapping), else the checkpoint's own when it has one."""
    limit = parse_size(max_shard_size)
    out_dir = Path(out_dir)
    tmp = _temporary_beside(out_dir)
    try:
        given = None if config is None else (dict(config) if isinstance(config, Mapping) else read_config(config))
        ckpt, inv = offline.verified(path)
        doc = inv.manifest
        hf_config, config_from = ((given, "the given config" if isinstance(config, Mapping) else str(config))
                                  if given is not None else config_of_checkpoint(doc))
        state_names = _state_names(doc)
        model = _model_with_names(hf_config, state_names) if hf_config is not None else None
        if hf_config is not None:
            _check_ties(hf_config, doc, config_from, model)
        reader = FileSystemReader(ckpt)
        saved = offline.saved_tensors(ckpt, reader, doc)
        keys, names_from = ({}, None) if model is None else (checkpoint_keys(model, sorted(state_names)),
                                                              type(model).__name__)
        tensors = sorted((Written(keys.get(t.name, t.name), t) for t in saved), key=lambda w: natural_key(w.key))
        shards = plan_shards(tensors, limit)
        names = tuple(SHARD.format(i, len(shards)) for i in range(1, len(shards) + 1))
        unsafe = next((t for t in saved if t.exported_dtype not in _DTYPES), None)
        if unsafe is not None:
            raise CheckpointError(f"{unsafe.name!r} is a {unsafe.exported_dtype} tensor, which safetensors cannot "
                                  f"hold; consolidate to a torch file instead (--out model.pt).")
        for name, shard in zip(names, shards):
            _write_shard(tmp / name, shard, lambda ts: offline.read_tensors(ckpt, reader, ts), out_dir)
        counted = set(doc["params"]) | set(doc.get("frozen", {}))
        parameters = sum(math.prod(t.full_shape) for t in saved if t.name in counted)
        total = sum(t.nbytes for t in saved)
        where = {w.key: name for name, shard in zip(names, shards) for w in shard}
        index = {"metadata": {"total_parameters": parameters, "total_size": total},
                 "weight_map": dict(sorted(where.items()))}
        _write_json(tmp / INDEX, index, out_dir)
        if hf_config is not None:
            _write_json(tmp / CONFIG, _float32(hf_config), out_dir)
        _publish(tmp, out_dir)
    except BaseException:
        layout.remove(tmp)
        raise
    return Exported(out_dir, names, len(tensors), parameters, total, config_from, ckpt, doc, names_from)


def _cannot_write(out_dir: Path, why: str) -> CheckpointError:
    return CheckpointError(f"cannot write the Hugging Face directory {out_dir}: {why}; choose a new directory in a "
                           f"writable place with room for the model.")


def _temporary_beside(out_dir: Path) -> Path:
    """A new empty directory beside ``out_dir`` to write into, after checking that ``out_dir`` may be written
    (``consolidate_hf``'s docstring says what is refused)."""
    inside = offline.inside_checkpoint(out_dir)
    if inside is not None:
        raise CheckpointError(f"{out_dir} lies inside the checkpoint directory {inside}, which writing there would "
                              f"damage; write the Hugging Face directory outside it (e.g. {out_dir.name}).")
    if out_dir.is_dir():
        try:
            if any(out_dir.iterdir()):
                raise _cannot_write(out_dir, "it is a directory with files in it, which this would mix with or "
                                             "replace")
        except PermissionError:
            raise _cannot_write(out_dir, "it cannot be listed (permission denied)") from None
    elif os.path.lexists(out_dir):
        raise _cannot_write(out_dir, "it is a file")
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        layout.remove(tmp)  # left by an earlier run of this pid
        tmp.mkdir()
    except OSError as exc:
        why = "a parent is not a directory" if isinstance(exc, (FileExistsError, NotADirectoryError)) else \
            exc.strerror or str(exc)
        raise _cannot_write(out_dir, why) from None
    return tmp


def shard_header(shard: list) -> bytes:
    """The safetensors header of a shard file holding ``shard`` (``Written`` tensors) in order: the 8-byte
    little-endian length, then the JSON of every tensor's key, dtype, shape and byte range (padded with spaces
    to a multiple of 8 bytes, as the safetensors package writes it)."""
    doc: dict = {"__metadata__": {"format": "pt"}}  # transformers loads only files that say they are torch's
    offset = 0
    for w in shard:
        t = w.tensor
        doc[w.key] = {"dtype": _DTYPES[t.exported_dtype], "shape": list(t.full_shape),
                      "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


READ_BATCH_BYTES = 16 << 20  # tensors read by one DCP load while writing (each load costs ~0.1 s of planning)


def _read_batches(tensors: list, read_many) -> Iterator[tuple]:
    """``(tensor, value)`` for ``tensors`` in order, read ``READ_BATCH_BYTES`` (or one tensor) at a time by
    ``read_many(list) -> {name: value}``: one DCP load per batch, not per tensor (a model of 956 small tensors
    took 140 s), while at most a batch is held."""
    batch, size = [], 0
    for t in tensors + [None]:
        nbytes = 0 if t is None else t.nbytes
        if batch and (t is None or size + nbytes > READ_BATCH_BYTES):
            values = read_many(batch)
            for b in batch:
                yield b, values.pop(b.name)
            batch, size = [], 0
        if t is not None:
            batch.append(t)
            size += nbytes


def _write_shard(path: Path, shard: list, read_many, out_dir: Path) -> None:
    """Write the shard file at ``path``: its header, then each tensor's bytes as ``read_many`` gives them
    (``shard``: ``Written`` tensors, ``read_many`` of a list of their ``SavedTensor``s)."""
    try:
        with open(path, "wb") as f:
            f.write(shard_header(shard))
            for t, value in _read_batches([w.tensor for w in shard], read_many):
                value = value.contiguous()
                if value.dtype != t.exported_dtype or value.numel() != math.prod(t.full_shape):
                    raise CheckpointError(f"{t.name!r} was read as {value.dtype} {list(value.shape)}, not the "
                                          f"{t.exported_dtype} {list(t.full_shape)} its checkpoint's manifest "
                                          f"records; the checkpoint is damaged: use an older one.")
                f.write(memoryview(value.reshape(-1).view(torch.uint8).numpy()))  # host order: little-endian (x86, ARM)
                del value
    except OSError as exc:
        raise _cannot_write(out_dir, exc.strerror or str(exc)) from None


def _write_json(path: Path, doc: Mapping, out_dir: Path) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2, sort_keys=True)
            f.write("\n")
    except OSError as exc:
        raise _cannot_write(out_dir, exc.strerror or str(exc)) from None


def _publish(tmp: Path, out_dir: Path) -> None:
    try:
        os.replace(tmp, out_dir)  # onto nothing, or onto an empty directory
    except OSError as exc:
        raise _cannot_write(out_dir, exc.strerror or str(exc)) from None


def _float32(config: Mapping) -> dict:
    """``config`` saying the files hold float32 (transformers 5 writes ``dtype``, 4 ``torch_dtype``; without
    either it loads float32)."""
    return {k: "float32" if k in ("dtype", "torch_dtype") else v for k, v in config.items()}


def _check_ties(config: Mapping, doc: Mapping, config_from: str, model=None) -> None:
    """A config that ties the word embeddings, for a checkpoint without tied tensors: from_pretrained would
    replace the trained output head by the input embedding. ``model``: the config's model built on meta, when
    it could be: a class that ties nothing whatever its config says (BigBirdPegasus) is no such case."""
    ties = config.get("tie_word_embeddings") is True
    if model is not None:
        ties = len(list(model.named_parameters(remove_duplicate=False))) > len(list(model.named_parameters()))
    if ties and not doc.get("aliases"):
        raise CheckpointError(f"the model config ({config_from}) ties the word embeddings (tie_word_embeddings: "
                              f"true), but the checkpoint's model has no tied tensors, so from_pretrained would "
                              f"drop its trained output layer; give the {CONFIG} of the model as it was trained.")
