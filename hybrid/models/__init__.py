"""Built-in models: a tensor-parallel GPT (``hybrid.models.gpt``) for the demo, benchmarks and tests."""

from hybrid.models.gpt.model import GPT, GPTConfig, count_parameters

__all__ = ["GPT", "GPTConfig", "count_parameters"]
