"""The link arithmetic (hybrid.plan.links): how a collective's bytes split by link, the groups the ZeRO options
cut a DP group into, the per-link traffic of a step for each option, the options' keys and their refusals."""

import pytest

from hybrid.config.stage_policy import policy_for
from hybrid.config.training import TrainConfig
from hybrid.errors import ConfigError
from hybrid.plan.links import (Quantization, ShardTopology, inter_fraction, link_totals, quantized_bytes, split,
                               step_traffic)

TWO_BY_TWO = (0, 0, 1, 1)  # 4 DP ranks, 2 per node
TWO_BY_THREE = (0, 0, 0, 1, 1, 1)


def test_a_ring_crosses_nodes_once_per_node():
    assert inter_fraction(1, 8) == 0  # inside one node
    assert inter_fraction(8, 8) == 1  # one rank per node: every byte crosses
    assert inter_fraction(2, 4) == pytest.approx(0.5)  # 2 of the ring's 4 hops leave a node
    assert split(1000, 2, 8) == (750, 250)
    assert quantized_bytes(1000, 256) == 1000 + 4 * 4  # int8 values and one fp32 scale per block


def test_shard_groups_replicas_and_positions():
    topo = ShardTopology.of(TWO_BY_THREE, "node")
    assert topo.shard == 3 and topo.replicas == 2
    assert topo.shard_groups() == [[0, 1, 2], [3, 4, 5]]
    assert topo.replica_groups() == [[0, 3], [1, 4], [2, 5]]
    assert [topo.position(r) for r in range(6)] == [0, 1, 2, 0, 1, 2]
    assert (topo.spans().shard.nodes, topo.spans().replica.nodes) == (1, 2)
    straddling = ShardTopology.of(TWO_BY_THREE, 2).spans(2)  # rank 2's group [2, 3] spans both nodes
    assert (straddling.shard.nodes, straddling.replica.nodes) == (2, 2)

    two = ShardTopology.of(TWO_BY_THREE, 2)  # [2, 3] straddles the nodes
    assert two.shard_groups() == [[0, 1], [2, 3], [4, 5]] and two.replicas == 3
    assert ShardTopology.of(TWO_BY_THREE, "all").shard == 6


def test_hierarchical_positions_let_no_level_permute_data():
    topo = ShardTopology.of(TWO_BY_THREE, hierarchical=True)
    assert topo.intra_groups() == [[0, 1, 2], [3, 4, 5]]
    assert topo.inter_groups() == [[0, 3], [1, 4], [2, 5]]
    # local index l on node n owns shard l*m + n: node part l (the intra step's) holds the l-th ranks' shards
    assert [topo.position(r) for r in range(6)] == [0, 2, 4, 1, 3, 5]
    hpz = ShardTopology.of(TWO_BY_THREE, hierarchical=True, secondary="node")
    assert hpz.secondary_groups() == [[0, 1, 2], [3, 4, 5]] and hpz.secondary == 3


@pytest.mark.parametrize("nodes, kwargs, start", [
    ((0, 0, 1, 1), dict(shard=3), "zero.shard_group is 3 ranks but that does not divide the DP size 4; choose"),
    ((0, 1, 2, 3), dict(secondary="node"), "zero.secondary_shard keeps a secondary parameter shard among the DP "
                                           "ranks of one node (hpZ), but there is one DP rank per node here"),
    ((0, 1, 2, 3), dict(hierarchical=True), "zero.hierarchical splits collectives into a step inside each node and "
                                            "one across nodes, but the shard group of 4 DP ranks is one DP rank"),
    ((0, 0, 1, 1), dict(shard="node", hierarchical=True), "zero.hierarchical splits collectives into a step inside "
                                                          "each node and one across nodes, but the shard group of 2"),
    ((0, 0, 1, 1), dict(shard="node", secondary="node"), "zero.secondary_shard saves backward's all-gather across "
                                                         "nodes, but the shard group of 2 DP ranks is inside one"),
    ((0, 0, 0, 0, 1, 1, 1, 1), dict(secondary=3), "zero.secondary_shard is 3 ranks but a shard group has 4 DP "
                                                  "ranks per node"),
    ((0, 0, 0, 1), dict(shard="node"), "zero.shard_group is node but the DP ranks are spread unevenly"),
])
def test_bad_combinations_are_one_sentence(nodes, kwargs, start):
    with pytest.raises(ConfigError) as err:
        ShardTopology.of(nodes, **kwargs)
    assert str(err.value).startswith(start) and "\n" not in str(err.value), str(err.value)


UNITS = [1024, 2048, 512]  # padded elements of three units


