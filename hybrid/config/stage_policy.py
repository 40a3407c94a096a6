"""What each ZeRO stage shards and which collective moves it: the one table the engine's pieces consult.

| stage | units            | params held       | grads held | grad reduction (mode)   | after the step, all-gather |
|-------|------------------|-------------------|------------|-------------------------|----------------------------|
| 0     | buckets          | full              | full       | all-reduce              | nothing                    |
| 1     | buckets          | full              | full       | reduce-scatter, in place| every unit                 |
| 2     | buckets          | full              | own shard  | reduce-scatter to shard | every unit                 |
| 3     | modules (+ small)| own shard         | own shard  | reduce-scatter to shard | the persistent unit only   |

The fp32 master weights and optimizer state are sharded from stage 1 on (stage 0 keeps one full copy), so
``shard_optimizer`` is also what optimizer offload needs (``config.ZeroConfig`` refuses it at stage 0).
Stages 0-1 reduce once per optimizer step; stages 2-3 at every micro-step (only the shard is kept).
Nothing else in the engine tests the stage number: a new stage (or an offload variant) is a new row.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StagePolicy:
    stage: int
    shard_optimizer: bool  # master weights and moments: this rank's shard only
    shard_grads: bool      # gradients: a persistent shard only (transient buckets in backward)
    shard_params: bool     # parameters: a shard, gathered per unit around forward and backward
    grad_mode: str         # GradReducer mode
    module_units: bool     # units follow the module tree (else gradient buckets)
    refresh: str           # which units are all-gathered after the step: "none" | "all" | "persistent"

    def n_shards(self, dp: int) -> int:
        """How many ways the layout is cut on a DP group of ``dp`` ranks."""
        return dp if self.shard_optimizer else 1

    @property
    def norm_over_dp(self) -> bool:
        """Whether each rank's gradient-norm partial sums cover only its shard (so they are summed over DP)."""
        return self.shard_optimizer


POLICIES = {
    0: StagePolicy(0, shard_optimizer=False, shard_grads=False, shard_params=False, grad_mode="all_reduce",
                   module_units=False, refresh="none"),
    1: StagePolicy(1, shard_optimizer=True, shard_grads=False, shard_params=False, grad_mode="scatter_full",
                   module_units=False, refresh="all"),
    2: StagePolicy(2, shard_optimizer=True, shard_grads=True, shard_params=False, grad_mode="scatter_shard",
                   module_units=False, refresh="all"),
    3: StagePolicy(3, shard_optimizer=True, shard_grads=True, shard_params=True, grad_mode="scatter_shard",
                   module_units=True, refresh="persistent"),
}


def policy_for(stage: int) -> StagePolicy:
    return POLICIES[stage]
