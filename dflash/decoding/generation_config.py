"""How the keywords of a generate call become the settings our loops run with.

:func:`resolve_generation` follows transformers' own resolution
(``GenerationMixin._prepare_generation_config`` and ``_prepare_generated_length``
of transformers 5.x), field by field:

1. the base is ``generation_config=`` if given (a copy), else an empty
   :class:`transformers.GenerationConfig`;
2. every field still unset (``None``) takes the target's
   ``target.generation_config`` value, then transformers' global default
   (``GenerationConfig._get_default_generation_params()``: ``max_length=20``,
   ``do_sample=False``, ``temperature=1.0``, ``top_k=50``, ``top_p=1.0``, ...);
3. the call's keywords override everything.

Then:

- **greedy or sampled**: ``do_sample`` decides. ``do_sample=False`` is greedy
  whatever the temperature (transformers builds no warper then). One package
  convention predates this and is kept: when ``do_sample`` is unset
  everywhere (call, ``generation_config=``, the target's config) and the call
  passes ``temperature > 0`` as a keyword, that call samples at that
  temperature with only the top-k / top-p / min-p that were set explicitly
  (transformers' global ``top_k=50`` is not added to such a call); and a
  call's ``temperature=0`` is greedy whatever the configs say (transformers
  would refuse it with sampling on).
- **sampling settings** (``do_sample=True``): temperature, then top-k, top-p,
  min-p, as transformers' warpers. Settings that change nothing are dropped:
  ``top_k`` 0 / None / >= the vocabulary, ``top_p`` >= 1, ``min_p`` None / 0.
- **length**: ``max_new_tokens`` wins over ``max_length``; a ``max_length``
  (call, config or the target's config) counts the prompt; with neither set,
  transformers' default ``max_length=20`` means 20 new tokens, capped at the
  model's ``max_position_embeddings`` (prompt included).
- **stops**: ``eos_token_id`` (int, list or tensor; from the configs when the
  call gives none) stops right after the token, as do our own
  ``stop_token_ids``; ``stopping_criteria`` (transformers' ``StoppingCriteria``
  or any callable ``(input_ids [1, n], scores) -> bool tensor``) is asked after
  every committed token.

Every other generation field must hold a value that changes nothing (its
transformers default, None, False); otherwise the call is refused with a
:class:`UnsupportedGeneration` (a ``ValueError``) that names the field and what
is allowed: nothing is silently ignored. :data:`KEYWORDS` is the table.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..target.head import head_shape
from ..target.wrappers import unwrap_target


class UnsupportedGeneration(ValueError):
    """A generate keyword (or input) our loops cannot serve; ``keyword`` names it."""

    def __init__(self, keyword: str, message: str):
        super().__init__(message)
        self.keyword = keyword


@dataclass(frozen=True)
class SamplingSettings:
    """The sampling of the target's choices: temperature, then top-k, top-p, min-p (transformers' order).

    ``temperature == 0`` is greedy (the argmax of the logits in the lm_head's
    dtype); then ``top_k``, ``top_p``, ``min_p`` are None. ``None`` means the
    setting is off (it would change nothing).
    """

    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: Optional[float] = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def active(self) -> Dict[str, Any]:
        """The filtering settings that are on (top_k / top_p / min_p), by name."""
        return {k: v for k, v in (("top_k", self.top_k), ("top_p", self.top_p), ("min_p", self.min_p))
                if v is not None}


#: Keywords of our own loops (not transformers'), with what they do.
LOOP_KEYWORDS = {
    "stop_token_ids": "extra stop tokens, added to eos_token_id",
    "seed": "seed of the target's samples (None: fresh entropy per call)",
    "block_size": "drafter block size (default: the drafter's)",
    "tree_budget": "DDTree draft nodes per round, or 'auto' (chosen each round; ddtree only)",
    "mask_token_id": "the drafter's mask token (ddtree only; default: the drafter's)",
    "return_trees": "keep each round's tree in result.trees (ddtree only)",
    "acceptance": "sampled DFlash chains: 'rejection' (default; drafts sampled from the drafter, kept with "
                  "probability min(1, p/q)) or 'match' (argmax drafts kept while they equal the target's sample); "
                  "ddtree: 'match' only",
    "stage_timing": "per-stage times in the result",
    "draft_window": "None (off) or an int W >= 1: the drafter attends only to the last W context rows before its "
                    "block (dflash / ddtree; the output is unchanged, only acceptance)",
}

#: transformers generate keywords we serve, with their meaning here (README's table comes from this).
SUPPORTED = {
    "generation_config": "base config; unset fields come from target.generation_config, then transformers' defaults",
    "max_new_tokens": "new tokens at most (wins over max_length)",
    "max_length": "prompt + new tokens at most",
    "do_sample": "False: greedy whatever the temperature; True: sample",
    "temperature": "sampling temperature (do_sample=True)",
    "top_k": "keep the k most likely tokens (do_sample=True)",
    "top_p": "nucleus sampling (do_sample=True)",
    "min_p": "drop tokens below min_p x the top probability (do_sample=True)",
    "eos_token_id": "int or list: stop right after any of them",
    "pad_token_id": "accepted; no effect at batch 1 (as in transformers)",
    "bos_token_id": "accepted; no effect (a prompt is required)",
    "stopping_criteria": "transformers StoppingCriteria(List) or callable, asked after every committed token",
    "streamer": "transformers streamer protocol: put(prompt [1, T]), put(each round's tokens [k]), end()",
    "attention_mask": "all ones only (batch 1, no padding)",
    "use_cache": "accepted; our own static cache is always used (same output)",
    "return_dict_in_generate": "drop-in: a GenerateDecoderOnlyOutput with sequences; dflash.generate always "
                               "returns a GenerationResult (result.sequences)",
    "num_beams": "1 only",
    "num_return_sequences": "1 only",
    "min_length / min_new_tokens": "only when they change nothing (0, or no eos token)",
    "speculation_type": "None or 'dflash'",
}

# Fields whose value never changes what a batch-1 decoder-only generation outputs (transformers' own
# behaviour), or which name the generation's plumbing rather than its output: accepted whatever they hold.
_INERT = {
    "pad_token_id", "bos_token_id", "use_cache", "cache_implementation", "cache_config", "max_cache_len",
    "compile_config", "disable_compile", "early_stopping", "length_penalty", "low_memory",
    "decoder_start_token_id", "transformers_version", "_from_model_config", "is_assistant", "_commit_hash",
    "return_dict_in_generate", "generation_kwargs",
}
# Fields this module reads.
_HANDLED = {"max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "min_p", "eos_token_id",
            "min_length", "min_new_tokens", "num_beams", "num_return_sequences", "speculation_type", "prefill_chunk_size"}
# Allowed (neutral) values of the other fields, besides None and transformers' global default.
_NEUTRAL = {
    "output_attentions": (False,), "output_hidden_states": (False,), "output_scores": (False,),
    "output_logits": (False,), "renormalize_logits": (False,), "token_healing": (False,),
    "remove_invalid_values": (False,), "guidance_scale": (1, 1.0), "num_beam_groups": (1,),
    "diversity_penalty": (0, 0.0), "penalty_alpha": (0, 0.0), "use_mtp": (False,), "typical_p": (1, 1.0),
    "epsilon_cutoff": (0, 0.0), "eta_cutoff": (0, 0.0), "repetition_penalty": (1, 1.0),
    "encoder_repetition_penalty": (1, 1.0), "no_repeat_ngram_size": (0,), "encoder_no_repeat_ngram_size": (0,),
}
# What to say instead, per refused field.
_ADVICE = {
    "num_beams": "beam search is not speculative decoding: num_beams must be 1",
    "num_return_sequences": "one sequence per call: num_return_sequences must be 1",
    "repetition_penalty": "repetition_penalty is not implemented: it must be 1.0",
    "no_repeat_ngram_size": "no_repeat_ngram_size is not implemented: it must be 0",
    "output_scores": "scores are not computed (the vocabulary logits are never materialized): it must be False",
    "output_logits": "logits are not computed (the vocabulary logits are never materialized): it must be False",
    "output_attentions": "attentions are not returned: it must be False",
    "output_hidden_states": "hidden states are not returned: it must be False",
    "num_assistant_tokens": "our drafter's block size sets the draft length: use block_size= / tree_budget=",
    "max_time": "max_time is not implemented: use max_new_tokens or stopping_criteria",
    "stop_strings": "stop_strings is not implemented: use eos_token_id / stop_token_ids or stopping_criteria",
}
# Call-level keywords of transformers' generate() that are not GenerationConfig fields.
_CALL_REFUSED = {
    "logits_processor": "custom logits processors are not supported (only temperature / top-k / top-p / min-p)",
    "prefix_allowed_tokens_fn": "prefix_allowed_tokens_fn is not supported",
    "negative_prompt_ids": "classifier-free guidance is not supported",
    "negative_prompt_attention_mask": "classifier-free guidance is not supported",
    "custom_generate": "custom_generate is not supported",
    "synced_gpus": "synced_gpus is not supported (one device)",
    "assistant_model": "dflash.generate takes its drafter as the `draft` argument, not assistant_model",
    "inputs_embeds": "the prompt must be token ids (input_ids)",
    "past_key_values": "a prompt cache cannot be passed in: the loops build their own",
    "cache": "a prompt cache cannot be passed in: the loops build their own",
    "position_ids": "position_ids cannot be passed: positions follow the prompt",
    "token_type_ids": "token_type_ids are not supported",
}
_CALL_EMPTY_OK = {"logits_processor", "synced_gpus"}  # accepted when empty / False / None


@dataclass
class GenerationPlan:
    """What one generation runs with, after :func:`resolve_generation`."""

    max_new_tokens: int
    sampling: SamplingSettings
    stop_token_ids: Tuple[int, ...] = ()
    stopping_criteria: Optional[Callable] = None
    streamer: Any = None
    return_dict_in_generate: bool = False
    loop_kwargs: Dict[str, Any] = field(default_factory=dict)
    #: a batch's ``attention_mask [b, T]`` (left padding; checked), None for an unpadded prompt
    attention_mask: Any = None
    #: the id that pads a batch's finished rows (``pad_token_id``, else the first eos id, as transformers)
    pad_token_id: Optional[int] = None
    #: rows per prefill pass (``prefill_chunk_size``; None: the whole prompt in one pass, as transformers)
    prefill_chunk_size: Optional[int] = None


def _token_ids(value, name: str) -> Tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.flatten().tolist()
    if isinstance(value, bool):
        raise UnsupportedGeneration(name, f"{name} must be an int or a list of ints, got {value!r}")
    if isinstance(value, int):
        return (value,)
    try:
        ids = tuple(value)
    except TypeError:
        raise UnsupportedGeneration(name, f"{name} must be an int or a list of ints, got {value!r}") from None
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise UnsupportedGeneration(name, f"{name} must be an int or a list of ints, got {value!r}")
    return ids


def _prompt_length(input_ids) -> int:
    """The prompt's length ``T`` (a batch's padded width), or a clear error."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() > 2:
            raise UnsupportedGeneration("input_ids", f"input_ids must be [T] or [b, T], got shape "
                                                     f"{tuple(input_ids.shape)}")
        return int(input_ids.shape[-1]) if input_ids.dim() > 0 else 1
    if input_ids is None:
        raise UnsupportedGeneration("input_ids", "input_ids is required (the prompt's token ids)")
    seq = list(input_ids)
    if seq and isinstance(seq[0], (list, tuple)):
        widths = {len(row) for row in seq}
        if len(widths) != 1:
            raise UnsupportedGeneration("input_ids", f"the rows of input_ids have different lengths {sorted(widths)}: "
                                                     "pad them to one width (left padding, with an attention_mask)")
        return widths.pop()
    return len(seq)


