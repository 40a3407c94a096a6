"""DeepSpeed settings hybrid has no field for: ignored where they cannot change the training, else refused.

``DEEPSPEED_KNOBS`` is the one list, by DeepSpeed path (a ``zero`` section is read as ``zero_optimization``).
``drop_deepspeed_knobs(section, where, ignored)`` is a config without them: a harmless value is dropped (its path
appended to ``ignored``, which ``TrainConfig.from_dict`` logs in one line), any other value raises its reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from hybrid.config import validate as v
from hybrid.errors import ConfigError


@dataclass(frozen=True)
class _Knob:
    """A DeepSpeed setting without a field here: values for which ``harmless`` holds change nothing (performance,
    logging, checkpoint format) and are ignored; any other value is refused with ``why`` (reason and fix)."""

    harmless: Callable[[Any], bool] = lambda value: True
    why: str = ""


def _only(expected: Any) -> Callable[[Any], bool]:
    """Harmless only as ``expected`` (``True`` never passes for ``1``)."""
    return lambda value: isinstance(value, bool) == isinstance(expected, bool) and value == expected


def _no_param_offload(value: Any) -> bool:
    return value is None or isinstance(value, Mapping) and value.get("device", "none") in ("none", None)


_IGNORED = _Knob()
DEEPSPEED_KNOBS = {
    **{key: _IGNORED for key in (
        "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
        "memory_breakdown", "dump_state", "tensorboard", "wandb", "csv_monitor", "comms_logger", "flops_profiler",
        "bf16.immediate_grad_update",
        "zero_optimization.stage3_max_live_parameters", "zero_optimization.stage3_max_reuse_distance",
        "zero_optimization.round_robin_gradients", "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "zero_optimization.stage3_gather_fp16_weights_on_model_save", "zero_optimization.load_from_fp32_weights",
        "zero_optimization.ignore_unused_parameters", "zero_optimization.memory_efficient_linear",
        "zero_optimization.elastic_checkpoint",
        "zero_optimization.allgather_partitions",  # false: broadcasts instead of an all-gather, the same values
        "zero_optimization.offload_optimizer.buffer_count", "zero_optimization.offload_optimizer.fast_init",
        "zero_optimization.offload_optimizer.pipeline_read", "zero_optimization.offload_optimizer.pipeline_write",
        "aio")},  # the swap store always pipelines its reads and writes, with its own threads and buffers
    "zero_optimization.offload_optimizer.ratio": _Knob(_only(1.0), "other than 1.0 (offloading part of the "
                                                       "optimizer) is not supported; remove it: all of it is offloaded"),
    "zero_optimization.offload_param": _Knob(_no_param_offload, "(ZeRO-Infinity parameter offload) is not "
                                             "supported; remove it (offload_optimizer: {device: cpu} is supported)"),
    # zero_quantized_weights, zero_quantized_gradients, zero_hpz_partition_size and mics_shard_size are
    # ZeroConfig fields (quantized_weights, quantized_gradients, secondary_shard, shard_group)
    "zero_optimization.zero_quantized_nontrainable_weights": _Knob(_only(False), "(ZeRO++ quantized frozen "
                                                                   "weights) would change them; remove it"),
    "zero_optimization.mics_hierarchical_params_gather": _Knob(
        lambda value: isinstance(value, bool) and not value,
        "is MiCS's two-level parameter all-gather; use zero_optimization.hierarchical: true (both the gradient "
        "reduce-scatter and the parameter all-gather, in two levels)"),
    # either value averages the gradients over DP, as here: the loss pre-divided by the DP size, or AVG in
    # the collective where the backend has it (NCCL); the two orders differ only in rounding
    "prescale_gradients": _Knob(lambda value: isinstance(value, bool), "must be true or false"),
    "communication_data_type": _Knob(lambda value: value is None, "is not a setting here; use "
                                     "zero_optimization.reduce_dtype (fp32 or bf16) for the dtype gradients are "
                                     "reduced in"),
    "data_types": _Knob(lambda value: not value, "is not a setting here; use zero_optimization.reduce_dtype "
                        "(fp32 or bf16) for the dtype gradients are reduced and accumulated in"),
    "gradient_predivide_factor": _Knob(_only(1.0), "other than 1.0 is not supported: gradients are averaged in "
                                       "one fixed order here; remove it"),
    "activation_checkpointing": _Knob(lambda value: not value, "(DeepSpeed's checkpointing API settings) has no "
                                      "effect here; remove it, and checkpoint activations in the model "
                                      "(torch.utils.checkpoint, or parallel.activation_checkpointing for the "
                                      "built-in GPT)"),
}


def _deepspeed_path(path: str) -> str:
    """``path`` as the DeepSpeed spelling names it in ``DEEPSPEED_KNOBS``."""
    return "zero_optimization" + path[4:] if path == "zero" or path.startswith("zero.") else path


def drop_deepspeed_knobs(section: dict, where: str, ignored: list) -> dict:
    """``section`` without the ``DEEPSPEED_KNOBS`` set to a harmless value (their paths appended to ``ignored``);
    one set to another value raises its reason."""
    out = {}
    for key, value in section.items():
        path = v.join(where, key)
        knob = DEEPSPEED_KNOBS.get(_deepspeed_path(path)) if isinstance(key, str) else None
        if knob is None:
            below = _deepspeed_path(path) + "."
            nested = isinstance(value, Mapping) and any(name.startswith(below) for name in DEEPSPEED_KNOBS)
            out[key] = drop_deepspeed_knobs(value, path, ignored) if nested else value
        elif knob.harmless(value):
            ignored.append(path)
        else:
            raise ConfigError(f"{path} {knob.why}.")
    return out
