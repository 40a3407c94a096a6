"""Meta-device construction and weights files in one process: values, precedence, and one-sentence errors.

The multi-rank guarantees (every stage, DP and TP layout gives the same model; peak memory) are in
tests/dist/test_meta_init.py.
"""

import pickle

import pytest
import torch
from torch import nn

import hybrid
from hybrid.errors import CheckpointError, ConfigError
from hybrid.models.gpt.model import GPT, GPTConfig
from safetensors.torch import save_file

TINY = GPTConfig(vocab_size=64, seq_len=16, hidden=32, n_layers=2, n_heads=4)


def _mlp():
    return nn.Sequential(nn.Linear(12, 20), nn.LayerNorm(20), nn.ReLU(), nn.Linear(20, 5))


def _equal_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_meta_gpt_materializes_to_the_ordinary_gpt():
    with torch.device("meta"):
        meta = GPT(TINY)
    hybrid.materialize(meta, seed=5)
    assert not any(p.is_meta for p in meta.parameters())
    assert _equal_state(meta, GPT(TINY, seed=5))
    assert not _equal_state(meta, GPT(TINY, seed=6))


def test_gpt_values_do_not_depend_on_a_wrapper():
    wrapped = nn.Sequential(GPT(TINY, device="meta"))
    hybrid.materialize(wrapped, seed=1)
    assert _equal_state(wrapped[0], GPT(TINY, seed=1))


def test_plain_modules_use_their_reset_parameters_seeded_by_name():
    with torch.device("meta"):
        a, b = _mlp(), _mlp()
    hybrid.materialize(a, seed=3)
    hybrid.materialize(b, seed=3)
    assert _equal_state(a, b)
    assert torch.equal(a[1].weight, torch.ones(20)) and a[0].weight.std() > 0
    c = hybrid.materialize(_mlp().to("meta"), seed=4)
    assert not torch.equal(a[0].weight, c[0].weight)


def _meta_gpt():
    return GPT(TINY, device="meta")


@pytest.mark.parametrize("build", [_mlp, _meta_gpt])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_on_meta_equals_materialize(stage, build):
    ref = hybrid.materialize(build().to("meta"), seed=2)
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}  # stage 3: every unit gathered and released
    engine = hybrid.initialize(build().to("meta"), {"zero_optimization": zero, "precision": "fp32"}, seed=2)
    state = engine.full_state_dict()
    for name, value in ref.state_dict().items():
        assert torch.equal(state[name], value), name
    report = engine.init_report
    assert report["source"] == "init" and report["peak_bytes"] >= report["model_state_bytes"] > 0
    for _ in range(2):  # a regathered unit must not look like an in-place change to autograd
        if build is _mlp:
            loss = engine(torch.randn(3, 12)).square().mean()
        else:
            ids = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len + 1))
            loss = engine(ids[:, :-1], ids[:, 1:])
        engine.backward(loss)
        assert engine.step()


def test_init_fn_overrides_reset_parameters():
    def init_fn(module):
        for p in module._parameters.values():
            nn.init.constant_(p, 0.25)

    model = hybrid.materialize(_mlp().to("meta"), init_fn=init_fn)
    assert all(torch.all(p == 0.25) for p in model.parameters())


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.norm = nn.LayerNorm(8)


def _hf_style_init(module):
    """As Hugging Face's ``_init_weights``: a parent initializes its children's tensors (T5's dense layers,
    GPT-2's scaled ``c_proj``); leaves it does not know keep their constructor's init."""
    if isinstance(module, _Block):
        module.out.weight.data.fill_(0.5)
        module.out.bias.data.zero_()
    elif isinstance(module, nn.LayerNorm):
        module.weight.data.fill_(2.0)


def test_init_fn_applies_as_model_apply_after_construction_parents_last():
    ordinary = _Stack()
    ordinary.apply(_hf_style_init)
    with torch.device("meta"):
        meta = _Stack()
    meta = hybrid.materialize(meta, init_fn=_hf_style_init)
    for (name, want), got in zip(ordinary.named_parameters(), meta.parameters()):
        if ".out." in name or name.startswith("norm."):
            assert torch.equal(got, want), name  # the parent's init of its children won (it was dropped)
        else:
            assert got.std() > 0.05 and got.abs().max() <= 1 / 8 ** 0.5, name  # Linear's own init, not zeros


