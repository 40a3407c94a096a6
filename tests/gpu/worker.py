"""What the GPU tests run on every rank, under torchrun (no Ray):

    python -m torch.distributed.run --nnodes 1 --nproc_per_node N --master_addr 127.0.0.1 --master_port P \
        -m tests.gpu.worker OUT.json --cases parity,memory,checkpoint --meshes 1x1

Each rank takes torchrun's variables, uses ``cuda:LOCAL_RANK`` (cpu where CUDA is absent, so the same code
path can be exercised on a CPU machine with ``--init-method file://...``), joins the default group through
``hybrid.comm.mesh.init_default_group`` and runs the cases; rank 0 writes one JSON object to OUT.json with the
measured errors and bytes, which the tests compare against ``TOLERANCE`` and the memory model, again after
every case, so a crash keeps the cases before it. On one rank a case that raises is left out, its traceback
under ``errors``, and the rest still run (with several ranks it ends the run: the others would wait in its
collectives). ``tests.gpu.torchrun`` sets ``HYBRID_FORCE_COLLECTIVES=1``: even groups of one rank issue
every collective (``parity`` records how many each case issued on its DP and TP groups).

* ``parity``: for every mesh ``TPxDP`` given and ZeRO stages 0–3, fp32 and bf16: the built-in GPT (gpt-tiny)
  trained ``STEPS`` steps by the engine against single-process ``torch.optim.AdamW`` on the same device,
  same seed and batches; relative errors of the losses (and, fp32, of the consolidated weights).
* ``memory``: a ~100M GPT at stage 0, bf16, one rank: ``torch.cuda.max_memory_allocated`` over three steps
  against ``hybrid.plan.memory``'s model-state bytes and activation estimate, and what the engine reports.
* ``levers``: optimizer offload to pinned host memory (stages 2 and 3, fp32 and bf16), activation
  checkpointing at stage 3, and offload ``device: none`` with ``pin_memory``: the same errors as ``parity``,
  where each case's optimizer states are (devices, pinned, ``memory_report``) and, for an offloaded case, the
  same run without offload (2 steps); on CUDA each run's device bytes after its steps and at its peak.
* ``checkpoint``: stage 3, fp32: a run of 6 steps saving every 3, against a run of 3 steps resumed for 3
  more from its checkpoint by a fresh engine (``hybrid.runtime.train.run_steps``): same losses and weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch

from hybrid.config.training import OptimizerConfig
from hybrid.zero.param_groups import torch_param_groups  # the engine's default groups
import torch.distributed as dist

import hybrid
from hybrid.config.training import TrainConfig
from hybrid.comm.collectives import collectives_forced
from hybrid.comm.mesh import build_mesh, init_default_group
from hybrid.models.gpt.model import GPT, GPTConfig, count_parameters
from hybrid.runtime.train import Context, JobSettings, run_steps

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "gpt-tiny.yaml"
STEPS, GLOBAL_BATCH, SEED = 8, 8, 0
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 1e-2, (0.9, 0.95), 1e-4, 0.1, 0.3  # eps: see tests/dist/test_zero_tp.py
# Relative error bounds: fp32 against the fp32 reference; bf16 (bf16 weights, fp32 master) against it too.
TOLERANCE = {"fp32": {"loss": 1e-4, "weights": 1e-4}, "bf16": {"loss": 3e-2}}
MEMORY_MODEL = dict(vocab_size=32768, seq_len=512, n_layers=8, hidden=1024, n_heads=16, mlp_ratio=4, dropout=0.0)
MEMORY_MICRO_BATCH = 4


def train_config(stage: int, precision: str, **zero) -> TrainConfig:
    return TrainConfig.from_dict({
        "zero": {"stage": stage, "reduce_bucket_size": 20_000, "allgather_bucket_size": 20_000,
                 "prefetch_bucket_size": 20_000, "param_persistence_threshold": 100, **zero},
        "precision": precision,
        "optimizer": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
        "gradient_clipping": CLIP,
    })


def batch(step: int, cfg: GPTConfig, device, rows: int = GLOBAL_BATCH) -> torch.Tensor:
    """Arithmetic sequences mod vocab (learnable), drawn on the CPU so every device sees the same data."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, cfg.vocab_size, (rows, 1), generator=g)
    stride = torch.randint(1, 4, (rows, 1), generator=g)
    return ((start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size).to(device)


@functools.lru_cache(maxsize=None)
def reference(cfg: GPTConfig, device) -> tuple[list, dict]:
    """Single-process GPT + torch.optim.AdamW + clip_grad_norm_ on ``device``: losses and final weights
    (computed once per process: ``parity`` and ``levers`` compare against the same run; read only)."""
    model = GPT(cfg, seed=SEED, device=device)
    opt = torch.optim.AdamW(torch_param_groups(model, OptimizerConfig(lr=LR, weight_decay=WEIGHT_DECAY)), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(STEPS):
        seq = batch(step, cfg, device)
        loss = model(seq[:, :-1], seq[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def rel(actual, expected) -> float:
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def parity(device, meshes: list[tuple[int, int]], args) -> dict:
    cfg = GPTConfig.from_yaml(TINY)
    ref_losses, ref_weights = reference(cfg, device)
    out = {"reference_losses": ref_losses}
    for tp, dp in meshes:
        mesh = build_mesh(tp=tp, dp=dp)
        micro = GLOBAL_BATCH // dp
        rows = slice(mesh.dp_rank * micro, (mesh.dp_rank + 1) * micro)
        for stage in (int(s) for s in args.stages.split(",")):
            for precision in ("fp32", "bf16"):
                model = GPT(cfg, tp_comm=mesh.tp_comm, seed=SEED, device=device)
                engine = hybrid.initialize(model, train_config(stage, precision), dp_group=mesh.dp_group,
                                           tp_group=mesh.tp_group)
                losses = []
                for step in range(STEPS):
                    seq = batch(step, cfg, device)[rows]
                    loss = engine(seq[:, :-1], seq[:, 1:])
                    engine.backward(loss)
                    engine.step()
                    value = loss.detach().float().clone()
                    mesh.dp_comm.all_reduce(value, average=True)  # the global loss: the mean over DP ranks
                    losses.append(value.item())
                case = {"loss_err": rel(losses, ref_losses), "losses": losses,
                        "dp_collectives": engine.comm_report()["total_calls"],
                        "tp_collectives": mesh.tp_comm.report()["total_calls"]}
                weights = engine.full_state_dict()
                if precision == "fp32":
                    case["weights_err"] = max(rel(weights[n], ref) for n, ref in ref_weights.items())
                out[f"tp{tp}xdp{dp}/stage{stage}/{precision}"] = case
                del engine, model
    return out


PINNED_OFFLOAD = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
LEVERS = {  # name -> (stage, precision, zero settings, activation checkpointing)
    "stage2-offload/fp32": (2, "fp32", PINNED_OFFLOAD, False),
    "stage3-offload/fp32": (3, "fp32", PINNED_OFFLOAD, False),
    "stage3-offload/bf16": (3, "bf16", PINNED_OFFLOAD, False),
    "stage3-ac/fp32": (3, "fp32", {}, True),
    "stage1-offload-none-pinned/bf16": (1, "bf16", {"offload_optimizer": {"device": "none", "pin_memory": True}},
                                        False),
}


def offloaded(zero: dict) -> bool:
    return (zero.get("offload_optimizer") or {}).get("device") == "cpu"


def where_states_are(engine, device) -> dict:
    """Where the engine keeps its optimizer states: the devices of the fp32 master and Adam moments this rank
    owns, whether they are pinned (on CUDA), and the engine's ``memory_report`` (device bytes, ``host``)."""
    views = [v for v in engine.shard_views().values() if v.end > v.start]
    tensors = [t for v in views for t in (v.master, v.exp_avg, v.exp_avg_sq)]
    return {"devices": sorted({str(t.device) for t in tensors}),
            "pinned": all(t.is_pinned() for t in tensors) if device.type == "cuda" else None,
            "report": engine.memory_report()}


def lever_run(device, cfg: GPTConfig, mesh, stage: int, precision: str, zero: dict, checkpointing: bool,
              weights: bool, steps: int = STEPS) -> dict:
    """One lever case: ``steps`` steps of gpt-tiny, its losses, where its optimizer states are and, on CUDA,
    the device bytes it holds after the steps and at its peak (over what was allocated before it was built)."""
    if device.type == "cuda":
        gc.collect()  # the previous case's engine can outlive its del until a cyclic collection
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    model = GPT(dataclasses.replace(cfg, activation_checkpointing=checkpointing), seed=SEED, device=device)
    engine = hybrid.initialize(model, train_config(stage, precision, **zero), dp_group=mesh.dp_group)
    losses = []
    for step in range(steps):
        seq = batch(step, cfg, device)
        loss = engine(seq[:, :-1], seq[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    case = {"losses": losses, "memory": where_states_are(engine, device)}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        case["memory"].update(allocated_bytes=torch.cuda.memory_allocated(device) - base,
                              peak_bytes=torch.cuda.max_memory_allocated(device) - base)
    if weights:
        case["weights"] = engine.full_state_dict()
    del engine, model
    return case


def levers(device, _meshes, _args) -> dict:
    """The planner's levers on one rank against the single-process reference: optimizer offload to pinned
    host memory (on CUDA: the side-stream gradient copies and the host step), activation checkpointing at
    stage 3, and ``offload_optimizer: {device: none, pin_memory: true}`` (nothing on the device is pinned).
    Each case says where its optimizer states are (``where_states_are``); an offloaded one also carries the
    same run without offload (``without_offload``), to compare the device memory of the two."""
    cfg = GPTConfig.from_yaml(TINY)
    ref_losses, ref_weights = reference(cfg, device)
    mesh = build_mesh(tp=1)
    out = {}
    for name, (stage, precision, zero, checkpointing) in LEVERS.items():
        case = lever_run(device, cfg, mesh, stage, precision, zero, checkpointing, weights=precision == "fp32")
        case["loss_err"] = rel(case["losses"], ref_losses)
        if precision == "fp32":
            weights = case.pop("weights")
            case["weights_err"] = max(rel(weights[n], ref) for n, ref in ref_weights.items())
        if offloaded(zero):  # two steps: the states exist after the first, every later step is alike
            case["without_offload"] = lever_run(device, cfg, mesh, stage, precision, {}, checkpointing, False,
                                                steps=2)
        out[name] = case
    return out


def memory(device, _meshes, _args) -> dict:
    """Peak CUDA bytes of three stage-0 bf16 steps of a ~100M GPT against the memory model."""
    from hybrid.plan.memory import activation_bytes, model_state_bytes

    if device.type != "cuda":
        return {"skipped": "no CUDA device"}
    cfg = GPTConfig(**MEMORY_MODEL)
    params = count_parameters(cfg)
    mesh = build_mesh(tp=1)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    model = GPT(cfg, seed=SEED, device=device)
    engine = hybrid.initialize(model, train_config(0, "bf16"), dp_group=mesh.dp_group, tp_group=mesh.tp_group)
    reported = 0
    for step in range(3):
        seq = batch(step, cfg, device, rows=MEMORY_MICRO_BATCH)
        engine.backward(engine(seq[:, :-1], seq[:, 1:]))
        if step == 2:
            report = engine.memory_report()
            reported = report["params"] + report["grads"] + report["optimizer"]
        engine.step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    states = model_state_bytes(params, dp=1, stage=0, tp=1, precision="bf16").total
    activations = activation_bytes(cfg.seq_len, MEMORY_MICRO_BATCH, cfg.hidden, cfg.n_heads, cfg.n_layers)
    logits = MEMORY_MICRO_BATCH * cfg.seq_len * cfg.vocab_size * 4  # fp32 logits and their gradient, not modelled
    return {"params": params, "peak_bytes": peak, "predicted_state_bytes": states,
            "predicted_activation_bytes": activations, "logit_bytes": logits, "reported_state_bytes": reported}


def checkpoint(device, _meshes, args) -> dict:
    """Stage 3 fp32: 6 uninterrupted steps vs 3 steps, then 3 more resumed by a fresh engine."""
    import yaml

    cfg_dict = yaml.safe_load(TINY.read_text())
    cfg = GPTConfig.from_yaml(TINY)
    mesh = build_mesh(tp=1)
    root = Path(args.checkpoint_dir)

    def run(run_dir: Path, steps: int) -> tuple[list, dict]:
        settings = JobSettings(steps=steps, micro_batch=GLOBAL_BATCH, stage=3, precision="fp32", seed=SEED,
                               checkpoint_dir=str(run_dir), checkpoint_every=3)
        losses = []
        ctx = Context(mesh, cfg_dict, settings, rank=dist.get_rank(), world_size=dist.get_world_size(),
                      device=str(device), reporter=lambda r: losses.append(r["loss"]) if "loss" in r else None)
        model = GPT(cfg, tp_comm=mesh.tp_comm, seed=SEED, device=device)
        engine = hybrid.initialize(model, train_config(3, "fp32"), dp_group=mesh.dp_group, tp_group=mesh.tp_group)

        def batches(step):
            seq = batch(step, cfg, device)
            return seq[:, :-1], seq[:, 1:]

        run_steps(ctx, engine, batches)
        return losses, engine.full_state_dict()

    whole, whole_weights = run(root / "whole", 6)
    first, _ = run(root / "resumed", 3)
    rest, resumed_weights = run(root / "resumed", 6)
    return {"whole": whole, "first": first, "rest": rest,
            "weights_err": max(rel(resumed_weights[n], w) for n, w in whole_weights.items())}


CASES = {"parity": parity, "memory": memory, "checkpoint": checkpoint, "levers": levers}


def parse_meshes(text: str) -> list[tuple[int, int]]:
    """``"2x1,1x2"`` → ``[(2, 1), (1, 2)]`` (tp x dp)."""
    return [tuple(int(n) for n in part.split("x")) for part in text.split(",") if part]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--cases", default="parity,memory,checkpoint")
    parser.add_argument("--meshes", default="1x1")
    parser.add_argument("--stages", default="0,1,2,3", help="ZeRO stages of the parity case")
    parser.add_argument("--init-method", default="env://")
    parser.add_argument("--checkpoint-dir", default=None)
    args = parser.parse_args(argv)
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")
    init_default_group(device, rank, world, timedelta(seconds=300), init_method=args.init_method)
    try:
        torch.manual_seed(SEED)
        results = {"device": str(device), "world_size": world, "forced_collectives": collectives_forced(),
                   "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   "errors": {}}
        for name in args.cases.split(","):
            try:
                results[name] = CASES[name](device, parse_meshes(args.meshes), args)
            except Exception:  # noqa: BLE001 -- the other cases still run and are written
                if world > 1:
                    raise
                results["errors"][name] = traceback.format_exc()[-6000:]
                print(f"case {name} raised:\n{results['errors'][name]}", file=sys.stderr, flush=True)
            if rank == 0:  # after every case: a crash in the next one keeps these
                Path(args.out).write_text(json.dumps(results, indent=1))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
