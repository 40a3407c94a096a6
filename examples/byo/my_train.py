"""A user's own entrypoint: the built-in GPT, trained by a loop written here on the model config's token file.

``hybrid launch`` imports this module on every rank from the shipped working directory, so it needs to be
importable from nowhere else. Whatever a rank prints reaches the driver's terminal prefixed ``(rank N ...)``.
"""

import os

from hybrid.models.gpt.config import GPTConfig
from hybrid.models.gpt.training import build_engine, data_path, open_token_file, train_options
from hybrid.runtime.train import run_steps, stream_batches


def train(ctx):
    here = ",".join(sorted(os.listdir(".")))  # what was shipped with the code
    print(f"{os.environ['GREETING']} rank {ctx.rank} of {ctx.world_size} in {os.getcwd()} holding {here}", flush=True)
    config = GPTConfig.from_dict(ctx.model_config["model"])
    engine = build_engine(ctx, config, train_options(ctx.model_config.get("train")))
    # data: is relative to the model config as the user wrote it; this rank may read a shipped copy of it
    path = data_path(ctx.model_config["data"], ctx.model_config_origin)
    data = open_token_file(path, ctx.local_path(path), config, seed=ctx.settings.seed)
    # a step is micro_batch x gradient_accumulation_steps rows per rank (run_steps cuts the micro-batches);
    # stream_batches serves this rank's rows and keeps the data position in every checkpoint, so a resume
    # (at another DP size or micro-batch too) reads on after the rows already read
    rows = ctx.settings.micro_batch * ctx.settings.gradient_accumulation_steps
    summary = run_steps(ctx, engine, stream_batches(ctx, data, rows), tokens_per_step=rows * ctx.mesh.dp * config.seq_len)
    return {**summary, "reference_loss": {"name": "unigram entropy of the data", "nats": data.unigram_entropy}}
