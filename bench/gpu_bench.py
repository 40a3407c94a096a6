"""Throughput of the built-in GPT on one GPU: hybrid's engine at ZeRO stage 0 (world 1) beside FSDP2
``fully_shard`` (world 1) on the same model, bf16, reported as tokens/s and model-FLOPs utilisation.

    python -m bench.gpu_bench --out bench/RESULTS-gpu.md [--tests "pytest summary"] [--cpu]

The GPU run uses ``configs/gpt-1.3b.yaml`` (1.42B parameters, seq 2048) at micro-batch ``MICRO_BATCH``;
``--cpu`` runs the same path on the CPU with gpt-tiny in seconds (the CI's dry run). Each implementation
builds the model (same seed), runs ``WARMUP`` untimed and ``STEPS`` timed steps on random tokens, and
records tokens/s, the step time and ``torch.cuda.max_memory_allocated``. Activation checkpointing is
measured too when the GPT or the engine config has an ``activation_checkpointing`` field; until then
the report says it was skipped. An implementation that runs out of memory is reported as such.

MFU = tokens/s × model FLOPs per token / the GPU's dense bf16 peak (``PEAK_BF16``, looked up by device
name; unknown GPUs and the CPU get tokens/s only). Model FLOPs per token are ``6·N + 12·L·h·s`` (the
PaLM paper's count: weights forward and backward, plus attention scores, not halved for the causal mask).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import platform
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
GPU_MODEL, CPU_MODEL = ROOT / "configs" / "gpt-1.3b.yaml", ROOT / "configs" / "gpt-tiny.yaml"
MICRO_BATCH = {"cuda": 4, "cpu": 2}
WARMUP = {"cuda": 3, "cpu": 1}
STEPS = {"cuda": 10, "cpu": 2}
# Dense bf16 tensor-core peak per GPU, FLOP/s, by a substring of torch.cuda.get_device_name().
PEAK_BF16 = (("H200", 989e12), ("H100", 989e12), ("H800", 989e12), ("A100", 312e12), ("A800", 312e12))


def peak_bf16_flops(device_name: str) -> Optional[float]:
    """The dense bf16 peak of the GPU called ``device_name``, or None when it is not in ``PEAK_BF16``."""
    for key, peak in PEAK_BF16:
        if key in device_name:
            return peak
    return None


def flops_per_token(params: int, layers: int, hidden: int, seq_len: int) -> int:
    """Model FLOPs of one token's forward and backward pass: ``6·N + 12·L·h·s``."""
    return 6 * params + 12 * layers * hidden * seq_len


def log(message: str) -> None:
    print(f"[gpu-bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def activation_checkpointing_field() -> Optional[str]:
    """Where the GPT's activation checkpointing is switched on ('model' or 'engine'), or None without it."""
    from hybrid.config.training import TrainConfig
    from hybrid.models.gpt.model import GPTConfig

    for where, cls in (("model", GPTConfig), ("engine", TrainConfig)):
        if "activation_checkpointing" in {f.name for f in dataclasses.fields(cls)}:
            return where
    return None


def _model_config(path: Path, checkpointing: bool):
    from hybrid.models.gpt.model import GPTConfig

    cfg = GPTConfig.from_yaml(path)
    if checkpointing and activation_checkpointing_field() == "model":
        cfg = dataclasses.replace(cfg, activation_checkpointing=True)
    return cfg


def _hybrid(model, checkpointing: bool):
    import hybrid
    from hybrid.config.training import OptimizerConfig, TrainConfig, ZeroConfig
    from hybrid.comm.mesh import build_mesh

    mesh = build_mesh(tp=1)
    extra = {"activation_checkpointing": True} if checkpointing and activation_checkpointing_field() == "engine" else {}
    engine = hybrid.initialize(model, TrainConfig(zero=ZeroConfig(stage=0), precision="bf16",
                                                  optimizer=OptimizerConfig(lr=1e-4), **extra),
                               dp_group=mesh.dp_group, tp_group=mesh.tp_group)

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    return step


def _fsdp2(model, device: torch.device):
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:  # one unit per transformer block, then the root, as torchtitan does
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def measure(impl: str, checkpointing: bool, device: torch.device, model_path: Path) -> dict:
    """Build ``impl`` on ``device``, run the warm-up and timed steps, return the figures (or the OOM)."""
    from hybrid.models.gpt.model import GPT, count_parameters

    kind = device.type
    cfg = _model_config(model_path, checkpointing)
    row = {"impl": impl, "checkpointing": checkpointing, "params": count_parameters(cfg)}
    baseline = 0
    if kind == "cuda":
        gc.collect()  # the previous row's engine can outlive its del until a cyclic collection
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    try:
        started = time.perf_counter()
        model = GPT(cfg, seed=0, device=device)
        step = _hybrid(model, checkpointing) if impl == "hybrid" else _fsdp2(model, device)
        log(f"{impl}{' +AC' if checkpointing else ''}: built in {time.perf_counter() - started:.1f} s; "
            f"{WARMUP[kind]} warm-up and {STEPS[kind]} timed steps")
        g = torch.Generator(device=device).manual_seed(0)
        shape = (MICRO_BATCH[kind], cfg.seq_len + 1)
        times = []
        for i in range(WARMUP[kind] + STEPS[kind]):
            seq = torch.randint(0, cfg.vocab_size, shape, device=device, generator=g)
            _sync(device)
            t0 = time.perf_counter()
            loss = step(seq[:, :-1], seq[:, 1:])
            _sync(device)
            if i >= WARMUP[kind]:
                times.append(time.perf_counter() - t0)
        row.update(step_s=sum(times) / len(times), loss=float(loss.detach()),
                   tokens_per_s=MICRO_BATCH[kind] * cfg.seq_len * len(times) / sum(times))
        if kind == "cuda":
            row["peak_bytes"] = torch.cuda.max_memory_allocated(device) - baseline  # this row's own
        log(f"{impl}{' +AC' if checkpointing else ''}: {row['tokens_per_s']:,.0f} tokens/s, "
            f"{row['step_s'] * 1e3:.1f} ms/step")
    except torch.cuda.OutOfMemoryError as err:
        row["error"] = f"out of memory: {str(err).splitlines()[0][:160]}"
        log(f"{impl}: {row['error']}")
    return row


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def machine(device: torch.device) -> dict:
    facts = {"python": platform.python_version(), "torch": torch.__version__, "host cpu": platform.processor()
             or platform.machine()}
    if device.type == "cuda":
        facts.update(gpu=torch.cuda.get_device_name(device), gpus=torch.cuda.device_count(),
                     cuda=torch.version.cuda,
                     gpu_memory_gib=round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1))
    else:
        facts["gpu"] = "none (--cpu dry run)"
    return facts


