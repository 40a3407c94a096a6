"""A failed rank's traceback goes to the run directory and the sentence names where (``launch.job.rank_traceback``)."""

from launch.job.rank_traceback import keep, pointing

SENTENCE = ("saving the step-10 checkpoint into /runs/x/checkpoints failed (No space left on device on rank 1; the "
            "partial .tmp-step-000010 was removed); free space there and run the job again to resume from step-000005.")


def test_the_traceback_is_kept_and_the_sentence_says_where(tmp_path):
    try:
        raise RuntimeError("deep inside the rank")
    except RuntimeError as err:
        path = keep(tmp_path, 3, err)
    assert path == tmp_path / "logs" / "rank-3-traceback.txt" and "deep inside the rank" in path.read_text()
    assert pointing(SENTENCE, path) == f"{SENTENCE[:-1]}; the rank's traceback: {path}"


def test_without_a_writable_run_directory_the_sentence_stands_alone(tmp_path):
    (tmp_path / "logs").write_text("a file where the directory goes")
    assert keep(tmp_path, 0, RuntimeError("x")) is None and keep(None, 0, RuntimeError("x")) is None
    assert pointing(SENTENCE, None) == SENTENCE
