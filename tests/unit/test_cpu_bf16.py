"""The bf16-on-a-slow-CPU warning: measured once (the best bf16 matmul time over the best fp32 one, on one thread,
timed by a scripted clock here), shown by the engine on the first rank, never for fp32 or a GPU."""

import logging

import pytest
import torch

import hybrid
from hybrid.plan import cpu_bf16
from tests.dist.zero_models import ParityNet, config


class ScriptedClock:
    """``time`` for ``cpu_bf16``: the timed matmuls last ``durations`` seconds in turn (fp32's, then bf16's),
    and the torch thread count is noted at every reading."""

    def __init__(self, durations):
        self.durations, self.now, self.started, self.threads = list(durations), 0.0, False, []

    def perf_counter(self) -> float:
        self.threads.append(torch.get_num_threads())
        if self.started:
            self.now += self.durations.pop(0)
        self.started = not self.started
        return self.now


@pytest.fixture
def measure(monkeypatch):
    """Measure afresh (the cache cleared before and after) with a ``ScriptedClock`` of the given durations."""
    cpu_bf16.bf16_matmul_slowdown.cache_clear()

    def run(durations):
        clock = ScriptedClock(durations)
        monkeypatch.setattr(cpu_bf16, "time", clock)
        return cpu_bf16.bf16_matmul_slowdown(), clock

    yield run
    cpu_bf16.bf16_matmul_slowdown.cache_clear()


def test_the_slowdown_is_the_best_bf16_time_over_the_best_fp32_time_on_one_thread(measure):
    threads = torch.get_num_threads()
    ratio, clock = measure([0.004, 0.002, 0.003,   # fp32: best 2 ms
                            0.5, 0.3, 0.4])        # bf16: best 300 ms
    assert ratio == pytest.approx(0.3 / 0.002) and clock.durations == []  # every repeat timed, best of each
    assert set(clock.threads) == {1} and torch.get_num_threads() == threads  # one thread, then restored


def test_a_zero_fp32_time_is_no_division_by_zero(measure):
    ratio, _ = measure([0.0, 0.0, 0.0, 0.001, 0.001, 0.001])
    assert ratio == pytest.approx(0.001 / 1e-9)


def test_the_thread_count_is_restored_when_the_measurement_fails(measure):
    threads = torch.get_num_threads()
    with pytest.raises(IndexError):
        measure([0.001])  # the clock runs out at the second timed matmul
    assert torch.get_num_threads() == threads


def test_one_measurement_per_process(measure, monkeypatch):
    first, _ = measure([0.001] * 3 + [0.02] * 3)
    monkeypatch.setattr(cpu_bf16, "time", None)  # a second measurement would fail
    assert cpu_bf16.bf16_matmul_slowdown() == first == pytest.approx(20.0)


@pytest.mark.parametrize("ratio, note", [(9.9375, None), (10.0, "10x"), (75.0, "75x")])
def test_the_note_follows_the_measured_ratio(measure, ratio, note):
    measure([0.0625] * 3 + [0.0625 * ratio] * 3)  # binary fractions: the measured ratio is exactly ``ratio``
    text = cpu_bf16.slow_bf16_note("cpu")
    assert (text is None) == (note is None)
    if note:
        assert f"takes {note} as long as fp32 here" in text and "parallel.precision: fp32" in text


def test_the_real_measurement_on_this_cpu_is_a_finite_positive_ratio():
    ratio = cpu_bf16.bf16_matmul_slowdown()
    assert isinstance(ratio, float) and 0 < ratio < float("inf")


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
