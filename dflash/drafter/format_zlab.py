"""The z-lab format (``dflash`` 0.1.0's ``DFlashDraftModel`` / ``DFlash2DraftModel``): our own layout.

``config.json`` is a Qwen3 config plus the DFlash keys; z-lab's classes read
each DFlash key from ``dflash_config`` first, then the top level (``block_size``
defaults to 16 there). Keys z-lab's classes read that change the drafter's math,
all implemented: ``target_layer_ids``, ``mask_token_id``, ``block_size``, ``is_causal``,
``layer_types``, ``sliding_window``, ``attention_bias``, ``rope_parameters``, the
DFlash2 keys ``conv_kernel_size`` / ``conv_group_size`` / ``selector_rank`` /
``selector_top_k``, and the drafter scalars (:data:`ZLAB_SCALARS`, read by
:class:`~dflash.drafter.model.DFlashDraftModel`): ``input_embedding_scale`` ``s``
(the block input is ``F.embedding(ids, W_embed) * s``), ``output_multiplier``
``m`` and ``final_logit_softcapping`` ``c`` (the drafter's logits are
``c * tanh(m W h / c)``; no cap when unset or ``<= 0``). ``hidden_act`` other
than ``silu`` is an error. The other formats have no spelling for the scalars:
writing a drafter that sets one away from its identity in them, or reading one
from a speculators config, is an error naming the key.

Other unknown keys are kept, as ``Qwen3Config`` keeps them. Speculators' anchored
sliding window (``sliding_window_anchored``) has no z-lab spelling: an error. Reading moves a
top-level ``mask_token_id`` / ``target_layer_ids`` into ``dflash_config`` (where
this package reads them). DFlash2 codebooks are written as published, without
``.weight`` (``candidate_selector.predecessor_codebook``); both spellings are read.
"""

from __future__ import annotations

import math
from typing import Any, Dict

import torch

from .config import DraftConfigError, dflash_value

#: z-lab's drafter scalars: the key -> its identity value (None: the softcap is off when unset or <= 0)
ZLAB_SCALARS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}
#: z-lab's default block size when a config has none
DEFAULT_BLOCK_SIZE = 16
#: keys only other formats carry, dropped when writing this one
FOREIGN_KEYS = ("speculators_config",)


def is_zlab(raw: Dict[str, Any]) -> bool:
    """The z-lab format's distinguishing key: ``dflash_config``."""
    return "dflash_config" in raw


def _scalar(key: str, value) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if not math.isfinite(number):
        raise DraftConfigError(f"drafter config sets {key}={value!r}; it must be a finite number")
    return number


def check_math_keys(raw: Dict[str, Any]) -> None:
    """Error naming a z-lab key that changes the drafter's math in a way this drafter does not implement
    (``hidden_act`` other than ``silu``), or a drafter scalar that is not a finite number."""
    for key in ZLAB_SCALARS:
        value = dflash_value(raw, key)
        if value is not None:
            _scalar(key, value)
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise DraftConfigError(f"hidden_act {act!r} is not supported (the drafter's MLP is SwiGLU: silu)")


def active_scalars(config) -> Dict[str, float]:
    """The drafter scalars ``config`` (a config object or dict) sets away from their identity."""
    out = {}
    for key, identity in ZLAB_SCALARS.items():
        value = dflash_value(config, key)
        if value is None:
            continue
        number = _scalar(key, value)
        if (number > 0) if identity is None else (number != identity):
            out[key] = number
    return out


def refuse_scalars(config, fmt: str) -> None:
    """Error when ``config`` sets a z-lab drafter scalar away from its identity: the ``fmt`` format has no
    spelling for it (its classes would compute other logits or block inputs)."""
    active = active_scalars(config)
    if active:
        shown = ", ".join(f"{k}={v}" for k, v in active.items())
        raise DraftConfigError(f"this drafter sets {shown} (z-lab's drafter scalars), which the {fmt} format does not "
                               f"carry: keep it in the z-lab format")


def config_from_zlab(raw: Dict[str, Any], target_config=None) -> Dict[str, Any]:
    """Our config dict from a z-lab ``config.json`` dict (checked, DFlash keys placed as this package reads them).

    ``target_config`` fills ``num_target_layers`` / ``vocab_size`` when the config lacks them.
    """
    check_math_keys(raw)
    if dflash_value(raw, "sliding_window_anchored") is not None:
        raise DraftConfigError("z-lab drafter config sets sliding_window_anchored, which z-lab's classes do not "
                               "read (it is speculators' window rule)")
    out = dict(raw)
    inner = dict(out.get("dflash_config") or {})
    for key in ("mask_token_id", "target_layer_ids"):
        if inner.get(key) is None and out.get(key) is not None:
            inner[key] = out.pop(key)
    out["dflash_config"] = inner
    if dflash_value(out, "block_size") is None:
        out["block_size"] = DEFAULT_BLOCK_SIZE
    for key, attr in (("num_target_layers", "num_hidden_layers"), ("vocab_size", "vocab_size")):
        if out.get(key) is None and target_config is not None and getattr(target_config, attr, None) is not None:
            out[key] = int(getattr(target_config, attr))
    for key in ("architectures", "auto_map", "model_type"):
        out.pop(key, None)
    return out


def refuse_anchored_window(config, fmt: str) -> None:
    """Error when ``config`` has sliding layers with speculators' anchored window, which ``fmt`` cannot spell."""
    layer_types = getattr(config, "layer_types", None) if not isinstance(config, dict) else config.get("layer_types")
    if dflash_value(config, "sliding_window_anchored") and "sliding_attention" in (layer_types or ()):
        raise DraftConfigError(
            f"this drafter's sliding_attention layers keep speculators' window (the W context rows before a block's "
            f"anchor for every block row); the {fmt} format's window is per query row: write it in the speculators "
            f"format")


def zlab_config(config, architecture: str) -> Dict[str, Any]:
    """The z-lab ``config.json`` dict of our drafter config (``architecture``: the class z-lab builds)."""
    refuse_anchored_window(config, "zlab")
    for key, flag in (("num_target_layers", "--num-target-layers"), ("vocab_size", "--vocab-size")):
        if getattr(config, key, None) is None:
            raise DraftConfigError(f"the z-lab format needs '{key}' (z-lab's classes read it), which this drafter "
                                   f"does not know yet: pass target_config= when loading, or {flag} to convert")
    out = config.to_dict()
    for key in FOREIGN_KEYS:
        out.pop(key, None)
    out["architectures"] = [architecture]
    return out


#: DFlash2 codebooks: our name -> the published z-lab (and speculators) name
CODEBOOKS = {f"candidate_selector.{n}.weight": f"candidate_selector.{n}"
             for n in ("predecessor_codebook", "successor_codebook")}


def bare_codebooks(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Weights with the DFlash2 codebooks named as published (no ``.weight``): z-lab's loader maps the bare
    name onto its embedding's ``.weight`` (and would double a ``.weight`` already there)."""
    return {CODEBOOKS.get(k, k): v for k, v in state.items()}


def weight_codebooks(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The inverse of :func:`bare_codebooks` (either spelling is read)."""
    back = {v: k for k, v in CODEBOOKS.items()}
    return {back.get(k, k): v for k, v in state.items()}
