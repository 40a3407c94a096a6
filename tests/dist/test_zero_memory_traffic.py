"""Memory and traffic of the ZeRO stages on 2 real gloo ranks, measured from the tensors and the comm.

``WideNet`` (Ψ ≈ 1.7M parameters, no unit needs padding) is stepped twice per case; the second step's
DP traffic and the memory held afterwards are checked:

* memory_report() params/grads/optimizer equal the seed's formula for the stage (``hybrid.plan.memory``), its
  scratch is the bf16 gradients' bounded fp32 staging buffer (none in fp32), and the storages of every live
  tensor in the process (walking ``gc``) agree with memory_report() within 2%;
* traffic per step: stage 0 all-reduces 2Ψ; stages 1 and 2 move Ψ + Ψ (equal to stage 0 within 1%);
  stage 3 moves 3Ψ (1.5x stage 0 within 1%); persistent parameters are never gathered in forward or
  backward, so the traffic drops by exactly their bytes (their fwd+bwd gathers become one post-step
  all-gather). The only other traffic is the 2-float all-reduce of the gradient norm's partial sums, and at
  stage 3 that of the check that every rank gathered the same units;
* stage 3 really releases: during a layer's forward only the units of the roots running (the model's
  "rest" unit and the layer's block, under the default ``auto`` policy) and the prefetched ones are gathered, and nothing is gathered or bucketed between steps; stage 2 never holds all gradients in
  buckets during backward.
"""

import gc

import pytest
import torch
import torch.distributed as dist

import hybrid
from hybrid.runtime.local_launch import run_local
from hybrid.plan.memory import model_state_bytes
from hybrid.plan.layout import CONVERT_NUMEL, SHM_MIN_BYTES, exchange_numel, kept_bucket_numel, region_bytes
from tests.dist.zero_models import WideNet, batch, rank_rows

pytestmark = pytest.mark.slow

NORM_BYTES = 2 * 2 * 8  # all-reduce (counted twice) of the two float64 partial sums
UNITS_CHECK_BYTES = 2 * 2 * 8  # ParamGatherer.start_units_check: (h, h^2) in float64
PRESENCE_BYTES = 2 * 4  # per parameter: hybrid.zero.presence's all-reduce (counted twice) of which got a gradient
PREFETCH = 200_000
BUCKET = 400_000
CASES = {
    "stage0": (0, "bf16", {}), "stage1": (1, "bf16", {}), "stage2": (2, "bf16", {}),
    "stage3": (3, "bf16", {"stage3_param_persistence_threshold": 0}),
    "stage3-persistent": (3, "bf16", {"stage3_param_persistence_threshold": 1000}),
    "stage1-fp32": (1, "fp32", {}),
    "stage3-fp32": (3, "fp32", {"stage3_param_persistence_threshold": 0}),
}


def _config(stage, precision, zero):
    z = {"stage": stage, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET,
         "stage3_prefetch_bucket_size": PREFETCH, **zero}
    return {"zero_optimization": z, "bf16": {"enabled": precision == "bf16"}, "gradient_clipping": 1.0}


def _live_tensor_bytes(engine) -> int:
    """Bytes of every live tensor's storage, but the peers' shared-memory regions this rank maps (the peer's
    memory; the report counts this rank's own region)."""
    gc.collect()
    shm = engine.dp_comm.transports.cpu.shm
    peers = {r.data_ptr() for q, r in enumerate(shm._regions) if q != shm.rank} if shm else set()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.untyped_storage().data_ptr() not in peers:
            storage = obj.untyped_storage()
            if storage.nbytes():
                storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(storages.values())


def _measure():
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch(0, 0, vocab=1024, rows=8, seq=16)
    x, y = x[rank_rows(rank, world)], y[rank_rows(rank, world)]
    out = {}
    for name, (stage, precision, zero) in CASES.items():
        engine = hybrid.initialize(WideNet(), _config(stage, precision, zero))
        at_init = engine.memory_report()
        seen = []
        probe = engine.module.blocks[1].fc1
        probe.register_forward_pre_hook(lambda m, a: seen.append(engine.memory_report()["buffers"]))
        in_backward = []  # buffers when an early layer's gradient arrives (the engine's hook runs right after)
        probe.weight.register_post_accumulate_grad_hook(
            lambda p: in_backward.append(engine.memory_report()["buffers"]))
        for step in range(2):  # the first forward records the module order that prefetch follows
            if step == 1:
                engine.reset_comm()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        threshold = engine.config.zero.param_persistence_threshold
        persistent = sum(n for n in engine.layout.numels if n < threshold) if stage == 3 else 0
        out[name] = dict(traffic=engine.comm_report(), memory=engine.memory_report(), at_init=at_init,
                         live=_live_tensor_bytes(engine),
                         gathered_in_forward=seen[-1], psi=engine.layout.param_numel,
                         n_params=len(engine.layout.numels),
                         padded=engine.layout.full_numel, persistent=persistent,
                         probe=engine.layout.locate(engine.names.index("blocks.1.fc1.weight"))[0].numel,
                         rest=sum(engine.layout.units[u].numel for u in engine.gatherer.module_units[engine.module])
                         if stage == 3 else 0,
                         buffers_in_backward=in_backward[-1], max_unit=max(u.numel for u in engine.layout.units),
                         unit_numels=[u.numel for u in engine.layout.units])
        del engine, probe, seen, in_backward, loss
        gc.collect()
    return out


