"""The prefill of a round's prompts: ``b`` prompts into one target cache of ``b`` sequences.

:func:`prefill` is the one entry: it writes every sequence's prompt rows into
its rows of the cache, commits them, hands each sequence's captured features
to ``ingest`` (the drafter's context), and returns the pre-norm hidden state
of each prompt's last row ``[b, H]`` (the round chooses the first tokens from
it). Two ways, by what the cache allows:

* **row by row** (one sequence, or a hybrid target): each prompt on its own
  rows (:meth:`KVBuffer.row`), exactly as one sequence's prefill
  (:meth:`TargetAdapter.prefill`: the first pass causal SDPA as
  ``generate()`` runs its prompt, then causal chunks). A hybrid target's batch
  takes this way too: causality keeps a pad row out of every real row's
  attention, but a linear-attention layer's recurrence would run the pad rows
  of a shorter prompt into that sequence's state (and the in-place chunk
  forward cannot be committed partially).
* **padded passes** (a batch of attention-only targets): the prompts in the
  same causal round passes, each from position 0, padded on the right to the
  longest (``[b, P_max]``; a pad row comes after every real one, so causality
  keeps it out of every real row), in chunks of ``chunk_size``, else
  :data:`~dflash.target.adapter.PREFILL_CHUNK`, else :data:`BATCH_PREFILL_CHUNK`
  rows (each pass builds a ``[b, T, S]`` visibility: chunks bound it). Each
  pass runs over the frozen cache (every sequence at its own length); each
  sequence keeps its real rows only (``length += min(P_r - start, chunk)``).
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch

from . import adapter as _adapter

__all__ = ["BATCH_PREFILL_CHUNK", "prefill"]

#: Rows per padded prefill pass of a batch (one sequence prefills its whole prompt in one pass): each pass
#: builds a ``[b, T, S]`` visibility over the longest prompt, which chunks of this many rows bound.
BATCH_PREFILL_CHUNK = 2048

#: ``ingest(r, features)``: sequence ``r``'s captured features ``[n, n_layers * H]`` of its next ``n`` prompt rows
Ingest = Callable[[int, torch.Tensor], None]


def prefill(adapter, cache, prompts: List[torch.Tensor], chunk_size: Optional[int] = None,
            ingest: Optional[Ingest] = None) -> torch.Tensor:
    """Prefill ``prompts`` (``b`` int64 tensors ``[P_r]``, ``b`` = the cache's sequences) into ``cache`` (empty,
    eager) and commit them; ``ingest`` gets each sequence's captured features in order (None: not wanted).
    Returns the last prompt row's pre-norm hidden state per sequence, ``[b, H]``. ``chunk_size``: rows per
    pass (a generation's ``prefill_chunk_size``; None: the defaults of the module docstring)."""
    if len(prompts) == 1 or getattr(cache, "linear", None) is not None:
        return _row_by_row(adapter, cache, prompts, chunk_size, ingest)
    return _padded(adapter, cache, prompts, chunk_size, ingest)


def _row_by_row(adapter, cache, prompts, chunk_size, ingest) -> torch.Tensor:
    """Each prompt on its own rows (:meth:`TargetAdapter.prefill` over :meth:`KVBuffer.row`); the cache then
    adopts the rows' lengths."""
    rows = [cache.row(r) for r in range(len(prompts))]
    last_hidden = torch.zeros(len(prompts), adapter.hidden_size, dtype=adapter.dtype, device=adapter.device)
    for r, prompt in enumerate(prompts):
        hidden, features = adapter.prefill(prompt, rows[r], chunk_size=chunk_size)
        last_hidden[r].copy_(hidden[0])
        if ingest is not None:
            ingest(r, features)
    cache.take_lengths(rows)
    return last_hidden


def _padded(adapter, cache, prompts, chunk_size, ingest) -> torch.Tensor:
    """The prompts in the same padded causal round passes (module docstring)."""
    chunk = chunk_size if chunk_size is not None else _adapter.PREFILL_CHUNK
    chunk = BATCH_PREFILL_CHUNK if chunk is None else int(chunk)
    device, b = adapter.device, len(prompts)
    lengths = [int(p.numel()) for p in prompts]
    width = max(lengths)
    ids = torch.zeros(b, width, dtype=torch.long, device=device)
    for r, p in enumerate(prompts):
        ids[r, : lengths[r]] = p
    counts = torch.tensor(lengths, dtype=torch.long, device=device)
    last_hidden = torch.zeros(b, adapter.hidden_size, dtype=adapter.dtype, device=device)
    cache.length_t.zero_()
    cache.freeze()
    columns = torch.arange(width, device=device)
    for start in range(0, width, chunk):
        end = min(width, start + chunk)
        hidden, captured = adapter.run_pass(ids[:, start:end], columns[start:end].expand(b, -1), cache)
        kept = (counts - start).clamp(min=0, max=end - start)  # each sequence's real rows in this chunk
        cache.advance(None, kept)
        cache.mirror([min(max(n - start, 0), end - start) + done for n, done in zip(lengths, cache.lengths)])
        ends = [n - 1 - start for n in lengths]
        for r in range(b):
            if 0 <= ends[r] < end - start:
                last_hidden[r].copy_(hidden[r, ends[r]])
        if ingest is not None:
            features = torch.cat(captured, dim=-1)  # [b, T, n*H]
            for r in range(b):
                real = min(max(lengths[r] - start, 0), end - start)
                if real:
                    ingest(r, features[r, :real])
    cache.static = False
    return last_hidden
