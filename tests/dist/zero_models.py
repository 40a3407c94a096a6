"""Models, data and the single-process reference shared by the ZeRO engine tests.

``ParityNet`` has everything the engine must get right: parameter sizes not divisible by the DP size, a
frozen parameter, a tied embedding/head weight, and an ``aux`` layer that some micro-steps skip.
``WideNet`` (~1.7M parameters) is big enough for memory and traffic to be dominated by model states;
its dimensions keep every unit free of padding, so traffic can be checked to the byte.
"""

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.config.training import TrainConfig
from hybrid.config.schedule import lr_at
from hybrid.zero.param_groups import torch_param_groups

VOCAB, DIM, HIDDEN = 37, 22, 45
STEPS, ACCUM, GLOBAL_BATCH, SEQ = 10, 2, 8, 6
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 2e-2, (0.9, 0.95), 1e-8, 0.1, 0.5


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = True):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class ParityNet(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, DIM), requires_grad=False)  # frozen
        self.blocks = nn.ModuleList(Block(DIM, HIDDEN) for _ in range(2))
        self.aux = nn.Linear(DIM, DIM)
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx, targets, use_aux: bool = True):
        x = self.emb(idx) * self.scale
        for block in self.blocks:
            x = block(x)
        if use_aux:
            x = x + torch.tanh(self.aux(x))
        return F.cross_entropy(self.head(self.ln_f(x)).flatten(0, 1), targets.flatten())


def uses_aux(step: int, micro: int) -> bool:
    """aux is skipped for whole steps (step % 3 == 1) and for one micro-step of others."""
    return not (step % 3 == 1 or (step % 4 == 2 and micro == 0))


def batch(step: int, micro: int, vocab: int = VOCAB, rows: int = GLOBAL_BATCH, seq: int = SEQ):
    g = torch.Generator().manual_seed(7919 * step + micro)
    data = torch.randint(0, vocab, (rows, seq + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def rank_rows(rank: int, world: int, rows: int = GLOBAL_BATCH) -> slice:
    per = rows // world
    return slice(rank * per, (rank + 1) * per)


def config(stage: int, precision: str = "fp32", **zero) -> dict:
    """A DeepSpeed-style dict with small buckets, so every model is cut into several units."""
    z = {"stage": stage, "reduce_bucket_size": 1000, "allgather_bucket_size": 1500,
         "stage3_prefetch_bucket_size": 2000, "stage3_param_persistence_threshold": 30, "sub_group_size": 500}
    z.update(zero)
    return {"zero_optimization": z, "bf16": {"enabled": precision == "bf16"},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                      "weight_decay": WEIGHT_DECAY}},
            "gradient_clipping": CLIP, "gradient_accumulation_steps": ACCUM}


def parity_forward(model, x, y, step: int, micro: int):
    return model(x, y, uses_aux(step, micro))


def reference(engine_config=None, lrs=None, make=ParityNet, forward=parity_forward, steps: int = STEPS,
              make_optimizer=None):
    """``make()`` (ParityNet) trained single-process on the global batches by the torch class of
    ``engine_config`` (a config dict; default: ``config(0)``, AdamW) over the engine's default parameter
    groups (or by ``make_optimizer(model)``), its schedule as a ``LambdaLR``; the learning rate of every step
    is appended to ``lrs``."""
    cfg = TrainConfig.from_dict(engine_config or config(0))
    opt_cfg = cfg.optimizer
    model = make()
    params = [p for p in model.parameters() if p.requires_grad]  # one unused for a whole step: grad None, skipped
    if make_optimizer is not None:
        opt = make_optimizer(model)
    else:
        opt = opt_cfg.torch_class(torch_param_groups(model, opt_cfg), **opt_cfg.torch_kwargs(), foreach=False)
    sched = None
    if cfg.scheduler is not None:
        s = cfg.scheduler
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda i: lr_at(s.type, s.values, opt_cfg.lr, i, opt_cfg.lr) / opt_cfg.lr)
    losses, norms = [], []
    for step in range(steps):
        for micro in range(ACCUM):
            x, y = batch(step, micro)
            loss = forward(model, x, y, step, micro)
            (loss / ACCUM).backward()
            losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(params, CLIP).item())
        if lrs is not None:
            lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    # state_dict()'s keys, as full_state_dict() gives them (ParityNet's tied head.weight included)
    return losses, norms, {n: t.detach().clone() for n, t in model.state_dict().items()}


def train_engine(engine, rank: int, world: int, forward=parity_forward, steps: int = STEPS):
    """The same schedule through the engine, on this rank's rows; returns (losses, norms, step flags)."""
    losses, norms, stepped = [], [], []
    rows = rank_rows(rank, world)
    for step in range(steps):
        for micro in range(ACCUM):
            x, y = batch(step, micro)
            loss = forward(engine, x[rows], y[rows], step, micro)
            engine.backward(loss)
            stepped.append(engine.step())
            losses.append(loss.item())
        norms.append(engine.last_grad_norm)
    return losses, norms, stepped


class WideNet(nn.Module):
    """~1.7M parameters; every parameter count is a multiple of 16, so no unit needs padding."""

    def __init__(self, vocab: int = 1024, dim: int = 256, hidden: int = 768, layers: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden, bias=False) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln_f(x)).flatten(0, 1), targets.flatten())
