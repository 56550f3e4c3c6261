"""Compile, before timing, every kernel variant a generation will launch.

On a GPU each Triton kernel compiles once per specialization key (constexprs,
launch options, which int arguments are 1 or divisible by 16). The kernels
keep every round-varying int out of the key (``do_not_specialize``) and pick
tiles from fixed tables, so the variants a generation needs are fixed by its
settings: :func:`warmup` launches each of them once.

1. a short generation with the same method, block size, budget and sampling
   mode on a synthetic prompt: the prefill, the draft pass (lm_head argmax or
   top-K), the verify pass (attention, lm_head argmax or sampling), the tree
   build, ancestor bits, walk and compaction, the gathers;
2. the attention kernel at every token count ``T`` a pass of these settings
   can have, unsplit and split over the key axis (the split count grows with
   the prefix, so a short generation alone would not reach it).

Which token counts. The attention launcher picks its tile (``BLOCK_M`` and
the rest of the config) from the packed row count ``T * G`` (``G`` query
heads per kv head), and the output's head stride ``T * D`` is a specialized
int; so two counts that agree on both need one binary. The fixed-size passes
are one count each: the AR step (1), the DFlash verify and the drafter's block
(``B``), the DDTree verify (``N + 1`` with ``N = tree_size(B - 1, K, budget)``,
``K = min(budget, vocab)``, a DFlash2 drafter's selector top-k: fewer than
``budget`` nodes when ``D`` levels of ``K`` cannot fill the budget). The prefill is not: a prompt of ``P`` tokens runs
one pass of ``P`` rows (or, with ``PREFILL_CHUNK`` set, passes of that many rows and a last one of the
rest), anything from 1 row up. Layers with a window, softcap or sinks run the kernel on the first
chunk too (``min(P, PREFILL_CHUNK)`` rows), plain layers only on the chunks
after it (SDPA runs the first). :func:`attention_row_counts` gives one count
per distinct variant in such a range, and each is launched.

Not covered: a cache whose key / value head stride ``max_len * D`` is not a
multiple of 16 (only head dims that are not) specializes on the cache length.
"""

from __future__ import annotations

import functools
from typing import Iterable, List, Optional, Tuple

import torch

import dflash_kernels
from dflash_kernels.tree_attention import tree_attention_config

from ..target import TargetAdapter, decoder_parts
from ..target.head import head_shape
from ..target import adapter as _adapter_module
from ..target.attention import KERNEL_MAX_HEAD_DIM
from ..target.families import config_value
from .generate import generate
from .options import DEFAULTS, check_tree_budget, default_tree_budget
from .round import tree_branching


def _row_key(T: int, group: int, head_dim: int, dtype: torch.dtype) -> tuple:
    """The part of an attention launch's compile key that depends on its token count ``T``.

    The config the launcher picks for ``T * group`` packed rows, and how the
    runtime specializes the output's head stride ``T * head_dim`` (the output
    is a fresh ``[Hq, T, D]`` tensor): equal to 1, a multiple of 16, or
    neither. Every other int the kernel is given is either fixed by the model
    and cache or kept out of the key (``do_not_specialize``).
    """
    cfg = tree_attention_config(head_dim, dtype, T * group)
    stride = T * head_dim
    return tuple(sorted(cfg.items())), stride == 1, stride % 16 == 0


@functools.lru_cache(maxsize=None)
def _kernel_geometries(adapter) -> List[tuple]:
    """The distinct ``(Hkv, D)`` of the target's layers the attention kernel runs: the config's one, or each
    per-layer geometry whose keys and values share a head dim within the kernel's (the others take the torch path:
    :data:`dflash.target.attention.KERNEL_MAX_HEAD_DIM`)."""
    geometry = getattr(getattr(adapter, "spec", None), "kv_geometry", None)
    if geometry is None:
        cfg = adapter.config
        head_dim = config_value(cfg, "head_dim") or cfg.hidden_size // cfg.num_attention_heads
        return [(config_value(cfg, "num_key_value_heads") or cfg.num_attention_heads, head_dim)]
    return sorted({(h, dk) for h, dk, dv in geometry if dk == dv <= KERNEL_MAX_HEAD_DIM})


