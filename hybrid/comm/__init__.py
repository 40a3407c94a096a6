"""Everything that moves tensors between ranks: the collectives, the process mesh, their transports.

- ``collectives``: ``Comm``, the one place collectives are called; it counts the bytes of every op and
  chooses each group's transports once.
- ``transport``: the interface every transport implements, and the handles of async ops.
- ``process_group``: torch.distributed on the group (NCCL or gloo).
- ``exchange``: faster gloo algorithms for CPU tensors (pairwise-exchange reduce-scatter, broadcast all-gather).
- ``shm_transport``, ``shm``: collectives of large CPU tensors through shared memory between the ranks of
  one host (the transport, and the ``ShmGroup`` it connects).
- ``buffer_pool``: reusable flat buffers for the collectives.
- ``heartbeat``: how many collectives this process has entered (what a hang report names).
- ``mesh``: the 2D mesh, dp (across nodes) x tp (inside a node), and its process groups.
- ``device``: the rank's device, bound on every thread that does its work.
"""

from hybrid.comm.collectives import SHM_MIN_BYTES, Comm, exchange_numel

__all__ = ["Comm", "SHM_MIN_BYTES", "exchange_numel"]
