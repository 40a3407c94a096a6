"""The ZeRO engine in one process (a DP group of one: every collective is a no-op), fast.

Checks the stage policies' shared machinery without communication: each stage reproduces
torch.optim.AdamW on ParityNet (frozen, tied, sometimes-unused parameters, accumulation, clipping), and
initialize() rejects bad configs with one error naming the field. The multi-rank behaviour is tested in
tests/dist.
"""

import gc
import re

import pytest
import torch

import hybrid
from hybrid.errors import ConfigError
_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]
from tests.dist.zero_models import ParityNet, config, reference, train_engine


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_single_rank_engine_matches_adamw(stage, ref):
    ref_losses, ref_norms, ref_state = ref
    engine = hybrid.initialize(ParityNet(), config(stage))
    losses, norms, stepped = train_engine(engine, rank=0, world=1)
    assert stepped == [False, True] * (len(losses) // 2)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)
    state = engine.full_state_dict()
    assert state.keys() == ref_state.keys()
    for name, value in ref_state.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert engine.global_step == engine.optimizer_step_count == len(norms)
    assert engine.comm_report()["total"] == 0


def test_initialize_rejects_bad_configs():
    with pytest.raises(ConfigError, match=r"^zero_optimization\.stage must be 0, 1, 2 or 3"):
        hybrid.initialize(ParityNet(), {"zero_optimization": {"stage": 5}})
    with pytest.raises(ConfigError, match=r"^zero_optimization\.reduce_bucket_size must be a positive integer"):
        hybrid.initialize(ParityNet(), {"zero_optimization": {"stage": 2, "reduce_bucket_size": -5}})
    with pytest.raises(ConfigError, match=r"^zero_optimization\.stage4_magic is not a known setting"):
        hybrid.initialize(ParityNet(), {"zero_optimization": {"stage4_magic": 1}})
    with pytest.raises(ConfigError, match=r"^train_batch_size is 64 but micro batch 4"):
        hybrid.initialize(ParityNet(), {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
                                        "gradient_accumulation_steps": 2})


def test_backward_twice_without_step_is_refused():
    from tests.dist.zero_models import batch

    engine = hybrid.initialize(ParityNet(), config(2))
    x, y = batch(0, 0)
    engine.backward(engine(x, y))
    with pytest.raises(RuntimeError, match="call step\\(\\) after every backward"):
        engine.backward(engine(x, y))
    assert engine.step() is False  # first micro-step of two


def test_backward_of_something_not_a_loss_is_one_sentence_and_leaves_the_engine_usable():
    from tests.dist.zero_models import batch

    engine = hybrid.initialize(ParityNet(), config(1))
    x, y = batch(0, 0)
    with torch.no_grad():
        detached = engine(x, y)
    for wrong, said in (({"loss": engine(x, y)}, "got a dict; pass output.loss"),
                        (None, "got a NoneType"),
                        (torch.ones(3, requires_grad=True), r"got a tensor of shape \(3,\)"),
                        (detached, "does not require grad")):
        with pytest.raises(TypeError, match=said):
            engine.backward(wrong)
    engine.backward(engine(x, y))  # the corrected call works: the refused ones changed nothing
    assert engine.step() is False


def test_step_without_engine_backward_is_refused():
    from tests.dist.zero_models import batch

    engine = hybrid.initialize(ParityNet(), config(1))
    x, y = batch(0, 0)
    engine(x, y).backward()  # loss.backward() instead of engine.backward(loss)
    with pytest.raises(RuntimeError, match=r"without engine\.backward\(loss\)"):
        engine.step()


def test_sparse_embedding_is_refused_at_initialize():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"^module '0' is an Embedding with sparse=True.*sparse=False$"):
        hybrid.initialize(model, config(2))


