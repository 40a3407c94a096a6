"""``zero.reduce_dtype: fp32`` with bf16 parameters keeps fp32 gradients (4 bytes a parameter, not 2): the
planner's stage choice counts them as the complete prediction (``predict_memory``) does, and ``hybrid
launch``/``hybrid plan`` take the dtype from the model config's ``zero:`` section."""

from pathlib import Path

from hybrid.config.training import ZeroConfig
from hybrid.models.gpt.model import GPT, GPTConfig
from hybrid.plan.memory import offload_bytes, predict_memory
from hybrid.zero.units import model_units
from hybrid.plan.planner import choose_stage
from launch.planning.plan import build_plan
from launch.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
PARAMS, GB = 10**9, 10**9


def test_the_stage_choice_counts_fp32_gradients_of_a_bf16_model():
    # 1B parameters on 2 GPUs of 11 GB: stage 1 holds 2 + 2 + 6 GB with bf16 gradients, 2 + 4 + 6 with fp32
    bf16 = choose_stage(PARAMS, 2, 1, 11 * GB, "bf16", headroom=0.0, offload=False)
    fp32 = choose_stage(PARAMS, 2, 1, 11 * GB, "bf16", headroom=0.0, offload=False, reduce_dtype="fp32")
    assert [bf16.stages[s].grads for s in range(4)] == [2 * PARAMS, 2 * PARAMS, PARAMS, PARAMS]
    assert [fp32.stages[s].grads for s in range(4)] == [4 * PARAMS, 4 * PARAMS, 2 * PARAMS, 2 * PARAMS]
    assert (bf16.stage, fp32.stage) == (1, 2) and fp32.stages[2].total == 10 * GB
    assert offload_bytes(PARAMS, 2, 2, precision="bf16", reduce_dtype="fp32").device == 2 * PARAMS + 2 * PARAMS


def test_the_planners_model_states_are_the_complete_predictions():
    cfg = GPTConfig(vocab_size=512, seq_len=32, n_layers=2, hidden=128, n_heads=4)
    units = model_units(GPT(cfg, device="meta"))
    params = sum(units.numels)
    plan = choose_stage(params, 2, 1, 10**12, "bf16", reduce_dtype="fp32")
    for stage in range(4):
        predicted = predict_memory(units, 2, stage, "bf16", zero=ZeroConfig(stage=stage, reduce_dtype="fp32"))
        for kind in ("grads", "optimizer"):  # equal up to alignment padding
            planned, full = getattr(plan.stages[stage], kind), getattr(predicted, kind)
            assert abs(planned - full) <= 0.01 * full, (stage, kind, planned, full)


def _spec(config: Path):
    return parse_spec({
        "cluster": {"address": "local", "nodes": 1, "gpus_per_node": 2, "gpu_memory_gb": 80},
        "job": {"entrypoint": "hybrid.models.gpt:train", "config": str(config), "steps": 3},
        "parallel": {"tp": 1, "precision": "bf16"},
    }, base_dir=ROOT)


def test_hybrid_plan_takes_the_reduce_dtype_from_the_model_configs_zero_section(tmp_path):
    tiny = (ROOT / "configs" / "gpt-tiny.yaml").read_text()
    plain, fp32 = tmp_path / "plain.yaml", tmp_path / "fp32.yaml"
    plain.write_text(tiny)
    fp32.write_text(tiny + "zero:\n  reduce_dtype: fp32\n")
    grads = {name: build_plan(_spec(path)).plan.stages[0].grads for name, path in (("bf16", plain), ("fp32", fp32))}
    assert grads["fp32"] == 2 * grads["bf16"] > 0