def attention_row_counts(first: int, last: int, group: int, head_dim: int, dtype: torch.dtype) -> Tuple[int, ...]:
    """One token count per distinct attention variant among ``T`` in ``[first, last]`` (the smallest of each).

    A pass of any ``T`` in the range launches the binary of the count
    returned for its variant (same config, same stride specialization).
    """
    seen = {}
    for T in range(max(1, first), last + 1):
        seen.setdefault(_row_key(T, group, head_dim, dtype), T)
    return tuple(sorted(seen.values()))


def _warm_attention(hq, hkv, d, dtype, device, rows: Iterable[int], bits_for, variants, scale):
    """``variants``: the distinct ``(window, softcap, sinks)`` of the layers (sinks a ``[Hq]`` tensor or None)."""
    prefix = 64  # any length: prefix lengths are not part of the key
    for T in rows:
        # The models' layout: a projection viewed as [T, H, D], heads moved first (not copied).
        q = torch.zeros(T, hq, d, dtype=dtype, device=device).transpose(0, 1)[None]
        kv = torch.zeros(1, hkv, prefix + T, d, dtype=dtype, device=device)
        positions = torch.arange(prefix, prefix + T, device=device)
        for window, softcap, sinks in variants:
            dflash_kernels.warmup_tree_attention(q, kv, kv, bits_for(T), prefix, scale=scale,
                                                 positions=positions if window else None, window=window,
                                                 softcap=softcap, sinks=sinks)


def _layer_variants(windows, softcaps=(), sinks=()):
    """One representative per distinct (window, softcap, has-sinks) over the layers: what picks a kernel variant."""
    seen = {}
    for i, window in enumerate(windows):
        softcap = softcaps[i] if softcaps else None
        sink = sinks[i] if sinks else None
        seen.setdefault((window, softcap, sink is not None), (window, softcap, sink))
    return list(seen.values())


def _sdpa_first_chunk(variant) -> bool:
    """A layer without window, softcap or sinks runs a prompt's first chunk on SDPA, not on the kernel."""
    window, softcap, sinks = variant
    return window is None and softcap is None and sinks is None


def prefill_row_ranges(max_prompt_len: int, chunk: int) -> Tuple[int, int]:
    """``(first, later)``: the most rows of a first prefill pass (prefix 0), and of a later one (0: none).

    A prompt of ``P <= max_prompt_len`` tokens runs a first pass of
    ``min(P, chunk)`` rows, then passes of ``chunk`` rows and a last one of
    the rest (1 .. ``chunk`` rows), the later ones only when ``P > chunk``.
    """
    first = max(0, min(max_prompt_len, chunk))
    later = chunk if max_prompt_len > chunk else 0
    return first, later


def tree_rows(block_size: int, tree_budget: int, vocab: int, draft=None) -> int:
    """Tokens of a DDTree verify pass: the root and ``tree_size(B - 1, K, budget)`` nodes, ``K =
    min(budget, vocab)`` (a DFlash2 ``draft``: its selector's top-k; :func:`~dflash.decoding.round.tree_branching`)."""
    return dflash_kernels.tree_size(block_size - 1, tree_branching(draft, tree_budget, vocab), tree_budget) + 1


def verify_tree_rows(block_size: int, tree_budget, vocab: int, draft=None) -> List[int]:
    """The token counts of every DDTree verify pass of these settings: one (:func:`tree_rows`), or, for a budget
    chosen per round (``"auto"`` or a list), one per bucket, whose trees branch as the largest's."""
    budget = check_tree_budget(tree_budget if tree_budget is not None else default_tree_budget(block_size))
    if isinstance(budget, int):
        return [tree_rows(block_size, budget, vocab, draft)]
    k = tree_branching(draft, budget[-1], vocab)
    return sorted({dflash_kernels.tree_size(block_size - 1, k, b) + 1 for b in budget})


