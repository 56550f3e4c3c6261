"""Drafter configuration: the published config.json format and the layer mapping.

A DFlash drafter checkpoint's ``config.json`` is a Qwen3 config plus

* ``num_target_layers``: decoder-layer count L of the target it was trained for,
* ``block_size``: B, the block length (anchor token + B-1 masked positions),
* ``dflash_config``: ``{"mask_token_id": int, "target_layer_ids": [int, ...]}``.

``target_layer_ids`` name the target decoder layers whose
*outputs* feed the drafter; layer id ``k`` is entry ``k + 1`` of Hugging Face's
``output_hidden_states`` tuple (entry 0 is the embedding output).

Formats that do not carry ``num_target_layers`` / ``vocab_size`` (transformers'
native assistant, speculators' vocabulary aside) leave them None: the drafter is
then checked against a target when paired with it
(:func:`dflash.decoding.check_pair`).
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence

from transformers import Qwen3Config


class DraftConfigError(ValueError):
    """A drafter config, checkpoint or target pairing that cannot work."""


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> List[int]:
    """The published spread of target layers read by an ``n``-layer drafter.

    ``n == 1``: ``[L // 2]``. Otherwise, with ``start = 1`` and ``end = L - 3``,
    id ``i`` is ``int(round(start + i * (end - start) / (n - 1)))`` for
    ``i = 0 .. n-1`` (Python's round). L=36, n=5 gives [1, 9, 17, 25, 33].
    """
    L, n = int(num_target_layers), int(num_draft_layers)
    if L < 1:
        raise DraftConfigError(f"num_target_layers must be >= 1, got {L}")
    if n < 1:
        raise DraftConfigError(f"the drafter must read at least one target layer, got n={n}")
    if n == 1:
        return [L // 2]
    start, end = 1, L - 3
    return [int(round(start + i * (end - start) / (n - 1))) for i in range(n)]


def validate_target_layer_ids(ids: Sequence[int], num_target_layers: int, warn_repeats: bool = True) -> List[int]:
    """Check ids against the target's layer count; warn on repeats (shallow targets) once, at config time."""
    ids = [int(i) for i in ids]
    if not ids:
        raise DraftConfigError("target_layer_ids is empty: the drafter needs at least one target layer")
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise DraftConfigError(
            f"target_layer_ids {ids} has ids {bad} out of range for a target with "
            f"{num_target_layers} decoder layers (allowed: 0..{num_target_layers - 1})"
        )
    if warn_repeats and len(set(ids)) != len(ids):
        warnings.warn(
            f"target_layer_ids {ids} repeats a layer (shallow target with {num_target_layers} layers); "
            "the repeated features are concatenated as given",
            stacklevel=3,
        )
    return ids


def make_draft_config(
    *,
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    intermediate_size: int,
    vocab_size: int,
    num_target_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: Optional[Sequence[int]] = None,
    head_dim: Optional[int] = None,
    rms_norm_eps: float = 1e-6,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 4096,
    layer_types: Optional[Sequence[str]] = None,
    sliding_window: Optional[int] = None,
    **extra: Any,
) -> Qwen3Config:
    """Build a drafter config in the published format (Qwen3 config + DFlash keys).

    ``target_layer_ids`` defaults to :func:`default_target_layer_ids` with one
    target layer per drafter layer.
    """
    ids = list(target_layer_ids) if target_layer_ids is not None else default_target_layer_ids(
        num_target_layers, num_hidden_layers
    )
    kwargs: Dict[str, Any] = dict(
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        head_dim=head_dim if head_dim is not None else hidden_size // num_attention_heads,
        rms_norm_eps=rms_norm_eps,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        tie_word_embeddings=False,
        architectures=["DFlashDraftModel"],
        num_target_layers=num_target_layers,
        block_size=block_size,
        dflash_config={"mask_token_id": int(mask_token_id), "target_layer_ids": ids},
    )
    if layer_types is not None:
        kwargs["layer_types"] = list(layer_types)
        kwargs["sliding_window"] = sliding_window
        kwargs["use_sliding_window"] = any(t == "sliding_attention" for t in layer_types)
        # written out: left unset, the reference makes sliding-window layers causal
        kwargs["is_causal"] = False
    kwargs.update(extra)
    config = qwen3_config(kwargs)
    check_draft_config(config)
    return config


#: the published DFlash2 defaults (speculators' DFlash2 config; z-lab's class reads the same keys)
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}


def dflash2_config(hidden_size: int, vocab_size: int, block_size: int, **overrides: Optional[int]) -> Dict[str, int]:
    """The DFlash2 keys of a new drafter config (pass them to :func:`make_draft_config` as extra keys).

    :data:`DFLASH2_DEFAULTS` with ``overrides`` (a None override keeps the
    default): ``conv_kernel_size`` K taps (``1 <= K <= block_size``),
    ``conv_group_size`` g channels per dynamic kernel (``g`` divides
    ``hidden_size``), ``selector_rank`` r (``>= 1``) and ``selector_top_k`` k
    candidates per position (``1 <= k <= vocab_size``). Written at the top
    level of ``config.json``, where z-lab's and speculators' classes read them.
    """
    unknown = sorted(set(overrides) - set(DFLASH2_DEFAULTS))
    if unknown:
        raise DraftConfigError(f"unknown DFlash2 keys {unknown}; allowed: {', '.join(DFLASH2_DEFAULTS)}")
    keys = {k: int(v if overrides.get(k) is None else overrides[k]) for k, v in DFLASH2_DEFAULTS.items()}
    K, g, r, k = (keys[n] for n in DFLASH2_DEFAULTS)
    if not 1 <= K <= int(block_size):
        raise DraftConfigError(f"conv_kernel_size must be in 1..block_size ({block_size}), got {K}")
    if g < 1 or int(hidden_size) % g:
        raise DraftConfigError(f"conv_group_size {g} must divide hidden_size {hidden_size}")
    if r < 1:
        raise DraftConfigError(f"selector_rank must be >= 1, got {r}")
    if not 1 <= k <= int(vocab_size):
        raise DraftConfigError(f"selector_top_k must be in 1..vocab_size ({vocab_size}), got {k}")
    return keys


def qwen3_config(values: Dict[str, Any]) -> Qwen3Config:
    """``Qwen3Config(**values)`` with transformers' validation errors turned into DraftConfigError.

    ``vocab_size`` None (a checkpoint format that does not carry it, before pairing) stays None.
    """
    layer_types = values.get("layer_types")
    if layer_types is not None and len(layer_types) != values.get("num_hidden_layers"):
        raise DraftConfigError(
            f"layer_types has {len(layer_types)} entries for {values.get('num_hidden_layers')} drafter layers"
        )
    unpaired = "vocab_size" in values and values["vocab_size"] is None
    if unpaired:
        values = {k: v for k, v in values.items() if k != "vocab_size"}
    try:
        config = Qwen3Config(**values)
    except (ValueError, TypeError) as e:  # HF strict-dataclass validation
        raise DraftConfigError(f"invalid drafter config: {e}") from e
    if unpaired:  # not known until the drafter is paired with a target (Qwen3Config's validator wants an int)
        object.__setattr__(config, "vocab_size", None)
    return config


def dflash_value(config, name: str, default: Any = None) -> Any:
    """A DFlash key: ``dflash_config[name]`` when present, else the top-level attribute, else ``default``
    (``config`` a config object or a ``config.json`` dict).

    Published configs place the drafter's own keys (``block_size``, the DFlash2
    keys, ``input_embedding_scale``, ...) either inside ``dflash_config`` or at
    the top level; both are read, ``dflash_config`` first.
    """
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    inner = get("dflash_config") or {}
    if name in inner and inner[name] is not None:
        return inner[name]
    value = get(name)
    return default if value is None else value


def draft_layer_ids(config: Qwen3Config) -> List[int]:
    """``target_layer_ids`` (``dflash_config`` or top level) if given, else the published default."""
    ids = dflash_value(config, "target_layer_ids")
    if ids is None:
        if getattr(config, "num_target_layers", None) is None:
            raise DraftConfigError("drafter config has neither 'target_layer_ids' nor 'num_target_layers' (the "
                                   "default ids are spread over the target's layers)")
        ids = default_target_layer_ids(config.num_target_layers, config.num_hidden_layers)
    return [int(i) for i in ids]


def check_draft_config(config: Qwen3Config) -> None:
    """Validate the DFlash keys of a drafter config, with messages naming the key."""
    keys = ("block_size",) if dflash_value(config, "target_layer_ids") is not None else ("num_target_layers",
                                                                                         "block_size")
    for key in keys:
        if dflash_value(config, key) is None:
            raise DraftConfigError(f"drafter config is missing '{key}' (required by the DFlash checkpoint format)")
    dflash_config = getattr(config, "dflash_config", None)
    if not isinstance(dflash_config, dict) or "mask_token_id" not in dflash_config:
        raise DraftConfigError("drafter config needs dflash_config = {'mask_token_id': int, 'target_layer_ids': [...]}")
    block_size = int(dflash_value(config, "block_size"))
    if block_size < 2:
        raise DraftConfigError(f"block_size must be >= 2 (anchor + at least one drafted token), got {block_size}")
    mask_id = int(dflash_config["mask_token_id"])
    if config.vocab_size is not None and not 0 <= mask_id < config.vocab_size:
        raise DraftConfigError(f"mask_token_id {mask_id} is outside the vocabulary (size {config.vocab_size})")
    ids = draft_layer_ids(config)
    if getattr(config, "num_target_layers", None) is not None:
        validate_target_layer_ids(ids, int(config.num_target_layers))
    elif not ids or min(ids) < 0:
        raise DraftConfigError(f"target_layer_ids {ids} must be a non-empty list of layer ids >= 0")
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        if len(layer_types) != config.num_hidden_layers:
            raise DraftConfigError(
                f"layer_types has {len(layer_types)} entries for {config.num_hidden_layers} drafter layers"
            )
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise DraftConfigError(f"layer_types {unknown} unknown; allowed: full_attention, sliding_attention")
        if "sliding_attention" in layer_types and not getattr(config, "sliding_window", None):
            raise DraftConfigError("layer_types has sliding_attention layers but sliding_window is not set")
