"""hybrid.data.TokenFile: dtypes, bounds, determinism, DP disjointness, resume, and one sentence per bad file."""

import numpy as np
import pytest
import torch

from hybrid.data import TokenFile, TokenFileMeta, metadata_path
from hybrid.data.tokens import permute, _key
from hybrid.errors import DataError


def write_tokens(path, ids, dtype="uint16", vocab_size=256, meta=True, tokens=None):
    np.asarray(ids, dtype={"uint16": "<u2", "uint32": "<u4"}[dtype]).tofile(path)
    if meta:
        metadata_path(path).write_text(TokenFileMeta(dtype=dtype, vocab_size=vocab_size,
                                                     tokens=len(ids) if tokens is None else tokens).to_json())
    return path


@pytest.fixture
def counting(tmp_path):
    """A file whose token at position i is i % 251: every row shows where in the file it came from."""
    return write_tokens(tmp_path / "count.bin", np.arange(10_000) % 251)


@pytest.mark.parametrize("dtype, vocab", [("uint16", 65_536), ("uint32", 100_000)])
def test_both_dtypes_read_back_the_ids_written(tmp_path, dtype, vocab):
    ids = np.random.default_rng(0).integers(0, vocab, 5_000)
    tf = TokenFile(write_tokens(tmp_path / "t.bin", ids, dtype, vocab), seq_len=16)
    assert tf.vocab_size == vocab and tf.tokens == 5_000
    starts = tf.starts(3, 4)
    rows = tf.global_batch(3, 4)
    assert rows.dtype == torch.long
    assert all(torch.equal(rows[i], torch.from_numpy(ids[s:s + 17].astype(np.int64))) for i, s in enumerate(starts))


def test_rows_lie_inside_the_file_and_targets_are_inputs_shifted(counting):
    tf = TokenFile(counting, seq_len=32)
    for step in range(0, 2_000, 7):  # many epochs: the file holds 302 rows
        starts = tf.starts(step, 8)
        assert starts.min() >= 0 and starts.max() + 33 <= tf.tokens
        x, y = tf.batch(step, 8)
        assert x.shape == y.shape == (8, 32) and torch.equal(x[:, 1:], y[:, :-1])
        assert torch.equal((x[:, 0] + 1) % 251, y[:, 0])  # consecutive file positions


def test_batches_are_a_function_of_seed_and_step_alone(counting):
    a, b = TokenFile(counting, seq_len=32, seed=1), TokenFile(counting, seq_len=32, seed=1)
    assert all(torch.equal(a.batch(s, 4, 1, 2)[0], b.batch(s, 4, 1, 2)[0]) for s in range(50))
    assert not torch.equal(a.batch(5, 4)[0], a.batch(6, 4)[0])
    assert not torch.equal(a.batch(5, 4)[0], TokenFile(counting, seq_len=32, seed=2).batch(5, 4)[0])


def test_dp_ranks_read_disjoint_tokens_and_partition_the_global_batch(counting):
    tf = TokenFile(counting, seq_len=32)
    for step in range(200):
        starts = np.sort(tf.starts(step, 4 * 8))
        assert (np.diff(starts) >= 33).all(), "two rows of one step overlap"
        whole = tf.global_batch(step, 32)
        parts = [tf.batch(step, 8, rank, 4) for rank in range(4)]
        assert torch.equal(torch.cat([torch.cat([x, y[:, -1:]], 1) for x, y in parts]), whole)


def test_an_epoch_visits_each_window_at_most_once_and_epochs_differ(counting):
    tf = TokenFile(counting, seq_len=32)
    per_epoch = tf.windows_per_epoch // 8
    epoch0 = np.concatenate([tf.starts(s, 8) for s in range(per_epoch)])
    epoch1 = np.concatenate([tf.starts(s, 8) for s in range(per_epoch, 2 * per_epoch)])
    assert len(set(epoch0.tolist())) == len(epoch0) and len(set(epoch1.tolist())) == len(epoch1)
    assert not np.array_equal(epoch0, epoch1)


def test_a_resumed_reader_continues_with_the_batches_an_uninterrupted_one_reads(counting):
    run = TokenFile(counting, seq_len=32, seed=3)
    uninterrupted = [run.batch(s, 4, 0, 2)[0] for s in range(60)]
    first = TokenFile(counting, seq_len=32, seed=3)
    before = [first.batch(s, 4, 0, 2)[0] for s in range(25)]
    del first  # the job dies after step 25; a new process opens the file and resumes at the saved step
    after = [TokenFile(counting, seq_len=32, seed=3).batch(s, 4, 0, 2)[0] for s in range(25, 60)]
    assert all(torch.equal(u, r) for u, r in zip(uninterrupted, before + after))


def _resumed(path, saved_step: int, state: dict) -> TokenFile:
    reader = TokenFile(path, seq_len=32, seed=3)
    reader.continue_from(saved_step, state)
    return reader


