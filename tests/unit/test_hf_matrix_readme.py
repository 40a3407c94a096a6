"""The README's Hugging Face summary is the matrix's own output: the table ``bench/hf_matrix.py`` writes between
its markers, from the committed docs/hf-matrix.md (a hand edit of either, or a matrix run that left the README
behind, fails here; the fix is to run the command the README names)."""

import pytest

pytest.importorskip("transformers")

from bench import hf_matrix  # noqa: E402


def test_the_readme_summary_is_generated_from_the_committed_matrix():
    rows, meta = hf_matrix.read_report(hf_matrix.DEFAULT_OUT)
    readme = hf_matrix.README.read_text()
    block = hf_matrix.README_BLOCK.search(readme)
    assert block is not None, "README.md lost its <!-- hf-matrix summary --> block"
    expected = hf_matrix.readme_table(rows, meta["command"])
    assert readme[block.end(1):block.start(2)] == expected, "run .venv/bin/python bench/hf_matrix.py"
    assert len(rows) == len(hf_matrix.all_types()), "the matrix covers every causal-LM type of this transformers"
