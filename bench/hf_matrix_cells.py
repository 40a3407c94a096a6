"""The checks of one type of the Hugging Face compatibility matrix, and what each cell says.

Each check returns a cell: ``pass``; the sentence the product raised (a ``hybrid.errors.UserError`` --
``ConfigError``, ``CheckpointError``, ... -- on one line); ``error: <ExceptionType>: <first line>`` for
anything else, a product bug (``Mismatch`` is the harness's own: the run finished but disagrees with its
reference, and names the worst tensor); or ``n/a: <why>`` where the check does not apply or transformers
itself cannot do its part (the tiny config fails in transformers alone, save_pretrained fails).

The single-process parts (``plain_check``, ``build_cell``, ``load_cell``, ``reference``) run anywhere; the
trained ones (``train_tp``, ``export_cell``) run on every rank of a gloo world (``hybrid.runtime.local_launch``)
and are driven by ``bench/hf_matrix_world.py``.

Training: the tiny model built the ordinary way after ``torch.manual_seed(SEED)`` on every rank (each rank
keeps its slice at TP 2), ZeRO stage 3, fp32, ``STEPS`` steps of AdamW (lr 1e-2, betas 0.9/0.95, eps 1e-4,
weight decay 0.1 over the engine's default groups) with gradient clipping at 0.3, on ``ROWS`` rows of ``SEQ``
tokens (split over DP). The reference is the same model trained in one process by ``torch.optim.AdamW`` over
``hybrid.zero.param_groups.torch_param_groups`` and ``clip_grad_norm_``, once in fp32 and once in fp64 from the
same values (a mixture of experts with transformers' eager experts where its grouped_mm has no fp64). A run
passes when its losses (the DP mean), its pre-clip gradient norms and every tensor of its ``full_state_dict()``
are within ``TOLERANCE_FACTOR`` (10) times torch fp32's own distance from the fp64 run, each measured as the
largest absolute difference over the largest absolute value (the losses of all steps together, the norms
together, the worst tensor), and never below ``TOLERANCE_FLOOR``: relative 1e-5, the project's own parity
tolerance (tests/dist/test_hf_tp.py), for a quantity fp32 gets almost exactly in one process (a loss or a
gradient norm: 1e-7) but that the engine sums in another order (a norm over flat shards was seen 1.7e-6 off). A tensor whose largest value is below ``SCALE_FLOOR`` (1e-3; one AdamW step moves a weight by up to
the learning rate, 1e-2) is measured against 1e-3 instead: a key projection's bias, whose gradient is zero in
exact arithmetic, holds rounding noise of ~1e-10 that differs by its own size from run to run. A model with
no fp64 run at all is compared with the fp32 run, within 10 times that run's distance from itself with each
step's batch in two accumulated halves (the reordering DP brings). Which rule a type got is in its row
(``--json``). Loading and exporting move bits: they must be equal.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch

from bench.hf_matrix_configs import ROWS, build, ids, loss_of, plain_check  # noqa: F401 (plain_check: for the world)

SEED, WEIGHTS_SEED, STEPS = 3, 11, 3
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 1e-2, (0.9, 0.95), 1e-4, 0.1, 0.3
TOLERANCE_FACTOR, TOLERANCE_FLOOR, SCALE_FLOOR = 10.0, 1e-5, 1e-3
PASS, NA = "pass", "n/a"
CELLS = ("build", "load", "tp1", "tp2", "export")


class Mismatch(Exception):
    """A check ran to the end but its result disagrees with the reference."""


def describe(err: BaseException) -> str:
    """The cell for an exception: the product's sentence, or ``error: Type: first line``."""
    from hybrid.errors import UserError, first_line

    if isinstance(err, UserError):
        return " ".join(str(err).split())
    return f"error: {type(err).__name__}: {first_line(err, limit=300)}"


def not_applicable(why: str, err: Optional[BaseException] = None) -> str:
    from hybrid.errors import first_line

    return f"{NA}: {why}" + (f" ({type(err).__name__}: {first_line(err, limit=200)})" if err is not None else "")


def cell(check: Callable[[], object]) -> str:
    try:
        check()
    except Exception as err:  # noqa: BLE001 -- every failure is a cell
        return describe(err)
    return PASS


def build_cell(config) -> None:
    """``AutoModelForCausalLM.from_config`` under ``hybrid.empty_init()``: every parameter on meta."""
    import hybrid

    with hybrid.empty_init():
        model = build(config)
    off = [n for n, p in model.named_parameters() if not p.is_meta]
    if off:
        raise Mismatch(f"{len(off)} parameter(s) built off meta under hybrid.empty_init(), e.g. {off[0]!r}")


