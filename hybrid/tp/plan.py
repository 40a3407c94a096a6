"""A TP plan applied to a built model: module-name patterns -> styles, as torchtitan's ``parallelize_module``
and Hugging Face's ``tp_plan`` do, for models written without ``hybrid.tp`` layers.

``apply_plan(model, plan, tp_comm)`` splits every module a pattern matches over the TP group of ``tp_comm``
(``hybrid.tp.styles``: the module becomes a subclass of its own class whose parameters hold this rank's
slice, marked for ZeRO, and whose forward adds the TP collectives), in place, before ``hybrid.initialize``.
Names stay: the model's ``state_dict()`` keys, a weights file's and a checkpoint's are those of the
single-process model. The model's own forward is untouched: a ``colwise`` projection hands its slice of
the heads to the model's ``view(..., -1, head_dim)``, a ``rowwise`` one sums over TP and adds its bias once.

A pattern is a module name whose dot-separated parts may hold shell wildcards (``hybrid.config.tp_plan``:
``model.layers.*.self_attn.q_proj``). Styles are ``colwise``, ``colwise_rep`` (colwise, output gathered: a
head whose logits a loss reads whole), ``rowwise``, ``rowwise_rep`` (rowwise taking a whole input),
``local_rowwise`` (rowwise without the sum, for a module above it marked ``all_reduce``), ``vocab`` (an
embedding split by rows), ``all_reduce``,
``replicate_grad`` (whole, its gradient summed over TP: a norm of this rank's heads) and ``replicate`` (left
whole); Hugging Face's spellings mean the same (``HF_SPELLINGS``: ``colwise_gather_output`` is
``colwise_rep``, ``embedding_rowwise`` is ``vocab``, ...).

Values: on a ``meta`` model nothing is drawn here; ``hybrid.initialize`` / ``hybrid.materialize`` give each
slice its values (from the weights file, an initializer, or the module's own init run on the full tensor:
``hybrid.weights.sources``), so they are the slices of the single-process model at every TP degree. On a
model with values each rank keeps its slice of the full tensor (a model built after ``torch.manual_seed(s)``
is one model at every degree). At TP 1 (``tp_comm`` None or one rank) the modules are converted and their
parameters marked but keep their whole tensors: the launcher reads the marks to see a model can be split.

A model's own plan (``OwnPlan``, from ``hybrid.tp.hf``) is read as transformers reads it: a pattern that matches
no module is left out, and one that names a bare parameter (``layers.*.self_attn.sinks: colwise``) splits it along
its first dimension. Whatever the plan, whole parameters that meet only this rank's slice of the features (found
by ``hybrid.tp.regions`` from the model's own forward, on fake tensors) get their gradient summed over TP
(``replicate_grad`` on their module, for those keys only), and ``plan_notes(model)`` says so for the plan line.

What cannot be applied is one ``ConfigError`` sentence naming the module and the fix, before anything changes:
an unknown style, a pattern of a user's plan matching no module (or naming a parameter), two styles for one
module, a style on the wrong kind of module or on a subclass whose forward does not go through the torch
layer's, a split size the degree does not divide, attention heads the degree does not divide (a Hugging Face
config's ``num_attention_heads`` / ``num_key_value_heads``: a projection split inside a head computes nonsense
without an error), a tensor tied between modules the plan splits differently, a split no sum over TP makes
exact (a whole parameter meeting slices and whole activations, a whole activation with a gradient meeting a
slice), a ``local_rowwise`` layer with a bias (each rank would add it to its partial sum before the sum,
counting it tp times), an embedding with ``max_norm`` or ``scale_grad_by_freq`` (per-row statistics a split
table cannot keep), and a module already split.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from hybrid.comm.collectives import Comm
from hybrid.config.tp_plan import normalize_plan, pattern_matches
from hybrid.errors import ConfigError
from hybrid.tp.hf_config import heads_refusal, text_config
from hybrid.tp.layers import TensorParallelModule
from hybrid.tp.sharding import tp_rank_size
from hybrid.tp.styles import STYLE_CLASSES, SplitModule, split_class
from hybrid.tp.regions import SLICE, trace_regions
from hybrid.weights.attrs import mark_tensor_parallel, tensor_parallel_dim
from hybrid.weights.sources import new_parameter, references, replace_tensor

def resolve_plan(model: nn.Module, plan: Any, where: str = "the TP plan") -> list[tuple[str, nn.Module, str]]:
    """``(module name, module, style)`` for every module a pattern of ``plan`` matches, in module order
    (``replicate`` ones included); see the module docstring for what is refused. A model's own plan
    (``OwnPlan``) is read as transformers reads it: a pattern that matches nothing is left out, and one that
    names a bare parameter (``colwise``: split by its first dimension, attention sinks) is ``param_entries``'."""
    own = isinstance(plan, OwnPlan)
    plan = normalize_plan(plan, where)
    used, out = set(), []
    for name, module in model.named_modules():
        if not name:
            continue
        hits = [(pattern, style) for pattern, style in plan.items() if pattern_matches(pattern, name)]
        used.update(pattern for pattern, _ in hits)
        styles = sorted({style for _, style in hits})
        if len(styles) > 1:
            raise ConfigError(f"{where} gives {name} two styles ({'; '.join(f'{p!r}: {s}' for p, s in hits)}); "
                              "make the patterns match it once.")
        if styles:
            out.append((name, module, styles[0]))
    for pattern in plan:
        if pattern not in used and not own:
            raise ConfigError(_unmatched(model, pattern, where))
    return out


