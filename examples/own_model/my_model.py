"""Bring your own model: a plain PyTorch model (no tensor-parallel layers) and the loop that trains it.

``build_model(model_config, tp_comm=None)`` is the hook the launcher calls on the driver, under
``torch.device("meta")``, to count the parameters and see that the model has no TP layers (so ``tp: auto``
plans tp = 1 and DP over every rank); ``train(ctx)`` calls it again on each rank, also on meta, and
``hybrid.initialize`` gives every parameter its values (``reset_parameters`` of each module, seeded by the
module's name) straight into the rank's shard.

A step is ``job.micro_batch × gradient_accumulation_steps`` rows per rank (the engine is built with the job's
accumulation), as ``hybrid.models.gpt.training.train`` does.

``ctx.parallelize(model)`` splits the model over the rank's TP group by the cluster file's
``parallel.tp_plan`` when it gives one (``cluster-tp.yaml``: the launcher then plans TP 2); without one it
returns the model as it is.
"""

import torch
import torch.nn.functional as F
from torch import nn

import hybrid
from hybrid.data import MarkovTokens
from hybrid.models.gpt.training import training_config
from hybrid.runtime.train import run_steps


class Block(nn.Module):
    """A pre-norm residual MLP block."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Next-token model: embedding, a Sequential of blocks, a norm and an output layer."""

    def __init__(self, vocab_size: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.blocks = nn.Sequential(*(Block(hidden) for _ in range(layers)))
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab_size, bias=False)

    def forward(self, idx, targets):
        logits = self.out(self.norm(self.blocks(self.embed(idx))))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_model(model_config, tp_comm=None):
    m = model_config["model"]
    return TinyLM(m["vocab_size"], m["hidden"], m["layers"])


def train(ctx):
    m, opt = ctx.model_config["model"], ctx.model_config["train"]
    with torch.device("meta"):
        model = build_model(ctx.model_config, ctx.mesh.tp_comm)
    model = ctx.parallelize(model)  # parallel.tp_plan over the TP group, when the cluster file gives one
    # training_config: the engine's TrainConfig at the planned stage, precision, optimizer offload and the
    # job's gradient accumulation (a re-plan may raise it: the engine must step once per accumulated step)
    config = training_config({"lr": opt["lr"], "weight_decay": 0.0, "gradient_clipping": 1.0}, ctx.stage,
                             ctx.settings.precision, offload=ctx.settings.offload,
                             accumulation=ctx.settings.gradient_accumulation_steps, nvme_path=ctx.settings.nvme_path)
    engine = hybrid.initialize(model, config, dp_group=ctx.mesh.dp_group, tp_group=ctx.mesh.tp_group,
                               seed=ctx.settings.seed, device=ctx.device)
    data = MarkovTokens(m["vocab_size"], m["seq_len"], seed=ctx.settings.seed)
    # A step is micro_batch x gradient_accumulation_steps rows per rank, trained as micro-batches of
    # micro_batch (run_steps cuts them): a re-plan that halves the micro-batch and doubles the accumulation
    # keeps the step's rows.
    rows, mesh = ctx.settings.micro_batch * ctx.settings.gradient_accumulation_steps, ctx.mesh

    def batches(step):  # a pure function of the step: each DP rank its own slice of the step's batch
        inputs, targets = data.batch(step, rows, mesh.dp_rank, mesh.dp)
        return inputs.to(ctx.device), targets.to(ctx.device)

    summary = run_steps(ctx, engine, batches, tokens_per_step=rows * mesh.dp * m["seq_len"])
    return {**summary, "tp": mesh.tp, "dp": mesh.dp, "stage": ctx.stage,
            "reference_loss": {"name": "synthetic chain floor", "nats": data.loss_floor}}
