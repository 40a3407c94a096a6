"""What a Hugging Face config says about splitting a model over TP, read without importing transformers (pure).

``heads_refusal(config, tp)``: attention splits by whole heads, so ``num_attention_heads`` and
``num_key_value_heads`` must divide by ``tp``; ``config_refusal`` adds the MLP's ``intermediate_size`` and the
vocabulary, and ``largest_tp(config, gpus_per_node)`` is the largest degree dividing the node that splits them all
(what ``tp: auto`` picks for such a model). ``text_config``: a multimodal config's language part.
"""

from __future__ import annotations

from typing import Any, Optional


def text_config(config: Any) -> Any:
    """The language model's config (a multimodal config's text part), or ``config`` itself."""
    get = getattr(config, "get_text_config", None)
    try:
        return get() if callable(get) else config
    except Exception:  # an older or unusual config: its own fields
        return config


def _field(config: Any, *names: str) -> Optional[int]:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def heads_refusal(config: Any, tp: int) -> Optional[str]:
    """Why attention of ``config`` cannot be split ``tp`` ways (heads not divisible), or None."""
    if config is None:
        return None
    config = text_config(config)
    heads = _field(config, "num_attention_heads", "n_head", "num_heads")
    kv = _field(config, "num_key_value_heads", "num_kv_heads") or heads
    name = type(config).__name__
    for field, value in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if value is not None and value % tp:
            return (f"{name}.{field} is {value}, which tp={tp} does not divide (attention is split by whole "
                    f"heads); use a TP degree that divides {value}")
    return None


def config_refusal(config: Any, tp: int) -> Optional[str]:
    """``heads_refusal``, then the MLP's ``intermediate_size`` and the ``vocab_size``."""
    refusal = heads_refusal(config, tp)
    if refusal is not None:
        return refusal
    config = text_config(config)
    for field in ("intermediate_size", "vocab_size"):
        value = _field(config, field)
        if value is not None and value % tp:
            return (f"{type(config).__name__}.{field} is {value}, which tp={tp} does not divide; use a TP degree "
                    f"that divides {value}")
    return None


def largest_tp(config: Any, gpus_per_node: int) -> int:
    """The largest divisor of ``gpus_per_node`` that splits ``config``'s heads, KV heads, MLP and vocabulary."""
    return next(tp for tp in range(gpus_per_node, 0, -1)
                if gpus_per_node % tp == 0 and config_refusal(config, tp) is None)
