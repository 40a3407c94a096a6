"""A/B of one engine change in the same two gloo processes: alternating blocks of steps with the change on
and off, so both variants see the same machine load (the 2-core bench machine's load moves step times by
up to 50 % between runs; interleaved blocks inside one process pair do not).

    .venv/bin/python bench/ab_engine.py CHANGE WORKLOAD PRECISION STAGE [--blocks B] [--steps S]

CHANGE (off = the behaviour before it):
  exchange-rs   gloo reduce-scatter as the pairwise exchange (off: an in-place all-reduce of the unit)
  exchange-ar   large gloo all-reduces as exchange + broadcasts (off: gloo's all-reduce)
  handoff       stages 0-1 copy fresh gradients into the emptied buffer (off: zero it, accumulate into it)
  keep-buckets  stages 2-3 on CPU reuse reduced buckets (off: a fresh zeroed bucket every time)
  empty-buckets stages 2-3 take new buckets uninitialised (off: zero-filled first)
  shm           DP collectives through shared memory (hybrid.comm.shm; off: the gloo paths above)
  malloc        glibc returns freed blocks at once (hybrid.plan.budget.follow_live_tensors, what a CPU rank's
                memory meter sets; off: glibc keeps freed heap, blocks under 32 MiB from it)

Prints the median step time (ms, rank 0, first step of each block left out) of both variants.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

CHANGES = ("exchange-rs", "exchange-ar", "handoff", "keep-buckets", "empty-buckets", "shm", "malloc")


class _AllReduceScatter:
    """The old gloo reduce-scatter: an in-place all-reduce of the whole unit."""

    def __init__(self, t, input, average):  # t: the ExchangeTransport
        self._work = dist.all_reduce(input, group=t.group, async_op=True)
        self._own, self._average, self._size = input.view(-1).tensor_split(t.size)[t.rank], average, t.size

    def wait(self):
        self._work.wait()
        if self._average:
            self._own.div_(self._size)
        return True


class _GlooAllReduce:
    def __init__(self, t, tensor):
        self._work = dist.all_reduce(tensor, group=t.group, async_op=True)

    def wait(self):
        self._work.wait()
        return True


def _switch(change: str, on: bool, engine, originals: dict) -> None:
    import hybrid.comm.exchange as hx
    import hybrid.zero.buckets as hb

    if change == "exchange-rs":
        hx._PairwiseReduceScatter = originals["rs"] if on else _AllReduceScatter
    elif change == "exchange-ar":
        hx._ExchangeAllReduce = originals["ar"] if on else _GlooAllReduce
    elif change == "empty-buckets":
        r = engine.reducer
        r._new_bucket = (type(r)._new_bucket.__get__(r) if on else
                         lambda u: r.bucket_pool.take(r.layout.units[u].numel, r.grad_shard.dtype,
                                                      r.grad_shard.device, zeroed=True))
    elif change == "shm":
        comm = engine.dp_comm  # off: the transport below the shared-memory one carries the CPU tensors
        chosen = originals.setdefault("shm", comm.transports)
        comm.transports = chosen if on else dataclasses.replace(chosen, cpu=chosen.cpu.fallback)
    elif change == "malloc":
        import ctypes

        from hybrid.plan.budget import follow_live_tensors

        if on:
            follow_live_tensors()
        else:
            m_trim_threshold, m_mmap_threshold = -1, -3
            mallopt = ctypes.CDLL("libc.so.6").mallopt
            mallopt(m_mmap_threshold, 32 << 20)
            mallopt(m_trim_threshold, 64 << 20)
    elif change == "keep-buckets":
        engine.reducer.bucket_pool.cap_numel = hb.KEEP_BUCKET_NUMEL if on else 0
        engine.reducer.bucket_pool.clear()


def _after_step(change: str, on: bool, engine) -> None:
    if change == "handoff" and not on:  # the old path: a zeroed buffer that autograd accumulates into
        engine.reducer._empty = False
        engine.reducer.flat_grad.zero_()
        engine.reducer.attach_grads()


def _rank(change: str, workload: str, precision: str, stage: int, blocks: int, steps: int) -> dict:
    import hybrid
    import hybrid.comm.exchange as hx
    from bench.workload import batch, build_model, workloads

    torch.set_num_threads(1)
    w = next(x for x in workloads(False) if x.name == workload).with_precision(precision)
    config = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"},
              "optimizer": {"type": "AdamW", "params": {"lr": w.lr, "weight_decay": w.weight_decay}},
              "gradient_clipping": 1.0}
    engine = hybrid.initialize(build_model(w), config)
    originals = {"rs": hx._PairwiseReduceScatter, "ar": hx._ExchangeAllReduce}
    rank, times, step = dist.get_rank(), {"on": [], "off": []}, 0
    for b in range(blocks):
        for on in ((True, False) if b % 2 == 0 else (False, True)):
            _switch(change, on, engine, originals)
            for i in range(steps):
                x, y = batch(w, step, rank)
                step += 1
                dist.barrier()
                start = time.perf_counter()
                engine.backward(engine(x, y))
                engine.step()
                _after_step(change, on, engine)
                dist.barrier()
                if i:
                    times["on" if on else "off"].append(time.perf_counter() - start)
    _switch(change, True, engine, originals)
    return {k: round(statistics.median(v) * 1e3, 1) for k, v in times.items()}


def main() -> None:
    from hybrid.runtime.local_launch import run_local

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("change", choices=CHANGES)
    p.add_argument("workload")
    p.add_argument("precision", choices=("fp32", "bf16"))
    p.add_argument("stage", type=int, choices=(0, 1, 2, 3))
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()
    res = run_local(_rank, 2, a.change, a.workload, a.precision, a.stage, a.blocks, a.steps, timeout_s=1800,
                    threads=1)[0]
    print(f"{a.change} {a.workload} {a.precision} stage {a.stage}: on {res['on']} ms, off {res['off']} ms "
          f"(on/off {res['on'] / res['off']:.3f})")


if __name__ == "__main__":
    main()
