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

What follows from the row (properties, for the pieces that ask a narrower question):

| stage | ``n_shards(N)`` | ``norm_over_dp`` | ``grads_all_reduced`` | ``bucket_buffers`` | ``kept_gathered``      |
|-------|-----------------|------------------|-----------------------|--------------------|------------------------|
| 0     | 1               | no               | yes                   | no                 | every unit             |
| 1     | N               | yes              | no                    | no                 | every unit             |
| 2     | N               | yes              | no                    | yes                | every unit             |
| 3     | N               | yes              | no                    | yes                | the persistent unit    |

* ``n_shards(N)``: how many ways the flat layout is cut on a DP group of N ranks;
* ``norm_over_dp``: each rank's gradient-norm partial sums cover its shard only, so they are summed over DP;
* ``grads_all_reduced``: the gradients are all-reduced whole (else reduce-scattered): on gloo an all-reduce
  goes through the pairwise exchange only from ``EXCHANGE_MIN_NUMEL`` elements, a reduce-scatter always
  (``hybrid.plan.layout.exchange_numel``);
* ``bucket_buffers``: gradients pass through transient unit-sized buckets reduced during backward and added
  into the shard; CPU ranks keep reduced buckets for the next backward (``hybrid.plan.layout.kept_bucket_numel``);
* ``kept_gathered``: which units' full parameters are held between steps ("all", or "persistent" where the
  parameters are sharded: the rest is gathered around each unit's forward and backward, by hooks on the
  unit roots, which a ``torch.compile``'d model cannot take).

Nothing else in the engine, the memory model or the planner tests the stage number: a new stage (or an
offload variant) is a new row.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StagePolicy:
    stage: int
    shard_optimizer: bool  # master weights and moments: this rank's shard only (what offload needs)
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

    @property
    def grads_all_reduced(self) -> bool:
        """Whether the gradients are all-reduced whole (else reduce-scattered)."""
        return self.grad_mode == "all_reduce"

    @property
    def bucket_buffers(self) -> bool:
        """Whether gradients pass through transient unit-sized buckets (reduced in backward, kept on CPU)."""
        return self.grad_mode == "scatter_shard"

    @property
    def kept_gathered(self) -> str:
        """Which units' full parameters are held between steps: "all", or "persistent" (the rest is gathered
        around each unit's forward and backward)."""
        return "persistent" if self.shard_params else "all"


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