def param_entries(model: nn.Module, plan: Any, where: str = "the TP plan") -> list[tuple[str, nn.Module, str, int]]:
    """``(parameter name, owning module, key, dim)`` for each bare parameter a model's own plan splits
    (``colwise``: along its first dimension of two or more, its only one of one); another style on a bare
    parameter is one sentence."""
    if not isinstance(plan, OwnPlan):
        return []
    out = []
    for pattern, style in normalize_plan(plan, where).items():
        for name in _params_of(model, pattern):
            if style != "colwise":
                raise ConfigError(f"{where}[{pattern!r}] gives the parameter {name} the style {style}; hybrid splits "
                                  "a bare parameter colwise only; leave it out of the plan or use tp 1.")
            owner_name, _, key = name.rpartition(".")
            param = model.get_parameter(name)
            out.append((name, model.get_submodule(owner_name), key, max(param.dim() - 2, 0)))
    return out


def _params_of(model: nn.Module, pattern: str) -> list[str]:
    """The parameters ``pattern`` names."""
    return [name for name, _ in model.named_parameters() if pattern_matches(pattern, name)]


def _unmatched(model: nn.Module, pattern: str, where: str) -> str:
    params = _params_of(model, pattern)
    if params:
        return (f"{where}[{pattern!r}] names the parameter {params[0]}, not a module; a plan splits modules "
                f"(name the module: {params[0].rpartition('.')[0] or params[0]}).")
    layers = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))][:3]
    shown = f" (its layers are named like {', '.join(layers)})" if layers else ""
    return (f"{where}[{pattern!r}] matches no module of {type(model).__name__}{shown}; correct the pattern or "
            "remove it.")


def check_plan(model: nn.Module, plan: Any, tp: int, where: str = "the TP plan") -> list[tuple[str, nn.Module, str]]:
    """What ``apply_plan`` would split at TP degree ``tp``, or the ``ConfigError`` it would raise (no
    process group needed: the launcher's check)."""
    return _checked(model, plan, tp, where)[0]


def _checked(model: nn.Module, plan: Any, tp: int, where: str) -> tuple[list, list]:
    """``check_plan``'s module assignments and the bare parameters the plan splits (``param_entries``)."""
    assignments = resolve_plan(model, plan, where)
    for name, module, style in assignments:
        _check_module(name, module, style, tp, where)
        if style == "mla_kv_a_proj" and not isinstance(rope_dim(model), int):
            raise ConfigError(f"{where}: {name} is mla_kv_a_proj, but the model's config has no qk_rope_head_dim "
                              "(the rotary features at the end of its output); give it another style or use tp 1.")
    bare = param_entries(model, plan, where)
    for name, _, _, dim in bare:
        size = model.get_parameter(name).shape[dim]
        if size % tp:
            raise ConfigError(f"{where}: the parameter {name} (colwise) has {size} rows, which tp={tp} does not "
                              f"divide; use a TP degree that divides {size}.")
    _check_ties(model, assignments, where)
    split = [name for name, _, style in assignments if STYLE_CLASSES[style].split_size] + [n for n, *_ in bare]
    refusal = _attention_refusal(model, split, tp)
    if refusal is not None:
        raise ConfigError(f"{where} cannot split {type(model).__name__} {tp} ways: {refusal}.")
    return assignments, bare