def _check_call_keywords(kwargs: dict) -> None:
    for name, why in _CALL_REFUSED.items():
        if name not in kwargs:
            continue
        value = kwargs.pop(name)
        if value is None or (name in _CALL_EMPTY_OK and not value):
            continue
        raise UnsupportedGeneration(name, f"{name}: {why}")


def _batch_size(input_ids) -> int:
    if isinstance(input_ids, torch.Tensor):
        return int(input_ids.shape[0]) if input_ids.dim() == 2 else 1
    seq = list(input_ids)
    return len(seq) if seq and isinstance(seq[0], (list, tuple)) else 1


def _check_attention_mask(mask, input_ids, prompt_len: int):
    """The attention mask as an int64 ``[b, T]`` CPU tensor (None when absent or all ones for one unpadded
    prompt); left padding only: a row must be zeros then ones, with at least one token."""
    if mask is None:
        return None
    mask = torch.as_tensor(mask)
    b = _batch_size(input_ids)
    if mask.dim() == 1:
        mask = mask[None]
    if mask.dim() != 2 or tuple(mask.shape) != (b, prompt_len):
        raise UnsupportedGeneration("attention_mask", f"attention_mask of shape {tuple(mask.shape)} does not match "
                                                      f"input_ids [{b}, {prompt_len}]")
    mask = mask.to("cpu", torch.long)
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise UnsupportedGeneration("attention_mask", "attention_mask must hold 0 (padding) and 1 (token) only")
    for r, row in enumerate(mask.tolist()):
        first = row.index(1) if 1 in row else None
        if first is None:
            raise UnsupportedGeneration("attention_mask", f"row {r} of attention_mask is all padding: every prompt "
                                                          "needs at least one token")
        if 0 in row[first:]:
            raise UnsupportedGeneration(
                "attention_mask", f"row {r} of attention_mask has a 0 after a 1 (right padding): decoder-only "
                "generation continues each row from its last token, so pad on the left "
                "(tokenizer(..., padding_side='left')), as transformers warns for right-padded decoder-only input")
    if b == 1 and bool((mask == 1).all()):
        return None
    return mask


