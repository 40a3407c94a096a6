"""hybrid.plan.planner follows every row of the seed's stage-selection guide, including offload and the error row."""

import re

import pytest

from hybrid.errors import ConfigError, PlanError
from hybrid.plan.planner import (
    ROW_AC,
    ROW_OFFLOAD,
    ROW_OFFLOAD_AC,
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
    assert "use at least 11 GPUs with the optimizer offloaded or at least 42 GPUs without, or GPUs" in message
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


# --- the levers: activation checkpointing, then offload (+AC), and the host memory -------------------------
# 1B parameters in bf16 on 8 GPUs of 10 GB (no headroom): stage 3 holds 2 GB of model states, 0.5 GB of them
# on the GPU with the optimizer offloaded (1.75 GB per rank on the host: 12Ψ/N of optimizer states and the
# 2Ψ/N gradient copy the host steps from).
B1 = 10**9


def lever_plan(full, checkpointed, **kwargs):
    return choose_stage(B1, 8, 1, 10 * GB, headroom=0, activation_bytes=full * GB,
                        checkpointed_activation_bytes=None if checkpointed is None else checkpointed * GB, **kwargs)


def test_activation_checkpointing_comes_after_plain_zero3():
    plan = lever_plan(9, 1)  # stage 3 needs 11 GB, with checkpointing 3 GB
    assert (plan.stage, plan.activation_checkpointing, plan.offload) == (3, True, False)
    assert plan.reason == (f"{ROW_AC}: stage 3 needs 11 GB, 3 GB with activation checkpointing, of 10 GB usable "
                           "per GPU")
    assert plan.per_gpu_bytes == 3 * GB and plan.chosen_activation_bytes == 1 * GB
    assert [o.label for o in plan.options] == ["0", "1", "2", "3", "3 + AC"]
    # the cheaper rows still win when they fit: with 7 GB of activations stage 3 fits without recompute
    assert not lever_plan(7, 1).activation_checkpointing


def test_offload_when_checkpointing_is_off_or_not_enough():
    plan = lever_plan(9, 1, activation_checkpointing=False)  # offloaded: 0.5 GB + 9 GB
    assert (plan.stage, plan.activation_checkpointing, plan.offload) == (3, False, True)
    assert plan.reason == (f"{ROW_OFFLOAD}: stage 3 needs 11 GB, 9.5 GB with the optimizer on CPU, of 10 GB usable "
                           "per GPU; host memory not checked (unknown): the optimizer states and gradients need 1.75 GB "
                           "per rank x 1 = 1.75 GB per node")
    assert plan.per_gpu_bytes == 9.5 * GB and plan.host_bytes == 1.75 * GB


def test_offload_with_checkpointing_is_the_last_row():
    # 3 + AC needs 2 + 8.5 GB, offload alone 0.5 + 20 GB, offload + AC 0.5 + 8.5 = 9 GB
    plan = lever_plan(20, 8.5, host_memory_bytes=64 * GB, ranks_per_node=8)
    assert (plan.stage, plan.activation_checkpointing, plan.offload) == (3, True, True)
    assert plan.reason == (f"{ROW_OFFLOAD_AC}: stage 3 needs 22 GB, 9 GB with the optimizer on CPU and "
                           "activation checkpointing, of 10 GB usable per GPU; host: 1.75 GB per rank x 8 = 14 GB of "
                           "64 GB usable per node")
    assert [o.label for o in plan.options] == ["0", "1", "2", "3", "3 + AC", "3 + offload", "3 + offload + AC"]
    assert plan.per_gpu_bytes == 9 * GB and plan.host_bytes_per_node == 14 * GB


def test_host_memory_too_small_for_the_offloaded_states_is_said():
    with pytest.raises(PlanError) as err:
        lever_plan(9, None, host_memory_bytes=10 * GB, ranks_per_node=8, offload=True)
    assert str(err.value) == (
        "1,000,000,000 parameters fit on the GPUs only with the optimizer states offloaded to CPU (ZeRO-3 + "
        "offload), but a node's 8 ranks need 1.75 GB each = 14 GB of host memory and a node has 10 GB usable: use "
        "at least 2 nodes (16 GPUs), as more DP ranks shard the states further, or nodes with more host memory "
        "(cluster.host_memory_gb).")
    # at the GPU count it names, the host memory holds them (12 DP ranks would, but a cluster has whole nodes)
    plan = choose_stage(B1, 16, 1, 10 * GB, headroom=0, activation_bytes=9 * GB, host_memory_bytes=10 * GB,
                        ranks_per_node=8, offload=True)
    assert plan.offload and "host: 875 MB per rank x 8 = 7 GB of 10 GB usable per node" in plan.reason
    # with offload on auto, plain ZeRO-3 on as many GPUs is the cheaper way, and the sentence says so
    with pytest.raises(PlanError, match=r"use at least 2 nodes \(16 GPUs\), where ZeRO-3 fits without offload, or"):
        lever_plan(9, None, host_memory_bytes=10 * GB, ranks_per_node=8)


def test_offload_off_ends_in_an_error_that_says_so():
    with pytest.raises(PlanError, match=r"even with ZeRO-3 with activation checkpointing, and offload is off "
                                        r"\(parallel.offload: false\): use at least"):
        lever_plan(20, 8.5, offload=False)


def test_offload_forced_on_takes_the_lowest_stage_that_fits_with_it():
    plan = lever_plan(0, None, offload=True)  # stage 1 with offload: 2 + 2 GB on the GPU
    assert (plan.stage, plan.offload) == (1, True) and "as requested (parallel.offload: true)" in plan.reason
    assert plan.per_gpu_bytes == 4 * GB and plan.host_bytes == 1.75 * GB


def test_checkpointing_forced_on_counts_the_checkpointed_activations_everywhere():
    plan = lever_plan(9, 1, activation_checkpointing=True)  # stage 0 fits with 16 + 1? no; stage 1: 6.5 GB
    assert (plan.stage, plan.activation_checkpointing) == (1, True)
    assert plan.reason.startswith(f"{ROW_STAGE1} with activation checkpointing: stage 0 needs 17 GB, stage 1 6.5 GB")


def test_a_forced_stage_uses_the_levers_left_on_auto():
    plan = lever_plan(9, 1, forced_stage=3)
    assert (plan.stage, plan.activation_checkpointing, plan.offload) == (3, True, False)
    assert plan.reason == "stage 3 as requested with activation checkpointing: needs 3 GB of 10 GB usable per GPU"
    plan = lever_plan(7, 1, forced_stage=2, activation_checkpointing=False)  # 3.75 + 7 GB; offloaded 2.25 + 7
    assert (plan.stage, plan.offload) == (2, True) and "with the optimizer offloaded to CPU" in plan.reason
    plan = lever_plan(9, 1, forced_stage=0)  # neither lever applies to stage 0 beyond checkpointing: 17 GB
    assert plan.stage == 0 and not plan.offload and "but it does not fit" in plan.reason


def test_offload_with_stage_0_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="offload is true but zero stage is 0: offloading moves each rank's shard "
                                          "of the optimizer states to the host, and stage 0 shards nothing"):
        lever_plan(0, None, offload=True, forced_stage=0)
    with pytest.raises(ConfigError, match="activation_checkpointing must be auto, true or false"):
        lever_plan(0, None, activation_checkpointing="yes")