@pytest.mark.parametrize("rows_after", [8, 4, 12])
def test_a_resume_with_another_global_batch_reads_the_rows_after_those_already_read(counting, rows_after):
    """The data position was the step alone: resumed with half the rows per step, the job read again rows it
    had trained on (and skipped rows with more)."""
    first = TokenFile(counting, seq_len=32, seed=3)  # 303 rows per epoch: 37 steps of 8, 7 left out
    saved_step = 20
    read = [first.starts(s, 8) for s in range(saved_step)]
    state = first.data_state(8)
    after = _resumed(counting, saved_step, state)
    rest_of_epoch = (first.windows_per_epoch - saved_step * 8) // rows_after
    more = [after.starts(s, rows_after) for s in range(saved_step, saved_step + rest_of_epoch)]
    epoch = np.concatenate(read + more).tolist()
    assert len(set(epoch)) == len(epoch)  # no row of the epoch twice
    assert len(epoch) > first.windows_per_epoch - rows_after  # and none skipped but the remainder
    if rows_after == 8:  # the same batch: exactly what an uninterrupted reader reads, epochs later too
        assert all(np.array_equal(after.starts(s, 8), first.starts(s, 8)) for s in range(saved_step, 120))
    # resumed again with the batch it now has: it goes on as the first resume does
    again = _resumed(counting, saved_step + 30, after.data_state(rows_after))
    assert all(np.array_equal(again.starts(s, rows_after), after.starts(s, rows_after))
               for s in range(saved_step + 30, saved_step + 120))


@pytest.mark.parametrize("field, value", [("tokens", "61715"), ("tokens", None), ("tokens", -5),
                                          ("vocab_size", True), ("vocab_size", 1_000_000),
                                          ("unigram_entropy_nats", "n/a"), ("sources", 5)])
def test_a_sidecar_with_a_field_of_the_wrong_kind_is_one_sentence(tmp_path, field, value):
    """They gave a TypeError traceback (exit 1), a rank's ValueError after the launch, or went unchecked."""
    import json

    path = write_tokens(tmp_path / "t.bin", np.arange(1000) % 50)
    meta = path.with_name(path.name + ".json")
    doc = json.loads(meta.read_text())
    meta.write_text(json.dumps({**doc, field: value}))
    with pytest.raises(DataError, match=f"says {field} "):
        TokenFile(path, seq_len=8)


def test_batch_arguments_out_of_range_are_refused(counting):
    tf = TokenFile(counting, seq_len=32)
    for args in ((0, 4, 2, 2), (0, 4, -2, 2), (0, 0, 0, 1)):  # -2 read rank 0's rows; 0 rows divided by zero
        with pytest.raises(ValueError, match="TokenFile.batch needs"):
            tf.batch(*args)
    with pytest.raises(ValueError, match="seq_len >= 1"):
        TokenFile(counting, seq_len=0)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097])
def test_the_permutation_is_a_bijection(n):
    out = permute(np.arange(n), n, _key(7, n))
    assert sorted(out.tolist()) == list(range(n))


def test_unigram_entropy_is_counted_when_the_metadata_lacks_it(tmp_path):
    tf = TokenFile(write_tokens(tmp_path / "t.bin", [0, 1] * 500), seq_len=4)
    assert tf.unigram_entropy == pytest.approx(np.log(2))


def test_a_raw_file_without_metadata_opens_with_dtype_and_vocab_size(tmp_path):
    path = write_tokens(tmp_path / "raw.bin", np.arange(1000) % 50, meta=False)
    assert TokenFile(path, seq_len=8, dtype="uint16", vocab_size=50).tokens == 1000


def _one_sentence(info) -> str:
    message = str(info.value)
    assert "\n" not in message and message.endswith(".") and "Traceback" not in message
    return message


def test_bad_files_are_one_sentence_each(tmp_path, counting):
    cases = []
    with pytest.raises(DataError) as info:
        TokenFile(tmp_path / "missing.bin", seq_len=8)
    cases.append((info, "does not exist; create it with `hybrid data prepare"))
    with pytest.raises(DataError) as info:
        TokenFile(tmp_path, seq_len=8)
    cases.append((info, "is a directory"))
    with pytest.raises(DataError) as info:
        TokenFile(write_tokens(tmp_path / "empty.bin", []), seq_len=8)
    cases.append((info, "is empty"))
    odd = write_tokens(tmp_path / "odd.bin", range(100))
    with open(odd, "ab") as f:
        f.write(b"\x01")
    metadata_path(odd).write_text(TokenFileMeta(dtype="uint16", vocab_size=256, tokens=100).to_json())
    with pytest.raises(DataError) as info:
        TokenFile(odd, seq_len=8)
    cases.append((info, "has 201 bytes, not a whole number of uint16 tokens (2 bytes each)"))
    with pytest.raises(DataError) as info:
        TokenFile(write_tokens(tmp_path / "big.bin", [1, 2, 300, 4] * 50, vocab_size=256), seq_len=8)
    cases.append((info, "holds token id 300 at position 2, not below its vocab_size 256"))
    with pytest.raises(DataError) as info:
        TokenFile(write_tokens(tmp_path / "nometa.bin", range(100), meta=False), seq_len=8)
    cases.append((info, "has no metadata file nometa.bin.json beside it"))
    with pytest.raises(DataError) as info:
        TokenFile(write_tokens(tmp_path / "changed.bin", range(100), tokens=99), seq_len=8)
    cases.append((info, "holds 100 tokens but changed.bin.json says 99"))
    with pytest.raises(DataError) as info:
        TokenFile(write_tokens(tmp_path / "short.bin", range(10)), seq_len=8)
    cases.append((info, "holds 10 tokens, too few for one row of seq_len 8"))
    with pytest.raises(DataError) as info:
        TokenFile(counting, seq_len=32).batch(0, micro_batch=200, dp_rank=0, dp=2)
    cases.append((info, "fewer than the 400 one step needs"))
    for info, expected in cases:
        assert expected in _one_sentence(info)


def test_the_dtype_is_the_smallest_that_holds_the_vocabulary():
    from hybrid.data.tokens import dtype_for

    assert (dtype_for(256), dtype_for(65_536), dtype_for(65_537), dtype_for(200_000)) == \
        ("uint16", "uint16", "uint32", "uint32")
