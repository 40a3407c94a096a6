"""hybrid.planner follows every row of the seed's stage-selection guide, including offload and the error row."""

import re

import pytest

from hybrid.errors import ConfigError, PlanError
from hybrid.planner import (
    ROW_OFFLOAD,
    ROW_STAGE1,
    ROW_STAGE2,
    ROW_STAGE3,
    ROW_STANDARD_DP,
    choose_stage,
)

GB = 10**9
B13 = 13 * 10**9


def test_seed_13b_on_8_gpus_of_80_gb():
    # The seed's worked example: fits on 80 GB? No / Yes (tight) / Yes / Yes.
    for headroom in (0.0, 0.1):
        plan = choose_stage(B13, 8, 1, 80 * GB, headroom=headroom)
        assert plan.fits == {0: False, 1: True, 2: True, 3: True}
        assert (plan.stage, plan.offload) == (1, False)
        assert plan.reason.startswith(ROW_STAGE1)
    assert plan.stages[1].total == 71.5 * GB and plan.usable_bytes == 72 * GB


def test_dp_1_gives_stage_0():
    plan = choose_stage(10**9, 1, 1, 80 * GB)
    assert (plan.stage, plan.offload) == (0, False)
    assert plan.reason.startswith(ROW_STANDARD_DP) and "DP degree is 1" in plan.reason


def test_fits_with_standard_dp_gives_stage_1():
    plan = choose_stage(10**9, 8, 1, 80 * GB)  # 16 GB at stage 0
    assert plan.fits[0] and (plan.stage, plan.offload) == (1, False)
    assert plan.reason.startswith(ROW_STANDARD_DP)


def test_still_oom_with_sharded_optimizer_gives_stage_2():
    plan = choose_stage(B13, 8, 1, 64 * GB, headroom=0)  # 71.5 > 64 >= 48.75
    assert plan.fits == {0: False, 1: False, 2: True, 3: True}
    assert (plan.stage, plan.offload) == (2, False) and plan.reason.startswith(ROW_STAGE2)


def test_not_even_with_sharded_optimizer_and_grads_gives_stage_3():
    plan = choose_stage(B13, 8, 1, 40 * GB, headroom=0)  # 48.75 > 40 >= 26
    assert plan.fits == {0: False, 1: False, 2: False, 3: True}
    assert (plan.stage, plan.offload) == (3, False) and plan.reason.startswith(ROW_STAGE3)


def test_too_large_for_zero3_gives_offload():
    plan = choose_stage(B13, 8, 1, 20 * GB, headroom=0)  # 26 > 20; params + grads = 6.5 fit
    assert not any(plan.fits.values())
    assert (plan.stage, plan.offload) == (3, True) and plan.reason.startswith(ROW_OFFLOAD)
    assert plan.per_gpu_bytes == 6.5 * GB


def test_nothing_fits_names_smallest_gpu_count():
    with pytest.raises(PlanError) as err:
        choose_stage(B13, 8, 1, 5 * GB, headroom=0)
    # Offload needs 4 bytes/param on the GPU: 52 GB / 5 GB -> 11 GPUs; plain ZeRO-3 16·13/5 -> 42 GPUs.
    message = str(err.value)
    assert "at least 11 GPUs" in message and "42 without offload" in message
    assert choose_stage(B13, 11, 1, 5 * GB, headroom=0).offload
    with pytest.raises(PlanError):
        choose_stage(B13, 10, 1, 5 * GB, headroom=0)
    assert choose_stage(B13, 42, 1, 5 * GB, headroom=0).stage == 3
    assert not choose_stage(B13, 42, 1, 5 * GB, headroom=0).offload


def test_smallest_gpu_count_is_a_multiple_of_tp():
    with pytest.raises(PlanError) as err:
        choose_stage(B13, 2, 4, 5 * GB, headroom=0)
    count = int(re.search(r"at least (\d+) GPUs", str(err.value)).group(1))
    assert count % 4 == 0
    choose_stage(B13, count // 4, 4, 5 * GB, headroom=0)
    with pytest.raises(PlanError):
        choose_stage(B13, count // 4 - 1, 4, 5 * GB, headroom=0)


def test_activations_count_against_memory():
    # 1B: stage 0 is 16 GB, stage 1 5.5 GB; 60 GB of activations leave only stage 1+ inside 72 GB.
    plan = choose_stage(10**9, 8, 1, 80 * GB, activation_bytes=60 * GB)
    assert plan.fits[0] is False and plan.stage == 1 and plan.reason.startswith(ROW_STAGE1)
    with pytest.raises(PlanError, match="activations alone"):
        choose_stage(10**9, 8, 1, 80 * GB, activation_bytes=75 * GB)


def test_fit_boundary_is_exact():
    assert choose_stage(B13, 8, 1, 71.5 * GB, headroom=0).fits[1]
    assert not choose_stage(B13, 8, 1, 71.5 * GB - 1, headroom=0).fits[1]
    # 4.5B at DP 1 is 72 GB: exactly 80 GB less 10%, which a binary 0.9 would miss.
    plan = choose_stage(4_500_000_000, 1, 1, 80 * GB, headroom=0.1)
    assert plan.fits[0] and plan.stage == 0


def test_forced_stage_overrides_and_warns():
    plan = choose_stage(B13, 8, 1, 80 * GB, forced_stage=0)
    assert (plan.stage, plan.offload) == (0, False)
    assert "does not fit" in plan.reason and plan.fits[0] is False
    plan = choose_stage(B13, 8, 1, 80 * GB, forced_stage=3)
    assert plan.stage == 3 and "does not fit" not in plan.reason


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(dp=0),
        dict(tp=0),
        dict(gpu_memory_bytes=0),
        dict(headroom=1.0),
        dict(headroom=-0.1),
        dict(activation_bytes=-1.0),
        dict(forced_stage=4),
        dict(precision="fp8"),
        dict(params=0),
    ],
)
def test_bad_inputs_raise_config_error(kwargs):
    args = dict(params=B13, dp=8, tp=1, gpu_memory_bytes=80 * GB) | kwargs
    with pytest.raises(ConfigError):
        choose_stage(**args)
