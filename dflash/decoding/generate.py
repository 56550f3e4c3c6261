"""``generate()``: one entry point for the AR baseline, the DFlash chain and the DDTree loop."""

from __future__ import annotations

from .ar import ar_generate
from .chain import dflash_generate
from .ddtree import ddtree_generate_result
from .result import GenerationResult

METHODS = ("ar", "dflash", "ddtree")


def generate(target, draft=None, input_ids=None, *, method: str = "dflash", max_new_tokens: int,
             temperature: float = 0.0, stop_token_ids=None, block_size=None, seed=None, tree_budget=None,
             **kwargs) -> GenerationResult:
    """Generate with ``method`` in ``"ar"``, ``"dflash"``, ``"ddtree"``.

    ``target``: a HF causal LM (Qwen3, Llama, ...); ``draft``: a
    :class:`dflash.DFlashDraftModel` (unused by ``ar``); ``input_ids``:
    ``[T]`` or ``[1, T]`` (batch 1). Temperature 0 is greedy and the output is
    exactly the target's own greedy decoding; at T > 0 the target samples
    (reproducible with ``seed``). Generation stops after ``max_new_tokens``
    new tokens or right after a token of ``stop_token_ids``.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; allowed: {', '.join(METHODS)}")
    if method == "ar":
        return ar_generate(target, input_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                           stop_token_ids=stop_token_ids, seed=seed, **kwargs)
    if draft is None:
        raise ValueError(f"method {method!r} needs a drafter (draft=DFlashDraftModel)")
    if method == "dflash":
        return dflash_generate(target, draft, input_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                               stop_token_ids=stop_token_ids, block_size=block_size, seed=seed, **kwargs)
    return ddtree_generate_result(target, draft, input_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                  stop_token_ids=stop_token_ids, block_size=block_size, seed=seed,
                                  tree_budget=tree_budget, **kwargs)


def spec_generate(draft, target, input_ids, max_new_tokens, stop_token_ids=None, temperature=0.0, **kwargs):
    """Drop-in DFlash generation: returns the output ids ``[1, prompt + new]``.

    Attached by the package root as ``DFlashDraftModel.spec_generate(target=, input_ids=, ...)`` (the
    reference implementation's call form; the drafter layer itself knows nothing of the loops). Same
    semantics as :func:`generate` with ``method="dflash"``; use that for the statistics.
    """
    result = generate(target, draft, input_ids, method="dflash", max_new_tokens=max_new_tokens,
                      temperature=temperature, stop_token_ids=stop_token_ids, **kwargs)
    return result.output_ids
