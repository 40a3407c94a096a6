"""Everything that moves tensors between ranks: the collectives, the process mesh, their transports.

- ``collectives``: ``Comm``, the one place collectives are called; it counts the bytes of every op.
- ``shm``: the shared-memory transport between the CPU ranks of one host.
- ``buffer_pool``: reusable flat buffers for the collectives.
- ``heartbeat``: how many collectives this process has entered (what a hang report names).
- ``mesh``: the 2D mesh, dp (across nodes) x tp (inside a node), and its process groups.
"""

from hybrid.comm.collectives import SHM_MIN_BYTES, Comm, exchange_numel

__all__ = ["Comm", "SHM_MIN_BYTES", "exchange_numel"]
