"""What the launcher knows of the job's model before any rank starts: Ψ, whether it has TP layers, its shape.

``model_facts(spec)`` measures rather than trusts. The entrypoint's module may define the hook

    def build_model(model_config: dict, tp_comm=None) -> torch.nn.Module

(``model_config`` is the parsed model config YAML, as ``ctx.model_config`` on the ranks; ``tp_comm`` the
rank's TP communicator, None for the single-process model). The launcher calls it on the driver under
``torch.device("meta")`` -- nothing is allocated -- and counts the parameters (Ψ, tied ones once) and looks
for parameters marked tensor-parallel (``hybrid.weights.attrs``): a model without them gets tp = 1. The hook
is looked up in the module ``job.entrypoint`` names, then in the module that defines the entrypoint
function (so ``from hybrid.models.gpt import train`` brings the built-in GPT's hook along). Without a hook,
a ``model:`` mapping is the built-in GPT's shape (``hybrid.models.gpt.training.build_model``; an ``hf:``
section a transformers model, ``hybrid.models.hf``, its paths resolved against the model config), and a model
config with only ``params: 7B`` is taken at its word (TP layers unknown). With a hook, ``params:`` is an
override that must agree with the count to 1 % (one ``ConfigError`` sentence otherwise). A GPT (the built
one is a ``hybrid.models.gpt.GPT``) also gives its shape (its TP refusals, its sequence length).

What one micro-step costs (``model_figures(facts, precision) -> ModelFigures``): activation bytes per GPU at any
micro-batch, TP degree and checkpointing, and the time model's ``ModelShape``. Every model built on the driver is
profiled (``hybrid.plan.profile``, on fake tensors, nothing allocated) at the job's sequence length
(``ModelFacts.seq``: ``hf.seq_len``, ``model.seq_len`` or a top-level ``seq_len`` of the model config) in the
training precision, without and with activation checkpointing: the built-in GPT as two of its blocks scaled to
all (``gpt_figures``; its analytic formulas are the tests' oracle), an ``hf:`` model from its transformers config
(``profile_config``: two layers built and scaled to all), a hook's model as it is built (``profile_model``); each
profile carries the TP calls of a block as the ranks split it (``hybrid.tp.traffic``). Profiles are cached per
model and sequence in the process. Where none can be taken (the forward reads values, an op without a fake
kernel, no sequence length, a model not built) ``ModelFigures.note`` says why in one sentence, naming the op,
and the plan counts no activations and ranks no layouts by time, as it says. Activation checkpointing is weighed
for a profiled model where the job's loop applies it (the built-in entrypoints; ``ModelFigures.checkpointing``):
an entrypoint of one's own applies it only where ``parallel.activation_checkpointing`` is true.

TP plans (``hybrid.tp.plan``): a model the hook returns unsplit is split on the driver, at TP 1 (its modules
converted and its parameters marked, nothing sliced), by ``parallel.tp_plan`` when the cluster file gives one,
else by a Hugging Face model's own plan (``hybrid.tp.hf``); the ranks apply the same plan over their TP group
(``Context.parallelize``). A plan that does not fit the model is one ``ConfigError`` sentence (for
``parallel.tp_plan``; a model's own plan that does not fit leaves it at TP 1, said why). ``ModelFacts.tp_refusal``
then says why a degree cannot split the model (a split size or the attention heads it does not divide).
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Optional

from hybrid.config import validate as v
from hybrid.errors import ConfigError
from hybrid.plan.cost import ModelShape
from hybrid.plan.memory import parse_count, profile_activation_bytes
from hybrid.config.yamlfile import load_yaml

BUILT_IN_ENTRYPOINT = "hybrid.models.gpt:train"
BUILT_IN_ENTRYPOINTS = (BUILT_IN_ENTRYPOINT, "hybrid.models.hf:train")
BUILT_IN_HOOKS = ("hybrid.models.gpt.training", "hybrid.models.hf")
HOOK = "build_model"
PARAMS_TOLERANCE = Fraction(1, 100)  # a params: override this far from the measured count is a typo
ANY_TP = 2  # a TP degree above 1, where hybrid.tp.splits_logits answers alike for all of them


@dataclass(frozen=True)
class ModelFacts:
    params: int
    tensor_parallel: Optional[bool]  # has parameters marked tensor-parallel; None: not known (not built)
    source: str  # how Ψ was found, for the plan's text
    shape: Optional[dict] = None  # the GPT shape (GPTConfig.to_dict()) when the model is the built-in GPT
    module: Any = field(default=None, compare=False, repr=False)  # the model on the meta device, when built
    tp_plan: str = ""  # which TP plan split the model on the driver ("" when none did)
    tp_note: str = ""  # why a model with a plan of its own was left unsplit ("" otherwise)
    seq: Optional[int] = None  # tokens per row, from the model config (None: not said)
    config: Any = field(default=None, compare=False, repr=False)  # an hf: model's transformers config

    def tp_refusal(self, tp: int) -> Optional[str]:
        """Why the model cannot be split ``tp`` ways, or None when it can (or is not known)."""
        if self.shape is not None:
            return gpt_tp_refusal(self.shape, tp)
        if self.module is not None:  # the modules a plan split, and a Hugging Face config's heads
            from hybrid.tp.plan import tp_refusal

            return tp_refusal(self.module, tp)
        return None


def model_facts(spec) -> ModelFacts:
    """Ψ, TP layers and shape of the model of ``spec`` (a ``launch.spec.LaunchSpec``); see the module docstring."""
    path = spec.job.config
    doc = load_yaml(path, "model config")
    stated = None
    if isinstance(doc, dict) and "params" in doc:
        stated = parse_count(doc["params"], field=f"params in {path}")
    hook, where = find_hook(spec.job.entrypoint, spec.job.working_dir)
    if hook is None and isinstance(doc, dict) and "model" not in doc and stated is not None:
        return ModelFacts(stated, None, f"params: in {path.name} (not built: {spec.job.entrypoint.split(':')[0]} "
                                        f"defines no {HOOK})")
    if hook is None:
        from hybrid.models.gpt.training import build_model as hook

        where = "the built-in GPT (hybrid.models.gpt.training.build_model), from the model: mapping"
    if spec.job.entrypoint in BUILT_IN_ENTRYPOINTS:  # its keys, train: options and data, before any rank starts
        from hybrid.models.gpt.training import check_model_config

        check_model_config(doc, path)
    hf_section = False  # the built-in hooks build an hf: section's model from its transformers config alone
    if getattr(hook, "__module__", "") in BUILT_IN_HOOKS:
        from hybrid.models.gpt.training import is_hf_config

        hf_section = is_hf_config(doc)
        if hf_section:  # hf: paths are relative to the model config, wherever the hook runs
            from hybrid.models.hf import absolute_paths

            doc = absolute_paths(doc, path)
    model = build_on_meta(hook, doc, where)
    counted = sum(p.numel() for p in model.parameters())
    if counted == 0:
        raise ConfigError(f"{where} built a model without parameters from {v.quote(str(path))}; return the "
                          "model to train from build_model.")
    from hybrid.weights.attrs import is_tensor_parallel

    own_by_default = getattr(hook, "__module__", "") in BUILT_IN_HOOKS  # our loops call ctx.parallelize
    tp_plan, tp_note = split_by_plan(model, spec.parallel.tp_plan, where, own_by_default)
    tensor_parallel = any(is_tensor_parallel(p) for p in model.parameters())
    source = f"counted on the meta device by {where}"
    params = counted
    if stated is not None:
        check_override(stated, counted, path, where)
        params, source = stated, f"params: {stated:,} in {path.name}, within 1% of the {counted:,} {source}"
    config = getattr(model, "config", None) if hf_section else None
    return ModelFacts(params, tensor_parallel, source, _gpt_shape(model), model, tp_plan, tp_note, seq_len_of(doc),
                      config)


def seq_len_of(doc) -> Optional[int]:
    """Tokens per row the model config says: ``hf.seq_len``, ``model.seq_len`` or a top-level ``seq_len``."""
    if not isinstance(doc, dict):
        return None
    for where in (doc.get("hf"), doc.get("model"), doc):
        value = where.get("seq_len") if isinstance(where, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def split_by_plan(model, tp_plan, where: str, own_by_default: bool = True) -> tuple[str, str]:
    """Split the driver's ``model`` at TP 1 by ``tp_plan`` (``parallel.tp_plan``: a plan, or ``own``), else by its
    own Hugging Face plan where the entrypoint is known to apply it (``own_by_default``: the built-in loops, which
    call ``ctx.parallelize``; a user's entrypoint opts in with ``parallel.tp_plan: own``, so a job that never
    splits its model is not planned at TP > 1); returns (which plan split it, "" for none; why its own plan was
    not used, "" when not tried or used)."""
    from hybrid.config.tp_plan import OWN
    from hybrid.tp.hf import hf_plan, own_plan_name
    from hybrid.tp.plan import apply_plan, plan_notes
    from hybrid.weights.attrs import is_tensor_parallel

    def described(name: str) -> str:  # the plan's name, and what hybrid did beyond its words
        notes = plan_notes(model)
        return f"{name} ({'; '.join(notes)})" if notes else name

    split_already = any(is_tensor_parallel(p) for p in model.parameters())
    if tp_plan == OWN:
        if split_already:
            raise ConfigError(f"parallel.tp_plan is {OWN}, but {where} returns a {type(model).__name__} with "
                              "tensor-parallel parameters already; remove parallel.tp_plan.")
        if hf_plan(model) is None:
            raise ConfigError(f"parallel.tp_plan is {OWN}, but the {type(model).__name__} {where} returns has no TP "
                              "plan of its own (config.base_model_tp_plan); give the plan as a mapping of module-name "
                              "patterns to styles instead.")
        name = own_plan_name(model)
        apply_plan(model, hf_plan(model), None, name)
        return described(name), ""
    if tp_plan is not None:
        if split_already:
            raise ConfigError(f"parallel.tp_plan is set, but {where} returns a {type(model).__name__} with "
                              "tensor-parallel parameters already (hybrid.tp layers, or a plan it applied); remove "
                              "parallel.tp_plan or build the model without them.")
        apply_plan(model, tp_plan, None, "parallel.tp_plan")
        return described("parallel.tp_plan"), ""
    if split_already:
        return "", ""
    name = own_plan_name(model)
    try:
        own = hf_plan(model)
        if own is None:
            return "", ""
        if not own_by_default:  # checked on a copy: the job's own entrypoint stays at TP 1 unless it opts in
            apply_plan(copy.deepcopy(model), own, None, name)
            return "", (f"{name} could split it, but {where} is the job's own: set parallel.tp_plan: {OWN} and "
                        "call ctx.parallelize(model) before hybrid.initialize to train it with TP")
        apply_plan(model, own, None, name)
    except ConfigError as err:
        return "", str(err).rstrip(".")
    return described(name), ""


def find_hook(entrypoint: str, working_dir=None) -> tuple[Optional[Callable], Optional[str]]:
    """The entrypoint's ``build_model`` and where it was found (``module.build_model``), or (None, None)."""
    from launch.spec import resolve_entrypoint

    fn = resolve_entrypoint(entrypoint, working_dir=working_dir)
    module_name = entrypoint.split(":")[0]
    for name in dict.fromkeys((module_name, getattr(fn, "__module__", None) or module_name)):
        hook = getattr(sys.modules.get(name), HOOK, None)
        if callable(hook):
            return hook, f"{name}.{HOOK}"
    return None, None


