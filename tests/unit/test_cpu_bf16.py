"""The bf16-on-a-slow-CPU warning: measured once, shown by the engine on the first rank, never for fp32 or a GPU."""

import logging

import pytest
import torch

import hybrid
from hybrid.plan import cpu_bf16
from tests.dist.zero_models import ParityNet, config


def test_the_slowdown_is_a_positive_ratio_measured_once():
    first = cpu_bf16.bf16_matmul_slowdown()
    assert first > 0
    assert cpu_bf16.bf16_matmul_slowdown() == first  # cached: one measurement per process


@pytest.mark.parametrize("slowdown, warned", [(1.2, False), (9.9, False), (10.0, True), (150.0, True)])
def test_the_note_names_the_slowdown_and_the_fp32_fix_only_past_the_factor(monkeypatch, slowdown, warned):
    monkeypatch.setattr(cpu_bf16, "bf16_matmul_slowdown", lambda: slowdown)
    note = cpu_bf16.slow_bf16_note("cpu")
    assert (note is not None) == warned
    if warned:
        assert f"{slowdown:.0f}x" in note and "parallel.precision: fp32" in note


def test_no_note_for_devices_other_than_the_cpu(monkeypatch):
    monkeypatch.setattr(cpu_bf16, "bf16_matmul_slowdown", lambda: 150.0)
    assert cpu_bf16.slow_bf16_note(torch.device("cuda", 0)) is None
    assert cpu_bf16.slow_bf16_note("meta") is None


@pytest.mark.parametrize("precision, slowdown", [("fp32", 150.0), ("bf16", 150.0), ("bf16", 1.5)])
def test_the_engine_warns_for_bf16_on_a_cpu_without_native_bf16_only(monkeypatch, caplog, precision, slowdown):
    monkeypatch.setattr(cpu_bf16, "bf16_matmul_slowdown", lambda: slowdown)
    with caplog.at_level(logging.WARNING, logger="hybrid.zero.engine"):
        hybrid.initialize(ParityNet(), config(1, precision=precision))
    warned = [r.getMessage() for r in caplog.records if "without native bf16 matmul" in r.getMessage()]
    assert len(warned) == (precision == "bf16" and slowdown >= cpu_bf16.SLOW_FACTOR)