def _inferred_attention_mask(input_ids, config, prompt_len: int):
    """The attention mask transformers' ``generate()`` infers when it is given none: where the prompt holds
    ``pad_token_id`` and that id is not an eos id, ``input_ids != pad_token_id`` (its pad tokens are masked out,
    wherever they are); else none (every token attended). Checked as a given mask is (left padding only): a pad
    id after a prompt's first other token is refused by name, since transformers would attend around it."""
    pad = config.pad_token_id
    if pad is None or isinstance(pad, (list, tuple)):
        return None
    eos = _token_ids(config.eos_token_id, "eos_token_id")
    if int(pad) in eos:
        return None
    ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.as_tensor(list(input_ids))
    if ids.dtype not in (torch.int32, torch.int64) or not bool((ids == int(pad)).any()):
        return None
    mask = (ids != int(pad)).long()
    try:
        return _check_attention_mask(mask, input_ids, prompt_len)
    except UnsupportedGeneration as e:
        rows = mask if mask.dim() == 2 else mask[None]
        r, where = next((r, row.tolist()) for r, row in enumerate(rows) if 0 in row.tolist()[row.tolist().index(1):]
                        or 1 not in row.tolist())
        pos = (where.index(0, where.index(1)) if 1 in where else 0)
        raise UnsupportedGeneration(
            "attention_mask", f"row {r} of the prompt holds pad_token_id={int(pad)} at position {pos} and no "
            f"attention_mask was given: transformers' generate() then infers attention_mask = (input_ids != "
            f"{int(pad)}) and masks that token out, which our loops do not (only left padding is). Pass "
            "attention_mask= explicitly (all ones: the token is attended), or set a pad_token_id that is not in the "
            "prompt") from e