def _totals(stage, topo, accumulation=1, quant=Quantization(), persistent=()):
    return link_totals(step_traffic(UNITS, persistent, policy_for(stage), topo, 4, 4, accumulation, quant))


def test_flat_stages_send_their_bytes_over_k_across_nodes():
    psi = sum(UNITS) * 4
    flat = ShardTopology.flat(4, 2)  # 2 DP ranks per node
    for stage, multiple in ((0, 2), (1, 2), (2, 2), (3, 3)):
        t = _totals(stage, flat)
        assert t["total"] == multiple * psi and t["inter"] == multiple * psi / 2, stage
    one_per_node = ShardTopology.flat(4, 1)
    assert _totals(3, one_per_node)["inter"] == 3 * psi  # ZeRO's 3Ψ, all of it across nodes


def test_the_options_move_less_across_nodes():
    psi = sum(UNITS) * 4
    stage2 = _totals(2, ShardTopology.flat(4, 2))["inter"]
    hier = ShardTopology.of(TWO_BY_TWO, hierarchical=True)
    assert _totals(3, hier)["inter"] == _totals(3, ShardTopology.flat(4, 2))["inter"]  # the same bytes, k NICs
    hpz = ShardTopology.of(TWO_BY_TWO, hierarchical=True, secondary="node")
    assert _totals(3, hpz)["inter"] == stage2 == psi  # backward's gather stays in the node
    q = Quantization(True, True, 256)
    # the forward gather and the reduce-scatter of half the units' elements each, one byte each (+ scales)
    assert _totals(3, hpz, quant=q)["inter"] == pytest.approx(sum(UNITS) * (1 + 4 / 256), rel=0.02)
    assert _totals(3, hpz, quant=q)["inter"] < _totals(3, ShardTopology.flat(4, 2))["inter"] / 3
    node = ShardTopology.of(TWO_BY_TWO, "node")  # HSDP: only the gradient shards' all-reduce crosses
    assert _totals(3, node)["inter"] == psi  # each rank all-reduces its half: 2 x psi/2
    assert _totals(3, node, accumulation=4)["inter"] == _totals(3, node)["inter"]  # once per optimizer step


def test_the_options_keys_and_deepspeeds_names():
    z = TrainConfig.from_dict({"zero_optimization": {"stage": 3, "mics_shard_size": 8, "zero_hpz_partition_size": 4,
                                                     "zero_quantized_weights": True,
                                                     "zero_quantized_gradients": True}}).zero
    assert (z.shard_group, z.secondary_shard, z.quantized_weights, z.quantized_gradients) == (8, 4, "int8", "int8")
    z = TrainConfig.from_dict({"zero_optimization": {"stage": 3, "mics_shard_size": -1, "zero_hpz_partition_size": 1,
                                                     "zero_quantized_weights": False}}).zero
    assert (z.shard_group, z.secondary_shard, z.quantized_weights) == ("all", "none", "none")
    z = TrainConfig.from_dict({"zero": {"stage": 2, "shard_group": "node", "hierarchical": True,
                                        "quantized_gradients": "int8", "quantization_block": 128}}).zero
    assert (z.shard_group, z.hierarchical, z.quantization_block) == ("node", True, 128)


@pytest.mark.parametrize("d, start", [
    ({"zero": {"stage": 2, "quantized_weights": "int8"}},
     "zero.quantized_weights quantizes the parameter all-gathers of each unit, which only ZeRO stage 3 does"),
    ({"zero_optimization": {"stage": 1, "zero_hpz_partition_size": 8}},
     "zero_optimization.zero_hpz_partition_size keeps a secondary shard of the gathered parameters, which only"),
    ({"zero": {"stage": 0, "quantized_gradients": "int8"}},
     "zero.quantized_gradients quantizes the gradients' reduce-scatter, but zero.stage is 0, which all-reduces"),
    ({"zero": {"stage": 2, "quantized_gradients": "int8", "reduce_scatter": False}},
     "zero.quantized_gradients quantizes the gradients' reduce-scatter, but zero.reduce_scatter is false"),
    ({"zero": {"stage": 0, "shard_group": 2}}, "zero.shard_group changes how the sharded states are reduced"),
    ({"zero": {"stage": 0, "hierarchical": True}}, "zero.hierarchical changes how the sharded states are reduced"),
    ({"zero": {"stage": 3, "shard_group": "half"}}, "zero.shard_group must be all, node or a number of DP ranks"),
    ({"zero": {"stage": 3, "quantized_weights": "int4"}}, "zero.quantized_weights must be one of"),
])
def test_option_refusals_in_the_config(d, start):
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict(d)
    assert str(err.value).startswith(start) and "\n" not in str(err.value), str(err.value)