def load_cell(config, where: Path) -> Optional[str]:
    """A random-init model's sharded ``save_pretrained`` directory read by ``hybrid.materialize(weights=DIR)``
    into the model built on meta: every tensor of the state dict equal. Returns an ``n/a`` cell where
    transformers cannot save the model, else None (or raises)."""
    import hybrid

    source = build(config, seed=WEIGHTS_SEED)
    state = source.state_dict()
    total = sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values())
    try:
        source.save_pretrained(where, max_shard_size=max(total // 3, 1))  # three shards or more
    except Exception as err:  # noqa: BLE001
        return not_applicable("transformers' save_pretrained fails", err)
    shards = len(list(where.glob("*.safetensors")))
    with hybrid.empty_init():
        model = build(config)
    hybrid.materialize(model, weights=str(where))
    loaded = model.state_dict()
    _same_keys(loaded, state, "materialized", "saved")
    for name, expected in state.items():
        if not torch.equal(loaded[name].cpu(), expected):
            raise Mismatch(f"{name!r} differs from the saved tensor ({shards} shards; "
                           f"{_rel(loaded[name], expected):.3g} relative)")
    return None


def train_config(stage: int):
    from hybrid.config.training import TrainConfig

    return TrainConfig.from_dict({
        "zero": {"stage": stage, "reduce_bucket_size": 3000, "allgather_bucket_size": 3000,
                 "prefetch_bucket_size": 3000, "param_persistence_threshold": 40},
        "precision": "fp32",
        "optimizer": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
        "gradient_clipping": CLIP,
    })


def _torch_run(config, dtype, halves: bool = False, experts: Optional[str] = None) -> dict:
    """The single-process run; ``halves``: each step's batch as two accumulated halves (what DP 2 computes);
    ``experts``: transformers' experts implementation (``eager`` runs in fp64, grouped_mm does not)."""
    from hybrid.zero.param_groups import torch_param_groups

    model = build(config, seed=SEED, dtype=dtype)
    if experts is not None:
        model.set_experts_implementation(experts)
    opt = torch.optim.AdamW(torch_param_groups(model, train_config(0).optimizer), lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WEIGHT_DECAY, foreach=False)
    losses, norms, no_grad = [], [], set()
    for step in range(STEPS):
        rows = ids(step)
        parts = (rows[:ROWS // 2], rows[ROWS // 2:]) if halves else (rows,)
        loss = 0.0
        for part in parts:
            part_loss = loss_of(model, part) / len(parts)
            part_loss.backward()
            loss += part_loss.item()
        no_grad |= {n for n, p in model.named_parameters() if p.requires_grad and p.grad is None}
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    return dict(losses=losses, norms=norms, weights={k: v.detach().clone() for k, v in model.state_dict().items()},
                no_grad=sorted(no_grad))


def _distance(run: dict, ref: dict) -> dict:
    return dict(losses=_rel(run["losses"], ref["losses"]), norms=_rel(run["norms"], ref["norms"]),
                weights=max((_rel(run["weights"][k], v) for k, v in ref["weights"].items() if v.is_floating_point()),
                            default=0.0))


def reference(config) -> dict:
    """The single-process run a check compares with, and its tolerances (see the module docstring)."""
    from hybrid.errors import first_line

    ref32 = _torch_run(config, torch.float32)
    ref64, how, failure = None, f"{TOLERANCE_FACTOR:g}x fp32's distance from fp64", None
    for experts in (None, "eager"):
        try:
            ref64 = _torch_run(config, torch.float64, experts=experts)
            how += " (experts: eager)" if experts else ""
            break
        except Exception as err:  # noqa: BLE001 -- an op without fp64 (grouped_mm): again with eager experts
            failure = failure or f"{type(err).__name__}: {first_line(err, limit=120)}"
    if ref64 is not None:
        distance, ref = _distance(ref32, ref64), ref64
    else:  # no fp64 run: fp32's distance from itself with each batch in two accumulated halves
        distance, ref = _distance(_torch_run(config, torch.float32, halves=True), ref32), ref32
        how = f"{TOLERANCE_FACTOR:g}x fp32's distance from fp32 in two halves (fp64: {failure})"
    tol = {k: max(TOLERANCE_FACTOR * d, TOLERANCE_FLOOR) for k, d in distance.items()}
    return dict(ref, tolerance=tol, how=how, fp32_distance=distance)


def check_run(run: dict, ref: dict, what: str) -> None:
    """Raise ``Mismatch`` where ``run`` (losses, norms, weights) is outside ``ref``'s tolerance."""
    tol = ref["tolerance"]
    for key in ("losses", "norms"):
        values = run[key]
        if not all(math.isfinite(v) for v in values):
            raise Mismatch(f"{what}: {key} {values} are not finite")
        err = _rel(values, ref[key])
        if err > tol[key]:
            raise Mismatch(f"{what}: {key} {_short(values)} vs {_short(ref[key])}: {err:.3g} relative, "
                           f"over {tol[key]:.3g}")
    weights, expected = run["weights"], ref["weights"]
    _same_keys(weights, expected, what, "the reference")
    errors = {}
    for name, ref_t in expected.items():
        got = weights[name]
        if tuple(got.shape) != tuple(ref_t.shape):
            raise Mismatch(f"{what}: {name!r} has shape {tuple(got.shape)}, the reference {tuple(ref_t.shape)}")
        errors[name] = (_rel(got, ref_t) if ref_t.is_floating_point()
                        else float(not torch.equal(got.to(ref_t.dtype), ref_t)))
    bad = {n: e for n, e in errors.items() if not e <= tol["weights"]}
    if bad:
        no_grad = set(ref.get("no_grad", ())) & set(bad)
        graded = {n: e for n, e in bad.items() if n not in no_grad}
        worst = max(graded or bad, key=lambda n: bad[n] if math.isfinite(bad[n]) else math.inf)
        if graded:
            also = f" (and {len(no_grad)} that got no gradient in the torch run)" if no_grad else ""
            raise Mismatch(f"{what}: {len(graded)} of {len(errors)} tensors off{also}, worst {worst!r} "
                           f"{bad[worst]:.3g} relative, over {tol['weights']:.3g}")
        raise Mismatch(f"{what}: {len(bad)} of {len(errors)} tensors off, all of them parameters that got no "
                       f"gradient in the torch run (its AdamW leaves those as they are), worst {worst!r} "
                       f"{bad[worst]:.3g} relative, over {tol['weights']:.3g}")


def train_tp(config, mesh, tp: int) -> tuple:
    """Train the tiny model on this rank's rows through the ZeRO engine over ``mesh`` (split by its own plan
    at ``tp`` 2); returns (engine, this rank's losses, norms, the full state dict on rank 0 else None)."""
    import hybrid
    from hybrid.tp import parallelize

    model = build(config, seed=SEED)
    if tp > 1:
        parallelize(model, mesh.tp_comm)
    engine = hybrid.initialize(model, train_config(3), dp_group=mesh.dp_group,
                               tp_group=mesh.tp_group if tp > 1 else None)
    per_rank = ROWS // mesh.dp
    rows = slice(mesh.dp_rank * per_rank, (mesh.dp_rank + 1) * per_rank)
    losses, norms = [], []
    for step in range(STEPS):
        loss = loss_of(engine, ids(step)[rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.last_grad_norm))
    return engine, losses, norms, engine.full_state_dict(rank0_only=True)


def hf_model_config(config) -> dict:
    """The config as the checkpoint's model config (JSON: what consolidate_hf writes as config.json)."""
    return json.loads(json.dumps(config.to_dict(), default=str))


def export_cell(run_dir: Path, out_dir: Path, weights: dict) -> None:
    """On one rank, after ``checkpoint.save(run_dir, ...)`` on all: ``consolidate_hf`` to ``out_dir``, then
    ``from_pretrained(out_dir)`` holds exactly ``weights`` (the engine's ``full_state_dict()``)."""
    from transformers import AutoModelForCausalLM

    from hybrid.checkpoint.hf_export import consolidate_hf

    total = sum(t.numel() * t.element_size() for t in weights.values())
    consolidate_hf(run_dir, out_dir, max_shard_size=max(total // 3, 1))
    loaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).state_dict()
    _same_keys(loaded, weights, "from_pretrained", "the engine's full_state_dict")
    for name, expected in weights.items():
        if not torch.equal(loaded[name], expected.to(loaded[name].dtype)):
            raise Mismatch(f"{name!r} read back by from_pretrained differs from the trained tensor "
                           f"({_rel(loaded[name], expected):.3g} relative)")


def fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def _same_keys(got: dict, expected: dict, got_name: str, expected_name: str) -> None:
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if missing or extra:
        from hybrid.errors import listing

        parts = ([f"missing {listing(missing, 3)}"] if missing else []) + (
            [f"extra {listing(extra, 3)}"] if extra else [])
        raise Mismatch(f"{got_name} and {expected_name} hold different tensors: {'; '.join(parts)}")


def _rel(actual, expected) -> float:
    """The largest difference over the largest value, or over ``SCALE_FLOOR`` where that is larger."""
    actual = torch.as_tensor(actual).detach().double().cpu()
    expected = torch.as_tensor(expected).detach().double().cpu()
    diff = (actual - expected).abs().max().item() if actual.numel() else 0.0
    scale = expected.abs().max().item() if expected.numel() else 0.0
    return diff / max(scale, SCALE_FLOOR)


def _short(values) -> str:
    return "[" + ", ".join(f"{v:.6g}" for v in values) + "]"
