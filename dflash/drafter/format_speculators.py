"""vLLM ``speculators`` (0.9.0) DFlash and DFlash2 drafter format.

``config.json`` (a ``SpeculatorModelConfig``): ``speculators_model_type``
(``dflash`` / ``dflash2``) and ``transformer_layer_config`` (the Qwen3 config
of the draft layers, ``vocab_size`` the verifier's) are its distinguishing
keys; beside them ``block_size``, ``mask_token_id``,
``aux_hidden_state_layer_ids``, ``draft_vocab_size``, ``target_hidden_size``,
``sliding_window_non_causal``, ``sample_from_anchor``, the DFlash2 keys at the top
level, ``speculators_version`` and ``speculators_config`` (``algorithm``, the
greedy ``proposal_methods`` with ``speculative_tokens = block_size - 1``,
``verifier: {name_or_path, architectures}``).

``aux_hidden_state_layer_ids`` index the verifier's hidden states with the
embedding output as 0 (speculators' converter writes z-lab id ``k`` as ``k + 1``):
``target_layer_ids = aux - 1``. Weights carry our names unprefixed (``fc``,
``hidden_norm``, ``layers.*``, ``norm``; DFlash2 codebooks as bare Parameters);
the verifier's ``embed_tokens`` / ``lm_head`` / ``verifier_lm_head`` /
``verifier_norm`` are not saved for a full draft vocabulary and are skipped
when present (this drafter uses the target's own).

Sliding-window layers: speculators keeps, for every row of a block, the ``W``
context rows before the block's anchor, and the block causally unless
``sliding_window_non_causal``; read as ``sliding_window_anchored`` (our
``DraftLayer``) with ``is_causal`` unset (sliding layers causal) or false.
z-lab's per-row window has no speculators spelling, nor speculators' in the
other formats: either way an error. Full-attention layers are bidirectional
within the block, as here.

Not implemented, each an error naming it: a reduced draft vocabulary
(``draft_vocab_size`` < the verifier's, with ``t2d`` / ``d2t`` buffers and the
drafter's own ``lm_head``), ``sample_from_anchor`` true, a ``target_hidden_size``
other than the hidden size, z-lab's drafter scalars (``input_embedding_scale``,
``output_multiplier``, ``final_logit_softcapping``) away from their identity,
read or written.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from .config import DraftConfigError, dflash_value, draft_layer_ids
from .dflash2 import DFLASH2_KEYS
from .format_native import BOOKKEEPING
from .format_zlab import bare_codebooks, check_math_keys, refuse_scalars

MODEL_TYPES = ("dflash", "dflash2")
SPECULATORS_VERSION = "0.9.0"
#: weights speculators keeps for the verifier (its embedding, head and final norm): skipped on read
VERIFIER_WEIGHTS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")
#: draft-vocabulary mapping buffers (target -> draft mask, draft -> target offsets)
VOCAB_MAPS = ("t2d", "d2t")
#: our config keys that are not part of speculators' transformer_layer_config
_OURS_ONLY = ("num_target_layers", "block_size", "dflash_config", "is_causal", "sliding_window_anchored",
              "architectures", "auto_map",
              "speculators_config", "dtype") + DFLASH2_KEYS + BOOKKEEPING
#: top-level speculators keys this reader understands
_TOP_KEYS = {"speculators_model_type", "speculators_version", "speculators_config", "transformer_layer_config",
             "block_size", "mask_token_id", "aux_hidden_state_layer_ids", "draft_vocab_size", "target_hidden_size",
             "sliding_window_non_causal", "sample_from_anchor", "architectures", "auto_map", "dtype", "torch_dtype",
             "transformers_version", "tie_word_embeddings", "_name_or_path"} | set(DFLASH2_KEYS)


def is_speculators(raw: Dict[str, Any]) -> bool:
    """The speculators format's distinguishing keys: ``speculators_model_type`` or ``transformer_layer_config``."""
    return "speculators_model_type" in raw or "transformer_layer_config" in raw


def has_sliding(layer_types: List[str]) -> bool:
    return any(t == "sliding_attention" for t in layer_types or ())


