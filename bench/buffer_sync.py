"""Syncing a model's persistent buffers from DP rank 0: one broadcast per buffer against ``Comm.broadcast_many``.

``.venv/bin/python bench/buffer_sync.py [BUFFERS] [NUMEL]`` (default 300 buffers of 16 floats, the running
statistics of a 100-block BatchNorm model) on 2 gloo ranks, one thread each: the mean time of one sync over
10 rounds, the better of 3 repeats, for both ways. Prints one line per rank.
"""

import sys
import time

import torch

from hybrid.comm.collectives import Comm
from hybrid.runtime.local_launch import run_local


def _rank(buffers: int, numel: int) -> str:
    torch.set_num_threads(1)
    comm = Comm(name="dp")
    tensors = [torch.zeros(numel) for _ in range(buffers)]
    each, packed = [], []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(10):
            for work in [comm.broadcast(t, 0, async_op=True) for t in tensors]:
                work.wait()
        each.append((time.perf_counter() - start) / 10)
        start = time.perf_counter()
        for _ in range(10):
            comm.broadcast_many(tensors, 0)
        packed.append((time.perf_counter() - start) / 10)
    return (f"rank {comm.rank}: {buffers} buffers of {numel}: one broadcast each {min(each) * 1e3:.2f} ms, "
            f"broadcast_many {min(packed) * 1e3:.2f} ms")


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:3]]
    for line in run_local(_rank, 2, *(args + [300, 16][len(args):])):
        print(line)
