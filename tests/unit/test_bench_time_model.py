"""bench/time_model.py's pure parts (issue 44): each model's layouts cover every pair of two factors' values, the
quick run takes each model's first and last, and the Llama it writes is a grouped-query transformers config the
plan profiles and splits at TP 2 (the timings themselves are the bench's, in bench/RESULTS.md)."""

import itertools
import json

from bench import time_model
from launch.planning.model_size import model_facts, model_figures
from launch.spec import parse_spec

FACTORS = [(1, 2), (1, 2, 3), (False, True), (0, 1)]  # tp, stage, activation checkpointing, half micro-batch


def test_each_models_layouts_are_a_covering_array_of_the_full_product():
    for rows in (time_model.GPT_ROWS, time_model.LLAMA_ROWS):
        assert len(set(rows)) == len(rows) < 24
        for i, j in itertools.combinations(range(4), 2):
            pairs = {(r[i], r[j]) for r in rows}
            assert pairs == set(itertools.product(FACTORS[i], FACTORS[j])), (i, j)
    full = time_model.layouts(4, quick=False)
    assert [lay["model"] for lay in full] == ["gpt"] * 12 + ["llama"] * 8
    # one global batch of 16 sequences: rows per DP rank, or half of them in each of two micro-steps
    assert {(lay["tp"], lay["micro_batch"]) for lay in full} == {(1, 4), (1, 2), (2, 8), (2, 4)}
    quick = time_model.layouts(4, quick=True)
    assert [time_model.label(lay) for lay in quick] == ["gpt tp1 z1 mb 4", "gpt tp2 z3 mb 8 AC", "llama tp1 z1 mb 4",
                                                        "llama tp2 z3 mb 4 AC"]


def test_the_benchs_llama_is_profiled_and_split_by_its_own_plan(tmp_path):
    paths = time_model.write_models(tmp_path)
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # grouped-query attention
    spec = parse_spec({"cluster": {"address": "local", "nodes": 2, "gpus_per_node": 2, "gpu_memory_gb": 16},
                       "job": {"entrypoint": "hybrid.models.gpt:train", "config": str(paths["llama"]), "steps": 1,
                               "global_batch": 16},
                       "parallel": {"tp": 2, "zero_stage": 1, "precision": "fp32"}}, base_dir=tmp_path)
    facts = model_facts(spec)
    assert facts.tp_refusal(2) is None and "LlamaForCausalLM" in facts.tp_plan
    shape = model_figures(facts, "fp32", spec.job.entrypoint).cost_shape()
    assert shape.flop_terms is not None and shape.layers == config["num_hidden_layers"] and shape.seq == time_model.SEQ


def test_the_verdict_judges_every_layout_after_the_first_at_the_first_ones_level():
    rows = [{"predicted_s": 0.010, "measured_s": 0.025}, {"predicted_s": 0.020, "measured_s": 0.048},
            {"predicted_s": 0.040, "measured_s": 0.101}, {"predicted_s": 0.030, "measured_s": 0.074}]
    check = time_model.verdict(rows)
    assert check["scale"] == 2.5 and check["calibrated"][1] == 0.05
    assert check["within"] == [True] * 4 and check["spearman"] == 1.0 and check["passed"]
    rows[2]["measured_s"] = 0.140  # 1.4x its calibrated prediction: out, though the ranking holds
    check = time_model.verdict(rows)
    assert check["within"][2] is False and check["spearman"] == 1.0 and not check["passed"]
