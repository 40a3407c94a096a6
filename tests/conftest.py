"""Shared test settings: loopback-only networking for every process group and Ray cluster."""

import os

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
# One intra-op thread in every test process (the pytest workers and what they start), as every rank has: with two
# xdist workers each running several processes on two cores, a second OpenMP thread per process only spins
# waiting for a core (measured: 25 % more CPU time for the same tests). Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Embedded-cluster launches plan from the tables, not from a calibration probe each (launch.planning.probe_local).
os.environ.setdefault("HYBRID_LOCAL_CALIBRATION", "0")

from launch.ray.cluster import LOOPBACK_ONLY_ENV  # noqa: E402  (imports neither Ray nor torch)

for _k, _v in LOOPBACK_ONLY_ENV.items():
    os.environ.setdefault(_k, _v)

import importlib.util  # noqa: E402

from hybrid.runtime.local_launch import preload  # noqa: E402

# What the dist tests' ranks import beyond the forkserver's default, imported once by it instead of by every
# rank: torch.distributed.checkpoint (0.5 CPU-s a rank that checkpoints) and the Hugging Face models (3 CPU-s a
# rank: test_hf_tp, test_hf_model and test_hf_checkpoints took 71 CPU-s without, 32 with).
preload("torch.distributed.checkpoint")
if importlib.util.find_spec("transformers") is not None:
    preload("transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2")


def pytest_xdist_make_scheduler(config, log):
    """Under ``-n N`` (``make test``), the suite's own scheduler (``tests/scheduling.py``)."""
    if config.getvalue("dist") in ("load", "loadscope"):
        from tests.scheduling import SuiteScheduling

        return SuiteScheduling(config, log)
    return None