def test_stage3_parameters_are_empty_outside_forward():
    engine = hybrid.initialize(ParityNet(), config(3, stage3_param_persistence_threshold=0))
    weight = engine.module.blocks[0].fc1.weight
    assert weight.shape == (0,) and engine.shapes[engine.names.index("blocks.0.fc1.weight")] == (45, 22)
    with pytest.raises(RuntimeError):  # a stray read outside the module's forward fails loudly
        torch.nn.functional.linear(torch.ones(2, 22), weight)
    seen = []
    engine.module.blocks[0].fc1.register_forward_pre_hook(lambda m, a: seen.append(tuple(m.weight.shape)))
    from tests.dist.zero_models import batch

    x, y = batch(0, 0)
    engine(x, y)
    assert seen == [(45, 22)] and weight.shape == (0,)
    assert engine.memory_report()["buffers"] == 0


def test_state_dict_of_released_parameters_at_stage3_is_refused_in_one_sentence():
    model = ParityNet()
    engine = hybrid.initialize(model, config(3, stage3_param_persistence_threshold=0))
    with pytest.raises(RuntimeError, match=r"state_dict\(\) at ZeRO stage 3 would hold empty tensors.*"
                                           r"engine\.full_state_dict\(\)"):
        model.state_dict()  # torch.save(model.state_dict()) would have saved 0-element tensors
    with pytest.raises(RuntimeError, match=r"load_state_dict\(\) at ZeRO stage 3 cannot write into released"):
        model.load_state_dict(engine.full_state_dict(), strict=False)
    assert set(model.state_dict(keep_vars=True)) >= set(engine.full_state_dict())  # the objects stay reachable
    assert hybrid.initialize(ParityNet(), config(2)).module.state_dict()  # below stage 3 nothing is released


def test_a_parameter_frozen_after_initialize_is_refused_not_stepped():
    from tests.dist.zero_models import batch

    model = ParityNet()
    engine = hybrid.initialize(model, config(2))
    next(p for p in model.parameters() if p.requires_grad).requires_grad_(False)  # AdamW would still move it
    x, y = batch(0, 0)
    with pytest.raises(RuntimeError, match=r"was frozen after hybrid\.initialize; .*before hybrid\.initialize"):
        engine.backward(engine(x, y))


def test_a_parameter_of_a_meta_built_model_unfrozen_after_initialize_is_refused():
    with torch.device("meta"):  # initialize replaces every parameter object of a model built on meta
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model[0].weight.requires_grad_(False)
    engine = hybrid.initialize(model, config(1))
    model[0].weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"\('0\.weight'\) was unfrozen after hybrid\.initialize"):
        engine.backward(engine(torch.randn(2, 4)).sum())


@pytest.mark.parametrize("stage", [0, 3])
def test_a_parameter_unfrozen_after_initialize_is_refused(stage):
    from tests.dist.zero_models import batch

    model = ParityNet()
    frozen = next(p for p in model.parameters())
    frozen.requires_grad_(False)
    engine = hybrid.initialize(model, config(stage))
    frozen.requires_grad_(True)  # the engine would never reduce or step it
    x, y = batch(0, 0)
    with pytest.raises(RuntimeError, match=r"1 parameter\(s\) \(.*\) was unfrozen after hybrid\.initialize"):
        engine.backward(engine(x, y))


def test_a_complex_parameter_is_refused():
    model = torch.nn.Linear(4, 4)
    model.phase = torch.nn.Parameter(torch.randn(4, dtype=torch.cfloat))
    with pytest.raises(ValueError, match=r"1 parameter\(s\) \('phase'\) was complex; .*view_as_real"):
        hybrid.initialize(model, config(0))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_post_accumulate_grad_hook_registered_after_initialize_sees_the_gradient(stage):
    from tests.dist.zero_models import batch

    model = ParityNet()
    engine = hybrid.initialize(model, config(stage))
    seen = []
    first = next(p for p in model.parameters() if p.requires_grad)
    first.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is not None))  # after initialize
    x, y = batch(0, 0)
    engine.backward(engine(x, y))  # torch would run it after the engine's hook, which takes the gradient
    assert seen == [True]
    engine.step()
    engine.backward(engine(x, y))  # nothing registered since: the check is skipped, the order still holds
    engine.step()
    first.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is not None))  # a later one too
    engine.backward(engine(x, y))
    assert seen == [True, True, True, True]


