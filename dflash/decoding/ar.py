"""Plain autoregressive decoding with the same cache and ops: the speedup baseline."""

from __future__ import annotations

import time

import torch

from ..target import TargetAdapter
from .result import GenerationResult
from .speculation import _Clock, _check_common, _generator, _Output, _prefill, _prepare_prompt


@torch.inference_mode()
def ar_generate(target, input_ids, *, max_new_tokens, temperature=0.0, stop_token_ids=None, seed=None,
                stage_timing=True) -> GenerationResult:
    """Plain autoregressive decoding with the same cache and ops (the speedup baseline)."""
    stop_ids = _check_common(max_new_tokens, temperature, stop_token_ids)
    adapter = TargetAdapter(target)
    try:
        prompt = _prepare_prompt(input_ids, adapter.vocab_size, adapter.device)
        gen = _generator(seed, adapter.device)
        cache = adapter.new_cache(prompt.numel() + max_new_tokens + 1)
        out = _Output(prompt, max_new_tokens, stop_ids)
        result = GenerationResult(output_ids=prompt[None], num_prompt_tokens=prompt.numel(), method="ar")
        clock = _Clock(adapter.device, stage_timing)
        start = clock.t
        token = _prefill(adapter, prompt, cache, temperature, gen)
        out.extend(token.tolist())
        result.time_to_first_token = clock.lap()
        while not out.done:
            pos = torch.tensor([out.committed - 1], device=adapter.device)
            hidden = adapter.forward(token, pos, cache)
            cache.commit(1)
            token = adapter.choose(hidden, temperature, generator=gen)
            out.extend(token.tolist())
            result.acceptance_lengths.append(1)
        result.verify_time = clock.lap()
        result.total_time = time.perf_counter() - start
        result.output_ids = torch.tensor([out.tokens], device=adapter.device)
        return result
    finally:
        adapter.close()
