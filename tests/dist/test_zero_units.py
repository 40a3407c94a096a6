"""Stage-3 units by subtree on ordinary PyTorch models, on real gloo ranks, against single-process AdamW.

Each model of ``own_models`` (an ``nn.TransformerEncoder`` under a tied ``F.linear`` head, blocks reading
their children's weights functionally, an ``nn.Sequential`` of blocks) is trained at stage 3 (fp32,
gradient accumulation 2, clipping) under the ``auto`` unit policy, and the encoder also under ``module``
(one unit per module: the MultiheadAttention's ``out_proj.weight`` and the head's ``emb.weight`` are then
read outside their units, so they are gathered on demand, logged by name) and under a callable policy;
the ``Sequential`` one also with both blocks in one activation-checkpoint region (same gathers as without);
blocks that keep an auxiliary loss (``AuxLossNet``) get their units gathered again when backward unpacks
their saved weights, before any gradient reaches their outputs (without that: wrong gradients, NaN norms).
Losses, gradient norms and final weights match the single-process reference to < 1e-5 at world 2 and 4;
the unit counts, the on-demand reads and the warnings are checked too.
"""

import logging

import pytest
import torch
import torch.distributed as dist

import hybrid
from hybrid.errors import UserError
from hybrid.runtime.local_launch import LocalRunError, run_local
from tests.dist.own_models import AuxLossNet, CheckpointedNet, EncoderNet, FunctionalNet, SequentialNet, plain_forward
from tests.dist.zero_models import ACCUM, config, reference, train_engine

pytestmark = pytest.mark.slow

STEPS = 4
MODELS = {"encoder": EncoderNet, "functional": FunctionalNet, "sequential": SequentialNet,
          "checkpointed": CheckpointedNet, "auxloss": AuxLossNet}
CASES = {
    "encoder": ("encoder", "auto"), "functional": ("functional", "auto"), "sequential": ("sequential", "auto"),
    "checkpointed": ("checkpointed", "auto"), "auxloss": ("auxloss", "auto"), "encoder-module": ("encoder", "module"),
    "encoder-callable": ("encoder", lambda name, m: name.startswith("encoder.layers.") and name.count(".") == 2),
}
WORLD4 = ["encoder", "functional", "sequential", "auxloss"]


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _run(names):
    rank, world = dist.get_rank(), dist.get_world_size()
    handler = _Messages()
    logging.getLogger("hybrid.zero.params").addHandler(handler)
    out = {}
    for name in names:
        model, unit = CASES[name]
        handler.lines.clear()
        engine = hybrid.initialize(MODELS[model](), config(3, stage3_unit=unit))
        engine.reset_comm()
        losses, norms, _ = train_engine(engine, rank, world, plain_forward, STEPS)
        out[name] = dict(losses=losses, norms=norms, state=engine.full_state_dict(), gathers=engine.gather_report(),
                         units=len(engine.gatherer.module_units), warnings=list(handler.lines),
                         idle=engine.memory_report()["buffers"])
    return out


def _rel(actual, expected) -> float:
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def _check(world, names):
    out = run_local(_run, world, names, timeout_s=240)
    refs = {m: reference(make=MODELS[m], forward=plain_forward, steps=STEPS) for m in {CASES[n][0] for n in names}}
    for name in names:
        ref_losses, ref_norms, ref_state = refs[CASES[name][0]]
        runs = [res[name] for res in out]
        losses = [sum(r["losses"][i] for r in runs) / world for i in range(STEPS * ACCUM)]
        assert _rel(losses, ref_losses) < 1e-5, f"{name}: losses {losses} vs {ref_losses}"
        for rank, run in enumerate(runs):
            case = f"{name} rank {rank}"
            assert _rel(run["norms"], ref_norms) < 1e-5, f"{case}: norms {run['norms']} vs {ref_norms}"
            for key, value in ref_state.items():
                assert _rel(run["state"][key], value) < 1e-5, f"{case}: {key}"
            assert run["idle"] == 0, f"{case}: buffers held between steps"
            on_demand = run["gathers"]["on_demand"]
            if name == "encoder-module":
                assert on_demand > 0, case
                assert any("emb.weight is read outside" in w for w in run["warnings"]), run["warnings"]
                assert any("self_attn.out_proj.weight is read outside" in w for w in run["warnings"]), run["warnings"]
            elif name == "auxloss":  # whatever backward reached first, no read was outside a unit in forward
                assert all("backward needed the unit holding blocks." in w for w in run["warnings"]), run["warnings"]
            else:
                assert on_demand == 0 and run["warnings"] == [], f"{case}: {run['warnings']}"
    if "sequential" in names:  # the rest (emb, ln_f, head) + one unit per block of the Sequential
        assert out[0]["sequential"]["units"] == 1 + 2
    if "checkpointed" in names:  # recomputing both blocks in backward gathers nothing twice
        assert out[0]["checkpointed"]["gathers"] == out[0]["sequential"]["gathers"]
    for name in ("encoder", "encoder-callable"):  # the rest (emb) + one unit per encoder layer
        if name in names:
            assert out[0][name]["units"] == 1 + 2, name


def test_stage3_units_own_models_world2():
    _check(2, list(CASES))


def test_stage3_units_own_models_world4():
    _check(4, WORLD4)


class _RoutedExperts(torch.nn.Module):
    """Two experts of one shape; ``route`` picks the one a rank's rows go to (data-dependent, as in an MoE)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8, bias=False) for _ in range(2))

    def forward(self, x, route):
        return self.experts[route](x).pow(2).mean()


def _routed_rank(same: bool):
    engine = hybrid.initialize(_RoutedExperts(), {"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}})
    route = 0 if same else dist.get_rank()
    engine.backward(engine(torch.randn(4, 8), route))
    try:
        engine.step()
    except UserError as err:
        try:  # the engine stays stopped: this step's gradients mix modules
            engine.backward(engine(torch.randn(4, 8), 0))
        except UserError as again:
            return str(err) if str(again) == str(err) else f"then: {again}"
        return "then: the engine went on"
    return None


def test_stage3_ranks_that_gather_different_units_are_refused_not_mixed():
    """The all-gathers of two same-sized units pair up across ranks: without the check each rank's forward ran
    with a weight made of one shard of each expert, and training went on."""
    assert run_local(_routed_rank, 2, True) == [None, None]
    for message in run_local(_routed_rank, 2, False):
        assert message.startswith("the DP ranks gathered different ZeRO stage-3 units in this step"), message


class _SkippingExperts(_RoutedExperts):
    def forward(self, x, used):
        return sum(self.experts[i](x).pow(2).mean() for i in used)


def _skipping_rank():
    engine = hybrid.initialize(_SkippingExperts(), {"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}})
    # rank 1's rows reach no row of expert 1 and it skips it (`if idx.numel():`): one gather fewer than rank 0's
    engine.backward(engine(torch.randn(4, 8), [0, 1] if dist.get_rank() == 0 else [0]))
    engine.step()


def test_stage3_ranks_that_run_a_different_number_of_modules_fail_naming_the_rule():
    """The collectives no longer pair up: the ranks wait until the collective timeout. What then fails says
    what the rule is (it was gloo's timeout alone)."""
    with pytest.raises(LocalRunError) as err:
        run_local(_skipping_rank, 2, timeout_s=3)
    message = str(err.value)
    assert "did not complete" in message and "the ranks ran different modules" in message, message
    assert "at stage 3 every DP rank must call the same modules in the same order" in message, message
