"""The DFlash chain loop.

One DFlash round, with ``n`` committed tokens (the last one, at position
``n-1``, not yet in the target's cache):

1. draft:  the drafter reads the new context rows and the block
   ``[x[n-1], MASK x (B-1)]`` at positions ``n-1 .. n+B-2``; the target's
   lm_head + argmax at block positions 1..B-1 gives proposals ``d_1..d_{B-1}``;
2. verify: the target runs on ``[x[n-1], d_1 .. d_{B-1}]``; its choice after
   block position j is ``posterior[j]`` (argmax, or a sample at T > 0);
3. commit: ``a`` = length of the prefix with ``d_{j+1} == posterior[j]``;
   commit ``posterior[0..a]`` (the accepted drafts plus the bonus token),
   keep ``a + 1`` rows of the target cache, and the captured features of
   those rows become the next round's context.

Everything stays on the device until ONE host read per round: the target's
choices and the accepted count ``a`` (a pinned non-blocking copy on CUDA).
The next block's anchor ``posterior[a]`` never leaves the device; stage times
come from CUDA events (:class:`~dflash.decoding.speculation.StageClock`).
"""

from __future__ import annotations

import torch

import dflash_kernels

from .result import GenerationResult  # noqa: F401  (the loop's return type)
from .speculation import Speculation


@torch.inference_mode()
def dflash_generate(target, draft, input_ids, *, max_new_tokens, temperature=0.0, stop_token_ids=None,
                    block_size=None, seed=None, stage_timing=True, sampling=None, stopping_criteria=None,
                    streamer=None) -> GenerationResult:
    """DFlash speculative decoding (one chain of ``block_size - 1`` drafts per round).

    ``sampling`` (a :class:`~dflash.decoding.generation_config.SamplingSettings`)
    replaces ``temperature`` when given; ``stopping_criteria`` and ``streamer``
    as in :class:`~dflash.decoding.speculation._Output` (the streamer gets each
    round's committed tokens as the round commits them).
    """
    with Speculation(target, draft, input_ids, method="dflash", max_new_tokens=max_new_tokens,
                     temperature=temperature, stop_token_ids=stop_token_ids, block_size=block_size, seed=seed,
                     stage_timing=stage_timing, sampling=sampling, stopping_criteria=stopping_criteria,
                     streamer=streamer) as s:
        B, clock = s.B, s.clock
        block_offsets = torch.arange(B, device=s.device)
        s.prefill()
        while not s.out.done:
            n = s.out.committed
            # draft: B-1 proposals for positions n .. n+B-2
            proposals = dflash_kernels.lm_head_argmax(s.draft(), s.lm_head, positions=s.draft_rows,
                                                      check_bounds=False)
            clock.mark("draft")

            # verify: the block at positions n-1 .. n-1+B-1 (a causal chain after the committed prefix)
            block = torch.cat([s.last_token, proposals])
            hidden = s.adapter.forward(block, (n - 1) + block_offsets, s.cache)
            choices = s.choose(hidden)
            clock.mark("verify")

            # commit: longest matching prefix plus the bonus token; the round's one host read
            accepted = torch.cumprod((proposals == choices[:-1]).long(), 0).sum()
            host = s.reader.read(torch.cat([choices, accepted[None]]))
            a = host[B]
            s.cache.commit(a + 1)
            s.context = s.adapter.context_features(rows=block_offsets[: a + 1], trusted_rows=True)
            s.last_token = choices[a : a + 1]
            s.commit(host[: a + 1])
            clock.mark("commit")
        return s.finish()
