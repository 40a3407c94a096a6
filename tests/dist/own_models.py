"""Ordinary PyTorch models that read parameters the way real code does, for the stage-3 unit tests.

* ``EncoderNet``: ``nn.TransformerEncoder`` of ``nn.TransformerEncoderLayer`` s (whose
  ``nn.MultiheadAttention`` passes ``out_proj.weight`` to a functional call) under an embedding whose
  weight the root's forward reads with ``F.linear`` (a tied head).
* ``FunctionalNet``: blocks that read their children's weights functionally (``F.linear(x, self.fc1.weight)``,
  ``x @ self.fc2.weight.t()``), never calling the children.
* ``AuxLossNet``: blocks that keep an auxiliary loss on themselves (as MoE routers do) after computing what
  they return; the model adds them to its loss, so backward reaches each block's weights before (and
  besides) the gradient of its output.
* ``SequentialNet``: an ``nn.Sequential`` of blocks; ``CheckpointedNet`` the same with the whole
  ``Sequential`` in one ``torch.utils.checkpoint`` region (so backward recomputes two units at once).

All take ``(idx, targets)`` and return the mean cross-entropy; sizes come from ``zero_models``.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.dist.zero_models import DIM, HIDDEN, VOCAB, Block


class EncoderNet(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, nhead=2, dim_feedforward=HIDDEN, dropout=0.0, batch_first=True,
                                           activation="gelu", norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        for p in self.encoder.parameters():  # the clones start equal; make the layers differ
            p.data.add_(0.05 * torch.randn_like(p))
        for layer in self.encoder.layers:
            # The key bias cannot change attention, so its gradient is rounding noise that Adam would
            # amplify into order-dependent updates: freeze the in-projection bias.
            layer.self_attn.in_proj_bias.requires_grad_(False)

    def forward(self, idx, targets):
        h = self.encoder(self.emb(idx))
        logits = F.linear(h, self.emb.weight)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class FunctionalBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        h = F.gelu(F.linear(self.ln(x), self.fc1.weight, self.fc1.bias))
        return x + h @ self.fc2.weight.t() + self.fc2.bias


class FunctionalNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(FunctionalBlock() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class AuxBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x):
        out = x + self.fc(self.ln(x))
        self.aux_loss = self.fc(self.ln(x)).pow(2).mean()  # made after the output, kept on the module
        return out


class AuxLossNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(AuxBlock() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx, targets):
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        loss = F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())
        return loss + 0.1 * sum(block.aux_loss for block in self.blocks)


class SequentialNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.body = nn.Sequential(*(Block(DIM, HIDDEN) for _ in range(2)))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx, targets):
        return F.cross_entropy(self.head(self.ln_f(self.body(self.emb(idx)))).flatten(0, 1), targets.flatten())


class CheckpointedNet(SequentialNet):
    def forward(self, idx, targets):
        h = checkpoint(self.body, self.emb(idx), use_reentrant=False)
        return F.cross_entropy(self.head(self.ln_f(h)).flatten(0, 1), targets.flatten())


def plain_forward(model, x, y, step: int, micro: int):
    return model(x, y)
