"""hybrid.config: our dict, the DeepSpeed-style dict, and one clear error per bad field."""

import copy
import logging

import pytest

from hybrid.config.training import OptimizerConfig, TrainConfig, ZeroConfig
from hybrid.errors import ConfigError


def test_defaults_follow_the_seed_and_torch_adamw():
    cfg = TrainConfig()
    assert cfg.zero == ZeroConfig(stage=0, reduce_bucket_size=500_000_000, allgather_bucket_size=500_000_000,
                                  prefetch_bucket_size=50_000_000, param_persistence_threshold=100_000,
                                  sub_group_size=1_000_000_000)
    assert (cfg.precision, cfg.gradient_clipping, cfg.gradient_accumulation_steps) == ("fp32", None, 1)
    assert cfg.optimizer == OptimizerConfig(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def test_deepspeed_dict():
    cfg = TrainConfig.from_dict({
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8, "allgather_bucket_size": 2e8,
                              "reduce_scatter": True, "overlap_comm": False, "contiguous_gradients": True,
                              "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
                              "sub_group_size": 1e9},
        "bf16": {"enabled": True},
        "fp16": {"enabled": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-6,
                                                  "weight_decay": 0.1}},
        "gradient_clipping": 1.0, "gradient_accumulation_steps": 2,
        "train_micro_batch_size_per_gpu": 4, "train_batch_size": 32,
    })
    z = cfg.zero
    assert (z.stage, z.reduce_bucket_size, z.allgather_bucket_size, z.prefetch_bucket_size) == (3, 500_000_000,
                                                                                             200_000_000, 50_000_000)
    assert (z.param_persistence_threshold, z.sub_group_size, z.overlap_comm) == (100_000, 1_000_000_000, False)
    assert isinstance(z.reduce_bucket_size, int)
    assert cfg.precision == "bf16"
    assert cfg.optimizer == OptimizerConfig(lr=1e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1, no_decay="none")
    assert (cfg.gradient_clipping, cfg.gradient_accumulation_steps) == (1.0, 2)
    cfg.check_batch(dp=4)
    with pytest.raises(ConfigError, match="train_batch_size"):
        cfg.check_batch(dp=2)


def test_our_dict_and_adam_l2_mode():
    cfg = TrainConfig.from_dict({"zero": {"stage": 2, "prefetch_bucket_size": 10}, "precision": "bf16",
                                 "optimizer": {"lr": 0.5, "weight_decay": 0.0}, "gradient_clipping": 0.0})
    assert (cfg.zero.stage, cfg.zero.prefetch_bucket_size, cfg.precision) == (2, 10, "bf16")
    assert cfg.optimizer.lr == 0.5 and cfg.gradient_clipping is None  # 0 means "off", as in DeepSpeed
    adam = TrainConfig.from_dict({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}})
    assert adam.optimizer.decoupled_weight_decay is False
    assert TrainConfig.from_dict({"optimizer": {"type": "Adam"}}).optimizer.decoupled_weight_decay is True


