"""transformers' native DFlash assistant format (``model_type`` ``muse_glimmer_assistant``).

The assistant model transformers ships for DFlash (class
``MuseGlimmerAssistantModel``, driven by ``generate(assistant_model=...,
speculation_type="dflash")``). Its config has top-level ``block_size`` /
``mask_token_id`` / ``target_layer_ids``; the context projection sits under
``encoder.``. The mapping to our (z-lab) layout is the table in
:mod:`dflash.drafter.formats`. Published native configs have neither
``num_target_layers`` nor ``vocab_size``: such a drafter loads with both None
and is validated when paired with a target (:func:`dflash.decoding.check_pair`).
DFlash2 drafters and attention biases cannot be written natively.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from .config import DraftConfigError, draft_layer_ids
from .format_zlab import refuse_anchored_window, refuse_scalars

NATIVE_MODEL_TYPE = "muse_glimmer_assistant"
NATIVE_ARCHITECTURE = "MuseGlimmerAssistantModel"

#: z-lab weight name -> native weight name (every other name is the same in both).
WEIGHT_RENAMES = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
_FROM_NATIVE = {v: k for k, v in WEIGHT_RENAMES.items()}

#: Config keys with the same name and meaning in both formats.
CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "attention_dropout",
               "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id", "block_size", "layer_types", "dtype")
#: transformers' bookkeeping keys, dropped when converting.
BOOKKEEPING = ("architectures", "auto_map", "model_type", "transformers_version", "_name_or_path", "torch_dtype",
               "id2label", "label2id", "chunk_size_feed_forward", "is_encoder_decoder", "output_attentions",
               "output_hidden_states", "problem_type", "return_dict")


def is_native(raw: Dict[str, Any]) -> bool:
    """The native format's distinguishing key: ``model_type == "muse_glimmer_assistant"``."""
    return raw.get("model_type") == NATIVE_MODEL_TYPE


def config_from_native(raw: Dict[str, Any], target_config=None) -> Dict[str, Any]:
    """Our (z-lab) config dict from a native assistant ``config.json`` dict.

    ``num_target_layers`` and ``vocab_size`` come from the dict (our extra
    keys), else from ``target_config`` (the target's config: its
    ``num_hidden_layers`` / ``vocab_size``), else stay None until the drafter
    is paired with a target.
    """
    raw = dict(raw)
    for key in ("mask_token_id", "block_size", "target_layer_ids"):
        if raw.get(key) is None:
            raise DraftConfigError(f"transformers-format drafter config is missing '{key}'")
    if raw.get("hidden_act", "silu") != "silu":
        raise DraftConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (the drafter's MLP is SwiGLU)")
    out: Dict[str, Any] = {k: raw[k] for k in CONFIG_KEYS if k in raw and raw[k] is not None}
    for key, attr in (("num_target_layers", "num_hidden_layers"), ("vocab_size", "vocab_size")):
        value = raw.get(key)
        if value is None and target_config is not None:
            value = getattr(target_config, attr, None)
        out[key] = None if value is None else int(value)
    out["dflash_config"] = {"mask_token_id": int(raw["mask_token_id"]),
                            "target_layer_ids": [int(i) for i in raw["target_layer_ids"]]}
    layer_types = raw.get("layer_types") or ["sliding_attention"] * int(raw["num_hidden_layers"])
    out["layer_types"] = list(layer_types)
    sliding = any(t == "sliding_attention" for t in layer_types)
    out["use_sliding_window"] = sliding
    out["is_causal"] = False  # the native assistant's mask is bidirectional
    out["sliding_window"] = int(raw.get("sliding_window", 2048)) + 1 if sliding else None
    if "rope_parameters" not in out:
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}  # the native class's default
    out["tie_word_embeddings"] = False
    known = set(CONFIG_KEYS) | set(BOOKKEEPING) | {"num_target_layers", "vocab_size", "target_layer_ids",
                                                    "mask_token_id", "sliding_window"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise DraftConfigError(f"transformers-format drafter config has keys this drafter does not implement: "
                               f"{', '.join(unknown)}")
    return out


def native_config(config) -> Dict[str, Any]:
    """The native assistant ``config.json`` dict of our (Qwen3-based) drafter config."""
    refuse_anchored_window(config, "transformers")
    refuse_scalars(config, "transformers")
    if getattr(config, "attention_bias", False):
        raise DraftConfigError("the transformers DFlash assistant has no attention biases; this drafter has "
                               "attention_bias=True and cannot be written in that format")
    d = config.to_dict()
    out: Dict[str, Any] = {k: d[k] for k in CONFIG_KEYS if k in d and d[k] is not None}
    out["hidden_act"] = d.get("hidden_act", "silu")
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    out["layer_types"] = layer_types
    if any(t == "sliding_attention" for t in layer_types):
        out["sliding_window"] = int(config.sliding_window) - 1
    out["mask_token_id"] = int(config.dflash_config["mask_token_id"])
    out["target_layer_ids"] = draft_layer_ids(config)
    for key in ("num_target_layers", "vocab_size"):  # our extras; None (unknown) is left out
        if d.get(key) is not None:
            out[key] = int(d[key])
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        out[key] = d.get(key)
    out["model_type"] = NATIVE_MODEL_TYPE
    out["architectures"] = [NATIVE_ARCHITECTURE]
    return out


def to_native_names(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {WEIGHT_RENAMES.get(k, k): v for k, v in state.items()}


def from_native_names(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        if k.startswith("model."):
            k = k[len("model."):]
        out[_FROM_NATIVE.get(k, k)] = v
    return out
