"""The time choice at the launcher's edges, without Ray: the cluster file's new keys, the plan's global batch
and fixed choices, the probe's figures (fitting a line through two sizes), the closed loop's records
(predicted vs measured step time in metrics.jsonl and the summary, time.json, calibration by
``hybrid plan --measured``) and the re-plan ladder ordered by time."""

import io
import json
import re
from pathlib import Path

import pytest

from hybrid.errors import ConfigError
from launch.job.display import Progress
from launch.job.metrics import measured_step_s, time_line, time_record, write_time_record
from launch.planning import replan
from launch.planning.plan import build_plan, format_plan, plan_dict
from launch.planning.probe_figures import PROBE_FILE, fit_line, read_probe, shared_rates, summarize, write_probe
from launch.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]


def spec_for(nodes=2, gpus=2, memory=80.0, job=(), cluster=(), interconnect=(), config="configs/gpt-tiny.yaml",
             **parallel):
    return parse_spec({
        "cluster": {"address": "local", "nodes": nodes, "gpus_per_node": gpus, "gpu_memory_gb": memory,
                    "interconnect": {"intra_node": "loopback", "inter_node": "loopback", **dict(interconnect)},
                    **dict(cluster)},
        "job": {"entrypoint": "hybrid.models.gpt:train", "config": config, "steps": 3, **dict(job)},
        "parallel": {"precision": "fp32", **parallel},
    }, base_dir=ROOT)


# ------------------------------------------------------------------------------------------ cluster.yaml

def test_the_time_keys_are_read_and_checked():
    spec = spec_for(job={"global_batch": 32}, cluster={"gpu": "A100", "gpu_tflops": 250},
                    interconnect={"intra_node_gbps": 2400, "inter_node_gbps": 200, "nics_per_node": 4})
    c = spec.cluster
    assert (c.gpu, c.gpu_tflops, c.intra_node_gbps, c.inter_node_gbps, c.nics_per_node) == ("A100", 250, 2400, 200, 4)
    assert spec.job.global_batch == 32 and spec.job.micro_batch_auto
    assert not spec_for(job={"global_batch": 32, "micro_batch": 4}).job.micro_batch_auto
    assert spec_for().job.global_batch is None
    for bad, field in (({"cluster": {"gpu": "K80"}}, "cluster.gpu"), ({"cluster": {"gpu_tflops": -1}}, "cluster.gpu_tflops"),
                       ({"interconnect": {"inter_node_gbps": "fast"}}, "cluster.interconnect.inter_node_gbps"),
                       ({"interconnect": {"nics_per_node": 0}}, "cluster.interconnect.nics_per_node"),
                       ({"job": {"global_batch": 0}}, "job.global_batch")):
        with pytest.raises(ConfigError, match=rf"^{field.replace('.', '[.]')}") as err:
            spec_for(**bad)
        assert str(err.value).count("\n") == 0


# ------------------------------------------------------------------------------------------------- plan

def test_the_global_batch_is_kept_and_the_micro_batch_chosen():
    lp = build_plan(spec_for(job={"global_batch": 32}))
    assert lp.rows * lp.layout.dp == 32 and lp.micro_batch * lp.accumulation == lp.rows
    ranking = lp.time.ranking
    assert {c.layout.global_batch for c in ranking.candidates} == {32}
    assert len({(c.layout.micro_batch, c.layout.accumulation) for c in ranking.candidates}) > 2
    assert plan_dict(lp)["batch"] == {"micro_batch": lp.micro_batch, "accumulation": lp.accumulation,
                                      "global_batch": 32}
    fixed = build_plan(spec_for(job={"global_batch": 32, "micro_batch": 2}))
    assert {c.layout.micro_batch for c in fixed.time.ranking.candidates} == {2} and fixed.micro_batch == 2
    with pytest.raises(ConfigError, match=r"^job\.global_batch is 6, which no layout splits: the DP degrees here "
                                          r"are 2, 4 .*use a multiple of 4\.$"):
        build_plan(spec_for(job={"global_batch": 6, "micro_batch": 2}))  # 3 rows at tp 2 and 1.5 at tp 1
    odd = build_plan(spec_for(nodes=1, gpus=4, job={"global_batch": 2}))  # the default tp 4 has dp 1: fine too
    assert odd.rows * odd.layout.dp == 2


