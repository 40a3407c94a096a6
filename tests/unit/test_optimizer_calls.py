"""The optimizer step and the gradient norm cost O(groups) calls, not O(elements); offload's host side.

* The step rule (``hybrid.plan.layout.step_rule``) is one pure function of the device, the gradient dtype,
  ``sub_group_size`` and the scratch memory: a GPU converts and steps a whole sub-group of bf16 gradients at
  once, a CPU 1M elements at a time (cache), and the memory model sizes the fp32 scratch by the same rule.
* The engine at world 1, bf16, stages 1-3: every torch op ``engine.step()`` dispatches (the norm, the
  conversion, the fused AdamW, the write-back, ...) counted for two models with the same layers and 4x the
  hidden width -- the same counts under the GPU's rule (no conversion limit), with a sub-group holding the
  whole shard; under the CPU's rule the wide model, whose matrices pass 1M elements, takes more (so the
  count does see the chunking).
* Offload: the host step runs with the rank's share of its node's cores (``zero.offload_optimizer.threads``
  when set); the host arena is one allocation of the memory model's host figure.
* Offload to NVMe: the same threads; the host arena holds the gradient copy alone (the master and the moments
  are the swap file's records), and with the store's record buffers it is the planner's NVMe host figure; the
  records are the optimizer's batches of the host's step rule (``CONVERT_NUMEL`` with bf16 gradients), so a
  bf16 model with matrices over that size steps bit for bit as with CPU offload.
"""

from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hybrid
from hybrid.config.training import ZeroConfig
from hybrid.plan import layout
from hybrid.plan.memory import offload_bytes, predict_memory
from hybrid.zero.host_threads import host_optimizer_threads, node_cores

# --- the pure rule ------------------------------------------------------------------------------------------
def test_a_gpu_steps_a_whole_sub_group_and_a_cpu_converts_in_cache_sized_chunks():
    assert layout.batch_numel(10**9, grad_is_fp32=False, device="cuda") == 10**9
    assert layout.batch_numel(10**9, grad_is_fp32=False, device="cpu") == layout.CONVERT_NUMEL
    assert layout.batch_numel(10**9, grad_is_fp32=True, device="cpu") == 10**9  # nothing to convert
    assert layout.batch_numel(5000, grad_is_fp32=False, device="cuda") == 5000
    # the free memory the scratch may use bounds it (fp32: 4 bytes an element)
    assert layout.batch_numel(10**9, grad_is_fp32=False, device="cuda", scratch_bytes=4 * 10**6) == 10**6
    assert layout.batch_numel(10**9, grad_is_fp32=True, device="cuda", scratch_bytes=4) == 10**9
    gpu, cpu = layout.step_rule("cuda", False, 10**9), layout.step_rule("cpu", False, 10**9)
    assert (gpu.batch_numel, gpu.norm_convert_numel, gpu.keep_scratch, gpu.per_piece) == (10**9, None, False, False)
    assert (cpu.batch_numel, cpu.norm_convert_numel, cpu.keep_scratch, cpu.per_piece) == (
        layout.CONVERT_NUMEL, layout.CONVERT_NUMEL, True, True)


def test_the_memory_model_counts_the_gpu_scratch_of_a_whole_sub_group():
    units = [[4_000_000, 1000], [4_000_000, 1000]]
    gpu = predict_memory(units, 1, 2, "bf16", device="cuda")
    cpu = predict_memory(units, 1, 2, "bf16", device="cpu")
    shard = sum(sum(u) for u in units)
    assert gpu.optimizer_transient >= 4 * shard and gpu.optimizer_transient < 4 * shard * 1.01
    assert cpu.optimizer_transient == 4 * layout.CONVERT_NUMEL
    capped = predict_memory(units, 1, 2, "bf16", device="cuda", zero=ZeroConfig(sub_group_size=1000))
    assert capped.optimizer_transient == 4 * 1000
    assert predict_memory(units, 1, 2, "fp32", device="cuda").optimizer_transient == 0


# --- the engine's calls per step ---------------------------------------------------------------------------
class Blocks(nn.Module):
    def __init__(self, hidden: int, layers: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                                  nn.Linear(4 * hidden, hidden)) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x.float().square().mean()


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def step_ops(hidden: int, stage: int) -> Counter:
    torch.manual_seed(0)
    engine = hybrid.initialize(Blocks(hidden), {"zero": {"stage": stage}, "precision": "bf16",
                                                "gradient_clipping": 1.0})
    x = torch.randn(4, hidden)
    engine.backward(engine(x))
    with CountOps() as ops:
        assert engine.step()
    return ops.counts


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_step_takes_as_many_calls_for_4x_the_width_under_the_gpu_rule(stage, monkeypatch):
    monkeypatch.delitem(layout.CONVERT_LIMITS, "cpu")  # the CPU takes the GPU's rule: no conversion limit
    narrow, wide = step_ops(192, stage), step_ops(768, stage)
    assert narrow == wide, (narrow, wide)
    optimizer = sum(n for op, n in wide.items() if op.startswith(("_fused_adamw", "_foreach_addcdiv")))
    assert 1 <= optimizer <= 2, wide  # one fused call per parameter group (decayed, not decayed)
    assert wide["_foreach_norm"] == 1, wide  # every gradient is bf16: one norm call