class _DenseWithRoot(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.empty(8))  # the root's own, initialized by the root's init
        self.ff = _Block()                        # both children initialized by their parent


def _init_parent_and_root(module):
    if isinstance(module, _Block):
        module.fc.weight.data.normal_(0, 0.1)
        module.out.weight.data.normal_(0, 0.1)
    elif isinstance(module, _DenseWithRoot):
        module.pos.data.normal_(0, 1.0)


def test_init_fn_gives_materialize_and_initialize_the_same_values():
    """A later module's ancestor init must not re-draw what the walk already materialized (the ancestor's own
    tensors, a sibling done earlier): materialize() walks with real tensors, initialize() with meta ones."""
    with torch.device("meta"):
        alone, engine_model = _DenseWithRoot(), _DenseWithRoot()
    alone = hybrid.materialize(alone, seed=3, init_fn=_init_parent_and_root)
    engine = hybrid.initialize(engine_model, {"zero_optimization": {"stage": 0}}, seed=3,
                               init_fn=_init_parent_and_root)
    full = engine.full_state_dict()
    assert all(torch.equal(full[name], p.detach()) for name, p in alone.named_parameters()), full


class _TiedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10)
        self.head.weight = self.emb.weight


def _init_through_the_alias(module):
    if isinstance(module, _TiedHead):
        module.head.weight.data.fill_(0.5)  # the tied weight, written through its second name


@pytest.mark.parametrize("init_fn", [None, _init_through_the_alias])
def test_tied_weights_get_the_same_values_from_materialize_and_initialize(init_fn):
    """materialize() walked a model it was changing (a tied weight then looked like the head's own and its
    reset drew numbers, moving the bias's stream), and an ancestor's write through an alias was lost."""
    with torch.device("meta"):
        alone, engine_model = _TiedHead(), _TiedHead()
    alone = hybrid.materialize(alone, seed=3, init_fn=init_fn)
    full = hybrid.initialize(engine_model, {"zero_optimization": {"stage": 0}}, seed=3,
                             init_fn=init_fn).full_state_dict()
    assert all(torch.equal(full[name], p.detach()) for name, p in alone.named_parameters())
    if init_fn is not None:
        assert torch.all(full["emb.weight"] == 0.5)


def test_a_meta_parameter_without_any_init_is_one_sentence():
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(3, device="meta"))

    with pytest.raises(ConfigError, match=r"parameter 'w' is on the meta device .* no reset_parameters"):
        hybrid.materialize(Bare())


class _Rotary(nn.Module):
    """What __init__ computes and no init writes: a norm's ones, a rotary table, a position index."""

    def __init__(self, writes=()):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("inv_freq", 1.0 / 10.0 ** (torch.arange(4.0) / 4), persistent=False)
        self.register_buffer("positions", torch.arange(4))
        self.writes = writes

    def init_fn(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight)
        if module is self:
            for name in self.writes:
                getattr(self, name).copy_(getattr(_Rotary(), name))


@pytest.mark.parametrize("left", ["scale", "inv_freq", "positions"])
def test_a_meta_tensor_no_init_wrote_is_one_sentence_not_zeros(left):
    writes = [n for n in ("scale", "inv_freq", "positions") if n != left]
    with torch.device("meta"):
        model = _Rotary(writes)
    kind = "parameter" if left == "scale" else "buffer"
    with pytest.raises(ConfigError, match=rf"^{kind} '{left}' is on the meta device and _Rotary has no "
                                          r"reset_parameters\(\) and init_fn did not write all of its values, so "
                                          r"what _Rotary.__init__ put there is lost; set it in "):
        hybrid.materialize(model, init_fn=model.init_fn)
    with torch.device("meta"):
        model = _Rotary(["scale", "inv_freq", "positions"])
    hybrid.materialize(model, init_fn=model.init_fn)  # an init that writes them all: the ordinary values
    ordinary = _Rotary()
    for name in ("scale", "inv_freq", "positions"):
        assert torch.equal(getattr(model, name), getattr(ordinary, name)), name


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_weights_file_round_trip(tmp_path, suffix):
    source = GPT(TINY, seed=9)
    path = tmp_path / f"w{suffix}"
    state = {k: v.contiguous() for k, v in source.state_dict().items()}
    torch.save(state, path) if suffix == ".pt" else save_file(state, str(path))
    loaded = hybrid.materialize(GPT(TINY, device="meta"), weights=path)
    assert _equal_state(loaded, source)
    for stage in (0, 3):
        engine = hybrid.initialize(GPT(TINY, device="meta"), {"zero_optimization": {"stage": stage}, "precision": "fp32"},
                                   weights=path)
        full = engine.full_state_dict()
        assert all(torch.equal(full[k], v) for k, v in state.items())
        assert engine.init_report["source"] == "weights"