@pytest.mark.parametrize("d, field", [
    ({"zero_optimization": {"stage": 5}}, "zero_optimization.stage"),
    ({"zero": {"stage": "2"}}, "zero.stage"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": -1}}, "zero_optimization.reduce_bucket_size"),
    ({"zero_optimization": {"allgather_bucket_size": 1.5}}, "zero_optimization.allgather_bucket_size"),
    ({"zero_optimization": {"stage3_param_persistence_threshold": -5}},
     "zero_optimization.param_persistence_threshold"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, "zero_optimization.offload_optimizer"),
    ({"zero_optimization": {"overlap_comm": "yes"}}, "zero_optimization.overlap_comm"),
    ({"zero_optimization": {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}},
     "zero_optimization.prefetch_bucket_size"),
    ({"zero": {}, "zero_optimization": {}}, "zero and zero_optimization"),
    ({"stepz_per_print": 10}, "stepz_per_print"),
    ({"fp16": {"enabled": True}}, "fp16"),
    ({"bf16": {"enabled": True, "loss_scale": 0}}, "bf16.loss_scale"),
    ({"precision": "fp16"}, "precision"),
    ({"precision": "fp32", "bf16": {"enabled": True}}, "precision"),
    ({"optimizer": {"type": "LBFGS"}}, "optimizer.type"),
    ({"optimizer": {"type": "NoSuchOpt"}}, "optimizer.type"),
    ({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.9]}}}, "optimizer.params.betas"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
     "zero_optimization.offload_optimizer.device is nvme but zero_optimization.offload_optimizer.path is not set"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_countt": 4}}},
     "zero_optimization.offload_optimizer.buffer_countt"),
    ({"scheduler": {"type": "OneCycle"}}, "scheduler.type"),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5}}},
     "scheduler.params.total_num_steps"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 5}}}, "scheduler.params.warmup_steps"),
    ({"optimizer": {"no_decay": 3}}, "optimizer.no_decay"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}, "no_decay": 3}}, "optimizer.no_decay must be 'auto'"),
    ({"optimizer": {"param_groups": [{"lr_scale": 2}]}}, "optimizer.param_groups[0].names"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "momentum": 0.9}}}, "optimizer.params.momentum"),
    ({"optimizer": {"lr": -1.0}}, "optimizer.lr"),
    ({"optimizer": {"betas": [0.9]}}, "optimizer.betas"),
    ({"optimizer": {"betas": [0.9, 1.0]}}, "optimizer.betas"),
    ({"optimizer": {"eps": 0}}, "optimizer.eps"),
    ({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}, "optimizer.params.adam_w_mode"),
    ({"gradient_clipping": -1}, "gradient_clipping"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
    ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu"),
])
def test_bad_fields_raise_one_error_naming_the_field(d, field):
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict(d)
    assert str(err.value).startswith(field), str(err.value)
    assert "\n" not in str(err.value)


def test_direct_construction_is_checked_too():
    with pytest.raises(ConfigError, match=r"^zero\.stage must be 0, 1, 2 or 3"):
        ZeroConfig(stage=5)
    with pytest.raises(ConfigError, match=r"^zero\.reduce_bucket_size must be a positive integer"):
        ZeroConfig(reduce_bucket_size=-1)
    with pytest.raises(ConfigError, match=r"^precision"):
        TrainConfig(precision="fp16")
    with pytest.raises(ConfigError, match=r"^config must be a mapping"):
        TrainConfig.from_dict([("zero", {})])


def test_reduce_dtype_is_checked_and_defaults_to_the_model_precision():
    assert TrainConfig(precision="bf16").grad_precision == "bf16"  # the seed's bf16 gradients
    cfg = TrainConfig.from_dict({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "reduce_dtype": "fp32"}})
    assert cfg.zero.reduce_dtype == "fp32" and cfg.grad_precision == "fp32"
    with pytest.raises(ConfigError, match="zero_optimization.reduce_dtype"):
        TrainConfig.from_dict({"zero_optimization": {"reduce_dtype": "fp16"}})
    with pytest.raises(ConfigError, match="reduce_dtype is bf16 but precision is fp32"):
        TrainConfig(zero=ZeroConfig(reduce_dtype="bf16"), precision="fp32")


@pytest.mark.parametrize("kind, expected", [("AdamW", 0.01), ("Adam", 0.0), ("SGD", 0.0), ("RMSprop", 0.0),
                                            ("Adagrad", 0.0)])
def test_weight_decay_left_out_of_our_format_is_the_named_torch_classs_default(kind, expected):
    # torch.optim.SGD(lr=0.1) decays nothing; neither may {"type": "SGD", "lr": 0.1}
    ours = TrainConfig.from_dict({"optimizer": {"type": kind, "lr": 0.1}}).optimizer
    assert ours.weight_decay == expected and ours.torch_kwargs()["weight_decay"] == expected
    assert OptimizerConfig(type=kind).weight_decay == expected
    given = TrainConfig.from_dict({"optimizer": {"type": kind, "lr": 0.1, "weight_decay": 0.2}})
    assert given.optimizer.weight_decay == 0.2


