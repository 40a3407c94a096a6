"""hybrid.plan.memory reproduces every number of the seed's tables exactly; its formulas hold for any Ψ, N, t."""

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybrid.errors import ConfigError
from hybrid.plan.memory import activation_bytes, all_stages, model_state_bytes, parse_count

GB = 10**9


def _table(params, dp, tp=1, precision="bf16"):
    """{stage: (params, grads, optimizer, total)} in GB, compared exactly."""
    return {
        stage: tuple(Fraction(x) / GB for x in (m.params, m.grads, m.optimizer, m.total))
        for stage, m in all_stages(params, dp, tp, precision).items()
    }


def _f(*values):
    return tuple(Fraction(str(v)) for v in values)


def test_seed_7b_on_8_gpus():
    table = _table(7 * 10**9, 8)
    # Section 1: the redundancy table (standard DP, per GPU) and its 8-GPU aggregate.
    assert table[0] == _f(14, 14, 84, 112)
    assert table[0][3] * 8 == 896 and table[0][3] * 8 - table[0][3] == 784
    # Sections 2-4: ZeRO-1, ZeRO-2, ZeRO-3.
    assert table[1] == _f(14, 14, 10.5, 38.5)
    assert table[2] == _f(14, 1.75, 10.5, 26.25)
    assert table[3] == _f(1.75, 1.75, 10.5, 14)


def test_seed_13b_on_8_gpus():
    table = _table(13 * 10**9, 8)
    assert table[0] == _f(26, 26, 156, 208)
    assert table[1] == _f(26, 26, 19.5, 71.5)
    assert table[2] == _f(26, 3.25, 19.5, 48.75)
    assert table[3] == _f(3.25, 3.25, 19.5, 26)


def test_seed_self_check_13b_on_16_gpus():
    table = _table(13 * 10**9, 16)
    assert table[0] == _f(26, 26, 156, 208)
    assert table[1] == _f(26, 26, 9.75, 61.75)
    assert table[2] == _f(26, 1.625, 9.75, 37.375)
    assert table[3] == _f(1.625, 1.625, 9.75, 13)


def test_seed_numbers_are_plain_ints_and_floats():
    stage2 = model_state_bytes(7 * 10**9, 8, 2)
    assert stage2.total == 26_250_000_000 and type(stage2.total) is int
    assert stage2.total / GB == 26.25
    odd = model_state_bytes(7, 3, 3)  # 16·7/3 bytes: not whole, so the correctly rounded float
    assert isinstance(odd.total, float) and odd.total == float(Fraction(112, 3))


def test_fp32_is_4_4_8_bytes_per_param():
    table = _table(7 * 10**9, 8, precision="fp32")
    assert table[0] == _f(28, 28, 56, 112)
    assert table[1] == _f(28, 28, 7, 63)
    assert table[2] == _f(28, 3.5, 7, 38.5)
    assert table[3] == _f(3.5, 3.5, 7, 14)


def test_tensor_parallel_divides_before_zero():
    # 13B with TP 2 and DP 8: each GPU starts from 6.5B parameters.
    table = _table(13 * 10**9, 8, tp=2)
    assert table[0] == _f(13, 13, 78, 104)
    assert table[3] == _f(1.625, 1.625, 9.75, 13)


psi = st.integers(min_value=1, max_value=10**13)
dp = st.integers(min_value=1, max_value=4096)
tp = st.integers(min_value=1, max_value=64)
precision = st.sampled_from(["bf16", "fp32"])


@given(psi, dp, tp, precision)
def test_totals_never_increase_with_stage(params, n, t, prec):
    totals = [Fraction(m.total) for m in all_stages(params, n, t, prec).values()]
    assert totals == sorted(totals, reverse=True)


@given(psi, dp, tp)
def test_summary_table_formulas(params, n, t):
    # The seed's summary, per GPU with Ψ/t parameters: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N (bf16).
    local = Fraction(params, t)
    expected = [16 * local, 4 * local + 12 * local / n, 2 * local + 14 * local / n, 16 * local / n]
    stages = all_stages(params, n, t)
    for stage, want in enumerate(expected):
        assert stages[stage].total == pytest.approx(float(want), rel=1e-15)