def build_on_meta(hook: Callable, model_config: Any, where: str):
    """``hook(model_config)`` under ``torch.device("meta")``; its failure is one ``ConfigError`` sentence."""
    import torch
    from torch import nn

    try:
        with torch.device("meta"):
            model = hook(model_config)
    except ConfigError:
        raise
    except Exception as err:  # the user's code: any failure is theirs to see, in one line
        # All its lines, joined: validators (Hugging Face's) give the reason on the second.
        text = " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or "no message"
        raise ConfigError(f"{where} failed on the driver (called under torch.device('meta') to count the "
                          f"parameters): {type(err).__name__}: {text[:400]}; fix build_model or the model "
                          "config.") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{where} returned {type(model).__name__}, not a torch.nn.Module; return the model "
                          "to train.")
    return model


def check_override(stated: int, counted: int, path, where: str) -> None:
    """``params:`` must agree with the measured count to ``PARAMS_TOLERANCE``."""
    if abs(Fraction(stated - counted, counted)) > PARAMS_TOLERANCE:
        raise ConfigError(f"params in {v.quote(str(path))} is {stated:,}, but {where} builds a model of "
                          f"{counted:,} parameters (off by more than 1%); remove params: (the count is measured) "
                          "or correct it.")


def _gpt_shape(model) -> Optional[dict]:
    from hybrid.models.gpt.model import GPT

    return model.config.to_dict() if isinstance(model, GPT) else None