def forward_goes_through(module: nn.Module, layer: type) -> bool:
    """Whether ``module``'s forward computes through ``layer``'s own forward, once (``super().forward(x)`` and
    more around it): then the split forward can run in its place. Found by running it once on meta (a
    forward that cannot run there, or calls ``layer``'s forward never or twice, is not split)."""
    cls = type(module)
    if cls.forward is layer.forward:
        return True
    calls = []

    class Probe(layer):
        def forward(self, *args, **kwargs):
            calls.append(1)
            return layer.forward(self, *args, **kwargs)

    if isinstance(module, nn.Embedding):
        example = torch.zeros((1, 2), dtype=torch.long, device="meta")
    elif isinstance(module, nn.Linear):
        example = torch.zeros((1, module.in_features), device="meta")
    else:
        return False
    stand_ins = {name: torch.empty_like(t, device="meta") for name, t in
                 [*module.named_parameters(), *module.named_buffers()]}
    module.__class__ = type(f"Probe{cls.__name__}", (cls, Probe), {"__module__": __name__})
    try:
        torch.func.functional_call(module, stand_ins, (example,), strict=False)
    except Exception:  # the subclass's own code: a forward that cannot run on meta is not split
        return False
    finally:
        module.__class__ = cls
    return len(calls) == 1


def _check_module(name: str, module: nn.Module, style: str, tp: int, where: str) -> None:
    cls = type(module).__name__
    if isinstance(module, (SplitModule, TensorParallelModule)):
        raise ConfigError(f"{where}: {name} ({cls}) is split already (a hybrid.tp layer, or a plan applied "
                          "before); apply one plan to a model built without TP layers.")
    layer = STYLE_CLASSES[style].torch_layer
    if layer is None:
        return
    if not isinstance(module, layer):
        raise ConfigError(f"{where}: {name} is a {cls}, but {style} splits an nn.{layer.__name__}; give it another "
                          f"style ({'vocab' if layer is nn.Linear else 'colwise or rowwise'} fits the other kind, "
                          "all_reduce or replicate any module).")
    if not forward_goes_through(module, layer):
        raise ConfigError(f"{where}: {name} is a {cls}, whose forward is its own rather than nn.{layer.__name__}'s "
                          "(it does not compute through nn.{0}.forward), so the split one would not run; leave it out "
                          "of the plan (replicate).".format(layer.__name__))
    if STYLE_CLASSES[style].split_size:
        size = _split_size(module, style)
        if size % tp:
            what = STYLE_CLASSES[style].split_size
            raise ConfigError(f"{where}: {name} ({style}) has {what}={size}, which tp={tp} does not "
                              f"divide; use a TP degree that divides {size}, or leave {name} out of the plan.")
    if style == "local_rowwise" and module.bias is not None:
        raise ConfigError(f"{where}: {name} is local_rowwise with a bias, which every TP rank would add to its "
                          f"partial sum before the sum (counting it tp times); use rowwise (the sum, then the "
                          "bias once) or a layer without bias.")
    if style in ("vocab", "embedding_col") and (module.max_norm is not None or module.scale_grad_by_freq):
        what = "max_norm" if module.max_norm is not None else "scale_grad_by_freq"
        raise ConfigError(f"{where}: {name} is an nn.Embedding with {what}, which a table split by rows cannot "
                          "apply as one table does; leave it out of the plan (replicate).")


def rope_dim(model: nn.Module):
    """The rotary features at the end of an MLA key projection's output: the config's ``qk_rope_head_dim``."""
    return getattr(text_config(getattr(model, "config", None)), "qk_rope_head_dim", None)


def _split_size(module: nn.Module, style: str) -> int:
    """The full size of the dimension ``style`` splits."""
    return int(getattr(module, STYLE_CLASSES[style].split_size))