class _FusedLinear(torch.autograd.Function):
    """A user's custom kernel: autograd records its inputs without dispatching __torch_function__."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x, grad.sum(0)


class _CustomKernelNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)

    def forward(self, x):  # fc2 never runs as a module: under stage3_unit "module" it is a unit of its own
        return _FusedLinear.apply(torch.tanh(self.fc1(x)), self.fc2.weight, self.fc2.bias).square().mean()


def test_a_custom_autograd_function_given_a_released_parameter_at_stage3_gets_it_gathered():
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    plain = _CustomKernelNet()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    engine = hybrid.initialize(_CustomKernelNet(), {
        "zero_optimization": {"stage": 3, "stage3_unit": "module", "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    for _ in range(3):
        plain(x).backward()
        opt.step()
        opt.zero_grad()
        engine.backward(engine(x))
        engine.step()
    for name, value in plain.named_parameters():
        torch.testing.assert_close(engine.full_state_dict()[name], value.detach(), rtol=1e-6, atol=1e-7)
    del engine
    gc.collect()
    assert torch.autograd.Function.__dict__["apply"] is _ORIGINAL_APPLY  # patched only while the engine lives


def test_a_compiled_model_at_stage3_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"torch\.compile'd model at ZeRO stage 3.*compile engine\.module"):
        hybrid.initialize(torch.compile(ParityNet()), config(3))


@pytest.mark.parametrize("stage", [0, 3])
def test_a_backward_that_raises_before_any_gradient_leaves_the_engine_as_it_was(stage):
    from tests.dist.zero_models import batch

    def run(fail: bool):
        engine = hybrid.initialize(ParityNet(), config(stage))
        for step in range(3):
            x, y = batch(step, 0)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            if fail and step == 0:
                with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                    engine.backward(loss)  # its graph is freed: autograd raises before any gradient
        return engine.full_state_dict()

    clean, after_failure = run(False), run(True)
    assert all(torch.equal(clean[k], after_failure[k]) for k in clean)


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("a kernel failed in backward")


def test_a_backward_that_raises_partway_stops_the_engine_with_one_sentence():
    torch.manual_seed(0)
    body, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    model = torch.nn.ModuleDict({"body": body, "head": head})
    engine = hybrid.initialize(model, config(0))
    loss = head(_FailingBackward.apply(body(torch.randn(3, 4)))).sum()
    with pytest.raises(RuntimeError, match="a kernel failed in backward"):
        engine.backward(loss)  # the head's gradients were already accumulated
    for call in (lambda: engine.backward(head(body(torch.randn(3, 4))).sum()), engine.step):
        with pytest.raises(RuntimeError, match=r"raised partway through \(RuntimeError\).*restart from the last"):
            call()


class _WithState(torch.nn.Module):
    """Tied weights, a buffer shared by two submodules, an int64 buffer, a non-persistent one and extra state."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(8, 4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight
        self.a, self.b = torch.nn.Module(), torch.nn.Module()
        shared = torch.zeros(4)
        self.a.register_buffer("ema", shared)
        self.b.register_buffer("ema", shared)
        self.register_buffer("count", torch.tensor([2 ** 40 + 1]))
        self.register_buffer("scratch", torch.ones(3), persistent=False)

    def get_extra_state(self):
        return {"version": 3}

    def set_extra_state(self, state):
        self.version = state["version"]

    def forward(self, x, y):
        h = self.emb(x)
        self.a.ema.add_(1.0)  # one tensor: b sees it too
        return torch.nn.functional.cross_entropy(self.head(h + self.b.ema).flatten(0, 1), y.flatten())


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("bf16", [False, True])
def test_full_state_dict_has_state_dicts_keys_and_loads_strictly(stage, bf16):
    engine = hybrid.initialize(_WithState(), {"zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}})
    x, y = torch.tensor([[1, 2, 3]]), torch.tensor([[2, 3, 4]])
    engine.backward(engine(x, y))
    engine.step()
    full = engine.full_state_dict()
    fresh = _WithState()
    assert list(full) == list(fresh.state_dict()), "tied names, persistent buffers and extra state, in order"
    assert full["head.weight"] is full["emb.weight"] and full["a.ema"] is full["b.ema"]
    assert full["a.ema"].tolist() == [1.0] * 4, "a buffer shared by two modules stays one tensor (bf16 too)"
    assert full["count"].dtype == torch.int64 and full["count"].item() == 2 ** 40 + 1
    assert full["_extra_state"] == {"version": 3}
    fresh.load_state_dict(full, strict=True)
    assert fresh.version == 3


@pytest.mark.parametrize("stage", [0, 3])
def test_bf16_engine_casts_floating_inputs_to_bf16(stage):
    class Mix(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x, scale, index):
            assert x.dtype == scale["s"].dtype == torch.bfloat16 and index.dtype == torch.int64
            return (self.fc(x) * scale["s"])[index].float().square().mean()

    engine = hybrid.initialize(Mix(), {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage}})
    x = torch.randn(3, 4, requires_grad=True)  # an fp32 input, as the data loader made it
    loss = engine(x, {"s": torch.tensor(2.0, dtype=torch.float64)}, index=torch.tensor([0, 2]))
    engine.backward(loss)
    assert engine.step() and x.grad is not None and x.grad.dtype == torch.float32  # the cast is differentiable


def test_a_client_state_that_would_not_come_back_as_it_went_in_and_a_bad_lr_are_one_sentence():
    """DeepSpeed pickles client_state; a hybrid checkpoint keeps it as JSON. A tensor there was a ValueError
    naming "extra state and model_config"; a tuple or an int key would have come back changed."""
    import hybrid
    from hybrid.checkpoint.manifest import check_extra
    from hybrid.errors import ConfigError, UsageError

    for bad, said in (({"t": torch.ones(2)}, "client_state['t'] is of type Tensor"),
                      ({"a": (1, 2)}, "client_state['a'] is of type tuple"),
                      ({1: "one"}, "client_state has the key 1 (of type int)"),
                      ({"a": [1, {"b": object()}]}, "client_state['a'][1]['b'] is of type object")):
        with pytest.raises(UsageError, match=re.escape(said)):
            check_extra(bad)
    check_extra({"epoch": 3, "seen": [1, 2.5, None, True, "s", {"k": {}}]})
    engine = hybrid.initialize(torch.nn.Linear(2, 2), {"zero_optimization": {"stage": 0}})
    for bad in ("x", -1, float("nan"), True):
        with pytest.raises(ConfigError, match=r"^engine.lr must be a number at least 0, got"):
            engine.lr = bad
    engine.lr = torch.tensor(0.5)
    assert engine.lr == 0.5


def test_a_config_file_path_is_read_as_deepspeed_initialize_reads_it(tmp_path):
    import json

    import hybrid

    ds = {"zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    (tmp_path / "ds_config.json").write_text(json.dumps(ds))
    (tmp_path / "ds_config.yaml").write_text("zero_optimization: {stage: 2}\n")
    (tmp_path / "broken.json").write_text("{")
    assert hybrid.initialize(torch.nn.Linear(2, 2), tmp_path / "ds_config.json").config.zero.stage == 1
    assert hybrid.initialize(torch.nn.Linear(2, 2), str(tmp_path / "ds_config.yaml")).config.zero.stage == 2
    with pytest.raises(ConfigError, match=r"broken.json' is not valid JSON"):
        hybrid.initialize(torch.nn.Linear(2, 2), str(tmp_path / "broken.json"))
    with pytest.raises(ConfigError, match=r"does not exist"):
        hybrid.initialize(torch.nn.Linear(2, 2), str(tmp_path / "missing.json"))
