"""Deciding and checking the layout: the memory model, the stage-selection planner, what a rank measures.

- ``layout``: the layout arithmetic the engine builds by and the memory model predicts from (pure).
- ``memory``: the seed's memory model (exact model states, activations, buffers).
- ``planner``: the stage-selection guide as a pure function, with its reason.
- ``cost``: the time model: each term of a step (compute, TP, ZeRO traffic, overlap, offload, optimizer).
- ``hardware``: the GPUs, links and efficiencies the time model assumes, each with its source.
- ``candidates``: every layout that keeps the global batch, ranked by predicted tokens/s among those that fit.
- ``budget``: what one rank measures of its own memory, and the budget check.
- ``monitor``: NVML facts of this node (GPU count, memory, name).
- ``cpu_bf16``: whether this CPU computes in bf16 at a useful speed.
"""
