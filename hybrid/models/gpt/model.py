"""The built-in tensor-parallel GPT: decoder-only, pre-LN, learned positions, untied head.

``GPT(config, tp_comm=None, seed=0)`` builds this TP rank's part of the model. With ``tp_comm=None`` (or a
TP group of size 1) it is the plain single-process model, the correctness reference. With TP degree t:

* token embedding: vocab-parallel; position embedding, layer norms: replicated;
* attention: fused QKV column-parallel with a per-head ``[q, k, v]`` row layout, so each rank's
  contiguous slice holds whole heads (n_heads/t of them); output projection row-parallel;
* MLP: column-parallel up-projection, GELU, row-parallel down-projection;
* LM head: column-parallel over the vocabulary; the loss is the vocab-parallel cross-entropy, so the
  full logits are never gathered in training.

Every parameter carries a ``hybrid.weights.init`` initializer keyed by its name in the GPT; its values are a
function of ``(seed, name)`` only, so the TP model built with seed S holds exactly the slices of the
single-process model built with seed S, and ``GPT(config, device="meta")`` handed to ``hybrid.initialize``
becomes the same model with each rank drawing only what it keeps. ``count_parameters(config)`` builds the model on the meta device (nothing allocated).
With ``activation_checkpointing`` each block is recomputed in backward (TP collectives included).
``GPTConfig.check_tp`` runs first, so a TP degree that does not split the heads, the vocabulary or the MLP
(or dropout with tp > 1) is one ConfigError before anything is allocated.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hybrid.comm.collectives import Comm
from hybrid.models.gpt.config import GPTConfig
from hybrid.weights.attrs import tensor_parallel_dim
from hybrid.tp.collectives import gather_from_tp_region
from hybrid.tp.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from hybrid.tp.loss import IGNORE_INDEX, vocab_parallel_cross_entropy
from hybrid.weights.init import Constant, Normal, set_initializer, stamp_keys
from hybrid.tp.sharding import init_param_, tp_rank_size, tp_slice

__all__ = ["GPT", "GPTConfig", "count_parameters"]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, tp_comm: Optional[Comm], device):
        super().__init__()
        _, tp = tp_rank_size(tp_comm)
        self.local_heads, self.head_dim = cfg.n_heads // tp, cfg.head_dim
        self.dropout = cfg.dropout
        self.qkv = ColumnParallelLinear(cfg.hidden, 3 * cfg.hidden, bias=cfg.bias, tp_comm=tp_comm,
                                        init_std=cfg.init_std, seed=None, device=device)
        self.proj = RowParallelLinear(cfg.hidden, cfg.hidden, bias=cfg.bias, tp_comm=tp_comm,
                                      init_std=_residual_std(cfg), seed=None, device=device)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, self.local_heads, 3, self.head_dim).unbind(3)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, self.local_heads * self.head_dim)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, tp_comm: Optional[Comm], device):
        super().__init__()
        self.fc = ColumnParallelLinear(cfg.hidden, cfg.ffn_hidden, bias=cfg.bias, tp_comm=tp_comm,
                                       init_std=cfg.init_std, seed=None, device=device)
        self.proj = RowParallelLinear(cfg.ffn_hidden, cfg.hidden, bias=cfg.bias, tp_comm=tp_comm,
                                      init_std=_residual_std(cfg), seed=None, device=device)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, tp_comm: Optional[Comm], device):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps, bias=cfg.bias, device=device)
        self.attn = CausalSelfAttention(cfg, tp_comm, device)
        self.ln2 = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps, bias=cfg.bias, device=device)
        self.mlp = MLP(cfg, tp_comm, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, tp_comm: Optional[Comm] = None, seed: int = 0, device=None):
        super().__init__()
        self.config = config
        self.tp_comm = tp_comm
        self.tp_rank, self.tp = tp_rank_size(tp_comm)
        config.check_tp(self.tp)
        self.tok_emb = VocabParallelEmbedding(config.vocab_size, config.hidden, tp_comm=tp_comm,
                                              init_std=config.init_std, seed=None, device=device)
        # Given its weight, nn.Embedding draws nothing: reset_parameters below (or hybrid.initialize, on meta)
        # does. (Its own normal_ on meta imports torch._dynamo and sympy: ~1 CPU-s and ~70 MB per process.)
        self.pos_emb = nn.Embedding(config.seq_len, config.hidden, device=device,
                                    _weight=torch.empty(config.seq_len, config.hidden, device=device))
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, tp_comm, device) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps, bias=config.bias, device=device)
        self.lm_head = ColumnParallelLinear(config.hidden, config.vocab_size, bias=False, tp_comm=tp_comm,
                                            init_std=config.init_std, seed=None, device=device)
        set_initializer(self.pos_emb.weight, Normal(std=config.init_std))
        for module in self.modules():
            if isinstance(module, nn.LayerNorm):
                set_initializer(module.weight, Constant(1.0))
                if module.bias is not None:
                    set_initializer(module.bias, Constant(0.0))
        stamp_keys(self)  # values follow the GPT's own parameter names, even inside a wrapper
        if self.pos_emb.weight.device.type != "meta":
            self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Every parameter from its initializer, seeded by ``seed`` and its name: on meta, ``hybrid.initialize``
        draws exactly these values, only the part each rank keeps."""
        for name, param in self.named_parameters():
            init_param_(param, seed, name, self.tp_rank, self.tp)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` when ``targets`` is None, else the mean next-token loss (a scalar)."""
        t = idx.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence of length {t} is longer than model.seq_len={self.config.seq_len}")
        positions = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        recompute = self.config.activation_checkpointing and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        logits = self.lm_head(self.ln_f(x))  # this rank's vocabulary slice
        if targets is None:
            return gather_from_tp_region(logits, self.tp_comm)
        targets = targets.reshape(-1)
        loss = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets, self.tp_comm,
                                            ignore_index=IGNORE_INDEX, vocab_size=self.config.vocab_size)
        return loss.sum() / (targets != IGNORE_INDEX).sum()  # the mean over kept tokens, as F.cross_entropy

    def full_to_tp_slice(self, name: str, tensor: torch.Tensor, tp_rank: Optional[int] = None,
                         tp: Optional[int] = None) -> torch.Tensor:
        """The TP slice of a full (single-process) parameter ``name`` held by ``tp_rank`` of ``tp``."""
        param = dict(self.named_parameters())[name]
        return tp_slice(tensor, tensor_parallel_dim(param),
                        self.tp_rank if tp_rank is None else tp_rank, self.tp if tp is None else tp)


def _residual_std(cfg: GPTConfig) -> float:
    # GPT-2: scale the projections that write into the residual stream by 1/sqrt(2·layers).
    return cfg.init_std / math.sqrt(2 * cfg.n_layers)


def count_parameters(config: GPTConfig) -> int:
    """Exact parameter count of the single-process model, built on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = GPT(config, device="meta")
    return sum(p.numel() for p in model.parameters())

