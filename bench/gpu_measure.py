"""One process measuring rows of the single-GPU benchmark, each appended to a JSONL file once measured.

    python -m bench.gpu_measure --jsonl FILE --rows hybrid-0,fsdp2 [--cpu] [--deadline UNIX_TIME]

``bench.gpu_bench`` starts it (see there). It joins a one-rank default group
(``hybrid.comm.mesh.init_default_group``) with hybrid's collectives issued for real on the one device
(``HYBRID_FORCE_COLLECTIVES=1`` unless the environment says otherwise), then, for each row
(``bench.gpu_rows``): builds the model (same seed), runs the warm-up and timed steps on random tokens, and
appends one JSON object: tokens/s, the step time, the allocator's peak over the timed steps and, for hybrid,
``hybrid.plan.memory.predict_memory``'s peak for the same config and the collectives issued per step; or
``error`` saying what went wrong (``oom`` when CUDA ran out of memory). A row that fails in any other way on
CUDA ends the process (exit status 3) once its row is written: its CUDA context may be unusable, and the
parent starts a fresh process for the rows left. No row is started after ``--deadline``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

from bench.gpu_rows import MICRO_BATCH, REDUCE_DTYPE, RowSpec, rows, steps

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"cuda": ROOT / "configs" / "gpt-1.3b.yaml", "cpu": ROOT / "configs" / "gpt-tiny.yaml"}
EXIT_CONTEXT_SUSPECT = 3


def log(message: str) -> None:
    print(f"[gpu-bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def append_row(path: Path, row: dict) -> None:
    """One JSON line, on disk before this returns (a crash of the next row must not lose it)."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


class _Hybrid:
    """hybrid's engine on a one-rank mesh: the GPT built on meta, materialized by the engine on ``device``."""

    def __init__(self, spec: RowSpec, cfg, device: torch.device):
        import hybrid
        from hybrid.comm.mesh import build_mesh
        from hybrid.config.training import TrainConfig
        from hybrid.models.gpt.model import GPT

        zero = {"stage": spec.stage, "reduce_dtype": REDUCE_DTYPE}
        if spec.offload:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
        config = TrainConfig.from_dict({"zero": zero, "precision": "bf16", "optimizer": {"lr": 1e-4}})
        mesh = build_mesh(tp=1)
        self.engine = hybrid.initialize(GPT(cfg, device="meta"), config, dp_group=mesh.dp_group,
                                        tp_group=mesh.tp_group, seed=0, device=device)

    def step(self, x, y):
        loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        return loss

    def reset_collectives(self) -> None:
        self.engine.reset_comm()

    def collectives(self) -> int:
        return self.engine.comm_report()["total_calls"]


class _Fsdp2:
    """FSDP2 ``fully_shard`` per block and the root (as torchtitan), bf16 compute, gradients reduced in
    ``REDUCE_DTYPE``, torch's AdamW (fused on CUDA)."""

    def __init__(self, spec: RowSpec, cfg, device: torch.device):
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.device_mesh import init_device_mesh

        from hybrid.models.gpt.model import GPT

        model = GPT(cfg, seed=0, device=device)
        mesh = init_device_mesh(device.type, (1,))
        reduce = {"fp32": torch.float32, "bf16": torch.bfloat16}[REDUCE_DTYPE]
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def step(self, x, y):
        loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def reset_collectives(self) -> None:
        pass

    def collectives(self):
        return None  # not counted: FSDP2 calls torch.distributed itself


def predicted_peak_bytes(spec: RowSpec, cfg, engine, kind: str) -> int:
    """``hybrid.plan.memory.predict_memory``'s allocator peak for ``engine``'s own config (with offload, the
    optimizer states are in host memory, as ``launch.planning.replan.predict`` counts them)."""
    from hybrid.models.gpt.model import GPT
    from hybrid.plan.memory import predict_memory
    from hybrid.zero.units import model_units
    from launch.planning.model_size import gpt_figures

    zero = engine.config.zero
    activations = gpt_figures(cfg.to_dict(), "bf16").activation_bytes(MICRO_BATCH[kind], 1, spec.checkpointing)
    p = predict_memory(model_units(GPT(cfg, device="meta"), 1, zero.stage3_unit), 1, spec.stage, "bf16",
                       activations=activations, zero=zero, device=kind)
    if spec.offload:
        p = dataclasses.replace(p, optimizer=0, optimizer_transient=0)
    return p.peak