def test_under_the_cpu_rule_the_wide_model_is_converted_in_more_chunks():
    narrow, wide = step_ops(192, 2), step_ops(768, 2)  # 768 x 3072 = 2.4M elements > CONVERT_NUMEL
    assert sum(wide.values()) > sum(narrow.values())
    assert wide["linalg_vector_norm"] > narrow["linalg_vector_norm"]


# --- offload: threads and the host arena --------------------------------------------------------------------
def test_the_host_optimizer_threads_are_the_ranks_share_of_the_nodes_cores():
    assert host_optimizer_threads(None, 112, 8) == 14  # a DGX H100: 112 cores, 8 GPUs
    assert host_optimizer_threads(None, 2, 4) == 1      # never zero
    assert host_optimizer_threads(3, 112, 8) == 3      # zero.offload_optimizer.threads wins


def _offload_engine(stage: int, precision: str = "bf16", **offload):
    torch.manual_seed(0)
    cfg = {"zero": {"stage": stage, "offload_optimizer": {"device": "cpu", **offload}}, "precision": precision}
    return hybrid.initialize(Blocks(256, layers=3), cfg)


@pytest.mark.parametrize("ranks, configured", [(1, None), (2, None), (1, 1)])
def test_the_host_step_runs_with_the_ranks_share_of_the_cores(ranks, configured, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    engine = _offload_engine(1, threads=configured) if configured else _offload_engine(1)
    expected = host_optimizer_threads(configured, node_cores(), ranks)
    assert engine.host_threads == expected
    seen, step = [], engine.optimizer.step
    monkeypatch.setattr(engine.optimizer, "step", lambda *a, **k: (seen.append(torch.get_num_threads()),
                                                                   step(*a, **k)))
    before = torch.get_num_threads()
    engine.backward(engine(torch.randn(4, 256)))
    engine.step()
    assert seen == [expected] and torch.get_num_threads() == before


@pytest.mark.parametrize("stage, precision", [(1, "bf16"), (3, "bf16"), (2, "fp32")])
def test_the_host_arena_is_the_memory_models_host_figure(stage, precision):
    engine = _offload_engine(stage, precision)
    params = engine.layout.param_numel  # stage 3 releases the module's parameters
    arena = engine.state.arena
    planned = offload_bytes(params, 1, stage, precision=precision).host
    assert arena.nbytes == pytest.approx(planned, rel=0.01)
    assert arena.used == arena.nbytes  # every byte carved: master, gradient copy, moments
    report = engine.memory_report()
    assert report["host"]["arena"] == arena.nbytes and report["optimizer"] == 0
    assert report["host"]["optimizer"] == 12 * engine.layout.shard_numel


def _nvme_engine(path, stage: int, precision: str = "bf16", hidden: int = 256, layers: int = 3, device="nvme",
                 **zero):
    torch.manual_seed(0)
    offload = {"device": "nvme", "path": str(path)} if device == "nvme" else {"device": "cpu"}
    cfg = {"zero": {"stage": stage, "offload_optimizer": offload, **zero}, "precision": precision}
    return hybrid.initialize(Blocks(hidden, layers=layers), cfg)


@pytest.mark.parametrize("stage, precision", [(1, "bf16"), (3, "bf16"), (2, "fp32")])
def test_with_nvme_the_host_arena_holds_the_gradient_copy_and_matches_the_planners_host_figure(stage, precision,
                                                                                               tmp_path):
    from hybrid.plan.memory import nvme_offload_bytes

    engine = _nvme_engine(tmp_path, stage, precision, sub_group_size=4096)
    try:
        shard, arena = engine.layout.shard_numel, engine.state.arena
        grad_item = engine.state.host_grad.element_size()
        assert engine.state.master is None and engine.optimizer.buffers == {}
        assert arena.nbytes == arena.used == layout.host_arena_bytes(shard, grad_item, 2, nvme=True) == grad_item * shard
        report = engine.memory_report()["host"]
        assert report["arena"] == report["grads"] == arena.nbytes
        assert report["optimizer"] == engine.optimizer.swap.host_bytes  # the record buffers
        planned = nvme_offload_bytes(engine.layout.param_numel, 1, stage, precision=precision, sub_group_size=4096)
        assert arena.nbytes + engine.optimizer.swap.host_bytes == pytest.approx(planned.host, rel=0.01)
    finally:
        engine.close()


def test_the_nvme_host_step_runs_with_the_host_threads(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    engine = _nvme_engine(tmp_path, 1)
    try:
        assert engine.host_threads == host_optimizer_threads(None, node_cores(), 1)
        seen, step = [], engine.optimizer.step
        monkeypatch.setattr(engine.optimizer, "step", lambda *a, **k: (seen.append(torch.get_num_threads()),
                                                                       step(*a, **k)))
        engine.backward(engine(torch.randn(4, 256)))
        engine.step()
        assert seen == [engine.host_threads]
    finally:
        engine.close()


def test_nvme_records_are_the_host_step_rules_batches_and_step_as_cpu_offload_does(tmp_path):
    hidden = 640  # 640 x 2560 = 1.6M elements a matrix: more than CONVERT_NUMEL, so bf16 batches are cut
    results = {}
    for device in ("cpu", "nvme"):
        engine = _nvme_engine(tmp_path, 2, "bf16", hidden=hidden, layers=1, device=device)
        try:
            rule = layout.step_rule("cpu", False, engine.config.zero.sub_group_size)
            numels = [b.numel for b in engine.optimizer.batches]
            assert engine.optimizer.sub_group_size == rule.batch_numel == layout.CONVERT_NUMEL
            assert max(numels) <= layout.CONVERT_NUMEL and len(numels) > 1
            if device == "nvme":
                assert [r.numel for r in engine.optimizer.swap.layout.records] == numels
            x = torch.randn(4, hidden, generator=torch.Generator().manual_seed(1))
            losses = []
            for _ in range(2):
                loss = engine(x)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            results[device] = (numels, losses, engine.full_state_dict())
        finally:
            engine.close()
    (numels_cpu, losses_cpu, state_cpu), (numels_nvme, losses_nvme, state_nvme) = results["cpu"], results["nvme"]
    assert numels_cpu == numels_nvme and losses_cpu == losses_nvme
    assert all(torch.equal(state_cpu[k], state_nvme[k]) for k in state_cpu)


def test_offload_threads_is_a_checked_setting():
    from hybrid.config.training import TrainConfig
    from hybrid.errors import ConfigError

    cfg = TrainConfig.from_dict({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu",
                                                                                          "threads": 4}}})
    assert cfg.zero.offload_optimizer.threads == 4
    assert TrainConfig.from_dict({"zero": {"stage": 1}}).zero.offload_optimizer.threads is None
    with pytest.raises(ConfigError, match=r"^zero_optimization\.offload_optimizer\.threads must be"):
        TrainConfig.from_dict({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu",
                                                                                       "threads": 0}}})