def _write(path, state):
    torch.save(state, path)
    return path


def test_weights_file_errors_are_one_sentence(tmp_path):
    good = {k: v.clone() for k, v in GPT(TINY).state_dict().items()}
    missing = dict(good)
    del missing["blocks.0.mlp.fc.weight"]
    extra = {**good, "head.extra": torch.zeros(2)}
    wrong = {**good, "ln_f.weight": torch.zeros(7)}
    cases = {
        "missing": (_write(tmp_path / "m.pt", missing), r"has no tensor 'blocks\.0\.mlp\.fc\.weight'"),
        "extra": (_write(tmp_path / "e.pt", extra), r"has a tensor 'head\.extra' that the model does not have"),
        "shape": (_write(tmp_path / "s.pt", wrong), r"holds 'ln_f\.weight' with shape \[7\] but the model's is \[32\]"),
        "not a dict": (_write(tmp_path / "l.pt", [torch.zeros(1)]), r"holds a list, not a state dict"),
        "non-tensor": (_write(tmp_path / "n.pt", {**good, "note": "hello"}), r"holds a str under 'note'"),
        "directory": (tmp_path, r"is a directory"),
        "absent": (tmp_path / "nope.pt", r"does not exist"),
    }
    full = _write(tmp_path / "full.pt", good)
    (tmp_path / "t.pt").write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    cases["truncated"] = (tmp_path / "t.pt", r"cannot be read as a torch state dict")
    (tmp_path / "evil.pt").write_bytes(pickle.dumps(Exception("not a tensor")))
    cases["unsafe pickle"] = (tmp_path / "evil.pt", r"cannot be read as a torch state dict")
    save_file({k: v.contiguous() for k, v in good.items()}, str(tmp_path / "full.safetensors"))
    data = (tmp_path / "full.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(data[: len(data) // 2])
    cases["truncated safetensors"] = (tmp_path / "t.safetensors", r"safetensors|damaged")
    for what, (path, pattern) in cases.items():
        with pytest.raises(CheckpointError, match=pattern) as info:
            hybrid.materialize(GPT(TINY, device="meta"), weights=path)
        message = str(info.value)
        assert "\n" not in message and len(message) < 400, (what, message)


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("count", torch.tensor([2 ** 40 + 1, 2 ** 24 + 1]))


@pytest.mark.parametrize("kept", ["emb.weight", "head.weight"])
def test_a_weights_file_may_hold_a_tied_tensor_under_any_of_its_names(tmp_path, kept):
    """safetensors' save_model keeps the alphabetically first name (GPT-2: lm_head.weight), torch.save every
    name, consolidate the first: each loads; integer buffers keep values fp32 would round."""
    source = _Tied()
    state = {k: v.clone() for k, v in source.state_dict().items() if k in (kept, "count")}
    save_file(state, str(tmp_path / "w.safetensors"))
    torch.save(source.state_dict(), tmp_path / "w.pt")
    for path in (tmp_path / "w.safetensors", tmp_path / "w.pt"):
        with torch.device("meta"):
            model = _Tied()
        hybrid.materialize(model, weights=path)
        assert model.head.weight is model.emb.weight
        assert torch.equal(model.emb.weight, source.emb.weight)
        assert model.count.tolist() == [2 ** 40 + 1, 2 ** 24 + 1]