def test_offload_bytes_are_the_issues_formula():
    from hybrid.plan.memory import offload_bytes

    split = offload_bytes(B13, 8, 3, precision="bf16")  # 2Ψ/N + 2Ψ/N on the GPU, 12Ψ/N + 2Ψ/N on the host
    assert (split.device, split.host) == (6.5 * GB, 22.75 * GB)
    split = offload_bytes(B13, 8, 1, tp=2, precision="fp32")  # fp32: 4Ψ/t + 4Ψ/t kept, master + moments moved
    assert (split.device, split.host) == (52 * GB, 13 * GB)  # 12Ψ/(tN) + the 4Ψ/(tN) fp32 gradient copy
    with pytest.raises(ConfigError, match="offload needs ZeRO stage 1, 2 or 3"):
        offload_bytes(B13, 8, 0)


# --- the GPU count a PlanError names is a whole number of nodes, in one formatter -------------------------
B100 = 100 * 10**9  # QA's /tmp/qa-cli/u.yaml: 100B on one node of 8 GPUs of 80 GB (72 GB usable), tp 1


def no_fit(**kwargs) -> str:
    with pytest.raises(PlanError) as err:
        choose_stage(**(dict(params=B100, dp=8, tp=1, gpu_memory_bytes=80 * GB) | kwargs))
    return str(err.value)


