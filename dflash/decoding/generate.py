"""``generate()``: one entry point for the AR baseline, the DFlash chain and the DDTree loop.

The call's keywords are resolved against ``target.generation_config`` as
transformers resolves them (:mod:`dflash.decoding.generation_config`), then
the method's loop runs with the resolved settings.
"""

from __future__ import annotations

from .compiled import check_max_cache_len
from .generation_config import GenerationPlan, UnsupportedGeneration, resolve_generation
from .loop import generate_rounds
from .options import DEFAULTS, METHODS, LoopOptions, check_draft_window
from .result import GenerationResult

__all__ = ["generate"]

# loop keywords each method takes besides the common ones
_METHOD_KEYWORDS = {
    "ar": {"seed", "stage_timing"},
    "dflash": {"seed", "stage_timing", "block_size", "acceptance", "draft_window"},
    "ddtree": {"seed", "stage_timing", "block_size", "tree_budget", "mask_token_id", "return_trees", "acceptance",
               "draft_window"},
}


def prepare_generation(target, draft, input_ids, *, method: str = DEFAULTS.method, generation_config=None,
                       **kwargs) -> GenerationPlan:
    """Check the method and resolve the keywords into a :class:`GenerationPlan`, before any model runs.

    Raises ``ValueError`` (an :class:`UnsupportedGeneration` for a keyword our
    loops cannot serve), naming the keyword and what is allowed.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; allowed: {', '.join(METHODS)}")
    if method != "ar" and draft is None:
        raise ValueError(f"method {method!r} needs a drafter (draft=DFlashDraftModel)")
    plan = resolve_generation(target, input_ids, generation_config, **kwargs)
    for name, value in plan.loop_kwargs.items():
        if name not in _METHOD_KEYWORDS[method] and value is not None:
            allowed = ", ".join(sorted(_METHOD_KEYWORDS[method]))
            raise UnsupportedGeneration(name, f"{name} does not apply to method {method!r} (its own keywords: "
                                              f"{allowed})")
    check_draft_window(plan.loop_kwargs.get("draft_window"), method)  # before any model runs
    return plan


def run_generation(target, draft, input_ids, plan: GenerationPlan, *, method: str = DEFAULTS.method,
                   compile=DEFAULTS.compile, max_cache_len=DEFAULTS.max_cache_len) -> GenerationResult:
    """Run ``method``'s loop with a resolved plan (see :func:`prepare_generation`).

    ``compile``: False (the round's steps called eagerly: the default), True
    (the same steps compiled, CUDA graphs on CUDA: :mod:`dflash.decoding.compiled`)
    or ``"static"`` (the pooled compiled round's steps called eagerly). ``max_cache_len``: what a new compiled
    round reserves (:func:`~dflash.decoding.compiled.reserved_rows`).
    """
    options = LoopOptions(max_new_tokens=plan.max_new_tokens, sampling=plan.sampling,
                          stop_token_ids=plan.stop_token_ids, stopping_criteria=plan.stopping_criteria,
                          streamer=plan.streamer, attention_mask=plan.attention_mask, pad_token_id=plan.pad_token_id,
                          prefill_chunk_size=plan.prefill_chunk_size,
                          **{k: v for k, v in plan.loop_kwargs.items() if k in _METHOD_KEYWORDS[method]})
    return generate_rounds(target, draft, input_ids, method, options, compile=compile,
                           max_cache_len=check_max_cache_len(max_cache_len))


def generate(target, draft=None, input_ids=None, *, method: str = DEFAULTS.method, generation_config=None,
             compile=DEFAULTS.compile, max_cache_len=DEFAULTS.max_cache_len, **kwargs) -> GenerationResult:
    """Generate with ``method`` in ``"ar"``, ``"dflash"``, ``"ddtree"``; returns a :class:`GenerationResult`.

    Every option left unset takes its default from :data:`~dflash.decoding.options.DEFAULTS`, the same for
    :func:`dflash.apply` and :func:`dflash.stream` (:class:`~dflash.decoding.options.GenerationDefaults`
    says what each is and why).

    ``target``: a HF causal LM (Qwen3, Llama, ...), also as a user holds it: a peft ``PeftModel``, a
    ``torch.compile``-d model, a torchao / bitsandbytes quantized model (``result.head_path`` says how its
    lm_head ran; README "Targets as you hold them"); ``draft``: a
    :class:`dflash.DFlashDraftModel` (unused by ``ar``); ``input_ids``:
    ``[T]``, ``[1, T]``, or a batch ``[b, T]`` padded on the left with its
    ``attention_mask [b, T]`` (as ``tokenizer(prompts, padding=True,
    padding_side="left")`` gives; right padding is refused): each row is
    generated as ``generate()`` generates it alone, its committed count its
    own each round, and ``result.output_ids [b, T + n]`` is the input then
    each row's new tokens, padded after a row's end with ``pad_token_id``
    (else the eos id), as transformers pads; ``result.rows`` holds each row's
    own result.

    Keywords are transformers' generate keywords, resolved exactly as
    ``target.generate()`` resolves them (defaults from
    ``target.generation_config``, then transformers' global defaults):
    ``generation_config``, ``max_new_tokens`` / ``max_length`` (default: 20 new
    tokens), ``do_sample`` (False: greedy whatever the temperature),
    ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``eos_token_id`` (int or
    list: stop right after one), ``pad_token_id``, ``stopping_criteria``,
    ``streamer``; plus our own ``stop_token_ids``, ``seed`` (reproducible
    samples), ``block_size``, ``tree_budget`` (an int, default ``2 * (B - 1)``, or ``"auto"``: chosen
    each round among 4 to 64 nodes from this device's measured costs and the
    acceptance seen), ``mask_token_id``,
    ``return_trees``, ``stage_timing``, ``acceptance`` (how a sampled DFlash
    chain accepts drafts: ``"rejection"``, the default, or ``"match"``;
    DDTree walks its tree, ``"match"`` only), ``draft_window`` (None, the default: off; an int ``W >= 1``:
    the drafter attends only to the last ``W`` context rows before its block, the target's features of the
    ``W`` committed positions before it, plus the block, each drafter layer's own sliding window still
    applying on top; dflash and ddtree only; the output stays the target's, only acceptance changes;
    :meth:`dflash.drafter.model.DraftLayer.round_window`). A ``temperature > 0`` given with no
    ``do_sample`` anywhere samples at that temperature (this package's
    convention before the transformers semantics). Anything our loops cannot
    serve (``num_beams > 1``, ``repetition_penalty != 1``, logits processors,
    ...) raises a ``ValueError`` naming it; nothing is silently ignored.

    Greedy output is exactly the target's own greedy decoding; sampled output
    has the distribution of ``target.generate(do_sample=True)`` with the same
    settings.

    ``compile=True`` runs the same round steps compiled
    (``torch.compile(fullgraph=True)``; captured as CUDA graphs on CUDA), set
    up before the clock starts (``result.compile_time``); the same tokens as
    eager for the same ``seed``, greedy or sampled (up to near-ties of the
    compiled arithmetic). Compiled rounds are pooled on the target and reused
    by every later call with the same settings whose prompt + new tokens fit
    their caches; a new round's caches hold the next power of two of rows
    (at least 256) for both sides, or with ``max_cache_len=N`` the rows of
    ``N`` tokens if more (``"auto"``, the default: on CUDA the target's
    ``max_position_embeddings``, capped by a quarter of the free memory;
    None: nothing reserved beyond the call's rows), so
    a growing sequence of calls compiles once. Eager rounds ignore it.
    Targets that cannot be traced raise
    :class:`~dflash.decoding.compiled.CompileUnsupported`.
    """
    plan = prepare_generation(target, draft, input_ids, method=method, generation_config=generation_config, **kwargs)
    return run_generation(target, draft, input_ids, plan, method=method, compile=compile,
                          max_cache_len=max_cache_len)
