"""hybrid: tensor parallelism inside a node, ZeRO data parallelism across nodes.

The library that runs inside one rank. It imports torch, never Ray.
"""

__version__ = "0.1.0"
