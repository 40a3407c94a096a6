"""Where every parameter's and buffer's values come from, one module at a time.

A model may be built on the ``meta`` device (``with torch.device("meta"): model = MyModel()``): nothing is
allocated, and the values are produced later, only where and when a rank needs them. ``ValueSources``
walks the model's modules in order (each tensor once, tied ones under their first name) and, for each
tensor, answers ``values(entry, lo, hi)``: elements ``[lo, hi)`` of this TP rank's flattened tensor, fp32
on the CPU (integer, bool and fp64 tensors in their own dtype: ``value_dtype``). In order of precedence,
the values are

1. the pretrained tensor of the same name in ``weights`` (``hybrid.weights.files``: a file, or a Hugging Face
   ``save_pretrained`` directory of shards; it holds full, TP-unsharded tensors and the rank reads only its
   range of its slice; a tied tensor may be held under any one of its names; of a transformers model, the
   file's keys are its checkpoint keys as transformers loads them, renames included:
   ``hybrid.weights.hf_keys``),
2. the tensor's own values when it is not on ``meta`` (a model built the ordinary way),
3. the parameter's layout-independent initializer (``hybrid.weights.init``; the built-in layers and GPT
   attach one to every parameter): only the chunks holding ``[lo, hi)`` are drawn,
4. otherwise the module's own initialization, run on CPU copies of the module's *direct* tensors under a
   CPU generator seeded from ``(seed, module name)``: ``module.reset_parameters()`` (or
   ``_reset_parameters()``), each module initializing its own tensors as FSDP's meta-device init does (a
   parent's reset of a child's tensor is superseded by the child's own); with ``init_fn``, what
   ``model.apply(init_fn)`` after an ordinary build gives (Hugging Face's ``post_init``): the module's
   ``reset_parameters``, then ``init_fn`` on it and on each of its ancestors, nearest first (the rest of the
   model on ``meta``), so a parent's init of its children's tensors wins. A meta tensor that no init writes
   in full (what its ``__init__`` computed is gone on meta) is a ``ConfigError`` naming it, never zeros; for
   a buffer (a rotary table) the sentence names ``hybrid.empty_init()``, which builds a model with its
   parameters on meta and its buffers computed as usual (``hybrid.weights.empty``). A module a TP plan split
   (``hybrid.tp.plan``) runs its own init on the *full* tensors and each TP rank keeps its slice.

So the values depend on ``seed`` and the names only, never on the DP size, ZeRO stage or TP degree: every
layout builds the same model. ``materialize(model, seed=...)`` applies the same rules to a whole model
in one process (the reference for tests, and the way to get an ordinary model from a meta-built one).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from hybrid.errors import ConfigError
from hybrid.weights.attrs import full_shape, tensor_parallel_dim
from hybrid.weights.empty import constructed_values
from hybrid.weights.init import get_initializer, local_values, read_local_range
from hybrid.weights.files import WeightsFile, open_weights
from hybrid.weights.hf_keys import checkpoint_keys, model_names

log = logging.getLogger(__name__)


@dataclass
class TensorEntry:
    """One parameter or buffer of the model, under the name it is first reached by."""

    name: str
    module: nn.Module
    key: str
    kind: str  # "param" | "buffer"
    tensor: torch.Tensor
    persistent: bool = True  # buffers: part of the state dict

    @property
    def is_param(self) -> bool:
        return self.kind == "param"


def module_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}:module:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2 ** 63 - 1)


def has_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def module_entries(model: nn.Module) -> Iterator[tuple[str, nn.Module, list]]:
    """``(module name, module, its direct tensors not seen before)`` in ``named_modules`` order."""
    seen: set = set()
    for mod_name, module in model.named_modules():
        entries = []
        for kind, tensors in (("param", module._parameters), ("buffer", module._buffers)):
            for key, t in tensors.items():
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                persistent = kind == "param" or key not in module._non_persistent_buffers_set
                entries.append(TensorEntry(f"{mod_name}.{key}" if mod_name else key, module, key, kind, t,
                                           persistent))
        if entries:
            yield mod_name, module, entries


def references(model: nn.Module) -> dict:
    """id(tensor) -> every ``(module, kind, key)`` holding it (tied weights are held twice)."""
    out: dict = {}
    for module in model.modules():
        for kind, tensors in (("param", module._parameters), ("buffer", module._buffers)):
            for key, t in tensors.items():
                if t is not None:
                    out.setdefault(id(t), []).append((module, kind, key))
    return out


def replace_tensor(refs: dict, old: torch.Tensor, new: torch.Tensor) -> None:
    """Put ``new`` wherever ``old`` is registered."""
    for module, kind, key in refs.get(id(old), ()):
        (module._parameters if kind == "param" else module._buffers)[key] = new


def new_parameter(old: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """A parameter over ``data`` that keeps ``old``'s marks (TP slicing, initializer) and requires_grad.

    Its version counter is its own, as for a parameter whose ``.data`` was reassigned: ``nn.Parameter(view)``
    would share the counter of ``view``'s base, and a stage-3 gather writing into that buffer would then look
    to autograd like an in-place change of every tensor saved for backward."""
    p = nn.Parameter(torch.empty(0, dtype=data.dtype, device=data.device), requires_grad=old.requires_grad)
    p.data = data
    p.__dict__.update({k: v for k, v in old.__dict__.items() if k.startswith("_hybrid")})
    return p


def _unwritten_fill(dtype: torch.dtype):
    """What a tensor holds before the module's own init runs, so what the init never wrote can be told: NaN,
    or an integer dtype's lowest value (an init never writes either); bool cannot be told (False)."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return False if dtype == torch.bool else torch.iinfo(dtype).min


