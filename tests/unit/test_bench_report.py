"""bench/report.py: the checks that make the benchmark fail loudly, on hand-made rows."""

import math

from bench import report
from bench.report import Row


def _row(impl, stage, losses, step_s=1.0, delta_rss=100, traffic=None, note=""):
    return Row(impl, stage, "4M", "fp32", step_s=step_s, delta_rss=delta_rss, losses=list(losses),
               traffic=traffic, math_note=note)


def test_summarize_takes_slowest_rank_median_and_mean_loss():
    per_rank = [dict(times=[1.0, 5.0, 2.0], losses=[2.0, 4.0], peak_rss=300, rss_before=100, state_bytes=7,
                     traffic=None),
                dict(times=[3.0, 1.0, 1.0], losses=[4.0, 6.0], peak_rss=250, rss_before=10, state_bytes=9,
                     traffic=None)]
    row = report.summarize("ddp", 0, "4M", "fp32", per_rank, wall_s=1.0)
    assert row.step_s == 3.0                 # slowest per step: [3, 5, 2] -> median 3
    assert row.losses == [3.0, 5.0]
    assert (row.peak_rss, row.delta_rss, row.state_bytes) == (300, 240, 9)


def test_loss_disagreement_is_reported_and_noted_rows_are_left_out():
    a, b = _row("hybrid", 0, [5.0, 4.0]), _row("ddp", 0, [5.0, 4.0 * (1 + 2e-4)])
    assert report.loss_disagreements([a, b], 1e-4) and not report.loss_disagreements([a, b], 1e-3)
    noted = _row("deepspeed", 0, [5.0, 3.0], note="different start-up state")
    assert not report.loss_disagreements([a, noted], 1e-4)
    assert report.loss_disagreements([a, _row("fsdp2", 3, [5.0, math.nan])], 1e-4)  # NaN never agrees


def test_stage_summary_against_fastest_and_leanest_peer():
    rows = [_row("hybrid", 3, [1], step_s=0.8, delta_rss=90), _row("fsdp2", 3, [1], step_s=1.0, delta_rss=120),
            _row("deepspeed", 3, [1], step_s=2.0, delta_rss=100)]
    (s,) = report.stage_summary(rows)
    assert (s.fastest, s.leanest) == ("fsdp2:3", "deepspeed:3")
    assert math.isclose(s.time_ratio, 0.8) and math.isclose(s.memory_ratio, 0.9) and s.time_ok and s.memory_ok


def test_traffic_ratios_against_the_seed():
    rows = [_row("hybrid", s, [1], traffic={"total": t}) for s, t in ((0, 200), (1, 200), (2, 200), (3, 300))]
    ratios = report.traffic_ratios(rows)
    assert ratios == {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.5} and not report.traffic_mismatches(ratios)
    assert report.traffic_mismatches({0: 1.0, 3: 1.0}) == ["stage 3: measured 1.000x stage 0, seed says 1.5x"]