def measure(spec: RowSpec, device: torch.device) -> dict:
    """One row (see the module docstring); never raises for the row's own failure."""
    from hybrid.comm.collectives import collectives_forced
    from hybrid.models.gpt.model import GPTConfig, count_parameters

    kind = device.type
    cfg = dataclasses.replace(GPTConfig.from_yaml(MODEL[kind]), activation_checkpointing=spec.checkpointing)
    warmup, timed = steps(spec, kind)
    row = {"row": spec.key, "label": spec.label, "impl": spec.impl, "stage": spec.stage,
           "checkpointing": spec.checkpointing, "offload": spec.offload, "params": count_parameters(cfg),
           "micro_batch": MICRO_BATCH[kind], "seq_len": cfg.seq_len, "warmup": warmup, "steps": timed}
    name = spec.label + (" +AC" if spec.checkpointing else "")
    runner = None
    try:
        started = time.perf_counter()
        _free(device)
        baseline = torch.cuda.memory_allocated(device) if kind == "cuda" else 0
        runner = (_Hybrid if spec.impl == "hybrid" else _Fsdp2)(spec, cfg, device)
        row["build_s"] = time.perf_counter() - started
        log(f"{name}: built in {row['build_s']:.1f} s; {warmup} warm-up and {timed} timed steps")
        g = torch.Generator(device=device).manual_seed(0)
        shape = (MICRO_BATCH[kind], cfg.seq_len + 1)
        times = []
        for i in range(warmup + timed):
            if i == warmup:
                runner.reset_collectives()
                if kind == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
            seq = torch.randint(0, cfg.vocab_size, shape, device=device, generator=g)
            _sync(device)
            t0 = time.perf_counter()
            loss = runner.step(seq[:, :-1], seq[:, 1:])
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        last = float(loss.detach())
        if not math.isfinite(last):
            raise FloatingPointError(f"the loss is {last} after {warmup + timed} steps")
        row.update(step_s=sum(times) / len(times), loss=last,
                   tokens_per_s=MICRO_BATCH[kind] * cfg.seq_len * len(times) / sum(times))
        if kind == "cuda":
            row["peak_bytes"] = torch.cuda.max_memory_allocated(device) - baseline
        calls = runner.collectives()
        if calls is not None:
            row["collectives_per_step"] = calls / timed
            row["forced_collectives"] = collectives_forced()
            if row["forced_collectives"] and not calls:
                raise RuntimeError("no collective was issued although HYBRID_FORCE_COLLECTIVES=1 forces them")
        if spec.impl == "hybrid":
            row["predicted_peak_bytes"] = predicted_peak_bytes(spec, cfg, runner.engine, kind)
        log(f"{name}: {row['tokens_per_s']:,.0f} tokens/s, {row['step_s'] * 1e3:.1f} ms/step")
    except torch.cuda.OutOfMemoryError as err:
        row.update(error=f"out of memory: {str(err).splitlines()[0][:160]}", oom=True)
        log(f"{name}: {row['error']}")
    except Exception as err:  # noqa: BLE001 -- every failure becomes this row's error; the next rows still run
        row.update(error=f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}",
                   traceback=traceback.format_exc()[-4000:])
        log(f"{name}: error: {row['error']}")
    finally:
        del runner
        _free(device)
    return row


def _free(device: torch.device) -> None:
    gc.collect()  # the previous row's engine can outlive its del until a cyclic collection
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jsonl", required=True)
    parser.add_argument("--rows", required=True, help="comma-separated row keys (bench.gpu_rows.RowSpec.key)")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--deadline", type=float, default=None, help="start no row after this time.time()")
    args = parser.parse_args(argv)
    from hybrid.comm.collectives import FORCE_COLLECTIVES_ENV
    from hybrid.comm.mesh import init_default_group
    import torch.distributed as dist

    os.environ.setdefault(FORCE_COLLECTIVES_ENV, "1")
    device = torch.device("cpu" if args.cpu else "cuda:0")
    by_key = {spec.key: spec for spec in rows(device.type)}
    todo = [by_key[key] for key in args.rows.split(",")]
    with tempfile.TemporaryDirectory(prefix="hybrid-gpu-bench-") as tmp:
        init_default_group(device, 0, 1, timedelta(seconds=300), init_method=f"file://{tmp}/store")
        try:
            for spec in todo:
                if args.deadline is not None and time.time() > args.deadline:
                    return 0
                row = measure(spec, device)
                append_row(Path(args.jsonl), row)
                if "error" in row and not row.get("oom") and device.type == "cuda":
                    sys.stdout.flush()  # no teardown on a CUDA context that may be broken: it could hang
                    os._exit(EXIT_CONTEXT_SUSPECT)
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