def test_memory_and_traffic_per_stage():
    out = run_local(_measure, 2, timeout_s=240)
    for rank, res in enumerate(out):
        psi = res["stage0"]["psi"]
        assert all(r["padded"] == psi for r in res.values()), "WideNet is laid out without padding"
        for name, r in res.items():
            stage, precision, _ = CASES[name]
            case = f"{name} rank {rank}"
            size = 2 if precision == "bf16" else 4
            mem = r["memory"]
            expected = model_state_bytes(psi, dp=2, stage=stage, precision=precision)
            extra = size * r["persistent"]  # persistent parameters are also held in full
            assert (mem["params"], mem["grads"], mem["optimizer"]) == (expected.params + extra, expected.grads,
                                                                       expected.optimizer), f"{case}: {mem}"
            assert mem["buffers"] == 0, f"{case}: {mem}"
            # Working buffers allocated at the first step and kept: bf16 gradients' fp32 scratch (norm and
            # step), gloo's pairwise-exchange receive buffers (hybrid.plan.layout.exchange_numel) and, at stages 2-3
            # on CPU, reduced buckets kept for the next backward.
            owned = psi if stage == 0 else psi // 2  # the elements this rank's optimizer steps
            bound = (4 * min(owned, CONVERT_NUMEL) if precision == "bf16" else 0)
            # gloo's exchange buffers, or those of the collectives below SHM_MIN_BYTES and this rank's
            # shared-memory region, whichever hybrid.comm used
            small = [n for n in r["unit_numels"] if n * size < SHM_MIN_BYTES]
            bound += max(size * exchange_numel(r["unit_numels"], 2, stage),
                         size * exchange_numel(small, 2, stage) + region_bytes(2))
            bound += size * kept_bucket_numel(r["unit_numels"], stage)
            if bound:
                assert 0 < mem["scratch"] <= bound, f"{case}: {mem} (bound {bound})"
            else:
                assert mem["scratch"] == 0, f"{case}: {mem}"
            assert r["at_init"] == {**mem, "scratch": 0}, f"{case}: right after initialize {r['at_init']}"
            held = sum(mem.values())
            assert abs(r["live"] - held) <= 0.02 * held, f"{case}: live tensors {r['live']} vs report {held}"

            t = r["traffic"]
            p_bytes = size * psi
            expect = {0: 2 * p_bytes, 1: 2 * p_bytes + NORM_BYTES, 2: 2 * p_bytes + NORM_BYTES,
                      3: 3 * p_bytes - size * r["persistent"] + NORM_BYTES + UNITS_CHECK_BYTES}[stage]
            expect += PRESENCE_BYTES * r["n_params"]
            assert t["total"] == expect, f"{case}: {t} expected total {expect}"
            if stage == 0:
                assert t["all_reduce"] == t["total"]
            else:
                assert t["reduce_scatter"] == p_bytes, case
            if stage == 3:
                running = size * (r["probe"] + r["rest"])  # the block's unit and the model's rest unit
                limit = running + size * PREFETCH
                assert running <= r["gathered_in_forward"] <= limit, f"{case}: {r['gathered_in_forward']}"
            else:
                assert r["gathered_in_forward"] == 0, case
            if stage == 2:  # during backward: one bucket reducing, the next ones filling, never all gradients
                bound = size * (BUCKET + 2 * r["max_unit"])
                assert 0 < r["buffers_in_backward"] <= min(bound, size * psi - 1), f"{case}: {r['buffers_in_backward']}"
            if stage < 2:
                assert r["buffers_in_backward"] == 0, case

        base = res["stage0"]["traffic"]["total"]
        for name, ratio in (("stage1", 1.0), ("stage2", 1.0), ("stage3", 1.5)):
            measured = res[name]["traffic"]["total"] / base
            assert abs(measured - ratio) < 0.01 * ratio, f"{name}/stage0 traffic = {measured:.5f}"
        drop = res["stage3"]["traffic"]["total"] - res["stage3-persistent"]["traffic"]["total"]
        assert res["stage3-persistent"]["persistent"] > 0 and drop == 2 * res["stage3-persistent"]["persistent"]
