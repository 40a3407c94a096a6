"""``HYBRID_FORCE_COLLECTIVES=1``: a world of one rank issues every collective a multi-rank job issues, and
trains exactly as without them (a sum over one rank is the identity).

The ZeRO parity cases of ``test_zero_parity`` (stages 0-3, fp32, bf16, fp32 reduction of bf16 gradients,
no persistence, the all-reduce path) and the GPT with TP layers of ``test_zero_tp`` (stages 0-3, tp 1 x dp 1)
run at world 1 on gloo with the switch on, against the same single-process references and checks as there.
Every engine's DP ``Comm`` and the mesh's TP ``Comm`` must have issued collectives: gradient reductions at
every stage, parameter all-gathers at stages 1-3, the TP layers' all-reduces and the all-gathers of the TP
slices that ``full_state_dict`` consolidates. The GPU check
(``tests/gpu``) runs its parity this way, so one GPU runs NCCL on each of these paths.
"""

import pytest
import torch

import hybrid
from hybrid.comm.collectives import FORCE_COLLECTIVES_ENV, Comm, collectives_forced
from hybrid.errors import ConfigError
from hybrid.runtime.local_launch import run_local
from tests.dist import test_zero_parity as parity
from tests.dist import test_zero_tp as zero_tp
from tests.dist.zero_models import STEPS

pytestmark = pytest.mark.slow


def _recording_engines(run, *args):
    """``run(*args)`` with every engine ``hybrid.initialize`` makes recorded; (its result, each engine's DP
    collective counts and whether its DP Comm was solo)."""
    engines = []
    initialize = hybrid.initialize

    def recording(*a, **kw):
        engines.append(initialize(*a, **kw))
        return engines[-1]

    hybrid.initialize = recording
    try:
        out = run(*args)
    finally:
        hybrid.initialize = initialize
    return out, [(e.dp_comm.solo, e.comm_report(), e.tp_comm.report() if e.tp_comm is not None else None)
                 for e in engines]


def _parity_cases(names):
    return _recording_engines(parity._run_cases, names)


def test_the_zero_parity_cases_at_world_1_issue_every_collective_and_match(monkeypatch):
    monkeypatch.setenv(FORCE_COLLECTIVES_ENV, "1")
    counts = []

    def run_forced(fn, world, names, **kw):  # test_zero_parity's checks, on the results of a forced world 1
        assert fn is parity._run_cases and world == 1
        (out, recorded), = run_local(_parity_cases, world, names, **kw)
        counts.extend(recorded)
        return [out]

    monkeypatch.setattr(parity, "run_local", run_forced)
    names = list(parity.CASES)
    parity._check(1, names)
    assert len(counts) == len(names)
    for name, (solo, report, _) in zip(names, counts):
        stage = int(name[len("stage")])
        assert not solo, name
        gradient_reductions = report["reduce_scatter_calls"] + report["all_reduce_calls"] - STEPS  # less the norm's
        assert gradient_reductions >= STEPS, (name, report)
        if stage >= 1:
            assert report["all_gather_calls"] >= STEPS, (name, report)  # the parameters after each step
        if stage == 3:
            assert report["all_gather_calls"] > report["reduce_scatter_calls"], (name, report)  # forward and backward


def _tp_runs():
    zero_tp.MESHES = [(1, 1)]
    meshes = []
    build_mesh = zero_tp.build_mesh

    def recording(*a, **kw):
        meshes.append(build_mesh(*a, **kw))
        return meshes[-1]

    zero_tp.build_mesh = recording
    try:
        out, engines = _recording_engines(zero_tp._rank_runs)
    finally:
        zero_tp.build_mesh = build_mesh
    (mesh,) = meshes
    return out, engines, (mesh.tp_comm.solo, mesh.tp_comm.report())


def test_the_gpt_with_tp_layers_at_world_1_issues_every_collective_and_matches(monkeypatch):
    monkeypatch.setenv(FORCE_COLLECTIVES_ENV, "1")
    cfg = zero_tp.GPTConfig.from_yaml(zero_tp.CONFIG)
    ref_losses, ref_norms, _, ref_weights = zero_tp._reference(cfg)
    (out, engines, (tp_solo, tp_report)), = run_local(_tp_runs, 1, timeout_s=240)
    assert not tp_solo and tp_report["all_reduce_calls"] > 0, tp_report  # the TP layers' forward and backward
    assert [solo for solo, _, _ in engines] == [False] * len(zero_tp.STAGES)
    for stage, (_, report, engine_tp) in zip(zero_tp.STAGES, engines):
        assert engine_tp["all_gather_calls"] > 0, (stage, engine_tp)  # full_state_dict's TP slices
        assert report["reduce_scatter_calls"] + report["all_reduce_calls"] > zero_tp.STEPS, (stage, report)
        assert stage == 0 or report["all_gather_calls"] > 0, (stage, report)
        res = out[(1, 1, stage)]
        assert zero_tp._rel(res["losses"], ref_losses) < 1e-5, (stage, res["losses"], ref_losses)
        assert zero_tp._rel(res["norms"], ref_norms) < 1e-5, (stage, res["norms"], ref_norms)
        for name, ref in ref_weights.items():
            assert zero_tp._rel(res["weights"][name], ref) < 1e-5, (stage, name)


def _solo_without_the_switch():
    return Comm(None).solo, Comm(None).report()["total_calls"]


def test_the_switch_is_off_by_default_and_a_bad_value_is_one_sentence(monkeypatch):
    monkeypatch.delenv(FORCE_COLLECTIVES_ENV, raising=False)
    assert run_local(_solo_without_the_switch, 1) == [(True, 0)]
    monkeypatch.setenv(FORCE_COLLECTIVES_ENV, "yes")
    with pytest.raises(ConfigError, match="HYBRID_FORCE_COLLECTIVES is 'yes'; set it to 1"):
        collectives_forced()
    monkeypatch.setenv(FORCE_COLLECTIVES_ENV, "0")
    assert not collectives_forced()
    assert Comm(None).solo  # no process group: nothing to communicate with, whatever the switch says
    monkeypatch.setenv(FORCE_COLLECTIVES_ENV, "1")
    assert Comm(None).solo and torch.distributed.is_initialized() is False