def test_without_a_global_batch_the_default_tp_runs_the_micro_batch_as_written():
    lp = build_plan(spec_for(job={"micro_batch": 8}))  # default tp 2: dp 2, so 16 sequences per step
    for c in lp.time.ranking.candidates:
        assert c.layout.global_batch == 16
        if c.layout.tp == 2:
            assert (c.layout.micro_batch, c.layout.accumulation) == (8, 1)


def test_a_users_fixed_choices_are_never_overridden():
    lp = build_plan(spec_for(tp=2, zero_stage=3, activation_checkpointing=True, offload=False,
                             job={"global_batch": 16, "micro_batch": 4}))
    assert (lp.layout.tp, lp.stage, lp.plan.activation_checkpointing, lp.plan.offload, lp.micro_batch) == \
        (2, 3, True, False, 4)
    assert {(c.layout.tp, c.layout.stage, c.layout.activation_checkpointing, c.layout.offload, c.layout.micro_batch)
            for c in lp.time.ranking.candidates} == {(2, 3, True, False, 4)}


def test_hybrid_plan_shows_the_table_and_the_reason():
    for name in ("local.yaml", "dgx-h100-8x8.yaml"):
        lp = build_plan(parse_spec_file(ROOT / "clusters" / name))
        text = format_plan(lp)
        assert "  layout " in text and "tokens/s" in text and "MFU" in text and "<- chosen" in text
        assert lp.time.ranking.reason in text and lp.time.chosen.fits
        doc = plan_dict(lp)
        assert doc["time"]["chosen"]["step_s"] == lp.predicted.step_s and doc["time"]["reason"]
    foreign = spec_for(config=str(_foreign_model()), job={"entrypoint": "tests.launch.entrypoints:where"})
    assert "time not estimated" in format_plan(build_plan(foreign))


def parse_spec_file(path):
    from launch.spec import load_spec

    return load_spec(path)


def _foreign_model(tmp=Path("/tmp")):
    import tempfile

    path = Path(tempfile.mkdtemp()) / "m.yaml"
    path.write_text("params: 7M\n")
    return path


# ----------------------------------------------------------------------------------------------- probe

def test_a_line_through_two_sizes_gives_latency_and_bandwidth():
    latency, bandwidth = fit_line([(1e6, 1e-4 + 1e6 / 2e9), (1e8, 1e-4 + 1e8 / 2e9)])
    assert latency == pytest.approx(1e-4) and bandwidth == pytest.approx(2e9)
    assert fit_line([(1e6, 2e-3), (1e8, 1e-3)]) == (0.0, 1e11)  # noise: the large one's rate, no latency


def _rank(rank, node, local, slow=1.0):
    group = {"size": 2, "all_reduce": [[65536, 1e-4 * slow], [16 << 20, 1e-2 * slow]],
             "all_gather": [[65536, 1e-4 * slow], [16 << 20, 5e-3 * slow]]}
    return {"rank": rank, "node": node, "local_rank": local, "device": "cpu", "intra": group, "inter": group,
            "matmul_flops": 50e9 / slow, "optimizer_rate": 4e8 / slow, "op_rate": 2e5 / slow,
            "memory_bandwidth": 2e10 / slow}