# ------------------------------------------------------------------------------ per step, in metrics.jsonl
class _Counters:
    """The two readings LinkMeter takes of an engine (``comm_report``, ``quantization_sums``), set by hand."""

    def __init__(self):
        self.intra = self.inter = 0.0
        self.sums = {"weights": None, "gradients": None}

    def comm_report(self):
        return {"intra": self.intra, "inter": self.inter, "total": self.intra + self.inter}

    def quantization_sums(self):
        return dict(self.sums)


def test_each_step_reports_its_own_bytes_per_link_and_int8_error():
    from hybrid.runtime.link_metrics import LinkMeter

    engine = _Counters()
    engine.intra, engine.inter = 100.0, 10.0  # the build and the resume
    meter = LinkMeter(engine)
    meter.step()
    engine.intra, engine.inter, engine.sums["gradients"] = 300.0, 60.0, (1.0, 100.0)
    assert meter.step() == {"dp_intra_bytes": 200.0, "dp_inter_bytes": 50.0, "quant_error_gradients": 0.1}
    engine.intra, engine.inter, engine.sums["gradients"] = 500.0, 110.0, (5.0, 200.0)
    assert meter.step() == {"dp_intra_bytes": 200.0, "dp_inter_bytes": 50.0, "quant_error_gradients": 0.2}
    engine.intra, engine.inter, engine.sums["gradients"] = 20.0, 5.0, (0.04, 1.0)  # reset_comm in between
    assert meter.step() == {"dp_intra_bytes": 20.0, "dp_inter_bytes": 5.0, "quant_error_gradients": 0.2}
    assert LinkMeter(object()).step() == {}  # an engine without the reports


def test_the_entry_takes_the_busiest_rank_and_the_summary_states_multiples_of_psi():
    from launch.job.metrics import link_line, step_entry

    records = {r: {"rank": r, "dp_rank": r, "loss": 1.0, "dp_intra_bytes": 100.0 + r, "dp_inter_bytes": 50.0 - r,
                   "quant_error_weights": 0.001 * (r + 1)} for r in range(2)}
    entry = step_entry(1, records)
    assert (entry["dp_intra_bytes"], entry["dp_inter_bytes"], entry["quant_error_weights"]) == (101.0, 50.0, 0.002)
    assert "quant_error_gradients" not in entry
    history = [{"step": s, "dp_intra_bytes": 300.0, "dp_inter_bytes": 150.0} for s in range(1, 6)]
    line = link_line(history, 100.0, {"intra": 300.0, "inter": 150.0}, "2-level+hpZ")
    assert line == ("ZeRO traffic per GPU and step (median of 2 steps): across nodes 150 B = 1.50 Ψ/t, inside nodes "
                    "300 B = 3.00 Ψ/t; theory for 2-level+hpZ: 1.50 and 3.00 Ψ/t (Ψ/t = 100 B)")
    assert link_line([{"step": 1, "loss": 1.0}], 100.0, {}, "flat") is None


def test_the_plan_weighs_exact_options_and_shows_int8_without_choosing_it():
    from hybrid.plan.candidates import LINK_CHOICES, link_options
    from hybrid.plan.cost import FLAT, Layout

    one_node = Layout(1, 4, 1, 3, 1, 1)
    assert link_options(one_node) == [FLAT]  # the shard group of the one node is all of it; nothing to split
    per_node = Layout(2, 2, 2, 3, 1, 1)  # tp 2 on nodes of 2: one DP rank per node
    assert link_options(per_node) == [FLAT]
    two_by_two = link_options(Layout(2, 2, 1, 3, 1, 1))
    assert two_by_two == list(LINK_CHOICES)
    assert [lk.label for lk in link_options(Layout(2, 2, 1, 2, 1, 1))] == ["", "shard node", "2-level"]

    from launch.planning.plan import build_plan, format_plan
    from tests.unit.test_time_plan import spec_for

    lp = build_plan(spec_for(nodes=2, gpus=2, zero_stage=3, tp=1))
    ranking = lp.time.ranking
    assert ranking.lossy and all(c.layout.links.quantized_weights for c in ranking.lossy)
    assert not any(c.layout.links.quantized_weights or c.layout.links.quantized_gradients
                   for c in ranking.candidates)
    text = format_plan(lp)
    assert "links   ZeRO traffic per GPU and step of tp 1, stage 3" in text
    assert "int8: yours to choose, zero.quantized_weights/gradients" in text and "<- " in text


