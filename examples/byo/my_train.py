"""A user's own entrypoint: the built-in GPT, trained by a loop written here on the model config's token file.

``hybrid launch`` imports this module on every rank from the shipped working directory, so it needs to be
importable from nowhere else. Whatever a rank prints reaches the driver's terminal prefixed ``(rank N ...)``.
"""

import os

from hybrid.data import TokenFile
from hybrid.models.gpt_config import GPTConfig
from hybrid.models.gpt_train import build_engine, data_path, train_options
from hybrid.train import run_steps


def train(ctx):
    here = ",".join(sorted(os.listdir(".")))  # what was shipped with the code
    print(f"{os.environ['GREETING']} rank {ctx.rank} of {ctx.world_size} in {os.getcwd()} holding {here}", flush=True)
    config = GPTConfig.from_dict(ctx.model_config["model"])
    engine = build_engine(ctx, config, train_options(ctx.model_config.get("train")))
    data = TokenFile(data_path(ctx.model_config["data"], ctx.model_config_path), config.seq_len, seed=ctx.settings.seed)
    micro_batch, mesh = ctx.settings.micro_batch, ctx.mesh

    def batches(step):  # a pure function of the step: a resumed run sees the same batches
        return data.batch(step, micro_batch, mesh.dp_rank, mesh.dp)

    summary = run_steps(ctx, engine, batches, tokens_per_step=micro_batch * mesh.dp * config.seq_len)
    return {**summary, "reference_loss": {"name": "unigram entropy of the data", "nats": data.unigram_entropy}}