def _check_ties(model: nn.Module, assignments: list, where: str) -> None:
    """A tensor held by several modules (a tied embedding and head) must be split alike by all of them."""
    styles = {id(module): (name, style) for name, module, style in assignments}
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    refs = references(model)
    for name, module, style in assignments:
        dims = STYLE_CLASSES[style].split_dims
        for key, dim in dims.items():
            param = module._parameters.get(key)
            if param is None:
                continue
            for holder, _, other_key in refs.get(id(param), ()):
                other_name, other_style = styles.get(id(holder), (names.get(id(holder), "?"), None))
                other_dim = None
                if other_style is not None:
                    other_dim = STYLE_CLASSES[other_style].split_dims.get(other_key)
                if other_dim != dim:
                    how = "is not in the plan" if other_style is None else f"is {other_style}"
                    raise ConfigError(f"{where}: {other_name}.{other_key} is tied to {name}.{key} (one tensor), "
                                      f"which {style} splits along dim {dim}, but {other_name} {how}; split both "
                                      "alike (a tied embedding and head: vocab and colwise_rep) or untie them.")


def _attention_refusal(model: nn.Module, split_names: list, tp: int) -> Optional[str]:
    """A Hugging Face config's heads must split whole when an attention module is split."""
    if tp == 1 or not any("attn" in n or "attention" in n for n in split_names):
        return None
    return heads_refusal(getattr(model, "config", None), tp)


class OwnPlan(dict):
    """A model's own plan (``hybrid.tp.hf``), read as transformers reads it (``resolve_plan``); ``notes`` say
    what hybrid did with it beyond the plan's words (an embedding kept whole, ...)."""

    def __init__(self, plan: dict, notes=()):
        super().__init__(plan)
        self.notes = list(notes)


def apply_plan(model: nn.Module, plan: Any, tp_comm: Optional[Comm], where: str = "the TP plan") -> nn.Module:
    """Split ``model`` over ``tp_comm``'s group by ``plan`` (see the module docstring), in place; returns it.
    ``plan_notes(model)`` then says what was done beyond the plan's words."""
    rank, tp = tp_rank_size(tp_comm)
    assignments, bare = _checked(model, plan, tp, where)
    summed, notes = grad_sums(model, assignments, bare, where)
    assignments = assignments + summed
    refs = references(model)
    split: dict = {}  # id(parameter) -> its split replacement, made once for a tied tensor
    for _, module, style in assignments:
        if style == "replicate":
            continue
        cls = split_class(style, type(module))
        for key, dim in cls.split_dims.items():
            param = module._parameters.get(key)
            if param is not None and id(param) not in split:
                split[id(param)] = (param, _split_parameter(param, dim, rank, tp))
        module.__class__ = cls
        module.tp_comm, module.tp_rank, module.tp = tp_comm, rank, tp
        if style == "mla_kv_a_proj":
            module.rope_dim = rope_dim(model)
    for _, owner, key, dim in bare:
        param = owner._parameters[key]
        split[id(param)] = (param, _split_parameter(param, dim, rank, tp))
    for old, new in split.values():
        replace_tensor(refs, old, new)
    model.hybrid_tp_notes = list(getattr(plan, "notes", ())) + notes
    return model


def plan_notes(model: nn.Module) -> list[str]:
    """What ``apply_plan`` did beyond the plan's words (one phrase each), for the plan line."""
    return list(getattr(model, "hybrid_tp_notes", ()))


