"""Drafter checkpoint formats: z-lab and transformers' native DFlash assistant, sharded or not.

Two on-disk formats hold the same drafter:

* ``zlab``: a Qwen3 ``config.json`` plus ``num_target_layers``, ``block_size``,
  ``dflash_config: {mask_token_id, target_layer_ids}``; weights ``fc.weight``,
  ``hidden_norm.weight``, ``layers.*``, ``norm.weight``.
* ``transformers``: the assistant model transformers ships for DFlash
  (``model_type`` ``muse_glimmer_assistant``, class ``MuseGlimmerAssistantModel``,
  driven by ``generate(assistant_model=..., speculation_type="dflash")``): top-level
  ``block_size`` / ``mask_token_id`` / ``target_layer_ids``; the context projection
  under ``encoder.`` (``encoder.fc``, ``encoder.output_norm_enc``).

Mapping (:data:`WEIGHT_RENAMES`, :data:`CONFIG_KEYS`), z-lab -> transformers:

* ``fc.weight`` ``[H, n*H]`` -> ``encoder.fc.weight``
* ``hidden_norm.weight`` ``[H]`` -> ``encoder.output_norm_enc.weight``
* ``layers.{i}.*``, ``norm.weight``: the same names (an optional ``model.`` prefix is read)
* ``dflash_config.mask_token_id`` / ``dflash_config.target_layer_ids`` -> top-level
  ``mask_token_id`` / ``target_layer_ids``; ``block_size`` -> ``block_size``
* ``num_target_layers``, ``vocab_size`` -> the same keys as extras (published native
  configs lack them: loading then takes them from ``target_config=``)
* ``layer_types`` -> ``layer_types`` (the native default is all ``sliding_attention``)
* ``sliding_window`` W -> ``sliding_window`` W - 1: ours hides keys with ``q - k >= W``
  (HF's causal rule), the native bidirectional mask keeps ``|q - k| <= W``
* ``rope_parameters`` (rope type and scaling, as declared) -> ``rope_parameters``
  (native default ``{"rope_type": "default", "rope_theta": 500000.0}``)
* ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
  ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``, ``max_position_embeddings``,
  ``attention_dropout``, ``hidden_act`` (silu only), ``bos/eos/pad_token_id``, ``dtype``: same keys

The native model has no attention biases (``attention_bias=True`` cannot be
written natively). Sharded checkpoints: ``model.safetensors.index.json``
(``{"weight_map": {name: file}}``) names the shard of every weight; both
formats are read and written sharded.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterable, Optional, Tuple

import torch

from .config import DraftConfigError

__all__ = ["FORMATS", "NATIVE_MODEL_TYPE", "detect_format", "zlab_config_from_native", "native_config_from_zlab",
           "to_native_names", "from_native_names", "read_weights", "write_weights"]

FORMATS = ("zlab", "transformers")
NATIVE_MODEL_TYPE = "muse_glimmer_assistant"
NATIVE_ARCHITECTURE = "MuseGlimmerAssistantModel"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

#: z-lab weight name -> native weight name (every other name is the same in both).
WEIGHT_RENAMES = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
_FROM_NATIVE = {v: k for k, v in WEIGHT_RENAMES.items()}

#: Config keys with the same name and meaning in both formats.
CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "attention_dropout",
               "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id", "block_size", "layer_types", "dtype")
#: transformers' bookkeeping keys, dropped when converting.
_BOOKKEEPING = ("architectures", "auto_map", "model_type", "transformers_version", "_name_or_path", "torch_dtype",
                "id2label", "label2id", "chunk_size_feed_forward", "is_encoder_decoder", "output_attentions",
                "output_hidden_states", "problem_type", "return_dict")


def detect_format(raw: Dict[str, Any], weight_names: Optional[Iterable[str]] = None) -> str:
    """'zlab' or 'transformers' from a ``config.json`` dict (and the weight names, when given).

    Config: ``dflash_config`` -> zlab; ``model_type == muse_glimmer_assistant`` or a
    top-level ``target_layer_ids`` / ``mask_token_id`` -> transformers. Weights:
    ``encoder.fc.weight`` -> transformers, ``fc.weight`` -> zlab. A config and
    weights that disagree, or neither telling, is a :class:`DraftConfigError`.
    """
    by_config = None
    if "dflash_config" in raw:
        by_config = "zlab"
    elif raw.get("model_type") == NATIVE_MODEL_TYPE or "target_layer_ids" in raw or "mask_token_id" in raw:
        by_config = "transformers"
    by_weights = None
    if weight_names is not None:
        names = {n[len("model."):] if n.startswith("model.") else n for n in weight_names}
        if "encoder.fc.weight" in names:
            by_weights = "transformers"
        elif "fc.weight" in names:
            by_weights = "zlab"
    if by_config and by_weights and by_config != by_weights:
        raise DraftConfigError(
            f"config.json is in the {by_config} format but the weights are named as in the {by_weights} format "
            f"({'encoder.fc.weight' if by_weights == 'transformers' else 'fc.weight'})")
    fmt = by_config or by_weights
    if fmt is None:
        raise DraftConfigError("config.json is not a DFlash drafter config: it has neither 'dflash_config' (z-lab "
                               "format) nor top-level 'target_layer_ids' / 'mask_token_id' (transformers format)")
    return fmt


def zlab_config_from_native(raw: Dict[str, Any], target_config=None) -> Dict[str, Any]:
    """Our (z-lab) config dict from a native assistant ``config.json`` dict.

    ``num_target_layers`` and ``vocab_size`` come from the dict (our extra
    keys), else from ``target_config`` (the target's config: its
    ``num_hidden_layers`` / ``vocab_size``); missing both is an error naming them.
    """
    raw = dict(raw)
    for key in ("mask_token_id", "block_size"):
        if key not in raw:
            raise DraftConfigError(f"transformers-format drafter config is missing '{key}'")
    if raw.get("hidden_act", "silu") != "silu":
        raise DraftConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (the drafter's MLP is SwiGLU)")
    out: Dict[str, Any] = {k: raw[k] for k in CONFIG_KEYS if k in raw and raw[k] is not None}
    for key, attr in (("num_target_layers", "num_hidden_layers"), ("vocab_size", "vocab_size")):
        value = raw.get(key)
        if value is None and target_config is not None:
            value = getattr(target_config, attr, None)
        if value is None:
            raise DraftConfigError(
                f"transformers-format drafter config has no '{key}' (published native configs omit it): pass "
                f"target_config= (the target model's config) to from_pretrained")
        out[key] = int(value)
    ids = raw.get("target_layer_ids")
    if ids is None:
        raise DraftConfigError("transformers-format drafter config is missing 'target_layer_ids'")
    out["dflash_config"] = {"mask_token_id": int(raw["mask_token_id"]), "target_layer_ids": [int(i) for i in ids]}
    layer_types = raw.get("layer_types") or ["sliding_attention"] * int(raw["num_hidden_layers"])
    out["layer_types"] = list(layer_types)
    sliding = any(t == "sliding_attention" for t in layer_types)
    out["use_sliding_window"] = sliding
    out["is_causal"] = False  # the native assistant's mask is bidirectional
    out["sliding_window"] = int(raw.get("sliding_window", 2048)) + 1 if sliding else None
    if "rope_parameters" not in out:
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}  # the native class's default
    out["tie_word_embeddings"] = False
    known = set(CONFIG_KEYS) | set(_BOOKKEEPING) | {"num_target_layers", "vocab_size", "target_layer_ids",
                                                     "mask_token_id", "sliding_window"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise DraftConfigError(f"transformers-format drafter config has keys this drafter does not implement: "
                               f"{', '.join(unknown)}")
    return out


def native_config_from_zlab(config) -> Dict[str, Any]:
    """The native assistant ``config.json`` dict of our (Qwen3-based) drafter config."""
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
    dflash = config.dflash_config
    out["mask_token_id"] = int(dflash["mask_token_id"])
    from .config import draft_layer_ids
    out["target_layer_ids"] = draft_layer_ids(config)
    out["num_target_layers"] = int(config.num_target_layers)
    out["vocab_size"] = int(config.vocab_size)
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


def read_weights(directory: str) -> Tuple[Dict[str, torch.Tensor], str]:
    """All weights of a checkpoint directory and how they were stored ('single', 'sharded', 'files').

    With ``model.safetensors.index.json`` exactly the shards its ``weight_map``
    names are read (a missing shard, or a weight the index lists but its shard
    lacks, is an error naming it); else every ``*.safetensors`` file.
    """
    from safetensors.torch import load_file

    index_path = os.path.join(directory, INDEX_NAME)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            index = json.load(f)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise DraftConfigError(f"{INDEX_NAME} in {directory!r} has no 'weight_map'")
        state: Dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            path = os.path.join(directory, shard)
            if not os.path.isfile(path):
                raise DraftConfigError(f"shard {shard!r} named by {INDEX_NAME} is missing from {directory!r}")
            state.update(load_file(path))
        absent = sorted(name for name in weight_map if name not in state)
        if absent:
            raise DraftConfigError(f"weights listed in {INDEX_NAME} but absent from their shards: "
                                   f"{', '.join(absent[:8])}")
        return state, "sharded"
    files = sorted(fn for fn in os.listdir(directory) if fn.endswith(".safetensors"))
    if not files:
        raise DraftConfigError(f"no .safetensors weight file in drafter directory {directory!r}")
    state = {}
    for fn in files:
        state.update(load_file(os.path.join(directory, fn)))
    return state, "single" if files == [WEIGHTS_NAME] else "files"


def write_weights(state: Dict[str, torch.Tensor], directory: str, max_shard_bytes: Optional[int] = None) -> None:
    """``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` of at most ``max_shard_bytes``
    each (a single larger tensor gets its own shard) plus ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    for fn in os.listdir(directory):  # stale weights of an earlier save would be read back
        if fn.endswith(".safetensors") or fn == INDEX_NAME:
            os.remove(os.path.join(directory, fn))
    if max_shard_bytes is None:
        save_file(state, os.path.join(directory, WEIGHTS_NAME), metadata={"format": "pt"})
        return
    shards, current, size = [], {}, 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = state[name]
        size += nbytes
    if current:
        shards.append(current)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(directory, fn), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fn
            total += t.numel() * t.element_size()
    with open(os.path.join(directory, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