@torch.inference_mode()
def warmup(target, draft=None, *, method: str = DEFAULTS.method, block_size: Optional[int] = DEFAULTS.block_size,
           tree_budget=DEFAULTS.tree_budget, temperature: float = 0.0, max_prompt_len: int = 2048,
           draft_window: Optional[int] = DEFAULTS.draft_window) -> None:
    """Launch every kernel variant ``generate(target, draft, method=..., ...)`` with these settings uses.

    ``draft_window``: the generations' drafter window (a window is a variant of the drafter's attention).

    ``max_prompt_len``: the longest prompt to expect; every prompt up to it
    (any length, so any short last prefill chunk) launches only warmed
    variants.
    """
    lm_head = decoder_parts(target)[3]  # found through the wrappers the target may wear
    vocab = head_shape(lm_head)[0]
    device = lm_head.weight.device
    B = int(block_size if block_size is not None else (draft.block_size if draft is not None else 2))
    prompt = (torch.arange(2 * B + 3, device=device) * 7 + 1) % max(1, vocab - 1)
    kw = dict(method=method, max_new_tokens=3 * B, temperature=temperature, seed=0)
    if method != "ar":
        kw["block_size"] = B
    if method == "ddtree":
        kw["tree_budget"] = tree_budget
    if draft_window is not None:
        kw["draft_window"] = draft_window
    generate(target, draft, prompt, **kw)
    if dflash_kernels.get_backend(device) != "triton":
        return
    chunk = _adapter_module.PREFILL_CHUNK  # read now: the adapter's prefill reads it per call
    chunk = int(max_prompt_len) if chunk is None else int(chunk)  # None: one pass of the whole prompt
    first_rows, later_rows = prefill_row_ranges(int(max_prompt_len), chunk)
    with TargetAdapter(target) as adapter:
        cfg = adapter.config
        hq = cfg.num_attention_heads
        dtype = adapter.dtype
        spec = getattr(adapter, "spec", None)
        variants = _layer_variants(adapter.windows, getattr(spec, "attn_softcaps", ()) or (),
                                   getattr(spec, "sinks", ()) or ())
        for hkv, head_dim in _kernel_geometries(adapter):
            group, scale = hq // hkv, head_dim ** -0.5

            def counts(last: int, group=group, head_dim=head_dim) -> List[int]:
                return list(attention_row_counts(1, last, group, head_dim, dtype)) if last > 0 else []

            # Chain passes (bits None): the decode step of AR / DFlash, and the prefill chunks.
            decode = {"ar": [1], "dflash": [B]}.get(method, [])
            kernel_first = [v for v in variants if not _sdpa_first_chunk(v)]
            plan = [(variants, sorted(set(decode) | set(counts(later_rows))))]
            if kernel_first:
                plan.append((kernel_first, [T for T in counts(first_rows) if T not in plan[0][1]]))
            for layer_variants, rows in plan:
                _warm_attention(hq, hkv, head_dim, dtype, device, rows, lambda T: None, layer_variants, scale)
            if method == "ddtree":
                tree_bits = lambda T: torch.full((T, (T + 31) // 32), -1, dtype=torch.int32, device=device)  # noqa: E731
                tree_counts = verify_tree_rows(B, tree_budget, adapter.vocab_size, draft)
                _warm_attention(hq, hkv, head_dim, dtype, device, tree_counts, tree_bits, variants, scale)
    if draft is not None and method != "ar":
        dc = draft.config
        draft_variants = _layer_variants([layer.sliding_window if draft_window is None else
                                          layer.round_window(torch.zeros(1, B, dtype=torch.long), B, draft_window)[0]
                                          for layer in draft.layers])
        _warm_attention(dc.num_attention_heads, dc.num_key_value_heads, dc.head_dim, draft.fc.weight.dtype, device,
                        [B], lambda T: torch.full((T, (T + 31) // 32), -1, dtype=torch.int32, device=device),
                        draft_variants, dc.head_dim ** -0.5)
