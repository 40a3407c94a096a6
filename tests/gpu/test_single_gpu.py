"""On one GPU, under ``torchrun --nproc_per_node 1`` (no Ray): engine parity at ZeRO stages 0–3 in fp32 and
bf16 against single-process AdamW on the same GPU, CUDA memory against the memory model, checkpoint save
and resume, and the NVML probe and ``hybrid monitor`` on a real GPU. Skipped without CUDA.

``levers``: optimizer offload to pinned host memory (the CUDA side stream), activation checkpointing at
stage 3, and ``offload_optimizer: {device: none, pin_memory: true}``, against the same reference; offloaded
states in pinned host memory (the engine's host figure, the tensors' devices) and the GPU lower by their
bytes than the same run without offload (``torch.cuda.memory_allocated`` after the steps,
``max_memory_allocated`` at the peak).
"""

import subprocess
import sys

import pytest
import torch

from tests.gpu.torchrun import ROOT, require_gpus, run_worker
from tests.gpu.worker import TOLERANCE

REASON = require_gpus(1)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run_worker(1, tmp_path_factory.mktemp("gpu1"), "--cases", "parity,memory,checkpoint,levers",
                      "--meshes", "1x1")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_matches_single_process_adamw_on_the_gpu(single, stage, precision):
    assert single["device"] == "cuda:0" and single["forced_collectives"]
    case = single["parity"][f"tp1xdp1/stage{stage}/{precision}"]
    assert case["dp_collectives"] > 0 and case["tp_collectives"] > 0, case  # NCCL ran on one GPU
    assert case["loss_err"] < TOLERANCE[precision]["loss"], case
    if precision == "fp32":
        assert case["weights_err"] < TOLERANCE["fp32"]["weights"], case


@pytest.mark.parametrize("name", ["stage2-offload/fp32", "stage3-offload/fp32", "stage3-offload/bf16",
                                  "stage3-ac/fp32", "stage1-offload-none-pinned/bf16"])
def test_offload_and_activation_checkpointing_match_on_the_gpu(single, name):
    case, precision = single["levers"][name], name.rsplit("/", 1)[1]
    assert case["loss_err"] < TOLERANCE[precision]["loss"], case
    if precision == "fp32":
        assert case["weights_err"] < TOLERANCE["fp32"]["weights"], case


TINY_PARAMS = 134_912  # configs/gpt-tiny.yaml
OFFLOADED = ["stage2-offload/fp32", "stage3-offload/fp32", "stage3-offload/bf16"]


@pytest.mark.parametrize("name", OFFLOADED)
def test_offloaded_optimizer_states_live_in_pinned_host_memory_not_on_the_gpu(single, name):
    case, precision = single["levers"][name], name.rsplit("/", 1)[1]
    offload, plain = case["memory"], case["without_offload"]["memory"]
    # without offload the GPU holds the Adam moments (8 bytes per parameter), and in bf16 the fp32 master too
    states = plain["report"]["optimizer"]
    assert states == pytest.approx((8 if precision == "fp32" else 12) * TINY_PARAMS, rel=0.01), plain
    assert plain["devices"] == ["cuda:0"] and "host" not in plain["report"]
    # offloaded: master and moments (12 bytes per parameter) in pinned host memory, none of it on the GPU
    assert offload["devices"] == ["cpu"] and offload["pinned"] is True, offload
    assert offload["report"]["optimizer"] == 0
    assert offload["report"]["host"]["optimizer"] == pytest.approx(12 * TINY_PARAMS, rel=0.01), offload
    # the GPU's own figures: less memory by the states' bytes after the steps, and a lower peak
    assert plain["allocated_bytes"] - offload["allocated_bytes"] >= 0.9 * states, (offload, plain)
    assert offload["peak_bytes"] <= plain["peak_bytes"] - 0.5 * states, (offload, plain)
    # and the same training: offload moves the states, not the arithmetic
    plain_losses = case["without_offload"]["losses"]
    assert case["losses"][:len(plain_losses)] == pytest.approx(plain_losses, rel=TOLERANCE[precision]["loss"])


def test_cuda_memory_is_what_the_memory_model_predicts(single):
    m = single["memory"]
    states, activations = m["predicted_state_bytes"], m["predicted_activation_bytes"]
    print(f"peak {m['peak_bytes'] / 2**30:.2f} GiB; model states {states / 2**30:.2f} GiB, activations "
          f"{activations / 2**30:.2f} GiB, logits {m['logit_bytes'] / 2**30:.2f} GiB predicted")
    # the engine holds exactly the model states of the paper's formula (up to alignment padding)
    assert abs(m["reported_state_bytes"] - states) <= 0.01 * states, m
    # the allocator's peak: at least the model states, at most states + activations + logits with 25% slack
    assert states <= m["peak_bytes"] <= 1.25 * (states + activations + m["logit_bytes"]) + 2**28, m


def test_checkpoint_resume_on_the_gpu_continues_the_run_exactly(single):
    c = single["checkpoint"]
    assert c["first"] == c["whole"][:3]
    assert c["rest"] == pytest.approx(c["whole"][3:], rel=1e-5)
    assert c["weights_err"] < 1e-5


def test_nvml_probe_and_hybrid_monitor_see_the_gpu():
    from hybrid.plan.monitor import probe

    result = probe()
    assert result.available, result.reason
    name = torch.cuda.get_device_name(0)
    assert len(result.gpus) >= 1 and result.gpus[0].total_bytes > 0
    assert any(name in gpu.name or gpu.name in name for gpu in result.gpus), (name, result.gpus)
    shown = subprocess.run([sys.executable, "-m", "launch.cli", "monitor"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "GPU 0: " in shown.stdout and " total " in shown.stdout, shown.stdout
