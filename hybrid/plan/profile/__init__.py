"""A model's profile, measured from the model itself: FLOPs, activation bytes and eager ops of one micro-step.

``profile_model(model, batch, seq)`` runs one micro-batch's forward and backward of any ``nn.Module`` on fake
tensors (``FakeTensorMode`` over meta stand-ins of every parameter and buffer, swapped in by
``torch.func.functional_call``: a model built on the meta device or under ``hybrid.empty_init()`` is profiled
without allocating anything) and reads what torch itself counts (``trace``):

- FLOPs of forward and backward (``FlopCounterMode``: matmuls and attention; elementwise ops count nothing, as
  in the analytic ``6·Ψ`` formulas);
- activation bytes saved for backward (``saved_tensors_hooks``; each storage once, parameters and buffers left
  out), per block and outside the blocks; with ``checkpointing`` what remains (the blocks' inputs); of the
  outside, the head's (``head``): what is saved from the head on (its input, what the loss saves) and its
  output, the logits (counted as alive: a causal LM's output keeps them); of a block's, the *whole* ones
  (``block_whole_bytes``): tensors saved as one vector per token of the residual stream's width (``width``, the
  last dimension of the blocks' input) -- the input, norms, residual sums -- which a TP group keeps whole on
  every rank where it splits the rest (heads, MLP columns); a row-parallel projection's input of that shape is
  counted whole though it is split (an over-count of at most one tensor per block), as is an MLP as wide as
  the residual stream;
- eager ops per micro-step (a ``TorchDispatchMode``, less ``detach``).

**Blocks.** The largest ``nn.ModuleList`` of one class (``blocks=`` names another) is cut to 1 and then 2 blocks
(0 and 1 for a one-block model): one block is the difference, *outside* is the rest (embeddings, final norm,
head, loss, and tensors the blocks share: a rotary table), and the profile counts ``layers`` blocks (the list's
length, or ``layers=``). So a 70B config costs two blocks: ``profile_config(config, batch, seq)`` builds a
transformers config's causal LM with 2 layers on meta and scales to its ``num_hidden_layers`` (0.4-0.6 s, some
100 MB). Blocks are taken to be alike: per-layer differences (alternating sliding-window layers) are the first
blocks'.

**Scaling.** Each figure is measured at ``(batch, seq)`` and ``(batch, seq // 2)`` and fitted exactly as
``b·s·(linear + quadratic·s)`` (``figures.Scaling``): the quadratic term is attention's s² (scores in FLOPs; in
bytes only where a kernel materializes them). Terms in ``s`` alone or constant (a rotary table, a tensor
computed from parameters) fold into the two at the measured batch.

**Attention.** ``attention="fused"`` (default) computes ``scaled_dot_product_attention`` on fake CPU tensors, so
torch picks the kernel it picks on a CPU: fused flash, O(s) saved, as a GPU's flash or memory-efficient kernel;
its backward's FLOPs are torch's count for fused kernels, which recompute the scores (10 h·s per token and
layer where the math path does 8). ``attention="math"``: torch's math path (what it takes on meta), which saves
the s² probabilities, as Korthikanti's formula counts. A model's own eager attention materializes them either
way. A checkpoint's recompute takes the forward's kernel where the profile checkpoints (``checkpointing``; a
checkpoint's ``context_fn``: torch function modes do not reach a recompute); a model that checkpoints its blocks
itself can be profiled with ``attention="math"`` only (else one sentence says so). ``dtype``: the compute dtype
(floating parameters and buffers are stood in by it; default: theirs).

**Inputs.** A transformers model gets ``input_ids`` and ``labels`` (its own loss) and ``use_cache=False``; its
``sdpa`` attention runs without a mask, as a step on unpadded windows does (under fake tensors transformers
cannot check for padding or packing and would build an s² mask the real step skips; sliding-window masks are
left out too); its checkpointing is its own (``activation_checkpointing_enable``). Any other model gets token
ids for its forward's first argument and for ``targets``/``labels`` if it takes one (or ``example(batch, seq,
device)``'s arguments: a tuple, or a dict of keyword arguments); its loss, or its first output needing a
gradient, summed, is back-propagated; ``checkpointing`` wraps each block in ``torch.utils.checkpoint``.

**Errors.** A model whose profile cannot be taken (a forward that reads values, such as ``.item()``; an op
without a fake kernel) raises ``ProfileError`` (a ``ConfigError``): one sentence naming the op and the
exception -- never a silent zero. The model is left as it was.
"""

from hybrid.plan.profile.figures import ModelProfile, Part, Scaling
from hybrid.plan.profile.measure import find_blocks, profile_config, profile_model
from hybrid.plan.profile.trace import ProfileError

__all__ = ["ModelProfile", "Part", "Scaling", "ProfileError", "find_blocks", "profile_config", "profile_model"]
