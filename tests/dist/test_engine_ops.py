"""The time model's eager ops per micro-step against the count on real ranks.

A micro-step's host cost is its eager ops at ``hw.op_overhead`` each (``hybrid.plan.cost``): the model's own, as
its profile counts them on fake tensors, plus what the ZeRO engine's hooks and input handling add per parameter
tensor and once (``ENGINE_OPS_PER_TENSOR`` / ``ENGINE_OPS_FIXED``) and each TP collective's ops
(``OPS_PER_TP_CALL``). Here two real gloo ranks train the built-in GPT and a Hugging Face Llama (grouped-query
attention) as the built-in loops build them, at TP 1 (DP 2, stages 0 and 1) and TP 2 (stage 3), and count each
micro-step's dispatched ops with the profile's own counter (``OpCounter``: less ``detach``); the plan's figure for
the same model and layout (``launch.planning.model_size`` -> ``ModelShape.ops_per_micro_step``) is within 8 % of
the count, the third step's (the first two warm the engine's buffers).
"""

import pytest

from hybrid.runtime.local_launch import run_local

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

SEQ, MICRO_BATCH, TOLERANCE = 32, 2, 0.08
GPT = {"vocab_size": 256, "seq_len": SEQ, "n_layers": 3, "hidden": 64, "n_heads": 4}
LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
         "max_position_embeddings": 2 * SEQ, "tie_word_embeddings": False, "use_cache": False}
LAYOUTS = [(1, 0), (1, 1), (2, 3)]  # (tp, stage) on two ranks


def _counted(kind: str, tp: int, stage: int) -> int:
    """Ops of the third micro-step of ``kind`` on this rank, built and split as the built-in loops do."""
    import torch
    import torch.distributed as dist

    import hybrid
    from hybrid.comm.mesh import build_mesh
    from hybrid.config.training import TrainConfig, ZeroConfig
    from hybrid.models import GPT as BuiltIn, GPTConfig
    from hybrid.models.hf import causal_lm_batch, new_model
    from hybrid.plan.profile.trace import OpCounter
    from hybrid.runtime.train import Context, JobSettings

    mesh = build_mesh(tp=tp)
    config = TrainConfig(zero=ZeroConfig(stage=stage), precision="fp32")
    if kind == "gpt":
        model = BuiltIn(GPTConfig(**GPT), tp_comm=mesh.tp_comm, device="meta")
        engine = hybrid.initialize(model, config, dp_group=mesh.dp_group, tp_group=mesh.tp_group)

        def loss_of(window):
            return engine(window[:, :-1], window[:, 1:])
    else:
        ctx = Context(mesh, {}, JobSettings(steps=3, micro_batch=MICRO_BATCH, stage=stage), rank=dist.get_rank(),
                      world_size=dist.get_world_size())
        with hybrid.empty_init():
            model = new_model(transformers.AutoConfig.for_model(**LLAMA))
        model = ctx.parallelize(model)
        engine = hybrid.initialize(model, config, dp_group=mesh.dp_group, tp_group=mesh.tp_group, seed=0,
                                   init_fn=model._init_weights)

        def loss_of(window):
            return engine(**causal_lm_batch(window[:, :-1], window[:, 1:])).loss
    window = torch.randint(0, 256, (MICRO_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(mesh.dp_rank))
    for _ in range(3):
        counter = OpCounter()
        with counter:
            engine.backward(loss_of(window))
        engine.step()
    return counter.count


def _rank(cases: list) -> list:
    return [_counted(*case) for case in cases]


def _predicted(tmp_path, kind: str, tp: int, stage: int) -> int:
    """The plan's ops per micro-step for the same model and layout, by the product's own functions."""
    import json

    from hybrid.plan.cost import Layout, tp_traffic
    from launch.planning.model_size import gpt_figures, model_facts, model_figures
    from launch.spec import load_spec

    if kind == "gpt":
        figures = gpt_figures({**GPT, "mlp_ratio": 4}, "fp32")
    else:
        (tmp_path / "config.json").write_text(json.dumps(LLAMA))
        (tmp_path / "model.yaml").write_text(f"hf: {{config: config.json, seq_len: {SEQ}}}\n")
        (tmp_path / "cluster.yaml").write_text(
            "cluster: {address: local, nodes: 1, gpus_per_node: 2, gpu_memory_gb: 8}\n"
            "job: {entrypoint: 'hybrid.models.hf:train', config: model.yaml, steps: 3}\n")
        figures = model_figures(model_facts(load_spec(tmp_path / "cluster.yaml")), "fp32", "hybrid.models.hf:train")
    shape = figures.cost_shape()
    layout = Layout(1, 2, tp, stage, MICRO_BATCH, 1, precision="fp32")
    return shape.ops_per_micro_step(False, stage, tp_traffic(shape, layout)[1])


def test_the_planned_ops_per_micro_step_are_what_the_ranks_dispatch(tmp_path):
    """One world of two ranks runs the six cases one after another (a few CPU-seconds each)."""
    cases = [(kind, tp, stage) for kind in ("gpt", "llama") for tp, stage in LAYOUTS]
    counted = run_local(_rank, 2, cases, timeout_s=300)
    assert counted[0] == counted[1]  # both ranks run the same ops
    for case, ops in zip(cases, counted[0]):
        predicted = _predicted(tmp_path, *case)
        print(f"{case}: counted {ops}, predicted {predicted} ({predicted / ops - 1:+.1%})")
        assert abs(predicted / ops - 1) <= TOLERANCE, (case, ops, predicted)
