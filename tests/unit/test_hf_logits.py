"""A Hugging Face causal LM's logits left split by vocabulary (``hybrid.tp.hf_logits``), in one process.

``causal_lm_loss`` over the whole vocabulary is transformers' ``ForCausalLMLoss`` (loss and gradient: the label
shift, ``ignore_index``, the mean over kept tokens, ``num_items_in_batch``, ``shift_labels``). ``logits_refusal``
reads the forward: Llama, Gemma 2 (soft-capped logits) and Cohere (``logit_scale``) keep the split; a forward that
takes a log-softmax, adds a bias over the vocabulary, slices it, computes its own loss or has a head that scales
each vocabulary entry after its product (as Dory's does) is refused in a phrase.
``splits_logits`` (the planner's question) on whole models, on models split at TP 1 as the launcher holds
them, and after ``split_logits``, whose model gives the loss it gave before. ``parallelize``'s two questions
(these logits, and ``hybrid.tp.regions``') read one run of the forward. The multi-rank parity is
tests/dist/test_hf_vocab_loss.py.
"""

import pytest
import torch
import torch.nn.functional as F

import hybrid
from hybrid.tp import apply_plan, causal_lm_loss, hf_plan, splits_logits
from hybrid.tp.forward_record import shared
from hybrid.tp.hf_logits import logits_refusal, output_head, split_logits, uses_split_logits
from hybrid.tp.plan import plan_notes
from hybrid.tp.styles import ColwiseLinear

transformers = pytest.importorskip("transformers")
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402

VOCAB = 64
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=16, use_cache=False)


def _labels(generator) -> torch.Tensor:
    labels = torch.randint(0, 11, (2, 5), generator=generator)
    labels[0, 2] = labels[1, 4] = -100
    return labels


@pytest.mark.parametrize("extra", [{}, {"num_items_in_batch": torch.tensor(7)}, {"shift_labels": "given"},
                                   {"ignore_index": 3}])
def test_causal_lm_loss_over_the_whole_vocabulary_is_transformers_loss(extra):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g, requires_grad=True)
    labels = _labels(g)
    if extra.get("shift_labels") == "given":
        extra = {"shift_labels": _labels(g)}
    if "ignore_index" in extra:
        labels = labels.masked_fill(labels == -100, extra["ignore_index"])
    expected = ForCausalLMLoss(logits, labels, 11, **extra)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    actual = causal_lm_loss(logits, labels, 11, **extra)
    (actual_grad,) = torch.autograd.grad(actual, logits)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(actual_grad, expected_grad, rtol=1e-5, atol=1e-7)


def test_no_kept_token_is_nan_as_in_transformers():
    labels = torch.full((1, 4), -100)
    assert torch.isnan(causal_lm_loss(torch.randn(1, 4, 8), labels, 8))
    assert torch.isnan(ForCausalLMLoss(torch.randn(1, 4, 8), labels, 8))


def _forward_with(model, input_ids, labels, logits_of):
    logits = logits_of(type(model).__mro__[1].forward(model, input_ids=input_ids).logits)
    loss = model.loss_function(logits=logits, labels=labels, vocab_size=VOCAB) if labels is not None else None
    return CausalLMOutputWithPast(loss=loss, logits=logits)


class LogSoftmaxFirst(transformers.LlamaForCausalLM):
    def forward(self, input_ids=None, labels=None, **kwargs):
        return _forward_with(self, input_ids, labels, lambda z: z.log_softmax(-1))


