"""The closed memory loop's pure parts: the complete prediction against the engine's real layout, the
rank-side meter and budget check (CPU RSS, an injected fake NVML), the re-plan ladder and its sentences,
the predicted-vs-measured table, and gradient accumulation keeping a step's rows."""

import dataclasses
import os
import re

import pytest
import torch

import hybrid
from hybrid.config.training import TrainConfig, ZeroConfig
from hybrid.plan.memory import predict_memory, unit_layout
from hybrid.zero.units import model_units
from hybrid.plan.budget import MemoryMeter, OutOfMemoryError, near_oom, should_measure
from hybrid.models.gpt.model import GPT, GPTConfig
from hybrid.runtime.local_launch import run_local
from hybrid.runtime.train import train_step
from launch.planning import replan
from hybrid.config.units import human_bytes
from launch.job.memory_view import memory_table, near_oom_line, usage_text
from launch.planning.model_size import gpt_figures
from launch.planning.plan import build_plan
from launch.spec import parse_spec
from tests.dist.meter_rank import meter_in_a_fresh_process
from tests.unit.test_monitor import FakeNvml, _two_h100s

GiB = 2**30
TINY = GPTConfig(vocab_size=256, seq_len=32, n_layers=2, hidden=64, n_heads=4)
WIDE = GPTConfig(vocab_size=512, seq_len=32, n_layers=2, hidden=128, n_heads=4)  # units above the threshold


# ------------------------------------------------------------------------------------------- prediction

@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-fp32-reduce"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("cfg", [TINY, WIDE], ids=["tiny", "wide"])
def test_model_states_equal_what_the_engine_holds(cfg, stage, precision):
    modules = model_units(GPT(cfg, device="meta"))
    precision, _, reduce = precision.partition("-")
    zero = ZeroConfig(stage=stage, reduce_bucket_size=20_000, param_persistence_threshold=10_000,
                      reduce_dtype="fp32" if reduce else None)
    engine = hybrid.initialize(GPT(cfg, device="meta"), TrainConfig(zero=zero, precision=precision))
    held = engine.memory_report()
    p = predict_memory(modules, 1, stage, precision, zero=zero)
    assert (p.params, p.grads, p.optimizer) == (held["params"], held["grads"], held["optimizer"])


@pytest.mark.parametrize("policy", ["auto", "module"])
@pytest.mark.parametrize("cfg", [TINY, WIDE], ids=["tiny", "wide"])
def test_stage3_units_are_the_engines(cfg, policy):
    """The prediction's stage-3 layout is the engine's, under the unit policy the engine uses."""
    zero = ZeroConfig(stage=3, stage3_unit=policy, param_persistence_threshold=1000)
    engine = hybrid.initialize(GPT(cfg, device="meta"), TrainConfig(zero=zero, precision="fp32"))
    layout, persistent = unit_layout(model_units(GPT(cfg, device="meta"), stage3_unit=policy), 3, 1, "fp32",
                                     zero.reduce_bucket_size, zero.param_persistence_threshold)
    assert [u.numel for u in layout.units] == [u.numel for u in engine.layout.units]
    assert persistent == set(engine.persistent_units)


def test_gpt_tiny_stage3_counts_the_persistent_parameters():
    """The issue's figure: at stage 3 the default threshold keeps every small gpt-tiny parameter gathered."""
    modules = model_units(GPT(TINY, device="meta"))
    p = predict_memory(modules, 2, 3, "fp32")
    layout, persistent = unit_layout(modules, 3, 2, "fp32")
    assert persistent and p.params == sum(layout.units[u].numel for u in persistent) * 4 + layout.shard_numel * 4