def test_the_gpu_rules_one_call_per_batch_steps_exactly_as_the_cpus_piece_by_piece(monkeypatch):
    from hybrid.config.training import OptimizerConfig
    from hybrid.zero.optimizer import FlatOptimizer, Piece
    from hybrid.zero.param_groups import Group

    sizes, n = [5, 37, 64, 3, 90], 199

    def run():
        torch.manual_seed(0)
        master, out = torch.randn(n), torch.zeros(n, dtype=torch.bfloat16)
        grad = torch.zeros(n, dtype=torch.bfloat16)
        pieces, at = [], 0
        for k, size in enumerate(sizes):
            pieces.append(Piece(master[at:at + size], grad[at:at + size], at, out[at:at + size], k % 2))
            at += size
        opt = FlatOptimizer(pieces, n, "cpu", OptimizerConfig(lr=1e-2, weight_decay=0.1), 50,
                            [Group(0.1), Group(0.0)])
        for step in range(3):
            grad.copy_(torch.randn(n))
            opt.step([1e-2, 2e-2], torch.tensor(0.5) if step else None)
        return opt.rule.per_piece, master, out

    per_piece, master_cpu, out_cpu = run()
    monkeypatch.delitem(layout.CONVERT_LIMITS, "cpu")
    one_call, master_gpu, out_gpu = run()
    assert per_piece and not one_call
    assert torch.equal(master_cpu, master_gpu) and torch.equal(out_cpu, out_gpu)


def test_the_host_arena_hands_out_aligned_zeroed_views_and_refuses_more_than_it_holds():
    from hybrid.zero.host_arena import HostArena

    arena = HostArena(layout.host_arena_bytes(8, 2, 2))  # 8 elements: master, bf16 gradient copy, two moments
    views = [arena.take(8, torch.float32), arena.take(8, torch.bfloat16), arena.take(8, torch.float32),
             arena.take(8, torch.float32)]
    assert arena.used == arena.nbytes == 8 * (4 + 2 + 4 + 4) and not arena.pinned
    assert all(v.abs().sum() == 0 and v.data_ptr() % v.element_size() == 0 for v in views)
    views[0].fill_(1)
    assert views[1].abs().sum() == 0  # disjoint
    with pytest.raises(RuntimeError, match="host arena of 112 bytes has no room"):
        arena.take(1, torch.float32)