def gpt_tp_refusal(model: dict, tp: int) -> Optional[str]:
    """Why the built-in GPT of shape ``model`` cannot be split ``tp`` ways, or None when it can."""
    from hybrid.models.gpt.model import GPTConfig

    try:
        GPTConfig.from_dict(model).check_tp(tp)
    except ConfigError as err:
        return str(err).rstrip(".")
    return None


# ------------------------------------------------------------------------------------ one micro-step's figures


@dataclass(frozen=True)
class ModelFigures:
    """What the plan knows of one micro-step of the job's model (module docstring): its profiles without and with
    activation checkpointing, or neither and ``note`` says why."""

    params: int
    precision: str
    seq: Optional[int] = None
    plain: Any = None                # hybrid.plan.profile.ModelProfile without activation checkpointing
    checkpointed: Any = None         # and with it
    logits_split: bool = False       # at TP > 1 the logits split by vocabulary (else gathered on every rank)
    note: str = ""                   # why nothing is known, one sentence without its full stop ("" when known)
    checkpointing: bool = True       # the job's loop applies activation checkpointing when the plan turns it on

    def checkpointing_lever(self, requested: Optional[bool]) -> Optional[bool]:
        """``parallel.activation_checkpointing`` as the plan may use it: auto (None) is off where the job's loop
        would not apply it."""
        return False if requested is None and not self.checkpointing else requested

    @property
    def known(self) -> bool:
        return self.plain is not None

    @property
    def source(self) -> str:
        """Where the figures come from, for the plan's text."""
        return f"profiled from {self.plain.model} at {self.seq} tokens" if self.plain is not None else ""

    def activation_bytes(self, micro_batch: int, tp: int, checkpointing: bool = False) -> float:
        """Activation bytes per GPU of one micro-batch (0 where nothing is known: ``note`` says why)."""
        if self.plain is None:
            return 0.0
        return profile_activation_bytes(self.plain, self.checkpointed, self.seq, micro_batch, tp, checkpointing,
                                        self.logits_split)

    def cost_shape(self) -> Optional[ModelShape]:
        """The time model's shape (None where nothing is known)."""
        if self.plain is None:
            return None
        return ModelShape.from_profile(self.plain, self.checkpointed, self.seq, self.params)


