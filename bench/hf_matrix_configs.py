"""Tiny configs of every causal-LM type transformers has, made by one shrinking function.

``tiny_config(model_type)`` is the type's own config class at its defaults, walked field by field (nested
sub-configs -- ``text_config``, ``vision_config``, ... -- the same way) and shrunk by the field's name: hidden 32,
intermediate 64, 2 layers, 4 attention heads of 8 features and 2 KV heads, vocabulary 128, 64 positions, a
sliding window of 4 (the rows are 8 tokens long, so the window masks), 4 experts with top-k 2 and a shared
one (experts and top-k set whatever the default: HunYuan-MoE's is 1 expert), MoE layers from the second
layer on, every dropout and router noise 0 (the runs are compared with a reference), no cache, no auxiliary
router loss (a load-balancing loss is not linear in the batch, so its mean over DP ranks is not the
batch's). No other field grows: a size already smaller (1 KV head, no shared expert) stays. Per-layer lists
(``layer_types``, ``mlp_layer_types``, ...) keep one layer of each kind the full model has, in the order
they first appear (a hybrid model keeps an attention layer and a Mamba one), and lists and dicts of layer
indices follow. Special token ids outside the new vocabulary move to its top, above the ids the matrix's rows
use (``DATA_VOCAB``), so no row holds an image token; ids inside it stay (a Roberta's pad id is also its
positions' padding index). ``OVERRIDES`` is the one table of what a family needs beyond that, each entry with
its reason.

``plain_check(config)`` is the same model in transformers alone (built with values, one forward with
labels, one backward): a type whose tiny config fails there is not a question for hybrid, and the matrix
says so instead of blaming the product. ``is_moe``, ``is_tied`` and ``has_plan`` classify a config; ``ids``
are the rows every run trains on, ``build`` and ``loss_of`` how every run builds and runs a model.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Optional

import torch

VOCAB, DATA_VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 128, 96, 32, 64, 2, 4, 2, 8
POSITIONS, WINDOW, EXPERTS, TOP_K, MOE_INTER = 64, 4, 4, 2, 32
SEQ, ROWS = 8, 4  # the rows every run trains on: ROWS x SEQ tokens

_SIZES = (  # (size, field names): a list, as several sizes are equal
    (HIDDEN, ("hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "hidden_dim", "embedding_size",
             "word_embed_proj_dim", "emb_dim", "input_embedding_size", "output_embedding_size", "lru_width",
             "embedding_dim", "hidden_size_global", "adapter_in_dim", "adapter_input_size",
             "adapter_out_dim")),
    (INTER, ("intermediate_size", "ffn_dim", "n_inner", "d_ff", "dff", "ffn_hidden_size", "decoder_ffn_dim",
            "encoder_ffn_dim", "feed_forward_size", "dim_ff", "intermediate_size_mlp", "dense_intermediate_size",
            "first_dense_intermediate_size", "mlp_only_intermediate_size", "d_inner", "mamba_d_ssm", "mlp_dim")),
    (MOE_INTER, ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_ffn_hidden_size",
                "moe_shared_expert_intermediate_size", "shared_intermediate_size",
                "shared_experts_intermediate_size", "expert_intermediate_size")),
    (LAYERS, ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
             "num_decoder_layers", "num_encoder_layers", "num_blocks", "num_layers_per_stack")),
    (HEADS, ("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
            "encoder_attention_heads", "attention_heads", "num_decoder_attention_heads",
            "num_encoder_attention_heads", "swa_num_attention_heads", "linear_num_value_heads")),
    (KV_HEADS, ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "num_query_groups",
               "swa_num_key_value_heads", "linear_num_key_heads", "index_n_heads", "index_num_heads")),
    (HEAD_DIM, ("head_dim", "attention_head_dim", "d_head", "dim_head", "attention_head_size", "kv_channels",
               "swa_head_dim", "v_head_dim", "linear_key_head_dim", "linear_value_head_dim", "index_head_dim",
               "linear_head_dim", "qk_head_dim")),
    (VOCAB, ("vocab_size", "vocab_size_per_layer_input", "decoder_vocab_size", "unpadded_vocab_size",
             "encoder_hash_byte_group_vocab", "shape_vocab_size", "pronunciation_vocab_size")),
    (POSITIONS, ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_target_positions",
                "max_source_positions", "context_length", "model_max_length", "original_max_position_embeddings")),
    (WINDOW, ("sliding_window", "sliding_window_size", "attention_window_size", "window_size",
             "local_attention_window_len")),
    (EXPERTS, ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")),
    (TOP_K, ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k")),
    (1, ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "n_group", "topk_group",
        "num_expert_group", "first_k_dense_replace", "num_dense_layers", "decoder_sparse_step",
        "moe_layer_start_index", "moe_layer_interval")),
    (16, ("kv_lora_rank", "q_lora_rank", "o_lora_rank", "mamba_d_state", "state_size", "ssm_state_size",
         "hidden_size_per_layer_input")),
    (4, ("qk_rope_head_dim", "qk_nope_head_dim", "index_topk", "mamba_chunk_size", "chunk_size", "rotary_dim",
         "mamba_n_heads", "n_mamba_heads", "mamba_num_heads", "mamba_dt_rank")),
    (16, ("shape_embed_dim", "pronunciation_embed_dim")),
    (16, ("mamba_d_head", "mamba_head_dim", "mamba_headdim")),
    (1, ("mamba_n_groups", "mamba_ngroups", "n_groups")),
    (0, ("num_nextn_predict_layers", "num_kv_shared_layers")),
)
SIZE_OF = {name: size for size, names in _SIZES for name in names}
_EXACT = next(names for _, names in _SIZES if "num_experts" in names) + next(
    names for _, names in _SIZES if "num_experts_per_tok" in names)
LAYER_FIELDS = next(names for _, names in _SIZES if "num_hidden_layers" in names)
EXPERT_FIELDS = next(names for _, names in _SIZES if "num_experts" in names)
# per-layer lists of indices (kept where below the new layer count)
_INDEX_LISTS = ("mlp_only_layers", "moe_layers", "full_attn_idxs", "hybrid_layer_ids", "index_layers",
                "ple_layer_ids", "attn_layer_indices")
_UNSET = ("head_dim", "num_key_value_heads")  # None in some defaults that the model code then divides by
_LAYER_VALUES = ("kv_source_layers",)  # per-layer lists whose values are layer indices
_NOISE = ("router_jitter_noise", "input_jitter_noise", "layerdrop", "mask_time_prob", "mask_feature_prob")
_TOKEN_IDS = ("token_id", "token_index")


def _is_dropout(name: str, value) -> bool:
    return (isinstance(value, float) and ("dropout" in name or "pdrop" in name or name.endswith("_drop")
                                           or name in _NOISE or name.endswith("layerdrop")))


def _layer_pick(doc: dict, layers: int) -> Optional[list]:
    """Indices of the layers to keep: the first of each kind any per-layer kind list names, then the next
    ones up to LAYERS."""
    picks: list = []
    for key, value in doc.items():
        if key.endswith("types") or key in ("layers_block_type", "block_types", "attention_types"):
            if isinstance(value, list) and len(value) == layers and all(isinstance(v, str) for v in value):
                seen: dict = {}
                for i, v in enumerate(value):
                    seen.setdefault(v, i)
                picks += [i for i in seen.values() if i not in picks]
    for i in range(layers):
        if len(picks) >= LAYERS:
            break
        if i not in picks:
            picks.append(i)
    return sorted(picks)[:max(LAYERS, len(picks))]


def shrink(doc: dict, token_ids: Optional[dict] = None, vocab: Optional[int] = None) -> dict:
    """``doc`` (a config's ``to_dict()``) with the fields the module docstring lists made tiny; nested
    configs shrunk alike. Special token ids outside the vocabulary (the config's, its text config's, else
    the enclosing one's: ``vocab``) move to the top of it."""
    original, doc = doc, copy.deepcopy(doc)
    token_ids = {} if token_ids is None else token_ids
    layer_field = next((k for k in LAYER_FIELDS if isinstance(doc.get(k), int)), None)
    old_layers = doc[layer_field] if layer_field else None
    pick = _layer_pick(doc, old_layers) if old_layers else None
    text = doc.get("text_config") if isinstance(doc.get("text_config"), dict) else {}
    if isinstance(doc.get("vocab_size") or text.get("vocab_size"), int):
        vocab = min(VOCAB, doc.get("vocab_size") or text.get("vocab_size"))
    for key, value in list(doc.items()):
        if pick and isinstance(value, dict) and value and all(_layer_key(k, old_layers) for k in value):
            doc[key] = {_renumbered(k, pick.index(int(k))): shrink(v, token_ids, vocab) if isinstance(v, dict) else v
                        for k, v in value.items() if int(k) in pick}
        elif isinstance(value, dict) and ("model_type" in value or key.endswith("config")):
            doc[key] = shrink(value, token_ids, vocab)
        elif pick and isinstance(value, list) and len(value) == old_layers and key not in _INDEX_LISTS:
            doc[key] = [value[i] for i in pick]
            if key in SIZE_OF and all(isinstance(v, int) for v in doc[key]):
                doc[key] = [min(v, SIZE_OF[key]) for v in doc[key]]
            if key in _LAYER_VALUES:  # each layer names another one: renumbered
                doc[key] = [pick.index(v) if v in pick else j for j, v in enumerate(doc[key])]
        elif key in _INDEX_LISTS and isinstance(value, list) and pick:
            doc[key] = [pick.index(i) for i in value if i in pick]
        elif key in _UNSET and value is None:  # a default the config leaves to be derived, and does not
            doc[key] = SIZE_OF[key]
        elif _is_dropout(key, value):
            doc[key] = 0.0
        elif key in _EXACT and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            doc[key] = SIZE_OF[key]  # a mixture of EXPERTS experts, top-k TOP_K, whatever the default
        elif key in SIZE_OF and isinstance(value, int) and not isinstance(value, bool):
            doc[key] = min(value, SIZE_OF[key])  # never larger: 0 often means "none", 1 KV head is MQA
    if pick:
        doc[layer_field] = len(pick)
        for k in LAYER_FIELDS:
            if isinstance(doc.get(k), int) and k != layer_field and doc[k] == old_layers:
                doc[k] = len(pick)
    _mla(doc, original)
    for key, value in list(doc.items()):
        if vocab and key.endswith(_TOKEN_IDS):
            doc[key] = _token(value, vocab, token_ids)
    for key in ("use_cache", "output_router_logits"):  # no cache; no auxiliary router loss (nonlinear in the
        if key in doc:                                  # batch: a DP mean of it is not the batch's)
            doc[key] = False
    return doc


def _mla(doc: dict, original: dict) -> None:
    """Multi-head latent attention's derived sizes: q/k heads of nope + rope features, and a ``head_dim`` that
    is the rope part where the full config had it so (DeepSeek's rotary table)."""
    if "qk_rope_head_dim" not in doc or "qk_nope_head_dim" not in doc:
        return
    if "qk_head_dim" in doc:
        doc["qk_head_dim"] = doc["qk_rope_head_dim"] + doc["qk_nope_head_dim"]
    if "head_dim" in doc and original.get("head_dim") == original.get("qk_rope_head_dim"):
        doc["head_dim"] = doc["qk_rope_head_dim"]
    if original.get("num_key_value_heads") == original.get("num_attention_heads"):  # k and v: one per head
        doc["num_key_value_heads"] = doc.get("num_attention_heads")


def _layer_key(key, layers: int) -> bool:
    return (isinstance(key, int) or (isinstance(key, str) and key.isdigit())) and int(key) < layers


def _renumbered(key, index: int):
    """A layer index as the config spelled it (an int, or a string of digits, zero-padded as it was)."""
    return index if isinstance(key, int) else str(index).zfill(len(key))


def _token(value, vocab: int, taken: dict):
    """A special token id inside ``vocab``: ids inside it stay (a Roberta's pad is its positions' padding index
    too), others get the next free id from the top, above DATA_VOCAB (the same id for the same original id)."""
    if isinstance(value, list):
        return [_token(v, vocab, taken) for v in value]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        return value
    if value < vocab:
        return value
    if value not in taken:
        taken[value] = vocab - 1 - len(taken)
    return taken[value]


def _partial_rotary(doc: dict) -> None:
    """Rope parameters whose per-frequency lists (longrope's factors) match the new head size."""
    rope = doc.get("rope_parameters")
    if isinstance(rope, dict):
        for value in rope.values():
            if isinstance(value, dict):
                _scale_factors(value, doc)
        _scale_factors(rope, doc)


def _scale_factors(rope: dict, doc: dict) -> None:
    head = doc.get("head_dim") or HEAD_DIM
    rotary = int(head * rope.get("partial_rotary_factor", 1.0))
    for key in ("short_factor", "long_factor"):
        if isinstance(rope.get(key), list):
            rope[key] = [1.0] * (rotary // 2)


def _as_many_kv_heads(doc: dict) -> None:
    """Every (nested) config with KV heads gets as many as it has heads."""
    if isinstance(doc.get("num_key_value_heads"), int) and isinstance(doc.get("num_attention_heads"), int):
        doc["num_key_value_heads"] = doc["num_attention_heads"]
    for value in doc.values():
        if isinstance(value, dict):
            _as_many_kv_heads(value)


_INDEXER = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 4,
            "indexer_compress_ratio": 2}  # its default leaves the indexer's sizes unset
# What a family needs beyond the generic shrink, each with why (field -> value; nested "text_config.x").
OVERRIDES: dict[str, dict[str, Any]] = {
    # its heads x head_dim must be hidden_size x expand (64)
    "mamba2": {"head_dim": 16},
    "falcon_h1": {"mamba_d_head": 16},
    # attention over the hidden state and the embeddings concatenated (2 x hidden); the tie of the shared
    # block needs two hybrid layers
    "zamba": {"attention_hidden_size": 64, "attention_head_dim": 16, "num_hidden_layers": 3,
              "layers_block_type": ["mamba", "hybrid", "hybrid"]},
    "zamba2": {"attention_hidden_size": 64, "attention_head_dim": 16},
    # one input, one recurrent, one output layer; its config.json spells each layer as (attention, mlp), twice
    # the counts
    "dory": {"num_hidden_layers": 6, "n_input_layers": 2, "n_recurrent_layers": 2, "n_output_layers": 2,
             "layer_types": ["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "mlp"]},
    "kolibri1_1": {"head_dim": 16},  # its NVFP4 key/value rounding needs a multiple of 16
    "zaya": {"num_experts_per_tok": 1},  # its validator: top-1 routing only
    "dots3_note": {"": _as_many_kv_heads},  # its validator: as many KV heads as heads, in every layer config
    "dots3_note_text": {"": _as_many_kv_heads},
    # defaults that leave the model without a top-k, experts or layer types
    "deepseek_v2": {"num_experts_per_tok": TOP_K},
    "dots1": {"n_routed_experts": EXPERTS, "num_experts_per_tok": TOP_K, "n_shared_experts": 1},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # its validator wants no per-layer inputs, its default has them
    "gemma4_assistant": {"text_config.hidden_size_per_layer_input": 0, "text_config.vocab_size_per_layer_input": 0},
    "qwen4_exp": {f"text_config.{k}": v for k, v in _INDEXER.items()},
    "qwen4_exp_text": _INDEXER,
    # LSH and local attention in chunks that divide the 8-token rows, axial positions of 8 x 32 features
    "reformer": {"is_decoder": True, "attn_layers": ["local", "lsh"], "local_attn_chunk_length": 4,
                 "lsh_attn_chunk_length": 4, "axial_pos_shape": [2, 4], "axial_pos_embds_dim": [16, 16],
                 "max_position_embeddings": SEQ, "num_buckets": 2, "num_hashes": 1},
    # multimodal parts the text forward never runs, still built: their channels
    "got_ocr2": {"vision_config.output_channels": 32},
    "phi4_multimodal": {f"audio_config.{k}": 32 for k in ("ext_pw_out_channel", "depthwise_separable_out_channel",
                                                           "nemo_conv_channels")},
    # its default rope_parameters is empty while its layers look theirs up by layer type
    "cohere_compass_text": {"rope_parameters": {t: {"rope_type": "default", "rope_theta": 10000.0}
                                                for t in ("full_attention", "sliding_attention")}},
}


def _set(doc: dict, dotted: str, value) -> None:
    """``doc[a][b] = value`` for ``"a.b"``; the key "" calls ``value(doc)``."""
    if not dotted:
        return value(doc)
    *parents, leaf = dotted.split(".")
    for p in parents:
        doc = doc[p]
    doc[leaf] = value


def config_class(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def tiny_config(model_type: str):
    """The type's tiny config (its own config class)."""
    cls = config_class(model_type)
    try:
        default = cls()
    except Exception:  # a default its own validator refuses: with the override's top-level fields
        given: dict = {}
        for dotted, value in OVERRIDES.get(model_type, {}).items():
            if not dotted:
                continue
            *parents, leaf = dotted.split(".")
            where = given
            for p in parents:
                where = where.setdefault(p, {})
            where[leaf] = value
        default = cls(**given)
    doc = shrink(default.to_dict())
    _partial_rotary(doc)
    for sub in doc.values():
        if isinstance(sub, dict) and "model_type" in sub:
            _partial_rotary(sub)
    for dotted, value in OVERRIDES.get(model_type, {}).items():
        _set(doc, dotted, value)
    for key in ("transformers_version", "architectures", "_name_or_path"):
        doc.pop(key, None)
    return cls.from_dict(doc)


def _configs(config) -> list:
    """``config`` and its nested sub-configs."""
    out = [config]
    for key in list(config.to_dict()):
        sub = getattr(config, key, None)
        if hasattr(sub, "to_dict") and hasattr(sub, "model_type"):
            out += _configs(sub)
    return out


def is_moe(config) -> bool:
    return any(isinstance(getattr(c, f, None), int) and getattr(c, f) > 1 for c in _configs(config)
               for f in EXPERT_FIELDS)


def is_tied(config) -> bool:
    """The input embedding and the head share one tensor (the text config's say where there is one)."""
    try:
        text = config.get_text_config()
    except Exception:  # noqa: BLE001 -- several text configs (Musicgen's): the config's own flag
        text = config
    return bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))


def has_plan(config) -> bool:
    """The config or a sub-config of it states a ``base_model_tp_plan``."""
    return any(getattr(c, "base_model_tp_plan", None) for c in _configs(config))


def ids(step: int, rows: int = ROWS) -> torch.Tensor:
    """Arithmetic sequences mod DATA_VOCAB (learnable, so training moves the weights in a way that matters)."""
    g = torch.Generator().manual_seed(500 + step)
    start = torch.randint(0, DATA_VOCAB, (rows, 1), generator=g)
    stride = torch.randint(1, 4, (rows, 1), generator=g)
    return (start + stride * torch.arange(SEQ)) % DATA_VOCAB


def build(config, seed: Optional[int] = None, dtype=None):
    """``AutoModelForCausalLM.from_config(config)``, seeded, in ``dtype``; train mode."""
    from transformers import AutoModelForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if dtype is not None:
        model = model.to(dtype)
    return model.train()


def loss_of(model, rows: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=rows, labels=rows)
    loss = out.loss if hasattr(out, "loss") else out[0]
    if loss is None or not torch.is_tensor(loss) or loss.dim() != 0:
        raise TypeError(f"{type(model).__name__} gave no scalar loss for (input_ids, labels)")
    return loss


MAX_PARAMS = 2_000_000  # a tiny config over this was not shrunk (a field the walk does not know)


def plain_check(config) -> None:
    """Raise when transformers itself cannot build and train the tiny config (one forward with labels, one
    backward, a finite loss), or when the config was not shrunk (over ``MAX_PARAMS`` parameters)."""
    with torch.device("meta"):
        count = sum(p.numel() for p in build(config).parameters())
    if count > MAX_PARAMS:
        raise ValueError(f"the tiny config still has {count:,} parameters; shrink the field that holds them")
    model = build(config, seed=0)
    loss = loss_of(model, ids(0))
    if not math.isfinite(loss.item()):
        raise FloatingPointError(f"loss {loss.item()}")
    loss.backward()
