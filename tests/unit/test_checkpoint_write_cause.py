"""The cause a failed checkpoint write names (``hybrid.checkpoint.write_errors``) and when a run saves
(``hybrid.checkpoint.cadence``): pure decisions, no process group."""

import errno

import pytest

from hybrid.checkpoint import cadence, write_errors
from hybrid.checkpoint.write_errors import DiskFacts, classify, error_errno, write_cause

DCP_SHORT_WRITE = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
ROOMY = DiskFacts(free_bytes=50 << 30, total_bytes=100 << 30, read_only=False)


def test_an_oserror_anywhere_in_the_chain_names_its_errno():
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError as inner:
            raise RuntimeError("write failed") from inner
    except RuntimeError as outer:
        assert error_errno(outer) == errno.EDQUOT
        cause, fix = write_cause(outer, "/nonexistent/anywhere")
    assert cause == "Disk quota exceeded" and fix.startswith("raise the quota there")


def test_words_of_a_known_errno_in_a_message_name_it():
    assert error_errno(RuntimeError("basic_ios::clear: No space left on device")) == errno.ENOSPC
    assert error_errno(RuntimeError("Read-only file system")) == errno.EROFS
    assert error_errno(DCP_SHORT_WRITE) is None


@pytest.mark.parametrize("facts, cause, fix", [
    (DiskFacts(4096, 3 << 20, False), "No space left on device: 4.096 KB free of 3.146 MB", "free space there"),
    (DiskFacts(2 << 30, 4 << 40, False), "No space left on device: 2.147 GB free of 4398.047 GB", "free space there"),
    (DiskFacts(1 << 30, 2 << 30, True), "Read-only file system", "make it writable"),
    (ROOMY, "RuntimeError: . unexpected pos 704 vs 598", "free space there"),
    (None, "RuntimeError: . unexpected pos 704 vs 598", "free space there"),
])
def test_an_error_that_hides_its_cause_is_named_by_the_disk(facts, cause, fix):
    got = classify(None, "RuntimeError: . unexpected pos 704 vs 598", facts)
    assert got[0] == cause and got[1].startswith(fix)


def test_an_errno_wins_over_the_disk_and_each_has_its_fix():
    assert classify(errno.EACCES, "x", DiskFacts(0, 1, True)) == ("Permission denied", "make it writable for every rank")
    assert classify(errno.ENOSPC, "x", ROOMY)[0] == "No space left on device"
    assert write_errors.fix_for(errno.EISDIR).startswith("move aside the file")


def test_the_sentence_names_the_checkpoint_a_rerun_resumes_from(tmp_path):
    tmp = tmp_path / "checkpoints" / ".tmp-step-000007"
    err = write_errors.write_failed(7, tmp, "No space left on device on rank 1", "free space there",
                                    previous=tmp_path / "checkpoints" / "step-000005")
    assert str(err) == (f"saving the step-7 checkpoint into {tmp.parent} failed (No space left on device on rank 1; "
                        "the partial .tmp-step-000007 was removed); free space there and run the job again to "
                        "resume from step-000005.")


def test_disk_facts_reads_the_nearest_existing_directory(tmp_path):
    facts = write_errors.disk_facts(tmp_path / "not" / "yet")
    assert facts is not None and facts.total_bytes > 0 and not facts.read_only


@pytest.mark.parametrize("step, every, seconds, since, forced, expected", [
    (10, 10, None, 0.0, False, True), (11, 10, None, 0.0, False, False), (20, 0, None, 99.0, False, True),
    (3, 0, None, 99.0, False, False), (3, 100, 30.0, 31.0, False, True), (3, 100, 30.0, 29.0, False, False),
    (3, 100, None, 0.0, True, True),
])
def test_a_save_is_due_by_steps_by_seconds_at_the_last_step_or_forced(step, every, seconds, since, forced, expected):
    assert cadence.due(step, 20, every, seconds, since, forced=forced) is expected


def test_the_seconds_are_agreed_and_count_from_the_last_save():
    now, asked = [0.0], []

    def agree(flag):
        asked.append(flag)
        return flag

    plan = cadence.Cadence(every=5, every_seconds=10.0, last_step=100, agree=agree, clock=lambda: now[0])
    now[0] = 4.0
    assert not plan.due(1) and asked == [False]
    assert plan.due(5) and asked == [False]  # on the step cadence: no collective
    now[0] = 12.0
    assert plan.due(6)
    plan.saved()
    now[0] = 15.0
    assert not plan.due(7)