def _check_other_fields(config, defaults: dict) -> None:
    for name, value in config.to_dict().items():
        if name in _HANDLED or name in _INERT or value is None:
            continue
        neutral = _NEUTRAL.get(name, ())
        if name in defaults and value == defaults[name]:
            continue
        if isinstance(value, (list, dict)):
            if not value:
                continue
        elif value in neutral:
            continue
        advice = _ADVICE.get(name)
        if advice is None:
            values = dict.fromkeys(((defaults[name],) if name in defaults else ()) + tuple(neutral))  # 1 == 1.0
            allowed = ", ".join(repr(v) for v in values)
            advice = f"{name} is not supported: it must be {allowed or 'None'}"
        raise UnsupportedGeneration(name, f"{name}={value!r}: {advice}")


def resolve_generation(target, input_ids, generation_config=None, **kwargs) -> GenerationPlan:
    """Resolve a generate call's keywords against ``target.generation_config`` (see the module docstring).

    ``kwargs``: transformers' generate keywords, plus :data:`LOOP_KEYWORDS`.
    Raises :class:`UnsupportedGeneration` (a ``ValueError``) for a keyword or
    value our loops cannot serve, naming it and what is allowed.
    """
    target = unwrap_target(target)  # a wrapped model's generate reads the inner model's generation config
    kwargs = dict(kwargs)
    loop_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in LOOP_KEYWORDS}
    stopping_criteria = kwargs.pop("stopping_criteria", None)
    streamer = kwargs.pop("streamer", None)
    attention_mask = kwargs.pop("attention_mask", None)
    kwargs.pop("tokenizer", None)  # transformers uses it only for stop_strings / token healing, both refused
    _check_call_keywords(kwargs)
    prompt_len = _prompt_length(input_ids)
    mask_given = attention_mask is not None
    attention_mask = _check_attention_mask(attention_mask, input_ids, prompt_len)
    max_new = kwargs.get("max_new_tokens")
    if max_new is not None and (isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new!r}")
    temperature = kwargs.get("temperature")
    if temperature is not None and (not isinstance(temperature, (int, float)) or temperature < 0):
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")

    config, explicit, explicit_max_length, legacy_temperature = _merged_config(target, generation_config, kwargs)
    if not mask_given:
        attention_mask = _inferred_attention_mask(input_ids, config, prompt_len)
    max_new = _max_new_tokens(config, explicit_max_length, prompt_len, target)
    stop_ids = _stop_ids(config, loop_kwargs.pop("stop_token_ids", None))
    stopping_criteria = _checked_criteria(stopping_criteria)
    if streamer is not None and not (callable(getattr(streamer, "put", None))
                                     and callable(getattr(streamer, "end", None))):
        raise UnsupportedGeneration("streamer", "streamer must have put(value) and end() (transformers' protocol)")
    sampling = _sampling(config, explicit, legacy_temperature, target, kwargs.get("temperature"))
    if streamer is not None and _batch_size(input_ids) > 1:
        raise UnsupportedGeneration("streamer", "a streamer takes one sequence's tokens (transformers' streamers "
                                                "support batch size 1 only): stream one prompt at a time")
    pad = config.pad_token_id if config.pad_token_id is not None else (stop_ids[0] if stop_ids else None)
    if pad is None and stopping_criteria is not None and _batch_size(input_ids) > 1:
        raise UnsupportedGeneration("pad_token_id", "a batch whose rows a stopping criterion may end early needs a "
                                                    "pad_token_id (or an eos_token_id) to pad the finished rows")
    chunk = config.prefill_chunk_size
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise UnsupportedGeneration("prefill_chunk_size", f"prefill_chunk_size must be None (the whole prompt in one "
                                                          f"pass) or an int >= 1, got {chunk!r}")
    return GenerationPlan(prefill_chunk_size=chunk, max_new_tokens=max_new, sampling=sampling, stop_token_ids=stop_ids,
                          stopping_criteria=stopping_criteria, streamer=streamer,
                          return_dict_in_generate=bool(config.return_dict_in_generate), loop_kwargs=loop_kwargs,
                          attention_mask=attention_mask, pad_token_id=None if pad is None else int(pad))