def _still_unwritten(t: torch.Tensor) -> bool:
    """Whether some element of ``t`` still holds ``_unwritten_fill`` (NaN compares unequal, so it is tested apart)."""
    if t.is_floating_point() or t.is_complex():
        return bool(t.isnan().any())
    return t.dtype != torch.bool and bool((t == _unwritten_fill(t.dtype)).any())


def value_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a tensor's values are handed over in: fp32 (the masters' precision) for floating tensors,
    the tensor's own for integer, bool and fp64 ones, whose values fp32 would round."""
    return torch.float32 if t.is_floating_point() and t.dtype != torch.float64 else t.dtype


@dataclass
class ModuleValues:
    """The value sources of one module's direct tensors (see the module docstring for the precedence)."""

    sources: "ValueSources"
    name: str
    module: nn.Module
    entries: list
    _fallback: Optional[dict] = field(default=None, repr=False)
    _unwritten: set = field(default_factory=set, repr=False)  # meta tensors' names no init wrote all of

    def values(self, entry: TensorEntry, lo: int, hi: int) -> torch.Tensor:
        src = self.sources
        t = entry.tensor
        dim = tensor_parallel_dim(t) if entry.is_param else None
        shape = full_shape(t, src.tp) if entry.is_param else t.shape
        dtype = value_dtype(t)
        if src.weights is not None and entry.persistent:
            name = src.name_in_file(entry.name)
            return read_local_range(lambda a, b: src.weights.read(name, a, b, dtype), shape, dim, src.tp_rank,
                                    src.tp, lo, hi)
        if not t.is_meta:
            return t.detach().reshape(-1)[lo:hi].to(device="cpu", dtype=dtype, copy=True)
        init = get_initializer(t) if entry.is_param else None
        if init is not None:
            return local_values(init, src.seed, init.key or entry.name, shape, dim, src.tp_rank, src.tp, lo, hi)
        if dim is not None and src.tp > 1 and not _inits_full_tensors(self.module):
            raise ConfigError(f"tensor-parallel parameter {entry.name!r} is on the meta device without a "
                              "hybrid.weights.init initializer, so its TP slices cannot match the full tensor; "
                              "attach one with set_initializer or build the model off meta.")
        values = self._fallback_values()[entry.name]
        if entry.name in self._unwritten:
            raise self._unwritten_error(entry)
        return values.reshape(-1)[lo:hi].to(dtype)

    def _unwritten_error(self, entry: TensorEntry) -> ConfigError:
        kind = "parameter" if entry.is_param else "buffer"
        cls = type(self.module).__name__
        own = any(hasattr(self.module, m) for m in ("reset_parameters", "_reset_parameters"))
        fn = self.sources.init_fn is not None
        who = (f"neither {cls}.reset_parameters() nor init_fn wrote" if own and fn else
               f"{cls}.reset_parameters() did not write" if own else
               f"{cls} has no reset_parameters() and init_fn did not write")
        return ConfigError(f"{kind} {entry.name!r} is on the meta device and {who} all of its values, so what "
                           f"{cls}.__init__ put there is lost; set it in {cls}.reset_parameters() or in init_fn, or "
                           f"{_off_meta(entry)}.")

    @property
    def init_bytes(self) -> int:
        """Bytes the module's own init holds (its direct tensors on the CPU), 0 when it did not run."""
        return sum(t.numel() * t.element_size() for t in (self._fallback or {}).values())

    def _fallback_values(self) -> dict:
        if self._fallback is None:
            self._fallback = self._run_module_init()
        return self._fallback

    @torch.no_grad()
    def _run_module_init(self) -> dict:
        """Run the module's own init on CPU copies of its direct tensors; returns name -> values."""
        module, init_fn = self.module, self.sources.init_fn
        own_init = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
        if init_fn is None and own_init is None:
            entry = next(e for e in self.entries if e.tensor.is_meta)
            kind = "parameter" if entry.is_param else "buffer"
            raise ConfigError(f"{kind} {entry.name!r} is on the meta device and its module "
                              f"({type(module).__name__}) has no reset_parameters() to initialize it; pass "
                              f"init_fn=, attach a hybrid.weights.init initializer, or {_off_meta(entry, 'it')}.")
        copies = {}  # id(the entry's tensor) -> its CPU copy, wherever the model holds it (tied aliases too)
        split = self._split_dims()
        for e in self.entries:
            shape = full_shape(e.tensor, self.sources.tp) if e.name in split else e.tensor.shape
            cpu = torch.full(shape, _unwritten_fill(e.tensor.dtype), dtype=e.tensor.dtype, device="cpu")
            copies[id(e.tensor)] = nn.Parameter(cpu, requires_grad=e.tensor.requires_grad) if e.is_param else cpu
        # Without init_fn only the module's own reset runs; with it, its ancestors' init too (the whole model).
        scope = module if init_fn is None else self.sources.model
        with _only_these_real(scope, copies, self.sources), torch.random.fork_rng(devices=[]):
            torch.manual_seed(module_seed(self.sources.seed, self.name))
            if init_fn is None:
                own_init()
            else:
                self._as_after_construction(own_init, init_fn)
            held = {e.key: (module._parameters if e.is_param else module._buffers).get(e.key) for e in self.entries}
        # what the module holds counts: its copy, or a tensor an init put in its place (module.weight = ...)
        out = {e.name: (held[e.key] if held[e.key] is not None and not held[e.key].is_meta
                        else copies[id(e.tensor)]).detach() for e in self.entries}
        for e in self.entries:  # no init wrote it: what its constructor computed, where empty_init kept it
            kept = constructed_values(e.tensor)
            if e.tensor.is_meta and kept is not None and _still_unwritten(out[e.name]):
                out[e.name] = kept.to(out[e.name].dtype)
        self._unwritten = {e.name for e in self.entries if e.tensor.is_meta and _still_unwritten(out[e.name])}
        src = self.sources
        return {name: t.chunk(src.tp, split[name])[src.tp_rank].contiguous() if name in split else t
                for name, t in out.items()}

    def _split_dims(self) -> dict:
        """Name -> split dim of the module's TP-split parameters whose own init runs on the full tensor (a
        module a TP plan split, ``init_full_tensors``), so each rank keeps its slice of the same full values."""
        if self.sources.tp == 1 or not _inits_full_tensors(self.module):
            return {}
        return {e.name: tensor_parallel_dim(e.tensor) for e in self.entries
                if e.is_param and tensor_parallel_dim(e.tensor) is not None}

    def _as_after_construction(self, own_init: Optional[Callable], init_fn: Callable) -> None:
        """The module's tensors as ``model.apply(init_fn)`` leaves them after an ordinary build (Hugging
        Face's ``post_init``): the constructor's ``reset_parameters`` first, then ``init_fn`` on the module and
        on each ancestor in turn (``apply`` visits children first, so a parent's init of its children's
        tensors wins). Every other tensor of the model is on ``meta`` meanwhile (``_only_these_real``), where
        an ancestor's init costs nothing and draws no random numbers; one that cannot run there (it reads
        values) is skipped with a warning."""
        if own_init is not None:
            try:
                own_init()
            except Exception as err:  # init_fn is the user's word on this module; note why this was skipped
                log.debug("%s.reset_parameters() failed before init_fn (%s)", self.name or "model", err)
        init_fn(self.module)
        parts = self.name.split(".") if self.name else []
        for depth in range(len(parts) - 1, -1, -1):
            prefix = ".".join(parts[:depth])
            try:
                ancestor = self.sources.model.get_submodule(prefix)
            except AttributeError:
                continue
            try:
                init_fn(ancestor)
            except Exception as err:
                _warn_once((prefix, type(err)), f"init_fn({prefix or 'the model'}) cannot run with its "
                           f"tensors on meta ({type(err).__name__}: {err}); its init of its descendants' "
                           "tensors is not applied")