def test_stage2_buckets_and_stage3_gathered_units_are_in_flight():
    modules = model_units(GPT(WIDE, device="meta"))
    zero = ZeroConfig(reduce_bucket_size=40_000, prefetch_bucket_size=1, param_persistence_threshold=10_000)
    p1, p2, p3 = (predict_memory(modules, 2, s, "fp32", zero=zero) for s in (1, 2, 3))
    assert p1.inflight == 0 and p2.inflight > 0
    layout, persistent = unit_layout(modules, 3, 2, "fp32", zero.reduce_bucket_size, zero.param_persistence_threshold)
    largest = max(u.numel for u in layout.units if u.index not in persistent)
    assert p3.inflight >= largest * 4  # the running unit is gathered in full
    more = predict_memory(modules, 2, 3, "fp32", zero=dataclasses.replace(zero, prefetch_bucket_size=10**9))
    assert more.inflight > p3.inflight  # prefetch gathers the next units too


def test_optimizer_transients_are_per_sub_group_piece():
    modules = model_units(GPT(WIDE, device="meta"))
    whole = predict_memory(modules, 1, 0, "bf16")
    pieces = predict_memory(modules, 1, 0, "bf16", zero=ZeroConfig(sub_group_size=1000))
    assert pieces.optimizer_transient == 1000 * 4 < whole.optimizer_transient  # the fp32 copy of a bf16 piece
    assert predict_memory(modules, 1, 0, "fp32").optimizer_transient == 0  # fp32: clipping scales in place


def test_activations_are_dtype_aware_and_checkpointing_keeps_less():
    """The plan's GPT activations (its profile: ``gpt_figures``)."""
    shape = GPTConfig(vocab_size=8192, seq_len=128, n_layers=12, hidden=512, n_heads=8).to_dict()
    fp32, bf16 = (gpt_figures(shape, p).activation_bytes(4, 1) for p in ("fp32", "bf16"))
    assert 1.5 < fp32 / bf16 < 2.0  # layers double; the loss is fp32 in both
    assert gpt_figures(shape, "fp32").activation_bytes(4, 1, checkpointing=True) < fp32 / 3
    # SDPA: nothing grows with s^2 (no attention scores kept)
    long = gpt_figures({**shape, "seq_len": 4 * 128}, "fp32").activation_bytes(4, 1)
    assert long == pytest.approx(4 * fp32, rel=0.01)


def test_runtime_reserve_is_in_the_total_only():
    p = predict_memory([[1000]], 1, 0, "fp32", runtime_reserve=5 * GiB)
    assert p.total == p.peak + 5 * GiB


# ------------------------------------------------------------------------------------------- the meter

@pytest.mark.slow  # a rank of its own (forked from the forkserver): not in the fast tier
def test_cpu_meter_measures_rss_growth_and_refuses_over_budget():
    # In a fresh process, not this one: in a whole-suite run this process has run many tests, and the 64 MiB
    # left no trace in its peak RSS twice (peak growth 0 in all of three tries once), whatever freed memory
    # under the baseline there; a rank starts as the meter expects, with nothing of other tests around.
    m, refused = run_local(meter_in_a_fresh_process, 1, timeout_s=120)[0]
    assert m["peak_bytes"] >= 60 * 2**20 and "RSS" in m["source"] and m["fraction"] < 1
    assert refused is not None and "exceeds this rank's memory budget" in refused, refused


def test_nvml_used_and_total_give_the_budget_and_the_near_oom_warning():
    from tests.unit.test_nvml_own_memory import process_record

    gpus = _two_h100s()
    gpus[1]["processes"] = [process_record(os.getpid(), 3 * GiB)]
    meter = MemoryMeter("cpu", nvml=FakeNvml(gpus), gpu_index=1)
    assert meter.budget_bytes == 80 * GiB  # the GPU's total
    m = meter.measure()
    assert m["nvml_used_bytes"] == 3 * GiB and m["used_bytes"] == 3 * GiB and not near_oom(m)
    gpus[1]["processes"] = [process_record(os.getpid(), 77 * GiB)]
    m = {**meter.measure(), "step": 7}
    assert near_oom(m)
    assert near_oom_line(5, m) == ("warning: rank 5 is near out of memory at step 7: 82.678 GB of 85.899 GB "
                                   "(96%, above 95%)")
    assert usage_text({5: m}) == "  mem 82.678 GB/85.899 GB (rank 5)"
    meter.check(m)
    gpus[1]["processes"] = [process_record(os.getpid(), 81 * GiB - 1)]
    with pytest.raises(OutOfMemoryError):
        meter.check(meter.measure())


