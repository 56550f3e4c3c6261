"""Drafter checkpoint formats: detection, reading and writing; sharded or not.

Five drafters in three on-disk formats, one module each:

* ``zlab`` (:mod:`~dflash.drafter.format_zlab`): z-lab ``dflash`` 0.1.0, DFlash and
  DFlash2: our own layout (a Qwen3 ``config.json`` plus ``num_target_layers``,
  ``block_size``, ``dflash_config: {mask_token_id, target_layer_ids}``).
* ``transformers`` (:mod:`~dflash.drafter.format_native`): transformers' native DFlash
  assistant (``model_type`` ``muse_glimmer_assistant``), DFlash only.
* ``speculators`` (:mod:`~dflash.drafter.format_speculators`): vLLM speculators 0.9.0,
  DFlash and DFlash2.

Detection (:func:`detect_format`) is by the keys only one format defines
(:data:`DISTINGUISHING_KEYS`), never by one they share (``mask_token_id`` and
``block_size`` are top-level in both speculators and native configs); none or
two matching is an error.

Mapping, ours (= z-lab) -> transformers | speculators ("=": the same name; "spec.": speculators;
``tlc``: speculators' ``transformer_layer_config``):

==================================  ==================================  ======================================
ours / zlab                         transformers                        speculators
==================================  ==================================  ======================================
``fc.weight`` ``[H, n*H]``          ``encoder.fc.weight``               =
``hidden_norm.weight`` ``[H]``      ``encoder.output_norm_enc.weight``  =
``layers.{i}.*``, ``norm.weight``   = (a ``model.`` prefix is read)     =
``candidate_selector.*_codebook``   (no DFlash2)                        = (bare Parameters, no ``.weight``)
(the target's embed / lm_head)      --                                  ``embed_tokens``, ``lm_head``,
                                                                        ``verifier_*``: skipped on read
``dflash_config.mask_token_id``     ``mask_token_id``                   ``mask_token_id``
``dflash_config.target_layer_ids``  ``target_layer_ids`` (same ids)     ``aux_hidden_state_layer_ids``: id + 1
``block_size``                      ``block_size``                      ``block_size``
``num_target_layers``               extra key, else None till paired    absent: None till paired
``vocab_size``                      extra key, else None till paired    ``tlc.vocab_size`` (= draft_vocab_size)
``sliding_window`` W (per row)      ``sliding_window`` W - 1            error (spec.'s window is per block)
``sliding_window`` W +              error (per row only)                ``tlc.sliding_window`` W (the W context
``sliding_window_anchored``                                             rows before the block's anchor)
``is_causal``                       false (bidirectional)               false (full attention only), or with
                                                                        sliding layers: unset (causal) <->
                                                                        ``sliding_window_non_causal`` false
``layer_types``                     = (default all sliding_attention)   ``tlc.layer_types``
DFlash2 ``conv_kernel_size``,       --                                  the same keys, top level
``conv_group_size``,
``selector_rank``,
``selector_top_k``
(the full target vocabulary)        (the full target vocabulary)        ``draft_vocab_size`` = ``tlc.vocab_size``;
                                                                        ``t2d`` / ``d2t`` / own ``lm_head``: error
(proposals at masked positions)     (the same)                          ``sample_from_anchor`` false (true: error)
(features of width H)               (the same)                          ``target_hidden_size`` null (or H)
--                                  --                                  ``sliding_window_non_causal`` without
                                                                        sliding layers: speculators' default
Qwen3 keys (``hidden_size``,        the same keys                       the same keys inside ``tlc``
``head_dim``, ``rope_parameters``,
``rms_norm_eps``, ...)
--                                  ``model_type``, ``architectures``   ``speculators_model_type``,
                                                                        ``speculators_version``,
                                                                        ``speculators_config``, ``architectures``
==================================  ==================================  ======================================

Each format module lists what it cannot carry (an error naming the key).
Sharded checkpoints: ``model.safetensors.index.json`` (``{"weight_map": {name:
file}}``) names the shard of every weight; every format is read and written sharded.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch

from .config import DraftConfigError
from .format_native import (config_from_native, from_native_names, is_native, native_config,
                            to_native_names)
from .format_speculators import config_from_speculators, is_speculators, speculators_config, speculators_state
from .format_zlab import bare_codebooks, config_from_zlab, is_zlab, weight_codebooks, zlab_config

__all__ = ["FORMATS", "DISTINGUISHING_KEYS", "detect_format", "read_checkpoint", "write_checkpoint",
           "to_native_names", "from_native_names", "read_weights", "write_weights"]

FORMATS = ("zlab", "transformers", "speculators")
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"

#: what each format's config.json has and no other format's does
DISTINGUISHING_KEYS = {
    "zlab": "'dflash_config'",
    "transformers": "model_type 'muse_glimmer_assistant'",
    "speculators": "'speculators_model_type' / 'transformer_layer_config'",
}
_TESTS: Dict[str, Callable[[Dict[str, Any]], bool]] = {"zlab": is_zlab, "transformers": is_native,
                                                        "speculators": is_speculators}


def detect_format(raw: Dict[str, Any], weight_names: Optional[Iterable[str]] = None) -> str:
    """The format of a ``config.json`` dict, by :data:`DISTINGUISHING_KEYS`.

    None matching or two matching is a :class:`DraftConfigError`, as is a
    config whose weights are named as in another format (``encoder.fc.weight``
    is native only; ``fc.weight`` is shared by z-lab and speculators).
    """
    matches = [fmt for fmt in FORMATS if _TESTS[fmt](raw)]
    if len(matches) > 1:
        raise DraftConfigError(f"config.json is ambiguous: it has the keys of the {' and the '.join(matches)} "
                               f"formats ({'; '.join(DISTINGUISHING_KEYS[f] for f in matches)})")
    if not matches:
        raise DraftConfigError("config.json is not a DFlash drafter config of a known format: it has none of "
                               + "; ".join(f"{DISTINGUISHING_KEYS[f]} ({f})" for f in FORMATS))
    fmt = matches[0]
    if weight_names is not None:
        names = {n[len("model."):] if n.startswith("model.") else n for n in weight_names}
        native_names = "encoder.fc.weight" in names
        if native_names != (fmt == "transformers") and (native_names or "fc.weight" in names):
            raise DraftConfigError(
                f"config.json is in the {fmt} format but the weights are named as in the "
                f"{'transformers' if native_names else 'zlab/speculators'} format "
                f"({'encoder.fc.weight' if native_names else 'fc.weight'})")
    return fmt


def read_checkpoint(directory: str, target_config=None) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor], str]:
    """``(our config dict, weights in our names, format)`` of a drafter directory in any format.

    ``target_config`` (the target's config) fills ``num_target_layers`` /
    ``vocab_size`` where the format does not carry them; else they stay None.
    """
    if not os.path.isdir(directory):
        raise DraftConfigError(f"drafter directory {directory!r} does not exist (loading is local only)")
    config_path = os.path.join(directory, CONFIG_NAME)
    if not os.path.isfile(config_path):
        raise DraftConfigError(f"no {CONFIG_NAME} in drafter directory {directory!r}")
    with open(config_path) as f:
        raw = json.load(f)
    state, _ = read_weights(directory)
    fmt = detect_format(raw, state.keys())
    if fmt == "transformers":
        return config_from_native(raw, target_config), from_native_names(state), fmt
    if fmt == "speculators":
        config, state = config_from_speculators(raw, state, target_config)
        return config, weight_codebooks(state), fmt
    return config_from_zlab(raw, target_config), weight_codebooks(state), fmt


def shown_names(fmt: str) -> Callable[[Dict[str, Any]], Dict[str, Any]]:
    """Our weight names -> the names ``fmt`` stores (for error messages)."""
    return {"transformers": to_native_names, "speculators": bare_codebooks, "zlab": bare_codebooks}[fmt]


def write_checkpoint(directory: str, config, state: Dict[str, torch.Tensor], fmt: str, architecture: str,
                     max_shard_bytes: Optional[int] = None) -> None:
    """Write ``config.json`` and the weights (ours: names and config) in ``fmt``; ``architecture`` is our
    class's (``DFlashDraftModel`` / ``DFlash2DraftModel``)."""
    if fmt not in FORMATS:
        raise DraftConfigError(f"unknown drafter format {fmt!r}; allowed: {', '.join(FORMATS)}")
    dflash2 = architecture == "DFlash2DraftModel"
    if fmt == "zlab":
        raw, state = zlab_config(config, architecture), bare_codebooks(state)
    elif fmt == "speculators":
        raw, state = speculators_config(config, dflash2), speculators_state(state)
    elif dflash2:
        raise DraftConfigError("the transformers DFlash assistant format holds DFlash drafters only, not "
                               "DFlash2DraftModel; write it in the zlab or speculators format")
    else:
        raw, state = native_config(config), to_native_names(state)
    raw["dtype"] = str(next(iter(state.values())).dtype).replace("torch.", "")
    os.makedirs(directory, exist_ok=True)
    write_weights(state, directory, max_shard_bytes)
    with open(os.path.join(directory, CONFIG_NAME), "w") as f:
        json.dump(raw, f, indent=2, sort_keys=True)


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