def _merged_config(target, generation_config, kwargs):
    """``(config, explicit, explicit_max_length, legacy_temperature)``: the call's keywords over
    ``generation_config`` over the model's, then transformers' global defaults (``explicit``: before the
    defaults); every field our loops cannot serve refused by name."""
    from transformers import GenerationConfig

    model_config = getattr(target, "generation_config", None) or GenerationConfig()
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise UnsupportedGeneration("generation_config", "generation_config must be a transformers GenerationConfig, "
                                                         f"got {type(generation_config).__name__}")
    explicit_max_length = (kwargs.get("max_length") is not None
                           or (generation_config is not None and generation_config.max_length is not None)
                           or model_config.max_length is not None)
    do_sample_set = (kwargs.get("do_sample") is not None
                     or (generation_config is not None and generation_config.do_sample is not None)
                     or model_config.do_sample is not None)
    legacy_temperature = (not do_sample_set and kwargs.get("temperature") is not None)

    config = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    config.update(**model_config.to_dict(), defaults_only=True)
    unknown = config.update(**kwargs)
    if unknown:
        names = ", ".join(sorted(unknown))
        allowed = sorted((set(SUPPORTED) - {"min_length / min_new_tokens"}) | set(LOOP_KEYWORDS))
        raise UnsupportedGeneration(sorted(unknown)[0], f"unknown generate keyword(s): {names}; allowed: "
                                    f"{', '.join(allowed)}, and the other GenerationConfig fields at values "
                                    "that change nothing")
    explicit = copy.deepcopy(config)  # before transformers' global defaults
    defaults = GenerationConfig._get_default_generation_params()
    config.update(**defaults, defaults_only=True)

    _check_other_fields(config, defaults)
    for name in ("num_beams", "num_return_sequences"):
        if getattr(config, name) not in (None, 1):
            raise UnsupportedGeneration(name, f"{name}={getattr(config, name)!r}: {_ADVICE[name]}")
    if config.speculation_type not in (None, "dflash"):
        raise UnsupportedGeneration("speculation_type", f"speculation_type={config.speculation_type!r}: only None "
                                                        "or 'dflash' (our loops)")
    return config, explicit, explicit_max_length, legacy_temperature


