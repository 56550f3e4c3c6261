"""The DFlash drafter: a block-diffusion model conditioned on target features.

Shapes (batch 1 at inference, B = block size, C = new context rows, H = hidden):

* context features ``[C, n*H]`` -> ``fc`` -> ``hidden_norm`` -> context states ``[C, H]``
* block states ``[B, H]``: the target's embedding of ``[last token, MASK x (B-1)]``
* every layer: queries from the block only; keys/values from
  ``[context states ; block states]`` through the layer's own k/v projections
  (k_norm on keys); RoPE at the tokens' absolute positions; NOT causal
* output: final RMSNorm of the block states ``[B, H]``; the caller applies the
  target's lm_head at block positions 1..B-1.
* z-lab's drafter scalars: the block input is ``F.embedding(ids, W_embed) *
  input_embedding_scale`` when the config sets that key (else the target's
  embedding module), and the drafter's logits are ``softcap(output_multiplier *
  W h)`` with the drafter's own ``final_logit_softcapping`` ``c``:
  ``c * tanh(z / c)``, none when unset or ``<= 0`` (:meth:`DFlashDraftModel.head_hidden`,
  :attr:`DFlashDraftModel.logit_softcap`).

The drafter owns no embedding and no lm_head. Its KV cache
(:class:`dflash.drafter.cache.DraftKVCache`) keeps the context K/V across rounds; the
block's K/V are scratch, overwritten by the next round.
"""

from __future__ import annotations

import importlib
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

import dflash_kernels
from dflash_kernels import reference as kernel_reference

from .config import DraftConfigError, check_draft_config, dflash_value, draft_layer_ids, qwen3_config
from .dflash2 import CandidateSelector, GroupedDynamicCausalConv, is_dflash2
from .formats import FORMATS, read_checkpoint, shown_names, write_checkpoint


class RMSNorm(nn.Module):
    """``w * (x * rsqrt(mean(x^2) + eps))``, the norm computed in fp32 and cast back first.

    On the CPU :func:`dflash_kernels.reference.rms_norm` (transformers' RMSNorm bit for bit, one op); elsewhere
    one fused ``torch.rms_norm`` kernel, whose weight multiplies before the cast back: the drafter's numbers
    only move its proposals, never the output."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            return kernel_reference.rms_norm(x, self.weight, self.eps)
        return torch.rms_norm(x, x.shape[-1:], self.weight.to(x.dtype), self.eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x [..., heads, T, D]`` with ``cos, sin`` broadcastable to it (``[T, D]``, or ``[b, 1, T, D]``)."""
    return x * cos + rotate_half(x) * sin


class DraftMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftAttention(nn.Module):
    """Block queries over ``[context ; block]`` keys, GQA, per-head q/k RMSNorm, non-causal."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        if self.num_heads % self.num_kv_heads:
            raise DraftConfigError(
                f"num_attention_heads {self.num_heads} must be a multiple of num_key_value_heads {self.num_kv_heads}"
            )
        H, D = config.hidden_size, self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=bias)
        self.q_norm = RMSNorm(D, config.rms_norm_eps)
        self.k_norm = RMSNorm(D, config.rms_norm_eps)
        self.scaling = D**-0.5

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Keys and values of ``x [..., T, H]``: ``[..., Hkv, T, D]`` each, RoPE'd keys (``cos, sin`` broadcastable
        to them)."""
        heads = (self.num_kv_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x).unflatten(-1, heads)).transpose(-3, -2)
        v = self.v_proj(x).unflatten(-1, heads).transpose(-3, -2)
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        block: torch.Tensor,
        context: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache=None,
        attn_mask: Optional[torch.Tensor] = None,
        window: Optional[int] = None,
        block_positions: Optional[torch.Tensor] = None,
        causal: bool = False,
        band: Optional[int] = None,
        visible: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``block [B, H]``, ``context [C, H]`` (C may be 0), ``cos/sin [C+B, D]``.

        Without ``cache`` (training): keys are ``[context ; block]``,
        ``attn_mask`` an additive float mask ``[B, C + B]`` (None: everything
        visible; a sliding window is part of it). With a frozen
        :class:`~dflash.drafter.cache.DraftKVCache` (a decoding round of ``b``
        sequences): ``block [b * B, H]`` (each sequence's block in turn),
        ``context [b, C, H]``, ``cos/sin [b, C + B, D]``; only the first
        ``count[r]`` (device) of sequence ``r``'s ``C`` context rows are real
        (the pass's :meth:`~dflash.drafter.cache.DraftKVCache.begin_block`);
        they and the block go to the cache and the block attends to all
        its sequence's cached context and the whole block, nothing read on the
        host. K/V are read once per kv head: the Triton path runs
        :func:`dflash_kernels.tree_attention` with every block key visible
        (GQA packed, ``window`` applied at ``block_positions [b, B]``: what
        :meth:`DraftLayer.round_window` gives, the rows' own positions, or their
        block's anchor for an anchored or drafter window; ``band``: the block
        bits' own band, :meth:`~dflash.drafter.cache.DraftKVCache.block_bits`);
        the reference path (``visible`` given) runs SDPA under ``visible [b, B,
        S]`` bool, the pass's mask of this layer's kind made from the same
        inputs (:meth:`DFlashDraftModel.round_visibility`).
        """
        if cache is not None:
            return self._round(block, context, cos, sin, cache, window, block_positions, causal, band, visible)
        B, C = block.shape[0], context.shape[0]
        q = self.q_norm(self.q_proj(block).view(B, self.num_heads, self.head_dim)).transpose(0, 1)
        q = apply_rope(q, cos[C:], sin[C:])
        k, v = self.project_kv(torch.cat([context, block], 0), cos, sin)
        mask = attn_mask.to(q.dtype) if attn_mask is not None else None
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=self.scaling,
                                             enable_gqa=True)[0]
        return self.o_proj(out.transpose(0, 1).reshape(B, self.num_heads * self.head_dim))

    def _round(self, block, context, cos, sin, cache, window, block_positions, causal, band=None, visible=None):
        """The decoding round's attention (see :meth:`forward`): ``[b * B, H]``."""
        b, C = context.shape[0], context.shape[1]
        B = block.shape[0] // b
        rows = block.view(b, B, -1)
        q = self.q_norm(self.q_proj(rows).unflatten(-1, (self.num_heads, self.head_dim))).transpose(1, 2)
        q = apply_rope(q, cos[:, None, C:], sin[:, None, C:])  # [b, Hq, B, D]
        k, v = self.project_kv(torch.cat([context, rows], 1), cos[:, None], sin[:, None])  # [b, Hkv, C + B, D]
        k_all, v_all, prefix = cache.write_block(self.layer_idx, k, v, C)
        if visible is not None:  # reference backend
            out = dflash_kernels.masked_attention(q, k_all, v_all, visible, scale=self.scaling)
        else:
            out = dflash_kernels.tree_attention(q, k_all, v_all, cache.block_bits(B, causal, band), prefix,
                                                scale=self.scaling, positions=block_positions, window=window,
                                                backend="triton")
        return self.o_proj(out.transpose(1, 2).reshape(b * B, self.num_heads * self.head_dim))


class DraftLayer(nn.Module):
    """Pre-norm attention then MLP, residual around each.

    ``causal``: block queries see only block keys at or before them (z-lab's
    ``is_causal``; unset, sliding-window layers are causal and full-attention
    layers are not, as the reference decides). DFlash2 layers
    (``attention_conv`` / ``mlp_conv`` set) wrap each sublayer in a
    :class:`~dflash.drafter.dflash2.GroupedDynamicCausalConv` along each block
    of ``block_size`` rows: ``y = finish(f(prepare(norm(x))))``.

    A sliding-window layer hides keys ``q - k >= W`` behind each query row
    (z-lab's rule), or, with ``sliding_window_anchored`` set (speculators'
    rule), keeps for every row of a block the ``W`` context rows before the
    block's anchor ``a`` (``a - W <= k < a``) and the block itself.

    A decoding round may add a drafter window (``draft_window``, anchored:
    :meth:`round_window`): it only ever hides context rows, and a layer sees
    the intersection of its own window and the drafter's.
    """

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = DraftAttention(config, layer_idx)
        self.mlp = DraftMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        layer_types = getattr(config, "layer_types", None)
        kind = layer_types[layer_idx] if layer_types else "full_attention"
        self.sliding_window = config.sliding_window if kind == "sliding_attention" else None
        # speculators' window: every row of a block keeps the W context rows before the block's anchor
        self.window_anchored = kind == "sliding_attention" and bool(dflash_value(config, "sliding_window_anchored"))
        if self.window_anchored:
            self.sliding_window = int(config.sliding_window) + 1  # hide a - k >= W + 1: keep k >= a - W
        is_causal = dflash_value(config, "is_causal")
        self.causal = kind == "sliding_attention" if is_causal is None else bool(is_causal)
        self.block_size = int(dflash_value(config, "block_size"))
        self.attention_conv: Optional[GroupedDynamicCausalConv] = None
        self.mlp_conv: Optional[GroupedDynamicCausalConv] = None

    def _wrapped(self, conv, sublayer, h, residual, block_size: int):
        """``residual + sublayer(h)``, the sublayer inside ``conv``'s prepare / finish when the layer has one
        (rows in blocks of ``block_size``, the pass's block length; the residual add fused into ``finish``)."""
        if conv is None:
            return residual + sublayer(h)
        rows, H = h.shape
        blocks = (rows // block_size, block_size, H)
        x, d1 = conv.prepare(h.view(blocks))
        out = sublayer(x.view(rows, H)).view(blocks)
        return conv.finish(out, d1, residual=residual.reshape(blocks)).view(rows, H)

    @property
    def kind(self) -> tuple:
        """``(sliding_window, causal, window_anchored)``: layers of one kind see the same keys in a round (the
        reference backend's visibility is made once per kind, :meth:`DFlashDraftModel.round_visibility`)."""
        return self.sliding_window, self.causal, self.window_anchored

    def window_positions(self, block_positions: torch.Tensor, block_size: int) -> torch.Tensor:
        """The positions a layer's window is measured from: each row's own, or (``window_anchored``) the
        position of its block's anchor (rows in blocks of ``block_size``, the pass's block length; any shape
        whose last dimension holds whole blocks, kept)."""
        if not self.window_anchored:
            return block_positions
        B = int(block_size)
        return block_positions.reshape(-1, B)[:, :1].expand(-1, B).reshape(block_positions.shape)

    def round_window(self, block_positions: torch.Tensor, block_size: int, draft_window: Optional[int] = None):
        """``(window, positions, band)``: what a decoding round's attention of this layer is given, the
        kernel's ``window`` measured from ``positions [b, B]`` (``pos_q - pos_k >= window`` hides key ``k``;
        block keys sit at the same ``positions``) and the block bits' ``band`` (None: none).

        Without ``draft_window``: the layer's own window at :meth:`window_positions`, no band.

        With ``draft_window = W`` (an int >= 1), block ``[a, a + B)`` (``a`` its anchor, the position of the
        last committed token; the context rows are positions ``< a``): every block row sees only the last
        ``W`` context rows before the block, ``a - W <= k < a``, intersected with the layer's own window, and
        the block keys it saw without ``W`` (the drafter window never hides a block key). So block row ``j``
        (position ``a + j``) sees the context rows

        * full-attention layer: ``[a - W, a)``, the last ``W``: window ``W + 1`` at the anchor for every row;
        * anchored sliding layer of window ``Wl``: ``[a - min(W, Wl), a)``: window ``min(W, Wl) + 1`` at the
          anchor;
        * z-lab sliding layer of window ``Wl`` (``q - k < Wl``, each row its own): ``[a - min(W, max(0,
          Wl - 1 - j)), a)``, i.e. ``k >= max(a - W, a + j - Wl + 1)``: the kernel's window stays ``Wl``, measured from
          ``max(a + j, a + Wl - W - 1)`` (unchanged when ``W >= Wl - 1``). Since that moves block rows'
          positions closer together, the layer's own rule inside the block (``j - j' >= Wl`` hidden, which
          only bites when ``Wl < B``) goes into the block bits as ``band = Wl``.

        Effective window per layer: ``min(layer window, W)`` context rows, counted back from the anchor.
        """
        B = int(block_size)
        if draft_window is None:
            return self.sliding_window, self.window_positions(block_positions, B), None
        W = int(draft_window)
        anchors = block_positions.reshape(-1, B)[:, :1]
        if self.sliding_window is None or self.window_anchored:
            window = W + 1 if self.sliding_window is None else min(self.sliding_window, W + 1)
            return window, anchors.expand(-1, B).reshape(block_positions.shape), None
        Wl = int(self.sliding_window)
        positions = torch.maximum(block_positions.reshape(-1, B), anchors + (Wl - W - 1))
        return Wl, positions.reshape(block_positions.shape), (Wl if Wl < B else None)

    def forward(self, block, context, cos, sin, cache=None, attn_mask=None, block_positions=None,
                block_size: Optional[int] = None, draft_window: Optional[int] = None,
                visible: Optional[torch.Tensor] = None):
        """``block [rows, H]`` in blocks of ``block_size`` rows (None: the config's ``block_size``; a decoding
        round passes its own, which may be smaller). ``draft_window``: a decoding round's drafter window
        (:meth:`round_window`; with ``cache`` only). ``visible``: on the reference backend, the round pass's
        ``[b, B, S]`` bool mask of this layer's :attr:`kind` (:meth:`DFlashDraftModel.round_visibility`); None
        on the Triton backend and in training."""
        B = self.block_size if block_size is None else int(block_size)
        window, positions, band = self.sliding_window, None, None
        if block_positions is not None:
            if cache is not None:
                window, positions, band = self.round_window(block_positions, B, draft_window)
            else:
                positions = self.window_positions(block_positions, B)
        attend = lambda h: self.self_attn(h, context, cos, sin, cache=cache, attn_mask=attn_mask,  # noqa: E731
                                          window=window, block_positions=positions, causal=self.causal,
                                          band=band, visible=visible)
        block = self._wrapped(self.attention_conv, attend, self.input_layernorm(block), block, B)
        return self._wrapped(self.mlp_conv, self.mlp, self.post_attention_layernorm(block), block, B)


def sliding_window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int], dtype: torch.dtype,
                        causal: bool = False, window_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Additive ``[Q, K]`` mask hiding keys more than ``window - 1`` positions behind a query (``window``
    None: no window), measured from ``window_pos [Q]`` when given (an anchored window), else from ``q_pos``.

    Keys ahead of the query (later block positions) stay visible unless ``causal``.
    """
    gap = q_pos[:, None] - k_pos[None, :]
    reach = gap if window_pos is None else window_pos[:, None] - k_pos[None, :]
    hidden = reach >= window if window is not None else torch.zeros_like(gap, dtype=torch.bool)
    if causal:
        hidden = hidden | (gap < 0)
    return torch.zeros(hidden.shape, dtype=dtype, device=q_pos.device).masked_fill_(hidden, torch.finfo(dtype).min)


#: the module behind :meth:`DFlashDraftModel.spec_generate`: the decoding layer's reference-compatible calls
GENERATION_MODULE = "dflash.decoding.compat"


def generation_module():
    """The decoding layer's reference-compatible calls (:mod:`dflash.decoding.compat`), resolved at call time.

    The one seam between the drafter and the loops above it: the drafter sits below ``decoding`` (it may not
    import it, tests/tooling/test_layout.py), yet z-lab's API drives generation from the drafter object
    (``draft.spec_generate(target=..., ...)``). The method therefore names the module it delegates to and
    imports it only when called, when ``dflash`` (and so ``dflash.decoding``) is loaded anyway: importing
    ``dflash.drafter`` imports the package root first.
    """
    return importlib.import_module(GENERATION_MODULE)


class DFlashDraftModel(nn.Module):
    """DFlash block-diffusion drafter (Qwen3-style layers reading target features): the one drafter class.

    The network (config, layers, checkpoint formats, :meth:`forward` for training, :meth:`draft_block` for a
    round) knows nothing of the loops, which sit in :mod:`dflash.decoding` above it and take any instance.
    :meth:`spec_generate` is z-lab's drafter-first call; it delegates, at call time, to
    :func:`dflash.decoding.compat.spec_generate` through :func:`generation_module` (the drafter never imports
    the decoding layer: no class is patched from above, and this class is ``dflash.DFlashDraftModel``).
    """

    #: the ``architectures`` entry of the z-lab format
    architecture = "DFlashDraftModel"

    def __init__(self, config: Qwen3Config):
        super().__init__()
        check_draft_config(config)
        self.config = config
        self.target_layer_ids = draft_layer_ids(config)
        self.block_size = int(dflash_value(config, "block_size"))
        self.mask_token_id = int(config.dflash_config["mask_token_id"])
        H = config.hidden_size
        self.layers = nn.ModuleList(DraftLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        # z-lab's drafter-side scalars (dflash_config first, then the top level), identity when unset
        scale = dflash_value(config, "input_embedding_scale")
        #: None: the block input is the target's embedding module; s: ``F.embedding(ids, W_embed) * s`` (z-lab)
        self.input_embedding_scale: Optional[float] = None if scale is None else float(scale)
        #: the drafter's logits are ``softcap(output_multiplier * lm_head(h))``
        self.output_multiplier = float(dflash_value(config, "output_multiplier", 1.0))
        cap = dflash_value(config, "final_logit_softcapping")
        #: the drafter's own final-logit softcap ``c * tanh(z / c)`` (None: unset or <= 0, as z-lab reads it)
        self.logit_softcap: Optional[float] = float(cap) if cap is not None and float(cap) > 0 else None

    # ------------------------------------------------------------------ forward
    def rope(self, positions: torch.Tensor, like: torch.Tensor):
        """``cos, sin [T, D]`` at absolute ``positions [T]`` (``[b, T, D]`` at ``[b, T]``)."""
        if positions.dim() == 2:
            cos, sin = self.rotary_emb(like, positions)
            return cos.to(like.dtype), sin.to(like.dtype)
        cos, sin = self.rotary_emb(like, positions[None])
        return cos[0].to(like.dtype), sin[0].to(like.dtype)

    def context_states(self, features: torch.Tensor) -> torch.Tensor:
        """``[C, n*H]`` target features -> ``[C, H]`` context states (fc, hidden_norm)."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def forward(
        self,
        block_embeds: torch.Tensor,
        context_features: torch.Tensor,
        positions: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        block_size: Optional[int] = None,
    ) -> torch.Tensor:
        """One drafter pass without a cache (training).

        ``block_embeds [R, H]`` (``R / block_size`` blocks of ``block_size`` rows; None: the config's),
        ``context_features [C, n*H]``, ``positions [C + R]`` absolute positions of the context rows then
        the blocks. ``attn_mask``: optional additive float ``[R, C + R]`` mask; sliding-window layers add
        their window on top. Returns the final-normed block states ``[R, H]``.
        """
        B = self.block_size if block_size is None else int(block_size)
        dtype = self.fc.weight.dtype
        block = block_embeds.to(dtype)
        context = self.context_states(context_features)
        cos, sin = self.rope(positions, block)
        block_positions = positions[context.shape[0]:]
        for layer in self.layers:
            mask = attn_mask
            if layer.sliding_window is not None or layer.causal:
                window = sliding_window_mask(block_positions, positions, layer.sliding_window, dtype, layer.causal,
                                             layer.window_positions(block_positions, B))
                mask = window if mask is None else mask + window
            block = layer(block, context, cos, sin, attn_mask=mask, block_positions=block_positions, block_size=B)
        return self.norm(block)

    def draft_block(self, block_embeds: torch.Tensor, context_features: torch.Tensor,
                    context_count: torch.Tensor, cache, block_size: Optional[int] = None,
                    draft_window: Optional[int] = None) -> torch.Tensor:
        """The decoding round's drafter pass of ``b`` sequences (fixed shapes, nothing read on the host).

        ``block_embeds [b, B, H]``; ``context_features [b, C, n*H]`` of which
        the first ``context_count[r]`` (device int64 ``[b]``) rows of sequence
        ``r`` are its new context; ``cache`` a frozen
        :class:`~dflash.drafter.cache.DraftKVCache` of ``b`` sequences holding
        their committed lengths ``L [b]`` on the device. New context row ``i``
        of sequence ``r`` sits at position ``L[r] + i``; its block at ``L[r] +
        count[r] + arange(B)``. Advances the cache by ``count``; returns the
        final-normed blocks ``[b, B, H]``. One sequence may also come unbatched
        (``[B, H]``, ``[C, n*H]``, count ``[1]``; returns ``[B, H]``), on a cache
        of one sequence. (``block_size``: accepted for the callers that name it;
        it is ``B``.)

        ``draft_window``: None (every committed context row visible), or an int ``W >= 1``: every block row
        attends only to the last ``W`` context rows before its block (the target's features of the ``W``
        committed positions before the anchor, ``[a - W, a)``, fewer when fewer exist) and to its block, each
        layer's own sliding window still applying on top (effective window ``min(layer window, W)``:
        :meth:`DraftLayer.round_window` says exactly which rows). It goes through the attention's ``window=``
        on both backends. The cache still holds every context row (masked, not dropped): memory is not
        bounded by ``W``; the Triton kernel skips the key tiles before the window, the reference backend's
        masked attention still runs over every cache row.
        """
        if draft_window is not None and (isinstance(draft_window, bool) or not isinstance(draft_window, int)
                                         or draft_window < 1):
            raise ValueError(f"draft_window must be an int >= 1 (the context rows before the block the drafter "
                             f"attends to) or None (all of them), got {draft_window!r}")
        if block_embeds.dim() == 2:
            return self.draft_block(block_embeds[None], context_features[None], context_count, cache,
                                    block_size, draft_window)[0]
        dtype = self.fc.weight.dtype
        b, B, H = block_embeds.shape
        if block_size is not None and int(block_size) != B:
            raise ValueError(f"block_size {block_size} but the block embeddings hold {B} rows")
        block = block_embeds.to(dtype).reshape(b * B, H)
        context = self.context_states(context_features)  # [b, C, H]
        C = context.shape[1]
        rows = cache.rows
        length = cache.length_t[:, None]
        block_positions = length + context_count[:, None] + rows[:B]  # [b, B]
        positions = torch.cat([length + rows[:C], block_positions], 1)  # [b, C + B]
        cos, sin = self.rope(positions, block)
        cache.begin_block(C, B, context_count)  # every layer's write rows, once for the pass
        masks = (self.round_visibility(cache, block_positions, C, B, draft_window)
                 if dflash_kernels.get_backend(block.device) != "triton" else None)
        for layer in self.layers:
            block = layer(block, context, cos, sin, cache=cache, block_positions=block_positions, block_size=B,
                          draft_window=draft_window, visible=None if masks is None else masks[layer.kind])
        cache.advance(context_count)
        return self.norm(block).view(b, B, H)

    def round_visibility(self, cache, block_positions: torch.Tensor, C: int, B: int,
                         draft_window: Optional[int] = None) -> dict:
        """The reference backend's masks of one round pass: ``{kind: visible [b, B, S] bool}``, one per distinct
        :attr:`DraftLayer.kind` ``(window, causal, anchored)``, shared by the layers of that kind.

        ``cache`` after :meth:`~dflash.drafter.cache.DraftKVCache.begin_block` (its ``block_dests[0]``, the
        prefix ``p [b]`` of each sequence, committed plus new context rows), ``block_positions [b, B]``, ``C``
        context rows per sequence, ``S = cache.key_rows(C + B)``. Block row ``j`` of sequence ``r`` sees key
        ``k`` iff ``k < p[r]`` (context) or ``k = p[r] + j'`` with block bit ``j'`` of row ``j`` set
        (:meth:`~dflash.drafter.cache.DraftKVCache.block_bits`; every bit, or causal ``j' <= j``, or the
        layer's band), and ``pos_q - pos_k < window`` (context key ``k`` at position ``k``, block keys at the
        queries' positions; :meth:`DraftLayer.round_window` gives the window, those positions and the band, the
        drafter window ``draft_window`` included). The layers take them as their
        forward's ``visible``; the cache does not keep them.
        """
        b = block_positions.shape[0]
        prefix, keys = cache.block_dests[0], cache.key_rows(C + B)
        masks = {}
        for layer in self.layers:
            key = layer.kind
            if key in masks:
                continue
            window, window_positions, band = layer.round_window(block_positions, B, draft_window)
            if window is None and band is None and not layer.causal:
                # every block row sees what one row after the whole block sees (every context row, every block
                # row): a one-row chain's compare, not the bits' lookup
                seen = dflash_kernels.tree_visibility(None, prefix + (B - 1), 1, n_keys=keys)
                masks[key] = seen.view(-1, 1, keys).expand(b, B, keys)
            else:
                masks[key] = dflash_kernels.tree_visibility(cache.block_bits(B, layer.causal, band), prefix, B,
                                                            n_keys=keys, positions=window_positions,
                                                            window=window)
        return masks

    def ingest_context(self, context_features: torch.Tensor, cache) -> None:
        """Append the K/V of ``context_features [C, n*H]`` (rows at positions ``length ..``) to ``cache`` eagerly.

        The drafter's context K/V depend only on each row's features and
        position (every layer projects the same context states), so this gives
        the rows a combined context + block pass would have written.
        """
        context = self.context_states(context_features)
        C = context.shape[0]
        if C == 0:
            return
        cos, sin = self.rope(torch.arange(cache.length, cache.length + C, device=context.device), context)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(context, cos, sin)
            cache.write(i, k, v)
        cache.commit(C)

    def head_hidden(self, states: torch.Tensor) -> torch.Tensor:
        """``states`` scaled so that the lm_head of the result is ``output_multiplier * lm_head(states)``
        (the lm_head has no bias); the states themselves when the multiplier is 1. The softcap
        (:attr:`logit_softcap`) is the lm_head op's ``softcap=`` on top."""
        return states if self.output_multiplier == 1.0 else states * self.output_multiplier

    # --------------------------------------------------------- checkpoints
    def save_pretrained(self, save_directory: str, dtype: Optional[torch.dtype] = None, format: str = "zlab",
                        max_shard_bytes: Optional[int] = None) -> None:
        """Write ``config.json`` and the safetensors weights in ``format``.

        ``format``: ``"zlab"`` (z-lab's published format), ``"transformers"``
        (transformers' native DFlash assistant, loadable by
        ``MuseGlimmerAssistantModel.from_pretrained``; DFlash only) or
        ``"speculators"`` (vLLM speculators); see :mod:`dflash.drafter.formats`
        for the mapping. ``max_shard_bytes``: write shards of at most that size
        plus ``model.safetensors.index.json``.
        """
        if format not in FORMATS:
            raise DraftConfigError(f"unknown drafter format {format!r}; allowed: {', '.join(FORMATS)}")
        state = {
            k: (v.to(dtype) if dtype is not None else v).detach().contiguous().cpu()
            for k, v in self.state_dict().items()
            if "rotary_emb" not in k
        }
        write_checkpoint(save_directory, self.config, state, format, self.architecture, max_shard_bytes)

    @classmethod
    def from_pretrained(cls, directory: str, dtype: Optional[torch.dtype] = None, device=None,
                        target_config=None) -> "DFlashDraftModel":
        """Load a drafter from a local directory (offline): ``config.json`` + safetensors, any format.

        The format (z-lab, transformers' native assistant, speculators) is
        detected from ``config.json`` (:func:`dflash.drafter.formats.detect_format`);
        sharded weights (``model.safetensors.index.json``) are read shard by
        shard. ``target_config``: the target's config, filling
        ``num_target_layers`` / ``vocab_size`` where the format does not carry
        them; without it they stay None and the drafter is checked against its
        target when paired (:func:`dflash.decoding.check_pair`).

        Raises :class:`DraftConfigError` naming the missing file, missing or
        unexpected weight names (as named in the checkpoint), or the weight whose
        shape does not match.
        """
        raw, state, fmt = read_checkpoint(directory, target_config)
        config = qwen3_config(raw)
        model = cls.class_for(config)(config)
        expected = {k: v for k, v in model.state_dict().items() if "rotary_emb" not in k}
        shown = shown_names(fmt)
        missing = sorted(shown({k: None for k in set(expected) - set(state)}))
        unexpected = sorted(shown({k: None for k in set(state) - set(expected)}))
        if missing:
            raise DraftConfigError(f"drafter checkpoint {directory!r} is missing weights: {', '.join(missing[:8])}"
                                   + (" ..." if len(missing) > 8 else ""))
        if unexpected:
            raise DraftConfigError(f"drafter checkpoint {directory!r} has unexpected weights: {', '.join(unexpected[:8])}"
                                   + (" ..." if len(unexpected) > 8 else ""))
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(expected[name].shape):
                shown_name = next(iter(shown({name: None})))
                raise DraftConfigError(
                    f"weight {shown_name} has shape {tuple(tensor.shape)} in {directory!r}, but the config implies "
                    f"{tuple(expected[name].shape)}"
                )
        model.load_state_dict(state, strict=False)
        if dtype is None:
            dtype = next(iter(state.values())).dtype
        return model.to(device=device, dtype=dtype).eval()

    @classmethod
    def class_for(cls, config) -> type:
        """The class that holds a drafter of ``config``: ``cls``, or its DFlash2 counterpart for a DFlash2
        config (:func:`~dflash.drafter.dflash2.is_dflash2`); a DFlash2 class asked for a DFlash config is an
        error."""
        dflash2 = is_dflash2(config)
        if dflash2 and not issubclass(cls, DFlash2DraftModel):
            return DFlash2DraftModel
        if not dflash2 and issubclass(cls, DFlash2DraftModel):
            raise DraftConfigError("this checkpoint is a DFlash drafter (no conv_kernel_size / conv_group_size / "
                                   "selector_rank / selector_top_k): load it with DFlashDraftModel")
        return cls

    def spec_generate(self, target, input_ids, max_new_tokens: int, stop_token_ids: Optional[Iterable[int]] = None,
                      temperature: float = 0.0, **kwargs) -> torch.Tensor:
        """DFlash generation with this drafter (z-lab's call): the output ids ``[1, prompt + new]``.

        ``target``: the HF causal LM; ``input_ids``: ``[T]`` or ``[1, T]``. Exactly
        :func:`dflash.decoding.compat.spec_generate` (``dflash.generate(target, self, input_ids,
        method="dflash", ...)`` keeping only ``output_ids``; greedy at ``temperature=0``: the target's own
        greedy tokens; ``kwargs`` are its keywords); use :func:`dflash.generate` for the statistics.
        """
        return generation_module().spec_generate(self, target, input_ids, max_new_tokens=max_new_tokens,
                                                 stop_token_ids=stop_token_ids, temperature=temperature, **kwargs)

    def extra_repr(self) -> str:
        return f"target_layer_ids={self.target_layer_ids}, block_size={self.block_size}, mask_token_id={self.mask_token_id}"


class DFlash2DraftModel(DFlashDraftModel):
    """The DFlash2 drafter: every layer's attention and MLP inside a grouped dynamic causal convolution, and a
    :class:`~dflash.drafter.dflash2.CandidateSelector` choosing the proposals (:mod:`dflash.drafter.dflash2`).

    Weights beyond DFlash's: ``layers.{i}.{attention,mlp}_conv.base_kernel [2, K, H]``,
    ``layers.{i}.{attention,mlp}_conv.kernel_projection.weight [2*K*G, H]``,
    ``candidate_selector.{predecessor,successor}_codebook.weight [V, r]``,
    ``candidate_selector.hidden_projection.weight [r, H]``.
    """

    architecture = "DFlash2DraftModel"

    def __init__(self, config: Qwen3Config):
        if not is_dflash2(config):
            raise DraftConfigError("a DFlash2 drafter config needs conv_kernel_size, conv_group_size, selector_rank "
                                   "and selector_top_k (in dflash_config or at the top level)")
        if config.vocab_size is None:
            raise DraftConfigError("a DFlash2 drafter needs vocab_size (its selector codebooks are [vocab_size, "
                                   "selector_rank])")
        super().__init__(config)
        K, g = int(dflash_value(config, "conv_kernel_size")), int(dflash_value(config, "conv_group_size"))
        if K > self.block_size:
            raise DraftConfigError(f"conv_kernel_size {K} exceeds block_size {self.block_size}")
        #: taps of each convolution along a block: a round's block size must be at least this
        self.conv_kernel_size = K
        for layer in self.layers:
            layer.attention_conv = GroupedDynamicCausalConv(config.hidden_size, K, g)
            layer.mlp_conv = GroupedDynamicCausalConv(config.hidden_size, K, g)
        self.candidate_selector = CandidateSelector(config)