def config_from_speculators(raw: Dict[str, Any], state: Dict[str, torch.Tensor], target_config=None):
    """``(our config dict, weights in our names)`` from a speculators ``config.json`` dict and its weights."""
    kind = raw.get("speculators_model_type")
    if kind not in MODEL_TYPES:
        raise DraftConfigError(f"speculators_model_type {kind!r} is not a DFlash drafter; allowed: "
                               f"{', '.join(MODEL_TYPES)}")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DraftConfigError("speculators drafter config has no 'transformer_layer_config' dict")
    unknown = sorted(set(raw) - _TOP_KEYS)
    if unknown:
        raise DraftConfigError(f"speculators drafter config has keys this drafter does not implement: "
                               f"{', '.join(unknown)}")
    for key in ("block_size", "mask_token_id", "aux_hidden_state_layer_ids"):
        if raw.get(key) is None:
            raise DraftConfigError(f"speculators drafter config is missing '{key}'")
    vocab = layer.get("vocab_size")
    draft_vocab = raw.get("draft_vocab_size", vocab)
    if draft_vocab != vocab or any(k in state for k in VOCAB_MAPS) or "lm_head.weight" in state:
        raise DraftConfigError(
            f"speculators drafter has a reduced draft vocabulary (draft_vocab_size {draft_vocab} of the verifier's "
            f"{vocab}, its own lm_head and t2d/d2t maps): this drafter proposes over the target's full vocabulary "
            f"with the target's lm_head; allowed: draft_vocab_size == transformer_layer_config.vocab_size")
    if raw.get("sample_from_anchor"):
        raise DraftConfigError("speculators drafter sets sample_from_anchor=true (the anchor position proposes "
                               "too); this drafter proposes at the masked positions only")
    hidden = layer.get("hidden_size")
    if raw.get("target_hidden_size") not in (None, hidden):
        raise DraftConfigError(f"speculators drafter sets target_hidden_size={raw['target_hidden_size']} != its "
                               f"hidden_size {hidden}; this drafter reads target features of its own width")
    aux = [int(i) for i in raw["aux_hidden_state_layer_ids"]]
    if any(i < 1 for i in aux):
        raise DraftConfigError(f"aux_hidden_state_layer_ids {aux} names the embedding output (0): this drafter "
                               f"reads decoder-layer outputs only (ids >= 1)")
    out = {k: v for k, v in layer.items() if k not in ("model_type", "architectures", "_attn_implementation")}
    check_math_keys(out)
    refuse_scalars(out, "speculators")
    num_target_layers = getattr(target_config, "num_hidden_layers", None) if target_config is not None else None
    out.update(num_target_layers=num_target_layers, block_size=int(raw["block_size"]), is_causal=False,
               dflash_config={"mask_token_id": int(raw["mask_token_id"]), "target_layer_ids": [i - 1 for i in aux]},
               tie_word_embeddings=False)
    if has_sliding(layer.get("layer_types")):
        out["sliding_window_anchored"] = True
        # speculators' default: bidirectional for dflash2, causal sliding layers for dflash
        if not raw.get("sliding_window_non_causal", kind == "dflash2"):
            out["is_causal"] = None  # unset: sliding layers causal, full-attention layers bidirectional
    if kind == "dflash2":
        for key in DFLASH2_KEYS:
            if raw.get(key) is None:
                raise DraftConfigError(f"speculators dflash2 drafter config is missing '{key}'")
            out[key] = int(raw[key])
    if raw.get("speculators_config") is not None:
        out["speculators_config"] = raw["speculators_config"]
    weights = {k: v for k, v in state.items() if k not in VERIFIER_WEIGHTS}
    return out, weights


def speculators_config(config, dflash2: bool) -> Dict[str, Any]:
    """The speculators ``config.json`` dict of our drafter config."""
    refuse_scalars(config, "speculators")
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    sliding = has_sliding(layer_types)
    if sliding and not dflash_value(config, "sliding_window_anchored"):
        raise DraftConfigError(
            "this drafter's sliding_attention layers keep a window per query row (z-lab's rule); speculators' window "
            "keeps the W context rows before a block's anchor for every block row, so they cannot be written in the "
            "speculators format (allowed: full_attention layers, or windows read from a speculators checkpoint)")
    is_causal = dflash_value(config, "is_causal")
    if is_causal:
        raise DraftConfigError("this drafter's layers are causal within the block (is_causal=true); speculators' "
                               "full-attention layers are always bidirectional")
    if config.vocab_size is None:
        raise DraftConfigError("the speculators format needs the verifier's vocab_size, which this drafter does not "
                               "know yet: pass target_config= when loading, or --vocab-size to convert")
    ids = draft_layer_ids(config)
    L = getattr(config, "num_target_layers", None)
    if L is not None and L - 1 in ids:
        raise DraftConfigError(f"target_layer_ids {ids} read the target's last layer ({L - 1}); speculators feeds "
                               f"the last layer's output to the drafter's training loss, not as a feature")
    block_size = int(dflash_value(config, "block_size"))
    layer = {k: v for k, v in config.to_dict().items() if k not in _OURS_ONLY}
    layer.update(model_type="qwen3", layer_types=layer_types, tie_word_embeddings=False)
    kind = "dflash2" if dflash2 else "dflash"
    previous = getattr(config, "speculators_config", None) or {}
    out: Dict[str, Any] = {
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "architectures": ["DFlash2DraftModel" if dflash2 else "DFlashDraftModel"],
        "transformer_layer_config": layer,
        "draft_vocab_size": int(config.vocab_size),
        "block_size": block_size,
        "mask_token_id": int(config.dflash_config["mask_token_id"]),
        "aux_hidden_state_layer_ids": [i + 1 for i in ids],
        "target_hidden_size": None,
        # the sliding layers' rule (is_causal unset: causal); without sliding layers, speculators' default
        "sliding_window_non_causal": (is_causal is not None) if sliding else bool(dflash2),
        "sample_from_anchor": False,
        "tie_word_embeddings": False,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": block_size - 1,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "default_proposal_method": "greedy",
            "verifier": previous.get("verifier") or {"name_or_path": None, "architectures": []},
        },
    }
    if dflash2:
        out.update({k: int(dflash_value(config, k)) for k in DFLASH2_KEYS})
    return out


def speculators_state(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Weights as speculators names them: ours, DFlash2 codebooks bare."""
    return bare_codebooks(state)