def _pattern(name: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def grad_sums(model: nn.Module, assignments: list, bare: list, where: str) -> tuple[list, list]:
    """The modules whose whole parameters meet only this rank's slice of the features (``hybrid.tp.regions``)
    as ``(name, module, "replicate_grad")`` entries, and the notes saying so; a split that no sum makes exact
    is one ``ConfigError`` sentence."""
    kinds = {module: STYLE_CLASSES[style].output_kind for _, module, style in assignments}
    if SLICE not in kinds.values():
        return [], []
    planned = {id(p) for _, module, style in assignments if style != "all_reduce" and style != "replicate"
               for p in module._parameters.values() if p is not None}
    planned |= {id(owner._parameters[key]) for _, owner, key, _ in bare}
    trace = trace_regions(model, {m: k for m, k in kinds.items() if k is not None}, planned)
    cls = type(model).__name__
    if trace.error is not None:
        return [], [f"not checked for whole parameters between split layers (its forward did not run on meta: "
                    f"{trace.error})"]
    if trace.mixed:
        name, op = next(iter(trace.mixed.items()))
        raise ConfigError(f"{where} cannot split {cls} exactly: the whole parameter {name} meets both this rank's "
                          f"slice of the features (in {op}) and whole activations, so no sum over TP gives its "
                          "gradient; use tp 1, or a plan that leaves its module outside the split layers.")
    if trace.reduction is not None:
        raise ConfigError(f"{where} cannot split {cls} exactly: {trace.reduction} reduces over the features the plan "
                          "splits (each rank would reduce over its part only, and compute another forward); use "
                          "tp 1, or a plan that leaves that computation whole.")
    if trace.activation is not None:
        raise ConfigError(f"{where} cannot split {cls} exactly: a whole activation that needs a gradient meets this "
                          f"rank's slice of the features in {trace.activation}, so its gradient would hold this "
                          "rank's part only; use tp 1, or a plan whose split layers enclose that computation.")
    styles = {name: style for name, _, style in assignments}
    keys: dict = {}  # owning module's name -> the keys of its parameters to sum
    for name in trace.partial:
        owner, _, key = name.rpartition(".")
        keys.setdefault(owner, []).append(key)
    out = []
    for owner, owned in keys.items():
        if styles.get(owner, "replicate") != "replicate":
            raise ConfigError(f"{where} cannot split {cls} exactly: {owner} holds whole parameters that meet this "
                              f"rank's slice of the features ({', '.join(owned)}), but is {styles[owner]} already; "
                              "use tp 1, or give them a module of their own.")
        module = model.get_submodule(owner)
        module.summed_keys = tuple(owned)
        out.append((owner, module, "replicate_grad"))
    if not out:
        return [], []
    shown = ", ".join(dict.fromkeys(_pattern(name) for name in trace.partial))
    return out, [f"gradients of the whole parameters between split layers summed over TP ({shown})"]


@torch.no_grad()
def _split_parameter(param: nn.Parameter, dim: int, rank: int, tp: int) -> nn.Parameter:
    """This rank's slice of ``param`` along ``dim`` (a meta one stays on meta), marked; ``param`` itself,
    marked, at TP 1."""
    if tp == 1:
        return mark_tensor_parallel(param, dim)
    if param.is_meta:
        shape = list(param.shape)
        shape[dim] //= tp
        data = torch.empty(shape, dtype=param.dtype, device="meta")
    else:
        data = param.detach().chunk(tp, dim)[rank].clone()
    return mark_tensor_parallel(new_parameter(param, data), dim)


def split_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules a plan split (``apply_plan``), with their names."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, SplitModule)]


def tp_refusal(model: nn.Module, tp: int) -> Optional[str]:
    """Why the model a plan split (at TP 1, as the launcher builds it) cannot be split ``tp`` ways -- a split
    size or the attention heads ``tp`` does not divide -- or None when it can."""
    names, modules = [], split_modules(model)
    for name, module in modules:
        if STYLE_CLASSES[module.tp_style].split_size:
            names.append(name)
            size = _split_size(module, module.tp_style)
            if size % tp:
                what = STYLE_CLASSES[module.tp_style].split_size
                return f"{name} ({module.tp_style}) has {what}={size}, not divisible by {tp}"
    owners = {name for name, _ in modules}
    for name, param in model.named_parameters():  # bare parameters a plan split (attention sinks)
        dim = tensor_parallel_dim(param)
        if dim is not None and param.shape[dim] % tp and name.rpartition(".")[0] not in owners:
            return f"the parameter {name} has {param.shape[dim]} rows, not divisible by {tp}"
    return _attention_refusal(model, names, tp)


def largest_degree(model: nn.Module, limit: int) -> tuple[int, dict]:
    """The largest divisor of ``limit`` (a node's GPUs) the split model allows, and why each larger one
    was refused (degree -> sentence)."""
    refusals = {}
    for tp in (d for d in range(limit, 0, -1) if limit % d == 0):
        refusal = tp_refusal(model, tp)
        if refusal is None:
            return tp, refusals
        refusals[tp] = refusal
    return 1, refusals
