"""The CPU memory meter's checks in a rank of its own (tests/unit/test_memory_loop.py runs it with ``run_local``):
imports only torch and the meter, so the rank loads it whatever the pytest worker's ``sys.path`` holds."""

import torch

from hybrid.plan.budget import MemoryMeter, OutOfMemoryError


def meter_in_a_fresh_process():
    """``(measured, the refusal's message or None)``: 64 MiB within a large budget, then 96 MiB more against 1 MiB."""
    meter = MemoryMeter("cpu", budget_bytes=10**12)
    hold = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    m = meter.measure()
    meter.check(m)  # within budget
    small = MemoryMeter("cpu", budget_bytes=2**20)
    more = torch.ones(96 * 2**20 // 4)  # above glibc's mmap threshold: fresh pages, whatever the heap holds
    try:
        small.check(small.measure())
        refused = None
    except OutOfMemoryError as error:
        refused = str(error)
    del hold, more
    return m, refused