def _max_new_tokens(config, explicit_max_length: bool, prompt_len: int, target) -> int:
    """New tokens at most: ``max_new_tokens``, else ``max_length`` minus the prompt (transformers' default
    ``max_length`` counts new tokens, capped by the model's ``max_position_embeddings``)."""
    if config.max_new_tokens is not None:
        max_new = config.max_new_tokens
    else:
        max_length = config.max_length
        if not explicit_max_length:
            max_length = max_length + prompt_len
            limit = getattr(getattr(target, "config", None), "max_position_embeddings", None)
            if limit is not None:
                max_length = min(max_length, limit)
        max_new = max_length - prompt_len
        if max_new < 1:
            raise UnsupportedGeneration("max_length", f"max_length {max_length} leaves no room after the "
                                                      f"{prompt_len}-token prompt: raise it, or use max_new_tokens")
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new!r}")
    return max_new


def _stop_ids(config, stop_token_ids) -> tuple:
    """eos ids then our extra stop ids, deduplicated; min_length / min_new_tokens refused with an eos."""
    eos = _token_ids(config.eos_token_id, "eos_token_id")
    extra = _token_ids(stop_token_ids, "stop_token_ids")
    for name in ("min_length", "min_new_tokens"):
        value = getattr(config, name)
        if value and eos:
            raise UnsupportedGeneration(name, f"{name}={value!r}: holding back the eos token is not implemented; "
                                              f"{name} must be 0 when an eos token is set")
    return tuple(dict.fromkeys(eos + extra))


def _checked_criteria(stopping_criteria):
    """``stopping_criteria`` when callable (an empty list: None), else refused."""
    if stopping_criteria is not None and not callable(stopping_criteria):
        raise UnsupportedGeneration("stopping_criteria", "stopping_criteria must be a transformers StoppingCriteria"
                                                         "(List) or a callable (input_ids, scores) -> bool tensor")
    if stopping_criteria is not None and isinstance(stopping_criteria, (list, tuple)) and len(stopping_criteria) == 0:
        return None
    return stopping_criteria


def _vocab_size(target) -> Optional[int]:
    head = getattr(target, "lm_head", None)
    if getattr(head, "weight", None) is not None:
        return head_shape(head)[0]
    return getattr(getattr(target, "config", None), "vocab_size", None)


def _sampling(config, explicit, legacy: bool, target, call_temperature=None) -> SamplingSettings:
    if call_temperature is not None and not isinstance(call_temperature, bool) and call_temperature == 0:
        return SamplingSettings()  # temperature=0 in the call: greedy, whatever the configs say
    if legacy:
        temperature = explicit.temperature
        if isinstance(temperature, (int, float)) and temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
        if not temperature:
            return SamplingSettings()
        source = explicit  # the package's temperature-only call: no global top_k=50
    else:
        if not config.do_sample:
            return SamplingSettings()
        temperature = config.temperature
        source = config
    if not isinstance(temperature, (int, float)) or temperature <= 0:
        raise ValueError(f"temperature must be > 0 when sampling (do_sample=True), got {temperature!r}; "
                         "use do_sample=False for greedy decoding")
    top_k, top_p, min_p = source.top_k, source.top_p, source.min_p
    vocab = _vocab_size(target)
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
        if top_k == 0 or (vocab is not None and top_k >= vocab):
            top_k = None
    if top_p is not None:
        if not 0.0 <= float(top_p) <= 1.0:
            raise ValueError(f"top_p must be in [0, 1] (1 = off), got {top_p!r}")
        top_p = None if float(top_p) >= 1.0 else float(top_p)
    if min_p is not None:
        if not 0.0 <= float(min_p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {min_p!r}")
        min_p = None if float(min_p) == 0.0 else float(min_p)
    return SamplingSettings(float(temperature), top_k, top_p, min_p)
