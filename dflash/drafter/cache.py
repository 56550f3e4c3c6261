"""The drafter's KV cache: context K/V persist across rounds, the block's K/V are scratch.

Storage and lengths as :class:`~dflash.cache.KVBuffer`. The prompt's context
rows are ingested eagerly (:meth:`DFlashDraftModel.ingest_context`, before
:meth:`freeze`); every round's drafter pass is a round pass
(:meth:`write_block`):

* it writes, for each sequence ``r`` of the batch, ``C`` new context rows (a
  fixed count, of which the first ``count[r]`` (device) are real) at rows
  ``[length_t[r], length_t[r] + C)``, then the ``B`` block rows at
  ``[length_t[r] + count[r], ... + B)`` (they overwrite the padding rows they
  meet);
* the block queries attend to rows ``[0, length_t[r] + count[r])`` (all
  context) and the ``B`` block rows, every one visible (the drafter is not
  causal); rows past ``length_t[r] + count[r] + B`` are stale and masked by
  the attention; with a drafter window (``draft_window=W``,
  :meth:`~dflash.drafter.model.DFlashDraftModel.draft_block`) only the last
  ``W`` context rows before the block are visible, by the attention's mask:
  the cache still holds every committed row (its memory is not bounded by
  ``W``), since rows are addressed by position and a later call may run
  without the window;
* :meth:`advance` adds ``count`` to ``length_t`` on the device.
"""

from __future__ import annotations

import torch

from ..cache import KVBuffer

__all__ = ["DraftKVCache"]


class DraftKVCache(KVBuffer):
    """The drafter's cache (see the module docstring; ``kv=``: caller storage)."""

    #: during a draft pass: ``(prefix [b], context rows [b, C], block rows [b, B])``, its writes' rows made once
    #: for every layer (:meth:`begin_block`); None between passes
    block_dests = None

    @staticmethod
    def kv_shape(config, max_len: int):
        """``(L, 2, Hkv, max_len, D)`` of a drafter cache of ``max_len`` rows."""
        return (config.num_hidden_layers, 2, config.num_key_value_heads, int(max_len), config.head_dim)

    def __init__(self, config, max_len: int, dtype, device, kv=None, batch: int = 1):
        layers, _, kv_heads, _, head_dim = self.kv_shape(config, max_len)
        super().__init__(layers, kv_heads, head_dim, max_len, dtype, device, kv=kv, batch=batch)
        self._block_bits = {}

    def block_bits(self, B: int, causal: bool = False, band=None) -> torch.Tensor:
        """``[B, ceil(B/32)]`` int32 block visibility: every bit set (each block query sees every block key),
        or with ``causal`` bit ``j'`` of row ``j`` set iff ``j' <= j``; ``band`` (an int, or None) also clears
        the bits ``j - j' >= band`` (a layer's own window inside the block, when a drafter window moves the
        positions its kernel window is measured from:
        :meth:`~dflash.drafter.model.DraftLayer.round_window`). Made once per cache, block size and kind,
        before any traced pass reads it."""
        key = (B, causal) if band is None else (B, causal, int(band))
        bits = self._block_bits.get(key)
        if bits is None:
            if causal or band is not None:
                j = torch.arange(B)
                seen = torch.ones(B, B, dtype=torch.bool)
                if causal:
                    seen &= j[None, :] <= j[:, None]
                if band is not None:
                    seen &= (j[:, None] - j[None, :]) < int(band)
                words = torch.zeros(B, (B + 31) // 32, dtype=torch.int64)
                for k in range(B):
                    words[:, k // 32] |= seen[:, k].long() << (k % 32)
                words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # as int32 bit patterns
                bits = words.to(device=self.length_t.device, dtype=torch.int32)
            else:
                bits = torch.full((B, (B + 31) // 32), -1, dtype=torch.int32, device=self.length_t.device)
            self._block_bits[key] = bits
        return bits

    def write_block(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, num_context: int):
        """Write ``k, v [b, Hkv, C + B, D]`` (``C = num_context`` padded context rows, then the block) at the rows
        the pass made (:meth:`begin_block`).

        Returns ``(k_all, v_all [b, Hkv, S', D], prefix [b])``: the layer's first
        ``S' =`` :meth:`key_rows` ``(C + B)`` rows and the number of keys before
        each sequence's block rows (``length_t + count``).
        """
        C = num_context
        keys = self.key_rows(k.shape[-2])  # the pass's C + B rows past the committed context bound its keys
        if self.block_dests is None:
            raise RuntimeError("DraftKVCache.write_block outside a draft pass: call begin_block first")
        prefix, context_rows, block_rows = self.block_dests
        # two writes in stream order: the context rows (padding included), then the block rows, which overwrite
        # the padding rows they meet; within each write the destination rows are distinct
        if C:
            self.write_rows(layer_idx, k[:, :, :C], v[:, :, :C], self.length_t, keys, dest=context_rows)
        k_all, v_all = self.write_rows(layer_idx, k[:, :, C:], v[:, :, C:], prefix, keys, dest=block_rows)
        return k_all, v_all, prefix

    def begin_block(self, num_context: int, block_size: int, count: torch.Tensor) -> None:
        """Begin a draft pass: its write rows, once for all its layers (:attr:`block_dests`, until :meth:`advance`):
        ``prefix = length_t + count [b]``, the context rows ``length_t[:, None] + arange(C)`` and the block rows
        ``prefix[:, None] + arange(B)``."""
        prefix = self.length_t + count
        self.block_dests = (prefix, self.length_t[:, None] + self.rows[:num_context],
                            prefix[:, None] + self.rows[:block_size])

    def advance(self, count: torch.Tensor) -> None:
        """Keep the pass's ``count [b]`` (device) real context rows of each sequence."""
        self.block_dests = None
        self.length_t.add_(count)