def _off_meta(entry: TensorEntry, what: str = "the module") -> str:
    """The last fix a meta-tensor refusal offers: for a buffer, ``hybrid.empty_init()``."""
    if entry.is_param:
        return f"build {what} off meta"
    return ("build the model under hybrid.empty_init() instead of torch.device('meta') (parameters on meta, "
            "buffers computed as usual)")


def _inits_full_tensors(module: nn.Module) -> bool:
    """Whether the module's own init writes full tensors although it holds TP slices (``hybrid.tp.styles``)."""
    return bool(getattr(module, "init_full_tensors", False))


@contextlib.contextmanager
def _only_these_real(scope: nn.Module, copies: dict, sources: "ValueSources"):
    """For the block, every tensor slot under ``scope`` holds a meta stand-in, except the slots of the tensors
    being initialized, which hold their CPU copies (``copies``: id of the model's tensor -> copy), under
    every name they have. An init then changes nothing the walk already materialized, draws no random numbers
    for anything else, and reaches a tensor through any of its aliases. Every slot is restored afterwards."""
    saved = []
    try:
        for store, key in sources.slots(scope):
            t = store[key]
            if t is None:
                continue
            saved.append((store, key, t))
            if id(t) in copies:
                store[key] = copies[id(t)]
            elif not t.is_meta:
                store[key] = sources.stand_in(t)
        yield
    finally:
        for store, key, t in saved:
            store[key] = t


