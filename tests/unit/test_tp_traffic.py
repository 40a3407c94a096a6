"""The TP collectives a plan's split makes (``hybrid.tp.traffic``), as the time model prices them: a Llama block
split by its own plan makes 2 all-reduces in forward (o_proj, down_proj) and 5 in backward (q, k, v, gate, up),
the 33 calls per micro-step at 4 layers counted on real ranks (7 x 4 + the embedding, the head, the loss's 3)."""

import dataclasses

import pytest

transformers = pytest.importorskip("transformers")

import hybrid  # noqa: E402
from hybrid.plan.cost import LOSS_CALLS, Layout, ModelShape, TpCalls, tp_traffic  # noqa: E402
from hybrid.plan.profile import find_blocks  # noqa: E402
from hybrid.tp import apply_plan  # noqa: E402
from hybrid.tp.hf import hf_plan  # noqa: E402
from hybrid.tp.traffic import block_collectives  # noqa: E402


def _llama():
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2)
    with hybrid.empty_init():
        model = transformers.AutoModelForCausalLM.from_config(config)
    apply_plan(model, hf_plan(model), None)
    return model


def test_a_llama_block_split_by_its_own_plan_makes_two_calls_forward_and_five_backward():
    _, blocks = find_blocks(_llama())
    calls = block_collectives(blocks[0], 64)
    assert calls == TpCalls(forward=2, backward=5, forward_width=64 + 64, backward_width=5 * 64,
                            by_style=(("colwise", 0, 5, 5 * 64), ("rowwise", 2, 0, 64 + 64)))


def test_the_built_in_gpts_block_makes_megatrons_two_and_two_and_its_profile_carries_them():
    """The GPT's own TP layers count as their styles: the column-parallel QKV and MLP input gradients in backward,
    the row-parallel projections' outputs in forward; ``gpt_figures``' profile carries the count to the time
    model, which prices the same calls it priced for the GPT before (2 + 2 per block)."""
    from launch.planning.model_size import gpt_figures

    figures = gpt_figures({"vocab_size": 512, "seq_len": 32, "n_layers": 4, "hidden": 64, "n_heads": 8}, "fp32")
    assert figures.plain.tp_block == TpCalls(2, 2, 128, 128, (("colwise", 0, 2, 128), ("rowwise", 2, 0, 128)))
    shape = figures.cost_shape()
    formulas = ModelShape(10**6, layers=4, hidden=64, heads=8, seq=32, vocab=512)  # tp_block None: the GPT's
    for ac in (False, True):
        lay = Layout(1, 2, 2, 1, 4, 1, ac, False, "fp32")
        assert tp_traffic(shape, lay) == pytest.approx(tp_traffic(formulas, lay))


def test_the_time_model_prices_the_plans_calls_instead_of_the_gpts():
    gpt = ModelShape(10**6, layers=4, hidden=64, heads=8, seq=32, vocab=512)
    llama = dataclasses.replace(gpt, tp_block=TpCalls(2, 5, 128, 320))
    for ac, recomputed in ((False, 0), (True, 2)):
        lay = Layout(1, 2, 2, 1, 4, 1, ac, False, "fp32")
        _, gpt_calls = tp_traffic(gpt, lay)
        nbytes, calls = tp_traffic(llama, lay)
        assert gpt_calls == (4 + recomputed) * 4 + 2 + LOSS_CALLS
        assert calls == (7 + recomputed) * 4 + 2 + LOSS_CALLS  # 33 without checkpointing, as counted on ranks
        ring, tokens = 2 * (2 - 1) / 2, 4 * 32
        width = (128 * (2 if ac else 1) + 320) * 4 + 2 * 64
        assert nbytes == pytest.approx((width * ring * tokens + LOSS_CALLS * ring * tokens) * 4)