@pytest.mark.parametrize("kind", ["AdamW", "Adam", "SGD", "RMSprop", "Adagrad"])
def test_weight_decay_left_out_of_a_deepspeed_params_section_is_zero_as_in_deepspeed(kind):
    # DeepSpeed's FusedAdam / DeepSpeedCPUAdam default to weight_decay 0.0, not torch AdamW's 0.01
    ds = TrainConfig.from_dict({"optimizer": {"type": kind, "params": {"lr": 0.1}}}).optimizer
    assert ds.weight_decay == 0.0 and ds.torch_kwargs()["weight_decay"] == 0.0
    given = TrainConfig.from_dict({"optimizer": {"type": kind, "params": {"lr": 0.1, "weight_decay": 0.2}}})
    assert given.optimizer.weight_decay == 0.2


HF_ZERO3 = {  # a Hugging Face Trainer ZeRO-3 config with its "auto"s filled in
    "fp16": {"enabled": False, "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": True, "immediate_grad_update": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True, "buffer_count": 4, "ratio": 1.0},
        "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": 65536,
        "stage3_prefetch_bucket_size": 58982, "stage3_param_persistence_threshold": 2560,
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True, "round_robin_gradients": True,
        "allgather_partitions": True},
    "gradient_accumulation_steps": 2, "gradient_clipping": 1.0, "steps_per_print": 2000,
    "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "wall_clock_breakdown": False,
    "zero_allow_untested_optimizer": True, "tensorboard": {"enabled": False},
}


def test_a_hugging_face_zero3_config_is_accepted_with_its_no_op_knobs_named_in_one_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="hybrid.config.training"):
        cfg = TrainConfig.from_dict(copy.deepcopy(HF_ZERO3))
    assert (cfg.zero.stage, cfg.zero.offload_optimizer.device, cfg.precision) == (3, "cpu", "bf16")
    assert (cfg.zero.prefetch_bucket_size, cfg.gradient_accumulation_steps) == (58982, 2)
    lines = [r.getMessage() for r in caplog.records if r.name == "hybrid.config.training"]
    assert len(lines) == 1, lines
    for path in ("steps_per_print", "tensorboard", "bf16.immediate_grad_update",
                 "zero_optimization.stage3_gather_16bit_weights_on_model_save",
                 "zero_optimization.offload_optimizer.buffer_count", "zero_optimization.offload_optimizer.ratio",
                 "zero_optimization.allgather_partitions", "zero_optimization.round_robin_gradients"):
        assert path in lines[0]
    assert "stage3_prefetch_bucket_size" not in lines[0]  # used, not ignored


def test_every_unknown_key_of_a_section_is_named_whole_in_one_sentence():
    d = {"zero_optimization": {"stage": 2, "stage3_gather_16bit_weights_on_model_savez": 1, "magic": 2}}
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict(d)
    assert str(err.value).startswith("zero_optimization.stage3_gather_16bit_weights_on_model_savez and "
                                     "zero_optimization.magic are not known settings; use one of: ")
    with pytest.raises(ConfigError) as err:  # a flood of keys is counted, not listed
        TrainConfig.from_dict({"zero_optimization": {"stage": 2, **{f"k{i}": 0 for i in range(5000)}}})
    assert str(err.value).startswith("zero_optimization.k0, zero_optimization.k1, ") and len(str(err.value)) < 2000
    assert "zero_optimization.k9 and 4990 more are not known settings" in str(err.value)


