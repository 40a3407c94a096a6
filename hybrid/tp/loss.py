"""Cross-entropy over vocabulary-parallel logits, without gathering the full logits.

Each TP rank holds the logits of its contiguous vocabulary slice ``[r·V/t, (r+1)·V/t)``. The loss per
token is ``log Σ_v exp(z_v − m) − (z_y − m)`` with ``m`` the global max (for numerical stability), and all
three global quantities come from TP all-reduces of per-token scalars: the max (MAX), the target logit
(only the owning rank contributes, SUM) and the sum of exponentials (SUM). The gradient with respect to
the local logits is ``softmax − onehot(y)`` restricted to the local slice, so backward needs no
communication.

Targets equal to ``ignore_index`` (-100, as ``F.cross_entropy`` and Hugging Face labels use) get loss 0 and
no gradient; any other target outside ``[0, V)`` is refused (``check_vocab_ids``), as ``F.cross_entropy``
would refuse it.

Memory: one fp32 copy of the local logits (shifted, exponentiated and normalised in place, saved as the
softmax); backward turns that saved softmax into the gradient in place (so the loss can be back-propagated
once: a second backward through it raises), then casts to the logits' dtype (a copy only when not fp32).

``causal_lm_loss`` is transformers' ``ForCausalLMLoss`` over vocabulary-parallel logits: the same label shift
(``labels[..., 1:]`` padded with ``ignore_index``, or ``shift_labels`` as given), the same reduction (the mean
over the kept tokens, or their sum over ``num_items_in_batch``), the logits never gathered.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybrid.comm.collectives import Comm
from hybrid.tp.layers import check_vocab_ids
from hybrid.tp.sharding import tp_rank_size

IGNORE_INDEX = -100  # F.cross_entropy's default, and Hugging Face's label for tokens without a loss


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, comm, ignore_index, vocab_size):
        rank, tp = tp_rank_size(comm)
        talk = comm is not None and not comm.solo  # a one-rank group communicates too when forced (Comm.solo)
        local_vocab = logits.shape[-1]
        if talk:
            _check_even_split(comm, local_vocab, logits.device)
        if vocab_size is not None and local_vocab * tp != vocab_size:
            raise ValueError(f"vocab_parallel_cross_entropy: logits of {local_vocab} entries on each of {tp} TP "
                             f"rank(s) are not a vocabulary of {vocab_size}: give each rank its V/tp slice (a "
                             "ColumnParallelLinear head, or F.linear with the VocabParallelEmbedding's weight)")
        start = rank * local_vocab
        ctx.logits_dtype = logits.dtype
        ignored = targets == ignore_index
        check_vocab_ids(targets.masked_fill(ignored, 0), local_vocab * tp, "target")

        logits_max = logits.max(dim=-1).values.float()
        if talk:
            comm.all_reduce(logits_max, op=dist.ReduceOp.MAX)
        shifted = logits.float() if logits.dtype != torch.float32 else logits.clone()
        shifted.sub_(logits_max.unsqueeze(-1))

        local_targets = targets - start
        outside = (local_targets < 0) | (local_targets >= local_vocab)
        local_targets = local_targets.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)

        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        if talk:
            # One all-reduce for both per-token sums.
            both = torch.stack([target_logit, sum_exp])
            comm.all_reduce(both)
            target_logit, sum_exp = both[0], both[1]

        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_targets, outside, ignored)
        ctx.consumed = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.consumed:
            raise RuntimeError("vocab_parallel_cross_entropy: backward ran twice through the same loss "
                               "(its saved softmax becomes the gradient in place); recompute the loss instead "
                               "of retain_graph=True")
        ctx.consumed = True
        softmax, local_targets, outside, ignored = ctx.saved_tensors
        grad = softmax  # in place: the saved softmax is not needed again
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_targets.unsqueeze(-1), -hit.unsqueeze(-1))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 tp_comm: Optional[Comm] = None, ignore_index: int = IGNORE_INDEX,
                                 vocab_size: Optional[int] = None) -> torch.Tensor:
    """Per-token loss (shape of ``targets``, fp32) from this rank's vocabulary slice of ``logits``.

    ``targets`` hold global vocabulary ids in ``[0, V)`` or ``ignore_index`` (loss 0, no gradient: a mean
    over the kept tokens is the caller's); every TP rank gets the same loss. The TP ranks must hold equal
    slices (checked once per width: a ``ValueError`` on every rank otherwise); with ``vocab_size`` given,
    logits that are not its slices (the full logits on every rank, from a plain ``nn.Linear`` head) are
    refused too.
    """
    return _VocabParallelCrossEntropy.apply(logits, targets, tp_comm, ignore_index, vocab_size)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: Optional[int] = None,
                   num_items_in_batch=None, ignore_index: int = IGNORE_INDEX,
                   shift_labels: Optional[torch.Tensor] = None, *, tp_comm: Optional[Comm] = None,
                   **_unused) -> torch.Tensor:
    """A Hugging Face causal LM's loss (transformers' ``ForCausalLMLoss``, its arguments, and ``tp_comm``: the
    TP group the vocabulary is split over; None or one rank: the whole vocabulary here) from this TP rank's
    vocabulary slice of ``logits`` (``[..., V/tp]``): position ``i`` predicts ``labels[..., i + 1]`` (or
    ``shift_labels[..., i]``), targets equal to ``ignore_index`` count for nothing, and the loss is their mean
    (``nan`` when none is kept, as ``F.cross_entropy``'s) or, with ``num_items_in_batch``, their sum divided by
    it. Every TP rank gets the same scalar (fp32); ``vocab_size``, when given, is checked against the slices."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(logits.device)
    per_token = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets, tp_comm,
                                             ignore_index, vocab_size)
    total = per_token.sum()
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


_EVEN: set = set()  # (comm, local width) already seen equal on every TP rank


def _check_even_split(comm: Comm, local_vocab: int, device) -> None:
    """Every TP rank must hold the same number of logits (the ranks derive V and their slice's start from
    it): one small all-reduce, and a host sync, the first time a width is seen."""
    key = (id(comm.group), local_vocab)
    if key in _EVEN:
        return
    widths = torch.tensor([local_vocab], dtype=torch.float64, device=device)
    widest, narrowest = (int(t[0]) for t in comm.extremes(widths))
    if widest != narrowest:
        raise ValueError(f"vocab_parallel_cross_entropy: the TP ranks hold logits of {narrowest} to {widest} "
                         "vocabulary entries; each must hold an equal V/tp slice (hybrid.tp layers split the "
                         "vocabulary evenly, a hand-made split must too)")
    _EVEN.add(key)