def test_the_memory_model_shards_over_the_group_and_counts_hpz():
    from hybrid.plan.memory import model_state_bytes

    psi, t = 7 * 10**9, 2
    flat = model_state_bytes(psi, 8, 3, tp=t)
    group = model_state_bytes(psi, 8, 3, tp=t, shard=4)
    assert flat.total == 16 * psi / (t * 8) and group.total == 16 * psi / (t * 4)  # 16Ψ/(t·s), bf16
    hpz = model_state_bytes(psi, 8, 3, tp=t, secondary=2)
    assert hpz.params == flat.params + 2 * psi / (t * 2)  # the secondary shard: P·Ψ/(t·h)
    assert model_state_bytes(psi, 8, 2, tp=t, secondary=2) == model_state_bytes(psi, 8, 2, tp=t)  # stage 3 only


def test_the_model_configs_zero_takes_the_link_options_and_the_plans_yield_to_them():
    from hybrid.models.gpt.training import train_options, training_config, with_plan_links, zero_options

    mine = zero_options({"hierarchical": True, "quantized_weights": "int8", "reduce_bucket_size": 1000})
    assert mine == {"hierarchical": True, "quantized_weights": "int8", "reduce_bucket_size": 1000}
    assert training_config(train_options(None), 3, "fp32", zero=mine).zero.quantized_weights == "int8"
    with pytest.raises(ConfigError, match="zero.quantized_weights quantizes the parameter all-gathers"):
        training_config(train_options(None), 2, "fp32", zero=mine)  # checked against the plan's stage
    plan = {"shard_group": "node"}
    assert with_plan_links(plan, {"reduce_bucket_size": 1000}) == {"shard_group": "node", "reduce_bucket_size": 1000}
    assert with_plan_links(plan, mine) == mine  # the user's link options alone, never a mix
    assert with_plan_links(None, {}) == {}


def test_the_summarys_theory_is_the_plans_options_on_the_placement():
    from launch.planning import replan
    from launch.planning.plan import build_plan
    from tests.unit.test_time_plan import spec_for

    lp = build_plan(spec_for(nodes=2, gpus=2, zero_stage=3, tp=1))
    psi, theory, label = replan.link_theory(lp, replan.initial_choice(lp))
    assert psi == lp.params * 4 and label == "flat"  # fp32; the exact options do not pay on this tiny model
    assert theory["inter"] == pytest.approx(1.5 * psi) and theory["intra"] == pytest.approx(1.5 * psi)  # 3Ψ/t, half across


def test_link_options_and_nvme_offload_are_weighed_priced_and_sized_together():
    """Issue 37 beside issue 38: every offload value (none, host memory, NVMe) meets every link option; the swap
    file and its disk time follow the shard group's shard, and the link options still cut the bytes across
    nodes with the states on NVMe."""
    from dataclasses import replace

    from hybrid.plan.candidates import LINK_CHOICES, layouts
    from hybrid.plan.cost import FLAT, Layout, LinkOptions, ModelShape, step_cost
    from hybrid.plan.hardware import build_hardware
    from hybrid.plan.planner import layout_option

    offered = layouts(2, 2, "bf16", [1], [3], [False], [False, True, "nvme"], 8, links=LINK_CHOICES)
    kinds = {(lay.offload, lay.nvme, lay.links) for lay in offered}
    for off, nvme in ((False, False), (True, False), (True, True)):
        assert {(off, nvme, lk) for lk in LINK_CHOICES} <= kinds, (off, nvme)

    psi = 10**9
    hw = build_hardware("NVIDIA H100 80GB HBM3", "bf16", "nvlink", "infiniband", 2)
    model = ModelShape(psi, 24, 2048, 16, 1024, 50_000)
    node = Layout(2, 2, 1, 3, 1, 1, False, True, "bf16", LinkOptions(shard_group="node"), nvme=True)
    flat = replace(node, links=FLAT)
    assert node.label == "tp1 z3 mb 1 nvme shard node"
    on_node, on_all = step_cost(model, node, hw), step_cost(model, flat, hw)
    assert on_all.nvme_read_bytes == 12 * psi / 4 and on_node.nvme_read_bytes == 12 * psi / 2  # the group's shard
    assert on_node.nvme_s > on_all.nvme_s > 0
    assert on_node.terms["dp_inter_bytes"] < on_all.terms["dp_inter_bytes"]

    sized = layout_option(psi, 4, 1, 3, 80e9, "bf16", offload=True, nvme=True, shard=2, ranks_per_node=2)
    assert sized.nvme and sized.disk_bytes == 12 * psi / 2
    assert layout_option(psi, 4, 1, 3, 80e9, "bf16", offload=True, nvme=True).disk_bytes == 12 * psi / 4