_PROFILES: dict = {}  # (model signature, seq, dtype) -> (plain, checkpointed) or the ProfileError sentence


def model_figures(facts: ModelFacts, precision: str, entrypoint: str = BUILT_IN_ENTRYPOINT) -> ModelFigures:
    """The job's model's figures in ``precision`` (module docstring); profiles taken once per process;
    ``entrypoint``: the job's (``job.entrypoint``), whose loop applies activation checkpointing or not."""
    if facts.shape is not None:
        return gpt_figures(facts.shape, precision, facts.params)
    if facts.module is None:
        return ModelFigures(facts.params, precision, facts.seq, note=(
            "the model was not built on the driver (a params: count without a build_model hook), so its profile "
            "cannot be taken"))
    if facts.seq is None or facts.seq < 2:
        return ModelFigures(facts.params, precision, facts.seq, note=(
            "the model config says no sequence length of at least 2 tokens (seq_len: at its top level or under "
            "model:), so the model's profile cannot be taken at it"))
    from hybrid.tp.traffic import with_block_collectives

    profiles = _profiles(facts.config, facts.module, facts.seq, precision)
    if isinstance(profiles, str):
        return ModelFigures(facts.params, precision, facts.seq, note=profiles)
    plain, checkpointed = (with_block_collectives(p, facts.module) for p in profiles)
    return ModelFigures(facts.params, precision, facts.seq, plain, checkpointed, logits_split(facts.module),
                        checkpointing=entrypoint in BUILT_IN_ENTRYPOINTS)