class VocabBias(transformers.LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.final_logits_bias = torch.nn.Parameter(torch.zeros(VOCAB))

    def forward(self, input_ids=None, labels=None, **kwargs):
        return _forward_with(self, input_ids, labels, lambda z: z + self.final_logits_bias)


class VocabSlice(transformers.LlamaForCausalLM):
    def forward(self, input_ids=None, labels=None, **kwargs):
        return _forward_with(self, input_ids, labels, lambda z: z[..., : VOCAB - 4])


class OwnLoss(transformers.LlamaForCausalLM):
    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = super().forward(input_ids=input_ids).logits
        return CausalLMOutputWithPast(loss=F.mse_loss(logits, logits.detach() + 1), logits=logits)


class ScaledHead(torch.nn.Linear):
    """A head of its own that scales each vocabulary entry after its product (as Dory's does)."""

    def __init__(self, config):
        super().__init__(config.hidden_size, VOCAB, bias=False)
        self.scale = torch.nn.Parameter(torch.ones(VOCAB))

    def forward(self, x):
        return super().forward(x) * self.scale


class OwnHead(transformers.LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.lm_head = ScaledHead(config)


def _meta(build):
    with hybrid.empty_init():
        return build()


def test_the_forward_decides_whether_the_logits_stay_split():
    for config in (transformers.LlamaConfig(**SHAPE), transformers.Gemma2Config(**SHAPE, head_dim=8),
                   transformers.CohereConfig(**SHAPE)):
        model = _meta(lambda: transformers.AutoModelForCausalLM.from_config(config))
        assert logits_refusal(model) is None, type(model).__name__
    refusals = {cls.__name__: logits_refusal(_meta(lambda: cls(transformers.LlamaConfig(**SHAPE))))
                for cls in (LogSoftmaxFirst, VocabBias, VocabSlice, OwnLoss, OwnHead)}
    assert refusals == {
        "LogSoftmaxFirst": "its forward applies _log_softmax to the logits before the loss",
        "VocabBias": f"its forward combines the logits with a tensor over the vocabulary (add with a tensor of "
                     f"shape ({VOCAB},)) before the loss",
        "VocabSlice": "its forward applies slice over the vocabulary of the logits before the loss",
        "OwnLoss": "its forward applies mse_loss over the vocabulary of the logits before the loss",
        "OwnHead": f"its forward combines the logits with a tensor over the vocabulary (mul with a tensor of "
                   f"shape ({VOCAB},)) before the loss",
    }, refusals


def test_splits_logits_answers_for_whole_models_and_models_split_at_tp1():
    llama = _meta(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)))
    assert splits_logits(llama, 2) and not splits_logits(llama, 1)
    split_at_tp1 = _meta(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)))
    apply_plan(split_at_tp1, hf_plan(split_at_tp1), None)  # as the launcher holds it; its forward traced so
    assert splits_logits(split_at_tp1, 2) and not splits_logits(split_at_tp1, 1)
    refused = _meta(lambda: VocabBias(transformers.LlamaConfig(**SHAPE)))
    assert not splits_logits(refused, 2)
    moe = _meta(lambda: transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(
        **SHAPE, num_local_experts=2, num_experts_per_tok=1)))
    assert not splits_logits(moe, 2)
    head_whole = _meta(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)))
    apply_plan(head_whole, {k: v for k, v in hf_plan(head_whole).items() if k != "lm_head"}, None)
    assert not splits_logits(head_whole, 2)


def test_split_logits_gives_the_loss_the_model_gave():
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**SHAPE, head_dim=8))
    ids = torch.randint(0, VOCAB, (2, 8))
    before = model(input_ids=ids, labels=ids).loss
    apply_plan(model, hf_plan(model), None)
    split_logits(model, None)
    assert type(output_head(model)) is ColwiseLinear and uses_split_logits(model) and splits_logits(model, 2)
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, before, rtol=1e-6, atol=0)


def test_parallelize_runs_the_forward_once_for_the_logits_and_the_regions():
    """Inside ``shared`` (as ``parallelize`` asks both of the whole model) one run of the forward answers both
    questions, each as it answers alone: Apertus's xIELU scalars summed over TP, its logits split."""
    runs = []

    def apertus():
        model = _meta(lambda: transformers.AutoModelForCausalLM.from_config(transformers.ApertusConfig(**SHAPE)))
        model.register_forward_pre_hook(lambda *_: runs.append(1))
        return model

    alone = apertus()
    refusal = logits_refusal(alone)
    apply_plan(alone, hf_plan(alone), None)
    assert len(runs) == 2
    runs.clear()
    together = apertus()
    with shared(together):
        assert logits_refusal(together) == refusal is None
        apply_plan(together, hf_plan(together), None)
    assert len(runs) == 1
    assert plan_notes(together) == plan_notes(alone) == [
        "gradients of the whole parameters between split layers summed over TP "
        "(model.layers.*.mlp.act_fn.alpha_p, model.layers.*.mlp.act_fn.alpha_n)"]