def test_the_nvml_gpu_follows_cuda_visible_devices_indices_uuids_and_mig(monkeypatch):
    from hybrid.plan.budget import nvml_gpu, visible_device
    from hybrid.plan.monitor import GpuInfo

    gpus = [GpuInfo(i, "H100", 80 * GiB, i * GiB, (80 - i) * GiB, None, uuid=f"GPU-{i}a{i}b-{i}")
            for i in range(4)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert [nvml_gpu(gpus, visible_device(i)).index for i in (0, 1)] == [3, 1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-2a2b-2, GPU-0a")  # a unique prefix is enough, as for CUDA
    assert [nvml_gpu(gpus, visible_device(i)).index for i in (0, 1)] == [2, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-,MIG-5c1e/1/0,7")  # ambiguous, a MIG slice, not on this node
    assert [nvml_gpu(gpus, visible_device(i)) for i in (0, 1, 2)] == [None, None, None]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert nvml_gpu(gpus, visible_device(2)).index == 2


def test_a_meter_whose_gpu_nvml_cannot_name_reads_no_nvml_figures(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-5c1e/1/0")
    meter = MemoryMeter("cpu", budget_bytes=10**12, nvml=FakeNvml(_two_h100s()))
    m = meter.measure()
    assert "nvml_used_bytes" not in m and m["used_bytes"] == m["peak_bytes"]  # not the whole GPU's use


def test_measurement_cadence():
    assert [s for s in range(1, 35) if should_measure(s, 10)] == [1, 2, 3, 10, 20, 30]


# ------------------------------------------------------------------------------------------- re-plan

# The ladder's tests below are sized around a runtime reserve of 75 MB (the CPU default until the meter left
# torch's lazily imported runtime out and none was left): given as cluster.runtime_reserve_gb.
RESERVE_GB = 0.075


def _plan(tmp_path, gpu_memory_gb, micro_batch=8, model=WIDE, **zero):
    cfg = tmp_path / "model.yaml"
    import yaml

    doc = {"model": dataclasses.asdict(model)}
    if zero:
        doc["zero"] = zero
    cfg.write_text(yaml.safe_dump(doc))
    spec = parse_spec({"cluster": {"address": "local", "nodes": 2, "gpus_per_node": 2,
                                   "gpu_memory_gb": gpu_memory_gb, "runtime_reserve_gb": RESERVE_GB},
                       "job": {"entrypoint": "hybrid.models.gpt:train", "config": str(cfg), "steps": 4,
                               "micro_batch": micro_batch},
                       "parallel": {"tp": 1, "precision": "fp32"}}, base_dir=tmp_path)
    return build_plan(spec)


def test_ladder_goes_up_the_stages_then_checkpoints_then_halves_the_micro_batch(tmp_path):
    lp = _plan(tmp_path, 80)
    rungs = [c.describe() for c in replan.ladder(lp, replan.Choice(1, 8))]
    assert rungs[:3] == ["stage 2", "stage 3", "stage 3 with activation checkpointing"]  # CPU: no offload rung
    ac = "stage 3 with activation checkpointing, "
    assert rungs[3:] == [ac + "micro-batch 4 x 2 accumulation steps", ac + "micro-batch 2 x 4 accumulation steps",
                         ac + "micro-batch 1 x 8 accumulation steps"][:len(rungs) - 3]
    for c in replan.ladder(lp, replan.Choice(1, 8)):
        assert c.micro_batch * c.accumulation == 8  # the global batch is unchanged


def test_replan_takes_the_first_rung_that_fits_the_measured_figures(tmp_path):
    lp = _plan(tmp_path, 0.2, reduce_bucket_size=100_000, prefetch_bucket_size=1)
    current = replan.Choice(1, 8)
    rungs = replan.ladder(lp, current)
    totals = [replan.predict(lp, c).total for c in rungs]
    usable = replan.usable_bytes(lp)
    extra = usable - min(totals) - 1  # what the run held beyond the prediction: only the smallest rung fits
    p1 = replan.predict(lp, current).total
    over = replan.Overshoot(3, p1 + extra, replan.budget_bytes(lp), p1, 2)
    assert over.extra == pytest.approx(extra)
    choice, prediction = replan.replan(lp, current, over)
    assert choice == rungs[totals.index(min(totals))] and prediction.total + over.extra <= usable
    assert all(t + over.extra > usable for t in totals[:rungs.index(choice)])


def test_nothing_fits_names_the_smallest_configuration(tmp_path):
    lp = _plan(tmp_path, 0.2)
    over = replan.Overshoot(0, 10 * GiB, 0.2e9, 1e8, 1)
    with pytest.raises(replan.NothingFits) as err:
        replan.replan(lp, replan.Choice(1, 8), over)
    text = str(err.value)
    assert text.startswith("nothing fits 0.180 GB usable per rank: even stage 3 with activation checkpointing, "
                           "micro-batch 1 x 8")
    assert re.search(r"; it would fit with cluster\.gpu_memory_gb >= [\d.]+$", text)  # no node count helps
    assert "\n" not in text


# ------------------------------------------------------------------------------------------- the table

def test_table_compares_per_category_and_the_peak():
    pred = predict_memory([[1000, 2000]], 1, 0, "fp32", activations=10_000, runtime_reserve=1000,
                          device="cpu").as_dict()
    m = {"device": "cpu", "peak_bytes": int(pred["total"] * 1.1), "used_bytes": int(pred["total"] * 1.1),
         "budget_bytes": 10**6, "fraction": 0.05, "step": 1, "source": "peak RSS growth"}
    report = {"params": pred["params"], "grads": pred["grads"], "optimizer": pred["optimizer"], "buffers": 0}
    lines = memory_table(pred, {0: m}, {0: report})
    assert lines[0].startswith("memory per rank (largest: rank 0, step 1")
    assert any(line.split()[:1] == ["parameters"] and line.rstrip().endswith("+0.0%") for line in lines)
    assert lines[-2].lstrip().startswith("peak (RSS growth)") and lines[-2].rstrip().endswith("+10.0%")



def test_a_cpu_peak_far_from_the_plan_says_what_the_plan_did_not_count():
    pred = predict_memory([[1000, 2000]], 1, 0, "fp32", activations=10_000, device="cpu").as_dict()
    m = {"device": "cpu", "peak_bytes": int(pred["total"] * 3.8), "used_bytes": int(pred["total"] * 3.8),
         "step": 100, "source": "peak RSS growth"}
    lines = memory_table(pred, {0: m}, {})
    assert lines[-2].rstrip().endswith("+280.0%")
    assert lines[-1].startswith(f"  not counted by the plan: {human_bytes(int(pred['total'] * 3.8) - pred['total'])} "
                                "of the rank's own memory beyond the tensors it predicts")
    m.update(peak_bytes=int(pred["total"] * 0.5))
    assert memory_table(pred, {0: m}, {})[-1].startswith("  counted by the plan but not held: ")
    m.update(peak_bytes=int(pred["total"] * 1.29))
    assert memory_table(pred, {0: m}, {})[-1].lstrip().startswith("peak (RSS growth)")  # within 30 %: no note


# ------------------------------------------------------------------------------------------- accumulation

def test_accumulation_splits_the_step_rows_and_matches_one_big_micro_batch():
    torch.manual_seed(0)
    x = torch.randint(0, TINY.vocab_size, (8, TINY.seq_len))
    losses = []
    for accumulation in (1, 2):
        engine = hybrid.initialize(GPT(TINY, device="meta"), TrainConfig(
            zero=ZeroConfig(stage=0), precision="fp32", gradient_accumulation_steps=accumulation))
        losses.append(train_step(engine, x, x, accumulation=accumulation))
        losses.append(train_step(engine, x, x, accumulation=accumulation))  # after one optimizer step
    assert losses[0] == pytest.approx(losses[2], rel=1e-6) and losses[1] == pytest.approx(losses[3], rel=1e-5)


# ------------------------------------------------------------------------------------------- the display

def _record(rank, step, used, budget):
    return {"rank": rank, "step": step, "loss": 1.0, "step_time_s": 1.0, "tokens": 10, "throughput_unit": "tokens",
            "memory": {"params": 100, "grads": 100, "optimizer": 200, "buffers": 0},
            "memory_measured": {"device": "cpu", "peak_bytes": used, "used_bytes": used, "budget_bytes": budget,
                                "fraction": used / budget, "source": "peak RSS growth"}}


def test_progress_prints_the_table_after_the_first_measured_step_and_warns_near_oom():
    import io

    from launch.job.display import Progress

    out = io.StringIO()
    progress = Progress(3, 2, out, tty=False)
    progress.new_plan(predict_memory([[100]], 1, 0, "fp32", device="cpu").as_dict())
    progress.add({"reports": [_record(0, 1, 500, 1000), _record(1, 1, 970, 1000)]})
    text = out.getvalue()
    assert "warning: rank 1 is near out of memory at step 1: 970 B of 1 KB (97%, above 95%)" in text
    assert "memory per rank after step 1 (largest: rank 1, step 1" in text
    assert "mem 970 B/1 KB (rank 1)" in text
    progress.add({"reports": [_record(0, 2, 500, 1000), _record(1, 2, 980, 1000)]})
    assert out.getvalue().count("near out of memory") == 1 and out.getvalue().count("memory per rank") == 1


def test_spec_reads_max_replans_and_the_runtime_reserve(tmp_path):
    from hybrid.errors import ConfigError

    (tmp_path / "m.yaml").write_text("model: {vocab_size: 64, seq_len: 8, n_layers: 1, hidden: 16, n_heads: 2}\n")

    def spec(**extra):
        return parse_spec({"cluster": {"address": "local", "nodes": 1, "gpus_per_node": 1, "gpu_memory_gb": 8,
                                       **extra.get("cluster", {})},
                           "job": {"entrypoint": "hybrid.models.gpt:train", "config": "m.yaml", "steps": 1,
                                   **extra.get("job", {})}}, base_dir=tmp_path)

    default = spec()
    assert default.job.max_replans == 3 and default.cluster.runtime_reserve_gb is None
    custom = spec(cluster={"runtime_reserve_gb": 2.5}, job={"max_replans": 0})
    assert custom.job.max_replans == 0 and custom.cluster.runtime_reserve_gb == 2.5
    assert replan.runtime_reserve(build_plan(custom)) == 2.5e9
    with pytest.raises(ConfigError, match="cluster.runtime_reserve_gb"):
        spec(cluster={"runtime_reserve_gb": -1})
    with pytest.raises(ConfigError, match=r"^cluster.runtime_reserve_gb must be a number from 0 to below "
                                          r"cluster.gpu_memory_gb \(8 GB\), got 8"):
        spec(cluster={"runtime_reserve_gb": 8})  # nothing would be left for the model
    with pytest.raises(ConfigError, match="job.max_replans"):
        spec(job={"max_replans": "many"})


def test_the_loop_replans_from_the_measurement_and_stops_at_max_replans(tmp_path):
    import io
    import json

    from launch.job.display import Progress
    from launch.planning.memory_loop import MemoryLoop

    def loop_for(max_replans):
        lp = _plan(tmp_path, 0.5, micro_batch=4, reduce_bucket_size=500_000, prefetch_bucket_size=500_000)
        big = dataclasses.replace(WIDE, vocab_size=2048, hidden=512, n_layers=4, n_heads=8)
        lp = dataclasses.replace(lp, model=dataclasses.asdict(big), spec=dataclasses.replace(
            lp.spec, job=dataclasses.replace(lp.spec.job, max_replans=max_replans, run_dir=tmp_path / "run")))
        progress = Progress(4, 4, io.StringIO(), tty=False)
        loop = MemoryLoop(lp, progress)
        progress.measured[2] = {"device": "cpu", "peak_bytes": 510_000_000, "used_bytes": 510_000_000,
                                "budget_bytes": 500_000_000, "step": 3}
        return loop

    loop = loop_for(1)
    line = loop.replan(2, 2)
    assert line.startswith("rank 2 ran out of memory at stage 1 (measured 510 MB of 500 MB, predicted ")
    assert ": restarting from step 2 at stage " in line and loop.choice.stage > 1
    loop.record_attempt(True)
    record = json.loads(loop.save().read_text())
    assert record["finished"] and record["overshoots"][0]["measured_bytes"] == 510_000_000
    assert record["replans"] == [line] and record["plan"]["stage"] == loop.choice.stage
    with pytest.raises(replan.NothingFits, match=r"job.max_replans \(0\) allows no more re-plans; it would fit at "
                                                 r"stage [23]( with activation checkpointing)? \(predicted"):
        loop_for(0).replan(2, 2)


def test_the_job_starts_on_the_first_rung_the_complete_prediction_fits(tmp_path):
    # wide enough that sharding saves more than the CPU collectives' staging costs (hybrid.comm.shm)
    deeper = dataclasses.replace(WIDE, n_layers=4, hidden=256)
    lp = _plan(tmp_path, 0.15, model=deeper, reduce_bucket_size=100_000, prefetch_bucket_size=1)
    usable = replan.usable_bytes(lp)
    planned = replan.planned_choice(lp)
    assert planned.stage == 1 and replan.predict(lp, planned).total > usable  # the planner's formulas say it fits
    start = replan.initial_choice(lp)
    rungs = replan.ladder(lp, planned)
    assert start in rungs and replan.predict(lp, start).total <= usable
    assert all(replan.predict(lp, c).total > usable for c in rungs[:rungs.index(start)])
    assert replan.start_note(lp).startswith(f"starting at {start.describe()} (predicted ")
    assert replan.start_note(_plan(tmp_path, 80)) is None  # it fits: the planner's choice stands
    forced = dataclasses.replace(lp, spec=dataclasses.replace(
        lp.spec, parallel=dataclasses.replace(lp.spec.parallel, zero_stage=1)))
    assert replan.initial_choice(forced) == planned  # a stage the user chose is run as chosen
    assert replan.start_note(forced).startswith("warning: stage 1 is predicted to need ")
    assert "(parallel.zero_stage is set, so no other stage is tried)" in replan.start_note(forced)


def test_the_start_warns_when_no_rung_fits_the_complete_prediction(tmp_path):
    lp = _plan(tmp_path, 0.08, reduce_bucket_size=100_000, prefetch_bucket_size=1)  # the runtime reserve alone is 75 MB
    planned = replan.planned_choice(lp)
    assert replan.initial_choice(lp) == planned  # nothing better to start with
    assert all(replan.predict(lp, c).total > replan.usable_bytes(lp) for c in [planned] + replan.ladder(lp, planned))
    note = replan.start_note(lp)
    assert note.startswith(f"warning: {planned.describe()} is predicted to need ")
    assert "usable (no other option on the ladder fits either); starting anyway" in note
