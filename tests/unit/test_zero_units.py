"""Pure stage-3 unit planning (hybrid.zero.units), the stage3_unit config field, and the training loop's
handling of Hugging Face style outputs and batches (hybrid.runtime.train.loss_of / batch_args)."""

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from hybrid.config.training import TrainConfig, ZeroConfig
from hybrid.errors import ConfigError, UserError
from hybrid.runtime.train import batch_args, batch_rows, loss_of
from hybrid.zero.units import plan_units, unit_roots


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))  # a container inside a block


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.body = nn.Sequential(Block(), nn.ReLU())
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.scale = nn.Parameter(torch.ones(4))


def _plan(model, policy):
    index = {id(p): i for i, p in enumerate(model.parameters())}
    names = {i: n for i, (n, _) in enumerate(model.named_parameters())}
    plans = plan_units(model, policy, index)
    return index, [(plan.name, sorted(names[i] for i in plan.params)) for plan in plans], plans


def test_auto_cuts_one_unit_per_block_of_the_outermost_containers():
    model = Net()
    index, plans, _ = _plan(model, "auto")
    assert [name for name, _ in plans] == ["", "blocks.0", "blocks.1", "body.0"]
    assert plans[0][1] == ["emb.weight", "scale"]  # the rest: the root's own and the leftovers
    assert plans[1][1] == ["blocks.0.fc.bias", "blocks.0.fc.weight", "blocks.0.mlp.0.bias", "blocks.0.mlp.0.weight",
                           "blocks.0.mlp.2.bias", "blocks.0.mlp.2.weight"]
    every = sorted(n for _, params in plans for n in params)
    assert every == sorted(n for n, _ in model.named_parameters())  # each parameter in exactly one unit


def test_auto_on_a_sequential_model_and_without_containers():
    seq = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2))
    index = {id(p): i for i, p in enumerate(seq.parameters())}
    assert [n for n, _ in unit_roots(seq, "auto", index)] == ["", "0", "2"]
    lin = nn.Linear(2, 2)
    assert [n for n, _ in unit_roots(lin, "auto", {id(p): i for i, p in enumerate(lin.parameters())})] == [""]


def test_auto_looks_through_containers_that_have_no_forward():
    # torchtitan keeps its blocks in an nn.ModuleDict; a ModuleList of ModuleLists / ModuleDicts is never
    # called itself, so its children are the modules that run (a hook on the container would never fire).
    class Titan(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(10, 4)
            self.layers = nn.ModuleDict({"0": Block(), "1": Block()})
            self.stages = nn.ModuleList([nn.ModuleList([Block(), Block()]), nn.ModuleDict({"a": Block()})])
            self.out = nn.Linear(4, 10)

    model = Titan()
    index = {id(p): i for i, p in enumerate(model.parameters())}
    assert [n for n, _ in unit_roots(model, "auto", index)] == [
        "", "layers.0", "layers.1", "stages.0.0", "stages.0.1", "stages.1.a"]
    assert all(isinstance(m, Block) for _, m in unit_roots(model, "auto", index)[1:])


def test_a_module_shared_by_two_blocks_is_read_by_both():
    model = Net()
    shared = nn.Linear(4, 4)
    model.blocks[0].extra, model.blocks[1].extra = shared, shared
    index, plans, objs = _plan(model, "auto")
    first, second = objs[1], objs[2]  # blocks.0, blocks.1
    shared_ids = {index[id(shared.weight)], index[id(shared.bias)]}
    assert shared_ids <= set(first.params) and not shared_ids & set(second.params)  # owned once
    assert shared_ids <= second.reads  # but read by the second block's unit too


def test_module_policy_and_tied_reads():
    model = Net()
    _, plans, objs = _plan(model, "module")
    names = [name for name, _ in plans]
    assert names[:3] == ["", "emb", "blocks.0.fc"] and "head" in names and "blocks" not in names
    head = objs[names.index("head")]
    assert head.params == [] and head.reads == objs[names.index("emb")].reads  # reads the tied weight's unit


def test_callable_policy_marks_roots_and_the_model_is_always_one():
    model = Net()
    _, plans, _ = _plan(model, lambda name, m: isinstance(m, Block))
    assert [name for name, _ in plans] == ["", "blocks.0", "blocks.1", "body.0"]
    _, plans, _ = _plan(model, lambda name, m: False)
    assert len(plans) == 1 and len(plans[0][1]) == len(list(model.parameters()))
    # a marked ModuleList is never called (its hooks would never fire): its blocks are the roots
    _, plans, _ = _plan(model, lambda name, m: name == "blocks")
    assert [name for name, _ in plans] == ["", "blocks.0", "blocks.1"]
    _, plans, _ = _plan(model, lambda name, m: True)  # each module once, containers looked through
    names = [name for name, _ in plans]
    assert len(names) == len(set(names)) and "blocks" not in names and "body" in names


def test_frozen_parameters_are_in_no_unit():
    model = Net()
    model.scale.requires_grad_(False)
    index = {id(p): i for i, p in enumerate(p for p in model.parameters() if p.requires_grad)}
    plans = plan_units(model, "auto", index)
    assert sum(len(p.params) for p in plans) == len(index)


def test_stage3_unit_config():
    assert ZeroConfig().stage3_unit == "auto"
    fn = lambda name, m: True  # noqa: E731
    assert TrainConfig.from_dict({"zero_optimization": {"stage": 3, "stage3_unit": fn}}).zero.stage3_unit is fn
    assert TrainConfig.from_dict({"zero": {"stage": 3, "stage3_unit": "module"}}).zero.stage3_unit == "module"
    with pytest.raises(ConfigError, match=r"^zero_optimization.stage3_unit must be auto, module or a function"):
        TrainConfig.from_dict({"zero_optimization": {"stage": 3, "stage3_unit": "block"}})


@dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor = None


def test_loss_of_tensor_mapping_and_attribute():
    loss = torch.tensor(1.5)
    assert loss_of(loss) is loss
    assert loss_of({"loss": loss, "logits": torch.zeros(2)}) is loss
    assert loss_of(Output(loss)) is loss
    for bad in ({"logits": torch.zeros(2)}, Output(None), torch.zeros(3), 3.0):
        with pytest.raises(UserError, match="no scalar loss"):
            loss_of(bad)


def test_batch_args_and_rows():
    x, y = torch.zeros(4, 3), torch.zeros(4, 3)
    assert batch_args({"input_ids": x, "labels": y}) == ((), {"input_ids": x, "labels": y})
    assert batch_args((x, y)) == ((x, y), {})
    assert batch_args(x) == ((x,), {})
    assert batch_rows((), {"input_ids": x}) == 4 and batch_rows((), {}) == 0


def test_the_context_seeds_torch_per_dp_rank_from_the_job_seed():
    from types import SimpleNamespace

    from hybrid.runtime.train import Context, JobSettings, rank_seed

    seeds = set()
    for dp_rank in range(3):
        Context(SimpleNamespace(dp_rank=dp_rank), {}, JobSettings(steps=1, micro_batch=1, stage=0, seed=7))
        assert torch.initial_seed() == rank_seed(7, dp_rank)
        seeds.add(torch.initial_seed())
    assert len(seeds) == 3 and rank_seed(8, 0) not in seeds  # each DP rank its own stream; the job seed counts
