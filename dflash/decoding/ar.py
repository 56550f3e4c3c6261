"""Plain autoregressive decoding with the same cache and ops: the speedup baseline.

One step: the target runs on the last token at position ``n - 1``; its choice
is the next token. The token stays on the device between steps; the one host
read per step brings it back for the stop / length checks.
"""

from __future__ import annotations

import time

import torch

from ..target import TargetAdapter
from .result import GenerationResult
from .speculation import (HostReader, SeedSource, StageClock, _check_common, _Output, _prepare_prompt, as_sampling,
                          choose_tokens, prefill)


@torch.inference_mode()
def ar_generate(target, input_ids, *, max_new_tokens, temperature=0.0, stop_token_ids=None, seed=None,
                stage_timing=True, sampling=None, stopping_criteria=None, streamer=None) -> GenerationResult:
    """Plain autoregressive decoding (``acceptance_lengths`` all 1; verify time = decode time).

    ``sampling`` replaces ``temperature`` when given; ``stopping_criteria`` and
    ``streamer`` as in :func:`~dflash.decoding.chain.dflash_generate` (one
    token per put).
    """
    sampling = as_sampling(sampling, temperature)
    stop_ids = _check_common(max_new_tokens, sampling.temperature, stop_token_ids)
    adapter = TargetAdapter(target)
    out = None
    try:
        device = adapter.device
        prompt = _prepare_prompt(input_ids, adapter.vocab_size, device)
        seeds = SeedSource(seed)
        cache = adapter.new_cache(prompt.numel() + max_new_tokens + 1)
        out = _Output(prompt, max_new_tokens, stop_ids, stopping_criteria=stopping_criteria, streamer=streamer)
        result = GenerationResult(output_ids=prompt[None], num_prompt_tokens=prompt.numel(), method="ar")
        reader = HostReader(device, 1)
        start = time.perf_counter()
        token, _ = prefill(adapter, prompt, cache, sampling, seeds)
        out.extend(reader.read(token))
        result.time_to_first_token = time.perf_counter() - start
        clock = StageClock(device, stage_timing)
        while not out.done:
            n = out.committed
            hidden = adapter.forward(token, torch.arange(n - 1, n, device=device), cache)
            cache.commit(1)
            token = choose_tokens(adapter, hidden, sampling, seeds.next())
            out.extend(reader.read(token))
            result.acceptance_lengths.append(1)
            clock.mark("verify")
        result.total_time = time.perf_counter() - start
        result.verify_time = clock.totals().get("verify", 0.0)
        result.output_ids = torch.tensor([out.tokens], device=device)
        return result
    finally:
        try:
            if out is not None:
                out.close()
        finally:
            adapter.close()
