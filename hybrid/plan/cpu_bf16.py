"""Whether this CPU computes in bf16 at a useful speed.

torch's CPU bf16 matmul needs AVX512-BF16 or AMX; on a CPU without them (AVX2-only hosts, many AMD EPYC and
older Intel machines) it takes a fallback about 100-150x slower than fp32, so a job in the GPU default
precision (bf16) on CPU ranks runs two orders of magnitude slower than the same job in fp32, without a word.

``bf16_matmul_slowdown()`` measures it once per process (a few 256x256 matmuls in each dtype on one thread,
so that other busy processes do not blur the ratio: about a millisecond with native bf16, ~0.2 s without);
``slow_bf16_note(device)`` is the sentence to show where a bf16 model runs on such a CPU, else None.
"""

from __future__ import annotations

import functools
import time
from typing import Optional

import torch

SLOW_FACTOR = 10.0  # a bf16 matmul this many times slower than fp32 is a fallback, not a native kernel
_SIZE, _REPEATS = 256, 3


@functools.lru_cache(maxsize=None)
def bf16_matmul_slowdown() -> float:
    """How many times longer a bf16 matmul takes than the same fp32 one on this CPU (best of a few runs)."""
    a = torch.randn(_SIZE, _SIZE, generator=torch.Generator().manual_seed(0))
    best = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # several threads waiting on cores other processes hold time their spinning
    try:
        for dtype in (torch.float32, torch.bfloat16):
            t = a.to(dtype)
            t @ t  # warm up: the first call picks and loads the kernel
            times = []
            for _ in range(_REPEATS):
                start = time.perf_counter()
                t @ t
                times.append(time.perf_counter() - start)
            best[dtype] = max(min(times), 1e-9)
    finally:
        torch.set_num_threads(threads)
    return best[torch.bfloat16] / best[torch.float32]


def slow_bf16_note(device) -> Optional[str]:
    """The warning for a bf16 model on ``device`` when that is a CPU without native bf16 matmul, else None."""
    if torch.device(device).type != "cpu":
        return None
    slowdown = bf16_matmul_slowdown()
    if slowdown < SLOW_FACTOR:
        return None
    return (f"precision is bf16 on a CPU without native bf16 matmul (no AVX512-BF16 or AMX): a bf16 matmul takes "
            f"{slowdown:.0f}x as long as fp32 here, so training will be that much slower; set precision to fp32 "
            f"(parallel.precision: fp32 in the cluster file) for CPU runs")
