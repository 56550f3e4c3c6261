"""The transformers drop-in: ``dflash.apply(target, draft)`` makes ``target.generate(...)`` speculative.

After ``dflash.apply(target, draft)`` (or ``dflash.apply(target, draft, method="ddtree", tree_budget=64)``) an
unchanged ``target.generate(**inputs, max_new_tokens=..., do_sample=...,
streamer=..., return_dict_in_generate=...)`` runs our loop, with the keywords
resolved exactly as transformers resolves them
(:mod:`dflash.decoding.generation_config`), and returns what transformers
returns: the ``LongTensor`` of sequences ``[b, prompt + new]`` (a batch left-padded
by ``tokenizer(prompts, padding=True, padding_side="left")``: each row as its
prompt alone would give, finished rows padded with ``pad_token_id``), or with
``return_dict_in_generate=True`` a ``GenerateDecoderOnlyOutput`` whose
``sequences`` is that tensor (scores, logits, attentions, hidden states and
the cache are None: requests for them fall back, below).

- **Fallback**: a call our loop cannot serve (right padding, beams, logits processors, output_scores / logits /
  attentions / hidden states, any refused keyword) runs transformers' own ``generate`` unchanged,
  with a warning the first time each reason occurs on that target: never a
  wrong answer.
- **assistant_model**: ``target.generate(assistant_model=draft)`` with our
  :class:`~dflash.drafter.model.DFlashDraftModel` runs our loop (the default method, ``dflash``, or the
  drafting method given to ``apply``); any other assistant model goes
  to transformers' assisted generation. This needs ``apply`` (``draft`` may be
  None then: calls without an assistant go to transformers).
- **Sampling seeds**: drawn from torch's global generator, so
  ``torch.manual_seed(s)`` before the call reproduces a sampled output, as
  with transformers (the stream of samples differs from transformers' own).

- **Compiled rounds**: ``apply(target, draft, compile=True)`` runs the rounds as
  :func:`dflash.generate` does with ``compile=True`` (``torch.compile`` of the
  round's two steps, captured as CUDA graphs on CUDA; inductor on the CPU): the
  same tokens as eager, and on a GPU several times the tokens/s of the
  launch-bound eager round. Recommended on GPUs. A compiled round serves every
  later call with the same settings that fits its caches; on CUDA the first
  call reserves the target's ``max_position_embeddings`` (capped by a quarter
  of the free memory: ``apply(..., max_cache_len=)``), so a growing chat
  compiles once.
- **Set-up**: what a call spends before its clock starts (compiling and
  capturing a round for new settings or for a call its caches cannot hold, and with
  ``method="ddtree", tree_budget="auto"`` measuring the budgets' costs, once per target, drafter,
  dtypes, device, sampling mode and batch-size bucket, reused at every prompt
  length: :func:`~dflash.decoding.bucket_costs.costs_key`) is never in the call's
  tokens/s. The handle reports it: ``handle.last_setup_seconds`` (the last call
  our loop ran; 0.0 when everything was reused), ``handle.setup_seconds`` (summed
  over the calls) and ``handle.last_result``, the
  :class:`~dflash.decoding.result.GenerationResult` of that call (rounds,
  ``tau``, ``total_time``, ``compile_time``, per-row results of a batch); None
  after a call that went to transformers.

Implemented as a patch of the instance's ``generate`` held in the target
side's registry (:mod:`dflash.target.patches`; the class is never touched):
:func:`unapply` releases it, which restores the instance exactly as it was (its
own ``generate`` attribute if it had one, else none, so the class's method
shows through again). Applying again releases the old patch and holds a new
one. ``apply`` returns a handle usable as a ``with`` block.

A wrapped target is patched on the object the user holds, the one whose ``generate`` they call: a
``torch.compile(model)`` (``compiled.generate`` would otherwise be forwarded to the model's), a peft
``PeftModel`` (its ``generate`` would otherwise reach the base model's through peft's own); calls are bound
to the transformers ``generate`` inside, and a fallback runs the wrapper's own ``generate``.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Optional

import torch

from ..drafter.model import DFlashDraftModel
from ..target import TargetAdapter
from ..target.patches import Patch, hold
from ..target.wrappers import unwrap_target
from .compiled import check_max_cache_len
from .generate import METHODS, prepare_generation, run_generation
from .generation_config import UnsupportedGeneration
from .options import DEFAULTS, check_acceptance, check_draft_window, check_pair, check_tree_budget

_STATE = "_dflash_dropin"


class DropIn:
    """The state of one ``apply``: the settings and the held ``generate`` patch; a context manager."""

    def __init__(self, target, draft, method: str, method_given: bool, loop_kwargs: dict, compile=False,
                 max_cache_len=None):
        self.target = target
        self.draft = draft
        self.method = method
        self.method_given = method_given
        self.loop_kwargs = loop_kwargs
        #: what runs the rounds: False (eager) or True (compiled; ``dflash.generate``'s ``compile=``)
        self.compile = compile
        #: what a new compiled round reserves (:func:`~dflash.decoding.compiled.reserved_rows`)
        self.max_cache_len = max_cache_len
        self.warned = set()
        self.held = None  # the patches held while applied (target.generate and the state attribute)
        #: the result of the last call our loop ran (None before any, and after a call that went to transformers)
        self.last_result = None
        #: that call's set-up seconds (compile / capture, the auto budget's cost measurement; 0.0 when reused)
        self.last_setup_seconds = 0.0
        #: the set-up seconds of every call our loop ran, summed
        self.setup_seconds = 0.0

    def wrap_generate(self, target, original):
        """The ``generate`` set on ``target`` while applied; ``original`` is the one calls reached before."""

        @functools.wraps(_transformers_generate(target))
        def generate(*args, **kwargs):
            return _dropin_generate(self, original, args, kwargs)

        return generate

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        unapply(self.target)

    def __repr__(self):
        return (f"DropIn(method={self.method!r}, draft={type(self.draft).__name__ if self.draft else None}, "
                f"compile={self.compile!r}, max_cache_len={self.max_cache_len!r})")


def _transformers_generate(target):
    """The transformers ``generate`` function behind ``target.generate`` (its keywords are what calls bind to):
    the class's own, or for a wrapped model (``torch.compile``'s ``OptimizedModule``, whose class has none and
    forwards the attribute; peft's ``PeftModel``, whose own takes ``*args, **kwargs``) the wrapped model's."""
    return type(unwrap_target(target)).generate


def is_applied(target) -> bool:
    return isinstance(target.__dict__.get(_STATE), DropIn)


def apply(target, draft=None, *, method: Optional[str] = None, tree_budget=DEFAULTS.tree_budget,
          block_size=DEFAULTS.block_size, mask_token_id=DEFAULTS.mask_token_id,
          stage_timing: bool = DEFAULTS.stage_timing, acceptance: Optional[str] = DEFAULTS.acceptance,
          compile=DEFAULTS.compile, max_cache_len=DEFAULTS.max_cache_len,
          draft_window: Optional[int] = DEFAULTS.draft_window) -> DropIn:
    """Make ``target.generate(...)`` run our loop (see the module docstring); returns a :class:`DropIn`.

    Every default is :data:`~dflash.decoding.options.DEFAULTS`'s, as for :func:`dflash.generate`.
    ``method``: None (with a drafter the default method, ``"dflash"``; with neither a drafter nor a method
    only ``assistant_model=<DFlashDraftModel>`` calls run our loop), ``"dflash"``, ``"ddtree"`` or
    ``"ar"`` (our plain decoding);
    ``tree_budget`` (ddtree; default ``2 * (B - 1)``; ``"auto"``: chosen each round from
    this device's measured costs, :mod:`dflash.decoding.budget_policy`), ``block_size``, ``mask_token_id``, ``acceptance``
    (sampled DFlash chains: ``"rejection"``, the default, or ``"match"``;
    ``"rejection"`` with ddtree is refused here), ``draft_window`` (None: off;
    an int ``W >= 1``: the drafter attends only to the last ``W`` context rows
    before its block; refused here with ``method="ar"``): as in
    :func:`dflash.generate`. ``compile``: False (eager rounds, the default) or
    True (compiled rounds, CUDA graphs on CUDA: as ``dflash.generate(...,
    compile=True)``; a target that cannot be traced raises
    :class:`~dflash.decoding.compiled.CompileUnsupported` at its first call).
    ``max_cache_len`` (compiled rounds only): the tokens (prompt + new) the
    first call's compiled round is sized for, so every later call that fits
    reuses it: ``"auto"`` (default) on CUDA the target's
    ``max_position_embeddings`` (the largest power of two of rows that fits
    where its two caches would take more than a quarter of the free GPU
    memory), none on the CPU (its reference
    attention runs over every cache row); an int; or None (each new round
    sized for its call, in powers of two: a growing chat compiles at most
    log2 of its growth). The set-up of each call is on the handle (``last_setup_seconds``, module
    docstring), never in its tokens/s. The drafter is checked against the
    target now (a mismatch raises ``DraftConfigError``). Applying again
    replaces the settings (``unapply`` still restores the original).
    """
    if method is not None and method not in METHODS:
        raise ValueError(f"unknown method {method!r}; allowed: {', '.join(METHODS)}")
    if not (isinstance(compile, bool) or compile in ("compile", "static")):  # "static": for tests (compiled.py)
        raise ValueError(f"compile must be False (eager rounds) or True (compiled rounds), got {compile!r}")
    check_max_cache_len(max_cache_len)
    if draft is not None and not isinstance(draft, DFlashDraftModel):
        raise TypeError(f"draft must be a DFlashDraftModel, got {type(draft).__name__}")
    chosen = method or (DEFAULTS.method if draft is not None else None)  # None: only assistant_model calls are ours
    if chosen != "ar" and draft is None and method is not None:
        raise ValueError(f"method {chosen!r} needs a drafter: apply(target, draft, ...)")
    if draft is not None:
        adapter = TargetAdapter(target, draft.target_layer_ids)
        try:
            check_pair(adapter, draft)
        finally:
            adapter.close()
    check_acceptance(acceptance, chosen or DEFAULTS.method)  # assistant_model calls run the default method
    check_draft_window(draft_window, chosen or DEFAULTS.method)
    loop_kwargs = dict(stage_timing=stage_timing)
    if draft_window is not None:
        loop_kwargs["draft_window"] = draft_window
    if acceptance is not None and chosen != "ar":
        loop_kwargs["acceptance"] = acceptance
    if block_size is not None:
        loop_kwargs["block_size"] = block_size
    if chosen == "ddtree":
        if tree_budget is not None:  # None: the loop's default, 2 * (B - 1)
            loop_kwargs["tree_budget"] = check_tree_budget(tree_budget)
        if mask_token_id is not None:
            loop_kwargs["mask_token_id"] = mask_token_id
    unapply(target)  # applying again replaces the settings: the original generate comes back first
    state = DropIn(target, draft, chosen, method is not None, loop_kwargs, compile=compile,
                   max_cache_len=max_cache_len)
    state.held = hold([Patch(target, "generate", wrap=state.wrap_generate, shadow=True, label="drop-in generate"),
                       Patch(target, _STATE, state, shadow=True, label="drop-in state")])
    return state


def unapply(target) -> None:
    """Undo :func:`apply`: ``target.generate`` is again exactly what it was before (no-op if not applied)."""
    state = target.__dict__.get(_STATE)
    if isinstance(state, DropIn):
        state.held.release()


def _warn_once(state: DropIn, key: str, reason: str) -> None:
    if key in state.warned:
        return
    state.warned.add(key)
    warnings.warn(f"dflash: this target.generate() call runs transformers' own generate ({reason})", UserWarning,
                  stacklevel=4)


def _torch_seed() -> int:
    return int(torch.randint(0, 2 ** 62, (1,)).item())


def _dropin_generate(state: DropIn, original, args, kwargs):
    target = state.target
    state.last_result, state.last_setup_seconds = None, 0.0  # until our loop has run this call
    try:
        bound = inspect.signature(_transformers_generate(target)).bind(target, *args, **kwargs)
    except TypeError:
        return original(*args, **kwargs)  # transformers says what is wrong
    call = dict(bound.arguments)
    call.pop("self", None)
    extra = dict(call.pop("kwargs", {}))
    inputs = call.pop("inputs", None)
    if inputs is None:
        inputs = extra.pop("input_ids", None)
    assistant = call.pop("assistant_model", None)
    generation_config = call.pop("generation_config", None)

    if assistant is not None:
        if not isinstance(assistant, DFlashDraftModel):
            return original(*args, **kwargs)  # transformers' assisted generation
        draft = assistant
        method = state.method if state.method_given and state.method != "ar" else DEFAULTS.method
        if state.draft is not assistant:
            adapter = TargetAdapter(target, draft.target_layer_ids)
            try:
                check_pair(adapter, draft)
            finally:
                adapter.close()
    elif state.method is None:
        return original(*args, **kwargs)
    else:
        draft, method = state.draft, state.method

    loop_kwargs = {k: v for k, v in state.loop_kwargs.items() if not (method != "ddtree" and k in
                                                                         ("tree_budget", "mask_token_id"))}
    request = {**loop_kwargs, **{k: v for k, v in call.items() if v is not None}, **extra}
    if inputs is None:
        _warn_once(state, "inputs", "no input_ids: our loop needs the prompt's token ids")
        return original(*args, **kwargs)
    try:
        plan = prepare_generation(target, draft, inputs, method=method, generation_config=generation_config,
                                  **request)
    except ValueError as exc:
        key = getattr(exc, "keyword", None) or str(exc)
        _warn_once(state, key, str(exc))
        return original(*args, **kwargs)
    if "seed" not in plan.loop_kwargs or plan.loop_kwargs["seed"] is None:
        plan.loop_kwargs["seed"] = None if plan.sampling.greedy else _torch_seed()
    try:
        result = run_generation(target, draft, inputs, plan, method=method, compile=state.compile,
                                max_cache_len=state.max_cache_len)
    except UnsupportedGeneration as exc:  # refused before any model runs (right padding, a streamer with a batch)
        _warn_once(state, exc.keyword or str(exc), str(exc))
        return original(*args, **kwargs)
    state.last_result = result
    state.last_setup_seconds = float(result.compile_time or 0.0)
    state.setup_seconds += state.last_setup_seconds
    sequences = result.output_ids.clone()  # a normal tensor (the loop's is an inference-mode tensor)
    if isinstance(inputs, torch.Tensor):
        sequences = sequences.to(inputs.device)
    if plan.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences
