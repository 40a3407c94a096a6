"""GPTConfig validation, YAML loading, and the meta-device parameter count."""

from pathlib import Path

import pytest
import torch

from hybrid.errors import ConfigError
from hybrid.models import GPT, GPTConfig, count_parameters

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = dict(vocab_size=256, seq_len=32, n_layers=2, hidden=64, n_heads=4)


def _closed_form(c: GPTConfig) -> int:
    h, f = c.hidden, c.ffn_hidden
    per_layer = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
    return c.vocab_size * h + c.seq_len * h + c.n_layers * per_layer + 2 * h + h * c.vocab_size


@pytest.mark.parametrize("overrides", [{}, dict(bias=False), dict(n_layers=3, mlp_ratio=2, n_heads=8)])
def test_count_parameters_matches_the_allocated_model(overrides):
    cfg = GPTConfig(**{**TINY, **overrides})
    assert count_parameters(cfg) == sum(p.numel() for p in GPT(cfg).parameters())


def test_shipped_configs_load_and_count_near_their_names():
    counts = {path.name: count_parameters(GPTConfig.from_yaml(path)) for path in CONFIGS.glob("gpt-*.yaml")}
    assert counts["gpt-tiny.yaml"] == 134_912
    # Untied LM heads add vocab·hidden to the published (tied) figures.
    for name, nominal, tolerance in [("gpt-125m.yaml", 125e6, 0.35), ("gpt-1.3b.yaml", 1.3e9, 0.1),
                                     ("gpt-7b.yaml", 6.7e9, 0.05), ("gpt-13b.yaml", 13e9, 0.05)]:
        assert abs(counts[name] - nominal) / nominal < tolerance, (name, counts[name])
        cfg = GPTConfig.from_yaml(CONFIGS / name)
        assert counts[name] == _closed_form(cfg)
        for tp in (1, 2, 4):  # gpt-125m has 12 heads, so not tp 8
            cfg.check_tp(tp)


@pytest.mark.parametrize("overrides, field", [
    (dict(n_heads=5), "model.n_heads"),
    (dict(hidden=0), "model.hidden"),
    (dict(n_layers=True), "model.n_layers"),
    (dict(n_layers=200_000), "model.n_layers must be a whole number from 1 to 4096"),
    (dict(vocab_size=2.5), "model.vocab_size"),
    (dict(dropout=1.0), "model.dropout"),
    (dict(layer_norm_eps=-1.0), "model.layer_norm_eps"),
    (dict(bias="yes"), "model.bias"),
])
def test_invalid_fields_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        GPTConfig(**{**TINY, **overrides})


@pytest.mark.parametrize("tp, field", [(3, "n_heads"), (8, "n_heads")])
def test_check_tp_rejects_degrees_that_do_not_split_heads(tp, field):
    with pytest.raises(ConfigError, match=f"model.{field}=4 is not divisible by the tensor-parallel degree tp={tp}"):
        GPTConfig(**TINY).check_tp(tp)


def test_check_tp_rejects_a_vocab_that_does_not_split():
    with pytest.raises(ConfigError, match="model.vocab_size=250"):
        GPTConfig(**{**TINY, "vocab_size": 250}).check_tp(4)


def test_dropout_needs_tp1():
    GPTConfig(**TINY, dropout=0.1).check_tp(1)
    with pytest.raises(ConfigError, match="model.dropout=0.1 is not supported with tensor parallelism"):
        GPTConfig(**TINY, dropout=0.1).check_tp(2)


def test_from_yaml_reads_the_model_mapping(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("model:\n  vocab_size: 256\n  seq_len: 32\n  n_layers: 2\n  hidden: 64\n  n_heads: 4\n"
                    "  layer_norm_eps: 1e-6\ntrain:\n  lr: 0.001\n")
    cfg = GPTConfig.from_yaml(path)
    assert cfg == GPTConfig(**TINY, layer_norm_eps=1e-6)


@pytest.mark.parametrize("text, match", [
    ("vocab_size: 256\n", "has no model: mapping"),
    ("model:\n  vocab_size: 256\n", "model.seq_len is missing"),
    ("model: {vocab_size: 256, seq_len: 32, n_layers: 2, hidden: 64, n_heads: 4, heads: 4}\n",
     "model.heads is not a known setting"),
    ("model: [1, 2\n", "is not valid YAML"),
])
def test_from_yaml_errors(tmp_path, text, match):
    path = tmp_path / "m.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        GPTConfig.from_yaml(path)


def test_from_yaml_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="model config .* does not exist"):
        GPTConfig.from_yaml(tmp_path / "absent.yaml")


def test_init_depends_on_seed_only():
    cfg = GPTConfig(**TINY)
    a, b, c = GPT(cfg, seed=3), GPT(cfg, seed=3), GPT(cfg, seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if name.endswith("weight") and "ln" not in name:
            assert not torch.equal(pa, pc), name


def test_logits_and_loss_agree_with_torch_cross_entropy():
    cfg = GPTConfig(**TINY)
    model = GPT(cfg, seed=0)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    targets = idx.roll(-1, dims=1)
    logits = model(idx)
    assert logits.shape == (2, cfg.seq_len, cfg.vocab_size)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))
    torch.testing.assert_close(model(idx, targets), expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="longer than model.seq_len"):
        model(torch.zeros(1, cfg.seq_len + 1, dtype=torch.long))


def test_zero_offload_in_the_model_config_points_at_the_cluster_files_lever():
    from hybrid.models.gpt.training import zero_options

    with pytest.raises(ConfigError, match=r"^zero.offload_optimizer in the model config is not read: .* the "
                                          r"cluster file's parallel.offload"):
        zero_options({"offload_optimizer": {"device": "cpu"}})
    assert zero_options({"reduce_bucket_size": 1000}) == {"reduce_bucket_size": 1000}


def test_train_options_are_checked_with_the_shared_vocabulary():
    from hybrid.models.sections import TRAIN_DEFAULTS, train_options

    assert train_options(None) == TRAIN_DEFAULTS
    from hybrid.models.gpt.training import training_config

    sgd = training_config(train_options({"lr": 0.1, "optimizer": {"type": "SGD", "params": {"momentum": 0.9}},
                                         "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}}),
                          stage=2, precision="fp32", offload=True)
    assert (sgd.optimizer.type, sgd.optimizer.lr, sgd.optimizer.extra) == ("SGD", 0.1, (("momentum", 0.9),))
    assert sgd.scheduler.type == "WarmupLR" and sgd.zero.offload_optimizer.enabled
    assert train_options({"lr": "5e-3", "gradient_clipping": 0})["lr"] == 0.005  # YAML's string 5e-3
    for section, message in (({"lr": -1}, "train.lr must be a number above 0, got -1."),
                             ({"lr": float("inf")}, "train.lr must be a number above 0, got inf."),
                             ({"branching": 0}, "train.branching must be a positive integer, got 0."),
                             ({"lrr": 1}, "train.lrr is not a known setting; use one of: lr, weight_decay, "
                                          "gradient_clipping, branching, optimizer, scheduler."),
                             ({"optimizer": {"type": "SGD", "params": {"momentun": 0.9}}},
                              "train.optimizer.params.momentun is not a known setting; use one of: adam_w_mode, dampening, "
                              "decoupled_weight_decay, lr, maximize, momentum, nesterov, weight_decay."),
                             ({"optimizer": {"type": "AdamW", "tpye": "x"}},
                              "train.optimizer.tpye is not a known setting; use one of: adam_w_mode, amsgrad, betas, "
                              "decoupled_weight_decay, eps, lr, maximize, params, type, weight_decay."),
                             ({"optimizer": {"adam_w_mode": True, "decoupled_weight_decay": False}},
                              "train.optimizer.decoupled_weight_decay and train.optimizer.adam_w_mode disagree (torch's and "
                              "DeepSpeed's name for the same switch); keep one of them."),
                             ({"lr": 0.01, "optimizer": {"lr": 0.001}},
                              "train.lr=0.01 and train.optimizer.lr=0.001 disagree; set lr in one place (remove one "
                              "of them)."),
                             ({"weight_decay": 0.1, "optimizer": {"type": "SGD", "params": {"weight_decay": 0}}},
                              "train.weight_decay=0.1 and train.optimizer.params.weight_decay=0 disagree; set "
                              "weight_decay in one place (remove one of them)."),
                             ([1], "train must be a mapping like {lr: 0.005}, got list [1].")):
        with pytest.raises(ConfigError) as err:
            train_options(section)
        assert str(err.value) == message
    # the same value in both places is not a conflict; the optimizer's alone sets it
    assert training_config(train_options({"lr": "1e-2", "optimizer": {"lr": 0.01}}), 1, "fp32").optimizer.lr == 0.01
    assert training_config(train_options({"optimizer": {"lr": 0.02}}), 1, "fp32").optimizer.lr == 0.02
