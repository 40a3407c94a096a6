"""Collectives by torch.distributed on the group itself (NCCL or gloo): the transport every group of two or
more ranks has, that carries its tensors not on the CPU, and that the CPU transports hand down what they do
not carry.

The mean (``average=True``): NCCL averages inside the collective (``ReduceOp.AVG``), for CUDA tensors on a
group whose backend has NCCL ("nccl", or "cpu:gloo,cuda:nccl" as ``hybrid.comm.mesh`` makes them); gloo has
no AVG, so there the sum is divided by the group size once the collective has finished.
"""

from __future__ import annotations

import torch.distributed as dist

from hybrid.comm.transport import DONE, Transport, averaged


class ProcessGroupTransport(Transport):
    def __init__(self, group, backend: str, size: int):
        self.group, self.size = group, size  # group None: the default group
        self.native_avg = "nccl" in backend.lower()

    def all_reduce(self, tensor, *, op=None, average=False, async_op=False):
        if average and op is None and self.native_avg and tensor.is_cuda:
            op, average = dist.ReduceOp.AVG, False
        work = dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        return averaged(work, tensor, average, self.size, async_op)

    def reduce_scatter(self, output, input, *, average=False, async_op=False):
        op = dist.ReduceOp.SUM
        if average and self.native_avg and input.is_cuda:
            op, average = dist.ReduceOp.AVG, False
        work = dist.reduce_scatter_tensor(output, input, op=op, group=self.group, async_op=async_op)
        return averaged(work, output, average, self.size, async_op)

    def all_gather(self, output, input, *, async_op=False):
        work = dist.all_gather_into_tensor(output, input, group=self.group, async_op=async_op)
        return work if async_op else DONE

    def all_to_all(self, output, input, *, async_op=False):
        work = dist.all_to_all_single(output, input, group=self.group, async_op=async_op)
        return work if async_op else DONE

    def broadcast(self, tensor, src, *, async_op=False):
        src = dist.get_global_rank(self.group, src) if self.group is not None else src
        work = dist.broadcast(tensor, src=src, group=self.group, async_op=async_op)
        return work if async_op else DONE

    def barrier(self) -> None:
        dist.barrier(group=self.group)
