"""A model of your own, built on the meta device and trained at ZeRO stage 3 on 2 local gloo ranks.

    python examples/meta_stage3.py

No rank ever holds the whole model: ``hybrid.initialize`` materializes each rank's shard straight from the
meta model. The last lines check the result against ``hybrid.materialize`` (the same model in one process).
"""

import torch
import torch.distributed as dist
from torch import nn

import hybrid
from hybrid.runtime.local_launch import run_local


def build() -> nn.Module:
    with torch.device("meta"):  # nothing is allocated, nothing initialized yet
        return nn.Sequential(nn.Embedding(512, 256), nn.Flatten(), nn.Linear(8 * 256, 512), nn.GELU(),
                             nn.Linear(512, 512))


def train_rank() -> dict:
    rank = dist.get_rank()
    engine = hybrid.initialize(build(), {"zero_optimization": {"stage": 3}, "precision": "fp32",
                                         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, seed=1234)
    initial = engine.full_state_dict()  # a collective: every rank
    data = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(5):
        ids = torch.randint(0, 512, (4, 8), generator=data)
        loss = nn.functional.cross_entropy(engine(ids), ids[:, 0])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"initial": initial, "losses": losses, "init_report": engine.init_report}


def main() -> None:
    results = run_local(train_rank, 2)
    reference = hybrid.materialize(build(), seed=1234).state_dict()
    same = all(torch.equal(results[0]["initial"][k], v) for k, v in reference.items())
    print("losses per rank:", [[round(x, 4) for x in r["losses"]] for r in results])
    print("construction:", results[0]["init_report"])
    print("initial weights equal hybrid.materialize:", same)


if __name__ == "__main__":
    main()
