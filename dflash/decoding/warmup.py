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
2. the attention kernel at the shapes of every target and drafter pass
   (``T`` = 1, ``B``, ``budget + 1``, a later prefill chunk), unsplit and
   split over the key axis (the split count grows with the prefix, so a short
   generation alone would not reach it).
"""

from __future__ import annotations

from typing import Optional

import torch

import dflash_kernels

from ..drafter.model import all_visible_bits
from ..target import PREFILL_CHUNK, TargetAdapter
from .generate import generate


def _attention_shapes(model_config, head_dim):
    hq = model_config.num_attention_heads
    hkv = getattr(model_config, "num_key_value_heads", None) or hq
    return hq, hkv, head_dim


def _warm_attention(hq, hkv, d, dtype, device, rows, bits_for, variants, scale):
    """``variants``: the distinct ``(window, softcap, sinks)`` of the layers (sinks a ``[Hq]`` tensor or None)."""
    prefix = 64  # any length: prefix lengths are not part of the key
    for T in rows:
        q = torch.zeros(1, hq, T, d, dtype=dtype, device=device)
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


@torch.inference_mode()
def warmup(target, draft=None, *, method: str = "dflash", block_size: Optional[int] = None,
           tree_budget: Optional[int] = None, temperature: float = 0.0, max_prompt_len: int = PREFILL_CHUNK) -> None:
    """Launch every kernel variant ``generate(target, draft, method=..., ...)`` with these settings uses.

    ``max_prompt_len``: the longest prompt to expect (a prompt past one
    prefill chunk runs the attention kernel on chunk-sized passes too).
    """
    vocab = target.lm_head.weight.shape[0]
    device = target.lm_head.weight.device
    B = int(block_size if block_size is not None else (draft.block_size if draft is not None else 2))
    prompt = (torch.arange(2 * B + 3, device=device) * 7 + 1) % max(1, vocab - 1)
    kw = dict(method=method, max_new_tokens=3 * B, temperature=temperature, seed=0)
    if method != "ar":
        kw["block_size"] = B
    if method == "ddtree":
        kw["tree_budget"] = tree_budget
    generate(target, draft, prompt, **kw)
    if dflash_kernels.get_backend(device) != "triton":
        return
    with TargetAdapter(target) as adapter:
        cfg = adapter.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        hq, hkv, d = _attention_shapes(cfg, head_dim)
        spec = getattr(adapter, "spec", None)
        variants = _layer_variants(adapter.windows, getattr(spec, "attn_softcaps", ()) or (),
                                   getattr(spec, "sinks", ()) or ())
        scale = head_dim ** -0.5
        budget = tree_budget if tree_budget is not None else 2 * (B - 1)
        rows = {1} if method == "ar" else ({B} if method == "dflash" else {budget + 1})
        if max_prompt_len > PREFILL_CHUNK:
            rows.add(PREFILL_CHUNK)
        chain_rows = rows - ({budget + 1} if method == "ddtree" else set())
        _warm_attention(hq, hkv, d, adapter.dtype, device, sorted(chain_rows), lambda T: None, variants, scale)
        if method == "ddtree":
            tree_bits = lambda T: torch.full((T, (T + 31) // 32), -1, dtype=torch.int32, device=device)  # noqa: E731
            _warm_attention(hq, hkv, d, adapter.dtype, device, [budget + 1], tree_bits, variants, scale)
    if draft is not None and method != "ar":
        dc = draft.config
        draft_variants = _layer_variants([layer.sliding_window for layer in draft.layers])
        _warm_attention(dc.num_attention_heads, dc.num_key_value_heads, dc.head_dim, draft.fc.weight.dtype, device,
                        [B], lambda T: all_visible_bits(T, device), draft_variants, dc.head_dim ** -0.5)