def test_cpu_ranks_measured_alone_get_their_share_of_their_hosts_cores():
    alone = [dict(_rank(r, r // 2, r % 2), host="a" if r < 3 else "b", cores=2) for r in range(4)]
    # three ranks on host a's 2 cores get 2/3 of the rate each; host b's one rank keeps all of its own
    assert shared_rates(alone, "matmul_flops") == pytest.approx([50e9 * 2 / 3] * 3 + [50e9])
    assert summarize(alone, 2, 2, "fp32")["matmul_flops"] == {"fp32": pytest.approx(50e9 * 2 / 3)}
    assert summarize(alone, 2, 2, "fp32")["op_rate"] == pytest.approx(2e5 * 2 / 3)  # dispatch shares the cores too
    gpus = [_rank(r, r // 2, r % 2) for r in range(4)]  # no host and cores: measured at once, kept as they are
    assert shared_rates(gpus, "optimizer_rate") == [4e8] * 4


def test_probe_json_takes_the_median_rate_and_the_slowest_rank_for_each_group(tmp_path):
    figures = summarize([_rank(0, 0, 0), _rank(1, 0, 1, slow=2.0), _rank(2, 1, 0), _rank(3, 1, 1)], 2, 2, "fp32")
    assert figures["matmul_flops"] == {"fp32": 50e9} and figures["optimizer_rate"] == 4e8  # one slow rank of four
    three = summarize([_rank(0, 0, 0, slow=2.0), _rank(1, 0, 1, slow=4.0), _rank(2, 1, 0)], 3, 1, "fp32")
    assert three["matmul_flops"] == {"fp32": 25e9}  # the middle one of 50, 25 and 12.5
    intra = figures["intra"]
    assert (intra["group_size"], intra["concurrent_groups"]) == (2, 2) and figures["inter"]["concurrent_groups"] == 2
    # the slowest rank's times; bus bytes: 2(n-1)/n of an all-reduce, (n-1)/n of an all-gather's output
    ar = fit_line([(65536, 2e-4), (16 << 20, 2e-2)])
    assert intra["all_reduce"]["bandwidth"] == pytest.approx(ar[1])
    assert intra["bandwidth"] == pytest.approx((intra["all_reduce"]["bandwidth"] + intra["all_gather"]["bandwidth"]) / 2)
    path = write_probe(tmp_path, figures)
    assert path.name == PROBE_FILE and read_probe(tmp_path)["optimizer_rate"] == 4e8
    assert read_probe(tmp_path, spec_for()) is not None and read_probe(tmp_path, spec_for(nodes=4)) is None
    lp = build_plan(spec_for(), probe=figures)
    assert lp.time.hardware.peak_flops == 50e9 and "measured" in lp.time.note
    # the per-micro-step figures: an op's time is one over the median op rate, the copy's bandwidth as measured
    assert figures["op_rate"] == 2e5 and figures["memory_bandwidth"] == 2e10
    assert (lp.time.hardware.op_overhead, lp.time.hardware.memory_bandwidth) == (pytest.approx(5e-6), 2e10)
    older = {k: v for k, v in figures.items() if k not in ("op_rate", "memory_bandwidth")}  # a probe before them
    assert build_plan(spec_for(), probe=older).time.hardware.op_overhead == pytest.approx(5.6e-6)
    (tmp_path / PROBE_FILE).write_text("[1]")
    with pytest.raises(ConfigError, match="probe.json is unreadable .*run hybrid probe again"):
        read_probe(tmp_path)


# --------------------------------------------------------------------------------------- the closed loop

def _entries(times, predicted=0.01):
    return [{"step": i + 1, "loss": 1.0, "step_time_s": t, "predicted_step_s": predicted} for i, t in enumerate(times)]


def test_measured_step_time_leaves_the_first_steps_out():
    assert measured_step_s(_entries([9.0, 9.0, 9.0, 0.02, 0.03, 0.01])) == (0.02, 3)
    assert measured_step_s(_entries([0.5, 0.1])) == (0.5, 2)
    assert measured_step_s([]) == (None, 0)
    line = time_line(0.01, _entries([1, 1, 1, 0.02, 0.02]), "tp1 z0 mb 4")
    assert line == ("step time: predicted 10 ms (tp1 z0 mb 4), measured 20 ms (median of 2 steps): measured / "
                    "predicted = 2.00")
    assert time_line(None, _entries([1.0])) is None


def test_every_metrics_entry_carries_the_prediction_and_the_summary_compares():
    progress = Progress(5, 1, io.StringIO(), tty=False)
    progress.predicted_step_s, progress.predicted_layout = 0.004, "tp1 z1 mb 2"
    for step in range(1, 6):
        progress.add({"rank": 0, "reports": [{"rank": 0, "step": step, "loss": 1.0, "step_time_s": 0.005,
                                              "throughput_unit": "tokens", "tokens": 10}]})
    assert all(e["predicted_step_s"] == 0.004 for e in progress.history)
    assert "step time: predicted 4 ms (tp1 z1 mb 2), measured 5 ms (median of 2 steps): measured / predicted = 1.25" \
        in progress.summary([], 1.0)


def test_hybrid_plan_measured_calibrates_from_time_json(tmp_path, capsys):
    from launch.cli import main

    lp = build_plan(spec_for())
    chosen = lp.time.chosen.layout
    layout = {"nodes": 2, "gpus_per_node": 2, "tp": chosen.tp, "stage": chosen.stage,
              "micro_batch": chosen.micro_batch, "accumulation": chosen.accumulation,
              "activation_checkpointing": chosen.activation_checkpointing, "offload": chosen.offload,
              "precision": "fp32"}
    measured = lp.predicted.step_s * 3
    history = _entries([measured] * 6, lp.predicted.step_s)
    write_time_record(tmp_path / "run", time_record(layout, lp.predicted.as_dict(), history, {}))
    cluster = tmp_path / "c.yaml"
    cluster.write_text(f"cluster: {{address: local, nodes: 2, gpus_per_node: 2, gpu_memory_gb: 80, interconnect: "
                       f"{{intra_node: loopback, inter_node: loopback}}}}\n"
                       f"job: {{entrypoint: 'hybrid.models.gpt:train', config: {ROOT / 'configs/gpt-tiny.yaml'}, "
                       f"steps: 3}}\nparallel: {{precision: fp32}}\n")
    assert main(["plan", str(cluster), "--measured", str(tmp_path / "run"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    factor = doc["calibration"]["factor"]
    assert 0 < factor < 1 and doc["time"]["calibration"] == factor
    rerun = [c for c in doc["time"]["candidates"] if (c["tp"], c["stage"], c["micro_batch"], c["accumulation"],
                                                      c["activation_checkpointing"], c["offload"]) ==
             (chosen.tp, chosen.stage, chosen.micro_batch, chosen.accumulation, chosen.activation_checkpointing,
              chosen.offload)]
    assert not rerun or rerun[0]["step_s"] == pytest.approx(measured)  # the run's layout predicts what it took
    assert main(["plan", str(cluster), "--measured", str(tmp_path / "run")]) == 0
    assert "took" in capsys.readouterr().out
    (tmp_path / "run" / "time.json").write_text('{"layout": {}}')
    assert main(["plan", str(cluster), "--measured", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --measured ") and "time.json lacks or garbles a field" in err and err.count("\n") == 1


def test_the_re_plan_ladder_is_ordered_by_predicted_time():
    lp = build_plan(spec_for(tp=1))
    current = replan.Choice(0, 4)
    rungs = replan.ladder(lp, current)
    ordered = replan.by_time(lp, rungs)
    assert sorted(map(repr, ordered)) == sorted(map(repr, rungs))
    times = [replan.predicted_cost(lp, c).step_s for c in ordered]
    for i, t in enumerate(times):  # each is within the tie of the fastest of those left
        assert t <= min(times[i:]) * 1.01 + 1e-12


# -------------------------------------------------------------------------------------- estimate --time

def _estimate(capsys, *argv):
    from launch.cli import main

    code = main(["estimate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


MPT7B = ["--params", "6.66B", "--gpus", "8", "--layers", "32", "--hidden", "4096", "--heads", "32", "--seq", "2048",
         "--micro-batch", "6", "--vocab", "50368", "--global-batch", "48"]


def test_estimate_time_ranks_a_cluster_not_yet_booked(capsys):
    code, out, err = _estimate(capsys, *MPT7B, "--time")
    assert code == 0 and err == "", err
    assert "  layout " in out and "<- chosen" in out and "nodes of 8 GPUs (--gpus-per-node not given" in out
    fastest = re.search(r"^Fastest: tp (\d+), stage (\d).*: ([\d,]+) tokens/s per GPU .*MFU ([\d.]+)%$", out, re.M)
    assert fastest and 5_000 < int(fastest.group(3).replace(",", "")) < 20_000 and 20 < float(fastest.group(4)) < 60
    code, out, _ = _estimate(capsys, *MPT7B, "--time", "--json")
    doc = json.loads(out)
    assert doc["time"]["chosen"]["fits"] and doc["time"]["global_batch"] == 48
    assert {c["micro_batch"] * c["accumulation"] * c["dp"] for c in doc["time"]["candidates"]} == {48}
    slower = json.loads(_estimate(capsys, *MPT7B, "--time", "--json", "--inter-gbps", "25", "--gpus", "16")[1])
    assert slower["time"]["hardware"]["inter_bandwidth"] < doc["time"]["hardware"]["inter_bandwidth"]


@pytest.mark.parametrize("extra, field", [(["--gpu", "K80"], "--gpu"), (["--gpu-tflops", "-1"], "--gpu-tflops"),
                                          (["--global-batch", "0"], "--global-batch"),
                                          (["--nics-per-node", "0"], "--nics-per-node")])
def test_estimate_time_refuses_bad_options_in_one_sentence(capsys, extra, field):
    code, _, err = _estimate(capsys, *MPT7B, "--time", *extra)
    assert code == 2 and err.startswith(f"error: {field}") and err.count("\n") == 1, err
    code, _, err = _estimate(capsys, "--params", "7B", "--gpus", "8", "--time")
    assert code == 2 and "--time needs the model's shape" in err