def gpt_figures(shape: dict, precision: str, params: Optional[int] = None) -> ModelFigures:
    """The built-in GPT of ``shape`` (``GPTConfig.to_dict()``) profiled as any model is: two of its blocks built on
    meta, without its own activation checkpointing (the profile applies it), scaled to its ``n_layers``; its
    logits split by vocabulary at TP > 1 (its head and loss are vocab-parallel); Ψ ``params`` (default: the
    profile's count). Its analytic formulas (Korthikanti's activations, ``6·Ψ + 12·L·h·s``) are the tests'
    oracle for this path (tests/oracles.py)."""
    import torch

    from hybrid.models.gpt.model import GPT, GPTConfig
    from hybrid.plan.profile import profile_model
    from hybrid.tp.traffic import with_block_collectives
    from hybrid.zero.engine import DTYPES

    key = ("gpt", tuple(sorted((k, v) for k, v in shape.items() if k != "activation_checkpointing")), precision)
    if key not in _PROFILES:
        config = GPTConfig.from_dict({**shape, "n_layers": min(2, shape["n_layers"]),
                                      "activation_checkpointing": False})
        with torch.device("meta"):
            model = GPT(config)
        _PROFILES[key] = tuple(
            with_block_collectives(profile_model(model, 1, shape["seq_len"], checkpointing=ac, dtype=DTYPES[precision],
                                                 layers=shape["n_layers"]), model) for ac in (False, True))
    plain, checkpointed = _PROFILES[key]
    return ModelFigures(params or plain.params, precision, shape["seq_len"], plain, checkpointed, logits_split=True)


def config_figures(config, seq: int, precision: str) -> ModelFigures:
    """A transformers config's figures on paper (``hybrid estimate --hf``): its causal LM profiled, Ψ the profile's
    count; the logits split at TP > 1 where ``hybrid.models.hf:train`` splits them and the TP calls of a block split
    by its own plan (of the model built on meta with two layers). ``ProfileError`` (one sentence) where the profile
    cannot be taken."""
    from hybrid.plan.profile import ProfileError
    from hybrid.plan.profile.measure import model_on_meta
    from hybrid.tp.traffic import with_block_collectives

    profiles = _profiles(config, None, seq, precision)
    if isinstance(profiles, str):
        raise ProfileError(profiles + ".")
    model = model_on_meta(config)
    split = logits_split(model)
    split_by_plan(model, None, "the model of --hf")  # as the ranks split it, for its TP calls
    plain, checkpointed = (with_block_collectives(p, model) for p in profiles)
    return ModelFigures(plain.params, precision, seq, plain, checkpointed, logits_split=split)


def _profiles(config, module, seq: int, precision: str):
    """``(plain, checkpointed)`` profiles of a transformers ``config``'s causal LM (two layers built, scaled to all:
    what ``hybrid.models.hf.build_model`` builds), else of ``module`` as built; or the sentence why none."""
    from hybrid.plan.profile import profile_config, profile_model
    from hybrid.zero.engine import DTYPES  # the compute dtype of each precision, as the engine runs it

    dtype = DTYPES[precision]
    if config is not None:
        key = ("config", config.to_json_string(), seq, precision)

        def take(checkpointing):
            return profile_config(config, 1, seq, checkpointing=checkpointing, dtype=dtype)
    else:
        key = (type(module).__module__, type(module).__qualname__, repr(module),
               tuple((n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()), seq, precision)

        def take(checkpointing):
            return profile_model(module, 1, seq, checkpointing=checkpointing, dtype=dtype)
    if key not in _PROFILES:
        try:
            _PROFILES[key] = (take(False), take(True))
        except ConfigError as err:  # ProfileError: the op that stopped it, in one sentence
            _PROFILES[key] = str(err).rstrip(".")
        except Exception as err:  # the profile's own limits meeting a model it does not know: said, not hidden
            _PROFILES[key] = (f"the profile of {type(module or config).__name__} could not be taken "
                              f"({type(err).__name__}: {' '.join(str(err).split())[:200]})")
    return _PROFILES[key]


def logits_split(module) -> bool:
    """Whether the ranks keep their ``V/t`` slice of the model's logits at TP ``t`` > 1 (the answer is the same at
    every such degree) rather than gathering them on every rank: a Hugging Face causal LM where
    ``hybrid.tp.splits_logits`` says ``Context.parallelize`` leaves them split with a vocabulary-parallel loss,
    or a head of ``hybrid.tp`` layers split by vocabulary without gathering (the built-in GPT's)."""
    from hybrid.plan.profile import find_blocks
    from hybrid.plan.profile.measure import output_head
    from hybrid.tp.hf import splits_logits
    from hybrid.weights.attrs import is_tensor_parallel

    if splits_logits(module, ANY_TP):
        return True
    head = output_head(module, find_blocks(module)[1])
    return (head is not None and getattr(head, "gather_output", True) is False
            and any(is_tensor_parallel(p) for p in head.parameters(recurse=False)))