def test_suggested_gpu_count_is_whole_nodes():
    # ZeRO-3 needs 16 B x 100B / 72 GB = 22.2 -> 23 ranks; nodes of 8 make it 24 (it said "23 GPUs")
    message = no_fit(offload=False, ranks_per_node=8)
    assert "use at least 3 nodes (24 GPUs), GPUs with more memory, or allow offload (auto)." in message
    assert choose_stage(B100, 24, 1, 80 * GB, offload=False, ranks_per_node=8).stage == 3
    with pytest.raises(PlanError):
        choose_stage(B100, 16, 1, 80 * GB, offload=False, ranks_per_node=8)
    # without a node size (one rank per node) the count is the exact GPU count
    assert "use at least 23 GPUs, GPUs" in no_fit(offload=False)


def test_a_node_size_not_known_is_said_in_gpus_but_still_rounds_to_the_tp_group():
    message = no_fit(dp=1, tp=8, offload=False, ranks_per_node=8, node_size_known=False)
    assert "use at least 24 GPUs, GPUs" in message and "node" not in message


def test_whole_nodes_hold_whole_tp_groups():
    # 80B at tp 4: 16 B x 80B / 4 / 72 GB -> DP 5, 20 GPUs; nodes of 6 hold TP groups of 4 only as 12-GPU
    # blocks, so 24 GPUs (4 nodes, DP 6)
    message = no_fit(params=80 * 10**9, dp=1, tp=4, offload=False, ranks_per_node=6)
    assert "use at least 4 nodes (24 GPUs), GPUs" in message
    assert choose_stage(80 * 10**9, 6, 4, 80 * GB, offload=False, ranks_per_node=6).stage == 3


def test_too_little_host_memory_names_whole_nodes():
    # QA's /tmp/qa-cli/u2.yaml: 100 GB of host memory per node; offload needs 175 GB per rank at 8 ranks
    forced = no_fit(offload=True, ranks_per_node=8, host_memory_bytes=100 * GB)
    # a node's host: 14 B x 100B / (dp) x 8 <= 90 GB -> dp >= 124.4 -> 125 -> 128 = 16 nodes (it said 125 GPUs)
    assert "use at least 16 nodes (128 GPUs), as more DP ranks shard the states further, or nodes" in forced
    assert choose_stage(B100, 128, 1, 80 * GB, offload=True, ranks_per_node=8, host_memory_bytes=100 * GB).offload
    with pytest.raises(PlanError):
        choose_stage(B100, 120, 1, 80 * GB, offload=True, ranks_per_node=8, host_memory_bytes=100 * GB)
    # on auto, 3 nodes run plain ZeRO-3, far fewer than offload needs
    auto = no_fit(ranks_per_node=8, host_memory_bytes=100 * GB)
    assert "use at least 3 nodes (24 GPUs), where ZeRO-3 fits without offload, or nodes" in auto


def test_the_offload_count_also_fits_the_host_memory_when_it_is_known():
    # offload alone needs 4 B x 100B / 72 GB -> 6 ranks on the GPU; a node's host of 100 GB holds 8 ranks'
    # 14 B x 100B / dp only from dp 125 on, i.e. 16 nodes
    message = no_fit(dp=1, ranks_per_node=8, host_memory_bytes=100 * GB)
    assert "use at least 16 nodes (128 GPUs) with the optimizer offloaded or at least 3 nodes (24 GPUs) " \
           "without, or" in message, message
    assert "use at least 1 node (8 GPUs) with the optimizer offloaded" in no_fit(dp=1, ranks_per_node=8)


def test_counts_read_as_numbers():
    from hybrid.plan.planner import MAX_GPUS, quantity

    assert [quantity(n, "GPU") for n in (1, 2, 24, MAX_GPUS)] == ["1 GPU", "2 GPUs", "24 GPUs", "10,000,000 GPUs"]
    assert quantity(1, "parameter") == "1 parameter"
    assert "on 1 GPU (tp=1" in no_fit(dp=1, offload=False)
    message = no_fit(params=10**18, dp=1, gpu_memory_bytes=GB)
    assert message.endswith("use more than 10,000,000 GPUs, or GPUs with more memory.")


@pytest.mark.parametrize("kwargs", [
    dict(offload=False),
    dict(dp=1),
    dict(activation_bytes=79 * GB),
    dict(ranks_per_node=8, host_memory_bytes=100 * GB),
    dict(ranks_per_node=8, host_memory_bytes=100 * GB, offload=True),
])
def test_every_plan_error_is_one_sentence_with_its_period(kwargs):
    message = no_fit(**kwargs)
    assert message.endswith(".") and "\n" not in message and message.count(". ") == 0, message
