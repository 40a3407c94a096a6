"""Side-by-side benchmarks of hybrid against DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed.

Entry point: ``python bench/compare.py`` (``make bench``); ``--quick`` is the smoke run the tests use.
"""