@pytest.mark.parametrize("d, start", [
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}},
     "zero_optimization.offload_param (ZeRO-Infinity parameter offload) is not supported; remove it "
     "(offload_optimizer: {device: cpu} is supported)."),
    ({"zero_optimization": {"zero_quantized_nontrainable_weights": True}},
     "zero_optimization.zero_quantized_nontrainable_weights (ZeRO++"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
     "zero_optimization.offload_optimizer.ratio other than 1.0"),
    ({"prescale_gradients": "yes"}, "prescale_gradients must be true or false."),
    ({"communication_data_type": "fp16"}, "communication_data_type is not a setting here; use "
     "zero_optimization.reduce_dtype"),
    ({"data_types": {"grad_accum_dtype": "fp32"}}, "data_types is not a setting here; use "
     "zero_optimization.reduce_dtype"),
    ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor other than 1.0 is not supported"),
    ({"activation_checkpointing": {"partition_activations": True}}, "activation_checkpointing (DeepSpeed's "
     "checkpointing API settings) has no effect here"),
])
def test_deepspeed_settings_that_would_change_the_training_are_refused_by_name_with_the_reason(d, start):
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict(d)
    assert str(err.value).startswith(start) and "\n" not in str(err.value), str(err.value)


def test_their_no_op_values_are_accepted():
    cfg = TrainConfig.from_dict({"zero_optimization": {"stage": 3, "offload_param": {"device": "none"},
                                                       "zero_quantized_weights": False,
                                                       "allgather_partitions": False},  # broadcasts: same values
                                 "prescale_gradients": False, "gradient_predivide_factor": 1.0})
    assert cfg.zero.stage == 3
    assert TrainConfig.from_dict({"prescale_gradients": True}) == TrainConfig.from_dict({})  # both average


@pytest.mark.parametrize("d, start", [
    ({"train_batch_size": "auto"}, "train_batch_size must be a positive integer, got 'auto' (\"auto\" is a "
     "placeholder the Hugging Face Trainer/Accelerate fill in"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "optimizer.params.lr must be"),
    ({"bf16": {"enabled": "auto"}}, "bf16.enabled must be true or false, got 'auto' (\"auto\" is a placeholder"),
    ({"fp16": {"enabled": "auto"}}, "fp16.enabled is \"auto\" (\"auto\" is a placeholder the Hugging Face "
     "Trainer/Accelerate fill in"),
])
def test_auto_is_explained_as_the_hugging_face_placeholder(d, start):
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict(d)
    message = str(err.value)
    assert message.startswith(start) and "placeholder" in message, message
    if "fp16" in d:
        assert "use bf16" in message


def test_accumulation_left_out_is_derived_from_train_batch_size_as_deepspeed_does():
    cfg = TrainConfig.from_dict({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4})
    assert cfg.check_batch(dp=2).gradient_accumulation_steps == 2
    assert cfg.check_batch(dp=4).gradient_accumulation_steps == 1
    with pytest.raises(ConfigError, match=r"^train_batch_size 16 is not a multiple of micro batch 4 x dp 3 = 12"):
        cfg.check_batch(dp=3)
    given = TrainConfig.from_dict({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                                   "gradient_accumulation_steps": 4})
    assert given.check_batch(dp=1) is given
    with pytest.raises(ConfigError, match=r"^train_batch_size is 16 but micro batch 4 x gradient_accumulation_steps "
                                          r"4 x dp 2 = 32; fix one of them"):
        given.check_batch(dp=2)
    assert TrainConfig.from_dict({"train_batch_size": 16}).gradient_accumulation_steps == 1


def test_the_engine_steps_with_the_derived_accumulation():
    import torch

    import hybrid

    engine = hybrid.initialize(torch.nn.Linear(4, 2), {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4})
    assert engine.config.gradient_accumulation_steps == 3


def test_no_decay_defaults_to_none_in_the_deepspeed_form_and_auto_in_ours():
    deepspeed = TrainConfig.from_dict({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}})
    ours = TrainConfig.from_dict({"optimizer": {"type": "AdamW", "lr": 1e-3, "weight_decay": 0.01}})
    assert deepspeed.optimizer.no_decay == "none" and ours.optimizer.no_decay == "auto"
    asked = TrainConfig.from_dict({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}, "no_decay": "auto"}})
    assert asked.optimizer.no_decay == "auto"