def report(rows: list[dict], facts: dict, cfg, micro_batch: int, command: str, tests: str,
           checkpointing_note: str) -> str:
    """The Markdown report: command, machine, model, one row per implementation, notes."""
    peak = peak_bf16_flops(facts.get("gpu", ""))
    per_token = flops_per_token(rows[0]["params"], cfg.n_layers, cfg.hidden, cfg.seq_len) if rows else 0
    lines = ["# GPU check: tests/gpu and single-GPU throughput", "",
             f"Command: `{command}`  ", f"Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}  ",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()), "",
             f"tests/gpu: {tests or 'not run'}", "",
             f"Model: built-in GPT, {_count(rows[0]['params'])} parameters ({cfg.n_layers} layers, hidden "
             f"{cfg.hidden}, {cfg.n_heads} heads, vocab {cfg.vocab_size}), seq {cfg.seq_len}, micro-batch "
             f"{micro_batch}, bf16, world 1; {per_token / 1e9:.2f} GFLOP per token (6N + 12·L·h·s).", "",
             "| implementation | activation checkpointing | tokens/s | step (ms) | MFU | peak memory (GiB) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        name = "hybrid ZeRO-0" if r["impl"] == "hybrid" else "FSDP2 fully_shard"
        ac = "on" if r["checkpointing"] else "off"
        if "error" in r:
            lines.append(f"| {name} | {ac} | {r['error']} | | | |")
            continue
        mfu = f"{100 * r['tokens_per_s'] * per_token / peak:.1f}%" if peak else "n/a (peak unknown)"
        memory = f"{r['peak_bytes'] / 2**30:.1f}" if "peak_bytes" in r else "n/a"
        lines.append(f"| {name} | {ac} | {r['tokens_per_s']:,.0f} | {r['step_s'] * 1e3:.1f} | {mfu} | {memory} |")
    lines += ["", f"MFU against the dense bf16 peak of {peak / 1e12:.0f} TFLOP/s." if peak else
              "MFU needs the GPU's bf16 peak, which is not known for this device: tokens/s only.",
              checkpointing_note, ""]
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Single-GPU throughput of hybrid ZeRO-0 beside FSDP2.")
    parser.add_argument("--out", required=True, help="where to write the Markdown report")
    parser.add_argument("--cpu", action="store_true", help="dry run on the CPU with gpt-tiny")
    parser.add_argument("--tests", default="", help="the tests/gpu summary line to put in the report")
    parser.add_argument("--command", default="bash bench/gpu_check.sh", help="the command to put in the report")
    args = parser.parse_args(argv)
    import torch.distributed as dist

    from hybrid.comm.mesh import init_default_group

    if not args.cpu and not torch.cuda.is_available():
        print("error: no CUDA GPU is visible (torch.cuda.is_available() is False); run with --cpu for the dry "
              "run, or on a machine with a GPU.", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.cpu else "cuda:0")
    model_path = CPU_MODEL if args.cpu else GPU_MODEL
    with tempfile.TemporaryDirectory(prefix="hybrid-gpu-bench-") as tmp:
        init_default_group(device, 0, 1, timedelta(seconds=300), init_method=f"file://{tmp}/store")
        try:
            where = activation_checkpointing_field()
            variants = [False, True] if where else [False]
            note = ("Activation checkpointing: measured (switched on in the " + where + " config)." if where else
                    "Activation checkpointing: skipped, the built-in GPT has no activation checkpointing yet.")
            rows = [measure(impl, ac, device, model_path) for ac in variants for impl in ("hybrid", "fsdp2")]
        finally:
            dist.destroy_process_group()
    cfg = _model_config(model_path, False)
    text = report(rows, machine(device), cfg, MICRO_BATCH[device.type], args.command, args.tests, note)
    Path(args.out).write_text(text)
    log(f"report written to {args.out}")
    return 1 if any("error" in r for r in rows) and args.cpu else 0


if __name__ == "__main__":
    sys.exit(main())
