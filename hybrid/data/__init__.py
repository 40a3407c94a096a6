"""Training data: a synthetic stream for tests (``MarkovTokens``) and token files on disk (``TokenFile``).

``hybrid.data.prepare`` turns text into a token file; both kinds of data yield a step's batch as a pure
function of (seed, step, DP rank), so a resumed job sees the batches an uninterrupted one would.
"""

from hybrid.data.markov import MarkovTokens
from hybrid.data.tokens import TokenFile, TokenFileMeta, metadata_path

__all__ = ["MarkovTokens", "TokenFile", "TokenFileMeta", "metadata_path"]
