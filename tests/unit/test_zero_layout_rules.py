"""The rules the engine and the memory model share: the stage policy's derived facts (the one table), the pure
layout arithmetic of ``hybrid.plan.layout`` (no torch at import), and what ZeRO reads of tensor parallelism
(``hybrid.zero.tp_interface``, satisfied by ``hybrid.tp``'s layers)."""

import subprocess
import sys

import pytest
import torch
from torch import nn

from hybrid.comm.collectives import Comm
from hybrid.config.stage_policy import policy_for
from hybrid.config.training import ZeroConfig
from hybrid.config.validate import STAGES
from hybrid.plan import layout
from hybrid.plan.memory import unit_layout
from hybrid.tp.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from hybrid.weights.attrs import gather_tp_tensor
from hybrid.zero.tp_interface import SplitOverTP, split_over_tp


def test_the_planner_the_memory_model_and_the_layout_import_no_torch():
    code = ("import sys, hybrid.plan.layout, hybrid.plan.memory, hybrid.plan.planner; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('hybrid.zero', 'hybrid.comm'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# stage -> (n_shards on 4 ranks, norm_over_dp, grads_all_reduced, bucket_buffers, kept_gathered), as documented
DERIVED = {0: (1, False, True, False, "all"), 1: (4, True, False, False, "all"),
           2: (4, True, False, True, "all"), 3: (4, True, False, True, "persistent")}


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_derives_the_facts_of_its_row(stage):
    p = policy_for(stage)
    assert (p.n_shards(4), p.norm_over_dp, p.grads_all_reduced, p.bucket_buffers, p.kept_gathered) == DERIVED[stage]


def test_buckets_are_kept_only_where_gradients_go_through_buckets():
    units = [3, 1 << 21, 5, layout.KEEP_BUCKET_NUMEL]
    kept = {stage: layout.kept_bucket_numel(units, stage) for stage in STAGES}
    assert kept == {0: 0, 1: 0, 2: 3 + 5 + (1 << 21), 3: 3 + 5 + (1 << 21)}  # smallest first, within the cap


def test_the_exchange_keeps_buffers_for_all_reduced_gradients_only_from_its_threshold():
    small, large = 1000, layout.EXCHANGE_MIN_NUMEL
    for stage in STAGES:
        all_reduced = policy_for(stage).grads_all_reduced
        assert layout.exchange_numel([small], 2, stage) == (0 if all_reduced else small // 2)
        assert layout.exchange_numel([large], 2, stage) == layout.exchange_cap_numel(2)  # capped


def test_the_optimizer_batch_is_capped_only_for_gradients_converted_to_fp32():
    assert layout.batch_numel(10**9, grad_is_fp32=True) == 10**9
    assert layout.batch_numel(10**9, grad_is_fp32=False) == layout.CONVERT_NUMEL
    assert layout.batch_numel(100, grad_is_fp32=False) == 100


def test_alignment_is_16_bytes_in_elements_of_the_dtype():
    assert [layout.align_elements(n) for n in (1, 2, 4, 8, 32)] == [16, 8, 4, 2, 1]


@pytest.mark.parametrize("stage", STAGES)
def test_the_stage_layout_cuts_the_stages_units_into_its_shards(stage):
    numels, unit_params = [50, 7, 300, 2], [[0, 1], [2, 3]]
    built, order, persistent = layout.stage_layout(numels, unit_params, policy_for(stage), 4, 4, 100, 5)
    assert built.n_shards == policy_for(stage).n_shards(4) and built.param_numel == sum(numels)
    if policy_for(stage).module_units:  # parameters under the threshold (5) pooled in one persistent unit
        assert [[s.param for s in u.slots] for u in built.units] == [[0, 1], [2], [3]] and persistent == {2}
    else:  # buckets of at most 100 aligned elements over the parameters in reverse
        assert [[s.param for s in u.slots] for u in built.units] == [[3], [2], [1, 0]] and persistent == set()
    assert sorted(order) == list(range(len(built.units)))


def test_the_memory_models_layout_defaults_are_zero_configs():
    numels = [[120_000, 40], [90_000]]
    assert unit_layout(numels, 3, 2) == unit_layout(numels, 3, 2, "bf16", ZeroConfig().reduce_bucket_size,
                                                    ZeroConfig().param_persistence_threshold)


def test_tp_layers_are_modules_split_over_tp_and_a_model_holding_them_is_not():
    model = nn.Sequential(ColumnParallelLinear(4, 6, tp_comm=None), RowParallelLinear(6, 4, tp_comm=None),
                          VocabParallelEmbedding(10, 4, tp_comm=None), nn.Linear(4, 4))
    model.tp, model.tp_comm = 1, None  # as a model keeps them to pass down to its layers (hybrid's GPT does)
    assert [name for name, _ in split_over_tp(model)] == ["0", "1", "2"]
    assert isinstance(model[0], SplitOverTP) and not isinstance(model[3], SplitOverTP)
    assert all(sub.tp_split() == (1, None) for _, sub in split_over_tp(model))


def test_gathering_the_slices_of_a_group_of_one_copies_the_tensor():
    local = torch.arange(6.0).view(2, 3)
    for comm in (None, Comm(name="solo")):
        full = gather_tp_tensor(local, 1, comm)
        assert torch.equal(full, local) and full.data_ptr() != local.data_ptr()