_WARNED: set = set()


def _warn_once(key, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(message)


class ValueSources:
    """Value sources for every tensor of ``model``, walked one module at a time (``modules()``)."""

    def __init__(self, model: nn.Module, *, seed: int = 0, init_fn: Optional[Callable] = None, weights=None,
                 tp_rank: int = 0, tp: int = 1):
        self.model, self.seed, self.init_fn = model, int(seed), init_fn
        self._slots: dict = {}       # id(scope) -> its tensor slots (``slots``)
        self._stand_ins: dict = {}   # id(tensor) -> (its meta stand-in, the tensor: keeps the id taken)
        self.tp_rank, self.tp = tp_rank, tp
        self.weights: Optional[WeightsFile] = None
        self._in_file: dict = {}  # a tensor's name -> the key the weights file holds it under, where they differ
        if weights is not None:
            self.weights = weights if isinstance(weights, WeightsFile) else open_weights(weights)
            self._check_names()

    def _check_names(self) -> None:
        """Match the file's keys to the model's names (``hf_keys``: as transformers loads them; a tied tensor
        under any one of its names) and check them strictly in the file's own keys (``WeightsFile.check``)."""
        weights = self.weights
        expected, aliases = self.expected_shapes()
        loaded = model_names(self.model, weights.shapes, f"{weights.what} {weights.path}")  # file key -> name
        held = {name: key for key, name in loaded.items()}  # the model's name -> the file's key
        for name, others in aliases.items():
            present = name if name in held else next((a for a in others if a in held), None)
            if present is not None and held[present] != name:
                self._in_file[name] = held[present]
        every = [n for name, others in aliases.items() for n in (name, *others)]
        absent = [n for n in every if n not in held and n not in self._in_file]
        saved = checkpoint_keys(self.model, absent) if absent else {}  # how a file would name what it lacks

        def key(name: str) -> str:
            return self._in_file.get(name) or held.get(name) or saved.get(name, name)

        weights.check({key(n): shape for n, shape in expected.items()},
                      {key(a) for others in aliases.values() for a in others})

    def name_in_file(self, name: str) -> str:
        """The key the weights file holds tensor ``name`` under: itself, the key transformers renames to it
        (``hybrid.weights.hf_keys``), or a key of another name of a tied tensor."""
        return self._in_file.get(name, name)

    def slots(self, scope: nn.Module) -> list:
        """Every ``(store, key)`` of a parameter or buffer under ``scope`` (tied ones under each name), listed
        once per scope: the walk changes what the slots hold, never which slots there are."""
        if id(scope) not in self._slots:
            self._slots[id(scope)] = [(store, key) for m in scope.modules(remove_duplicate=False)
                                      for store in (m._parameters, m._buffers) for key in store]
        return self._slots[id(scope)]

    def stand_in(self, t: torch.Tensor) -> torch.Tensor:
        """A meta tensor like ``t`` (a parameter for a parameter), made once per tensor."""
        if id(t) not in self._stand_ins:
            meta = torch.empty_like(t, device="meta")
            self._stand_ins[id(t)] = (nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta, t)
        return self._stand_ins[id(t)][0]

    def expected_shapes(self) -> tuple[dict, dict]:
        """(name -> full shape of every parameter and persistent buffer, name -> the other names of the same
        tensor in ``state_dict()``: a tied tensor's aliases)."""
        expected, name_of = {}, {}
        for _, _, entries in module_entries(self.model):
            for e in entries:
                if e.persistent:
                    expected[e.name] = tuple(full_shape(e.tensor, self.tp) if e.is_param else e.tensor.shape)
                    name_of[id(e.tensor)] = e.name
        aliases = {name: [] for name in expected}
        for key, t in self.model.state_dict(keep_vars=True).items():
            name = name_of.get(id(t))
            if name is not None and key != name:
                aliases[name].append(key)
        return expected, aliases

    def modules(self) -> Iterator[ModuleValues]:
        for name, module, entries in module_entries(self.model):
            yield ModuleValues(self, name, module, entries)

    def close(self) -> None:
        if self.weights is not None:
            self.weights.close()


@torch.no_grad()
def materialize(model: nn.Module, seed: int = 0, *, init_fn: Optional[Callable] = None, weights=None,
                device="cpu", tp_rank: int = 0, tp: int = 1) -> nn.Module:
    """Give every ``meta`` tensor of ``model`` (every tensor, with ``weights``) its values on ``device``, in
    place, exactly as ``hybrid.initialize`` would for any layout; returns ``model``."""
    sources = ValueSources(model, seed=seed, init_fn=init_fn, weights=weights, tp_rank=tp_rank, tp=tp)
    refs = references(model)
    try:
        for group in list(sources.modules()):  # listed before any tensor is replaced (ties are by identity)
            for e in group.entries:
                if not e.tensor.is_meta and sources.weights is None:
                    continue
                if not e.persistent and not e.tensor.is_meta:
                    continue
                values = group.values(e, 0, e.tensor.numel()).view(e.tensor.shape)
                data = values.to(device=device, dtype=e.tensor.dtype)
                replace_tensor(refs, e.tensor, new_parameter(e.tensor, data) if e.is_param else data)
    finally:
        sources.close()
    return model
