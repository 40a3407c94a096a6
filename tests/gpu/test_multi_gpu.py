"""On 2 GPUs (4 for TP2×DP2), under torchrun with NCCL (``cpu:gloo,cuda:nccl``): TP2, DP2 and TP2×DP2 at
ZeRO stages 0–3, fp32 and bf16, against single-process AdamW on the same GPU type. Skipped with fewer GPUs."""

import pytest

from tests.gpu.torchrun import require_gpus, run_worker
from tests.gpu.worker import TOLERANCE

pytestmark = pytest.mark.slow
MESHES = {"tp2xdp1": 2, "tp1xdp2": 2, "tp2xdp2": 4}  # mesh -> GPUs it needs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for nproc, meshes in ((2, "2x1,1x2"), (4, "2x2")):
        if require_gpus(nproc) is None:
            out.update(run_worker(nproc, tmp_path_factory.mktemp(f"gpu{nproc}"), "--cases", "parity",
                                  "--meshes", meshes)["parity"])
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("mesh", list(MESHES))
def test_tp_and_dp_over_nccl_match_single_process_adamw(mesh, stage, precision, request):
    reason = require_gpus(MESHES[mesh])
    if reason:
        pytest.skip(reason)
    case = request.getfixturevalue("runs")[f"{mesh}/stage{stage}/{precision}"]
    assert case["loss_err"] < TOLERANCE[precision]["loss"], case
    if precision == "fp32":
        assert case["weights_err"] < TOLERANCE["fp32"]["weights"], case
