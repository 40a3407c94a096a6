"""The process groups and collectives a ZeRO engine runs on, cut from its DP group by the ``zero`` options.

``ZeroGroups.build(dp_group, zero, policy, device)`` (collective over the DP group) learns where the DP ranks run
(``hybrid.comm.groups.group_nodes``), cuts the group as ``hybrid.plan.links.ShardTopology`` says for
``zero.shard_group``, ``zero.hierarchical`` and ``zero.secondary_shard`` (one sentence where the placement does
not allow them), creates this rank's sub-groups -- kind by kind, in the same order on every rank
(``hybrid.comm.groups.subgroup``) -- and gives the engine:

* ``dp``: the whole DP group (the initial broadcast, buffer broadcasts, stage 0's all-reduce, the unit check);
* ``exact``: the shard group's collectives, exact (the after-step all-gather, ``full_state_dict``, the
  gradient norm's sums);
* ``params``: the same, with stage 3's parameter all-gathers in int8 where ``zero.quantized_weights`` says so;
* ``grads``: the same, with the gradient reduce-scatter in int8 where ``zero.quantized_gradients`` says so;
* ``replicas``: the comm across the shard groups (each unit's gradient shard all-reduced once per step), or None;
* ``secondary``: hpZ's node-local comm for backward's all-gathers, or None;
* ``position``: the shard this rank owns (its shard group rank, or ``l·m + n`` when hierarchical).

Every comm knows the node of each of its ranks, so its bytes are counted per link; ``report()`` sums them over
the engine's comms. Without options every one of these is the DP group itself, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from hybrid.comm.collectives import Comm
from hybrid.comm.groups import global_ranks, group_nodes, subgroup
from hybrid.comm.sharded import CommSet, ShardCollectives
from hybrid.plan.links import ShardTopology


@dataclass
class ZeroGroups(CommSet):
    topology: ShardTopology
    dp: Comm
    exact: ShardCollectives
    params: ShardCollectives
    grads: ShardCollectives
    replicas: Optional[Comm]
    secondary: Optional[Comm]

    @property
    def position(self) -> int:
        return self.exact.rank

    @property
    def shard_size(self) -> int:
        return self.topology.shard

    @classmethod
    def build(cls, dp_group, zero, policy, device=None) -> "ZeroGroups":
        nodes = group_nodes(dp_group, device)
        if policy.shard_optimizer:
            topology = ShardTopology.of(nodes, zero.shard_group, zero.hierarchical,
                                        zero.secondary_shard if policy.shard_params else "none")
        else:
            topology = ShardTopology.of(nodes)
        dp = Comm(dp_group, "dp", nodes=nodes)
        ranks = global_ranks(dp_group) if dist.is_available() and dist.is_initialized() else [0]
        me = dp.rank

        def comm(groups: list, name: str) -> Optional[Comm]:
            """This rank's group of ``groups`` (DP ranks) as a Comm; None where there is none."""
            mine = next((g for g in groups if me in g), None)
            if mine is None:
                return None
            if len(mine) == topology.size:
                return dp
            return Comm(subgroup([ranks[r] for r in mine]), f"dp.{name}", nodes=[nodes[r] for r in mine])

        # created kind by kind, in this order on every rank (new_group pairs the members' calls in order)
        intra = comm(topology.intra_groups(), "intra")
        inter = comm(topology.inter_groups(), "inter")
        flat = comm(topology.shard_groups(), "shard")
        replicas = comm(topology.replica_groups(), "replica")
        secondary = comm(topology.secondary_groups(), "secondary")

        def collectives(weights: bool, gradients: bool) -> ShardCollectives:
            return ShardCollectives(flat, intra, inter,
                                    gather_block=zero.quantization_block if weights else None,
                                    reduce_block=zero.quantization_block if gradients else None)

        exact = collectives(False, False)
        if exact.rank != topology.position(me):
            raise RuntimeError(f"internal error: shard position {exact.rank} of DP rank {me} is not the "
                               f"topology's {topology.position(me)}")
        return cls(topology, dp, exact, collectives(zero.quantized_weights != "none", False),
                   collectives(False, zero.quantized_gradients != "none"), replicas, secondary)

    # -- bookkeeping -----------------------------------------------------------------------------------
    @property
    def comms(self) -> list:
        """Every distinct comm, once."""
        out = []
        for c in [self.dp, *self.exact.comms, self.replicas, self.secondary]:
            if c is not None and all(c is not o for o in out):
                out.append(c)
        return out

    def quantization_report(self) -> dict:
        """The relative error of the values this rank quantized since the last reset (None: none quantized)."""
        return {"weights": self.params.gather_error.relative(), "gradients": self.grads.reduce_error.relative()}

    def quantization_sums(self) -> dict:
        """``QuantError.sums()`` of the weights' and the gradients' int8 collectives since the last reset."""
        return {"weights": self.params.gather_error.sums(), "gradients": self.grads.reduce_error.sums()}

    def reset_quantization(self) -> None:
        self.params.gather_error.reset()
        self.grads.reduce_error.reset()