@given(st.integers(min_value=1, max_value=10**9), dp, tp, precision)
def test_stage3_is_stage0_over_n_and_tp_divides_exactly(k, n, t, prec):
    params = k * n * t  # whole bytes everywhere, so the identities hold to the byte
    stages = all_stages(params, n, t, prec)
    no_tp = all_stages(params, n, 1, prec)
    assert stages[3].total * n == stages[0].total
    for stage in range(4):
        m = stages[stage]
        assert m.total == m.params + m.grads + m.optimizer
        assert (m.params * t, m.grads * t, m.optimizer * t) == (
            no_tp[stage].params,
            no_tp[stage].grads,
            no_tp[stage].optimizer,
        )


@given(psi, dp, tp, precision)
def test_stage3_is_stage0_over_n_for_any_count(params, n, t, prec):
    stages = all_stages(params, n, t, prec)
    assert stages[3].total == pytest.approx(stages[0].total / n, rel=1e-15)


def test_dp_1_makes_every_stage_equal():
    stages = all_stages(13 * 10**9, 1)
    assert len({stages[s] for s in range(4)}) == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(params=0, dp=8, stage=0),
        dict(params=10, dp=0, stage=0),
        dict(params=10, dp=8, stage=4),
        dict(params=10, dp=8, stage=0, tp=0),
        dict(params=10, dp=8, stage=0, precision="fp8"),
        dict(params=10.5, dp=8, stage=0),
    ],
)
def test_bad_model_state_inputs_raise_config_error(kwargs):
    with pytest.raises(ConfigError):
        model_state_bytes(**kwargs)


def test_activations_korthikanti_without_tp():
    s, b, h, a, layers = 2048, 4, 4096, 32, 2
    expected = s * b * h * (34 + Fraction(5 * a * s, h)) * layers
    assert activation_bytes(s, b, h, a, layers) == float(expected)
    assert activation_bytes(s, b, h, a, layers) == 2048 * 4 * 4096 * (34 + 80) * 2


def test_activations_with_tp_and_checkpointing():
    s, b, h, a, layers = 2048, 1, 5120, 40, 40
    # t = 2: 10 + 24/2 + 5·40·2048/(5120·2) = 22 + 40 = 62 bytes per s·b·h.
    assert activation_bytes(s, b, h, a, layers, tp=2) == s * b * h * 62 * layers
    # t = 1 through the TP formula is the no-TP formula.
    assert activation_bytes(s, b, h, a, layers, tp=1) == s * b * h * (34 + 5 * a * s / h) * layers
    assert activation_bytes(s, b, h, a, layers, tp=8, checkpointing=True) == 2 * s * b * h * layers
    # TP never increases activations; checkpointing keeps far less.
    assert activation_bytes(s, b, h, a, layers, tp=8) < activation_bytes(s, b, h, a, layers, tp=2)
    assert activation_bytes(s, b, h, a, layers, checkpointing=True) < activation_bytes(s, b, h, a, layers)


def test_activations_reject_bad_shapes():
    with pytest.raises(ConfigError, match="heads"):
        activation_bytes(128, 1, 256, 6, 2, tp=4)
    with pytest.raises(ConfigError, match="seq"):
        activation_bytes(0, 1, 256, 4, 2)


@pytest.mark.parametrize(
    "text, count",
    [
        ("7B", 7_000_000_000),
        ("13e9", 13_000_000_000),
        ("350M", 350_000_000),
        ("1.3B", 1_300_000_000),
        ("7b", 7_000_000_000),
        ("125K", 125_000),
        ("1T", 10**12),
        ("7000000000", 7_000_000_000),
        ("7_000_000", 7_000_000),
        (" 2.5 B ", 2_500_000_000),
        (42, 42),
    ],
)
def test_parse_count(text, count):
    assert parse_count(text) == count


@pytest.mark.parametrize("text", ["", "B", "seven", "-7B", "0", "0.5", "1.5e0", "7X", "nan", "inf", True])
def test_parse_count_rejects(text):
    with pytest.raises(ConfigError, match="params"):
        parse_count(text)
