"""The run summary's sentence on checkpoints and the display's note per save (``launch.job.metrics``): bytes,
stall and write seconds from rank 0's ``checkpoint_saved`` reports."""

from launch.job.metrics import checkpoint_line, save_cost

BACKGROUND = [{"checkpoint_saved": s, "checkpoint_bytes": 51_024_491, "checkpoint_stall_s": stall,
               "checkpoint_write_s": write, "checkpoint_async": True}
              for s, stall, write in ((2, 0.074, 1.092), (4, 0.028, 0.466), (6, 0.031, 0.5))]


def test_the_summary_names_the_size_the_median_stall_and_the_write_of_the_saves():
    assert checkpoint_line(BACKGROUND) == ("checkpoints: 3 saved in the background, 51.024 MB each; training stopped "
                                           "0.03 s per save (median), each written in 0.50 s")
    sync = [dict(r, checkpoint_async=False, checkpoint_write_s=r["checkpoint_stall_s"]) for r in BACKGROUND[:1]]
    assert checkpoint_line(sync).startswith("checkpoints: 1 saved synchronously, 51.024 MB each; training stopped 0.07 s")


def test_reports_without_figures_say_nothing():
    assert checkpoint_line([]) is None and checkpoint_line([{"checkpoint_saved": 3}]) is None
    assert save_cost({"checkpoint_saved": 3, "checkpoint": "runs/x/checkpoints/step-000003"}) == ""
    assert save_cost(BACKGROUND[0]) == " (51.024 MB, training stopped 0.07 s; written in 1.09 s in the background)"
