"""Target adapter: drive a Hugging Face decoder with our cache, capture its layers, pick tokens.

A usable target has ``model.embed_tokens``, ``model.layers``, ``model.norm``,
``model.rotary_emb`` and ``lm_head`` (Qwen3, Llama, Mistral, Qwen2 and most
decoders of transformers 5.x). We never fork its modeling file:

* the decoder layers are called in order with our :class:`TargetKVCache`
  and additive float masks we build (eager attention adds boolean masks
  to the scores, so masks are always float);
* forward hooks on the mapped layers keep references to their outputs
  ``[T, H]``; :meth:`TargetAdapter.context_features` writes the requested
  rows of all of them into one ``[R, n*H]`` buffer with one
  :func:`dflash_kernels.gather_concat` launch;
* the final norm and the lm_head run only at the positions whose token is
  needed, fused with the argmax / sampling (:mod:`dflash_kernels.lm_head`).
"""

from __future__ import annotations

import inspect
from typing import Dict, List, Optional, Sequence

import torch

import dflash_kernels

from ..drafter.config import validate_target_layer_ids
from .cache import TargetKVCache

TREE_ATTENTION = "dflash_tree"

# RMSNorm classes computing ``w * normed(x).to(dtype)`` (safe to fuse into the lm_head op).
_FUSABLE_NORMS = ("Qwen3RMSNorm", "LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3MoeRMSNorm", "RMSNorm")


def _base_attention(module, name: str):
    """The attention function ``name`` of transformers' registry, or the model's own eager one."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    import sys

    return sys.modules[type(module).__module__].eager_attention_forward


def tree_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention function registered as ``"dflash_tree"`` in transformers' registry.

    Verify passes of DDTree switch the target to it: layers that got no dense
    mask run :func:`dflash_kernels.tree_attention` (prefix fully visible, tree
    keys by ancestor bit; ``query [1, Hq, T, D]``, ``key/value [1, Hkv, S, D]``
    views of our cache); layers with a dense mask (sliding windows) and every
    other pass use the model's own attention.
    """
    bits = kwargs.pop("dflash_tree_bits", None)
    prefix_len = kwargs.pop("dflash_prefix_len", None)
    base = kwargs.pop("dflash_base_attention", "sdpa")
    if bits is None or attention_mask is not None:
        return _base_attention(module, base)(module, query, key, value, attention_mask, scaling=scaling,
                                             dropout=dropout, **kwargs)
    out = dflash_kernels.tree_attention(query, key, value, bits, prefix_len, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


_registered = False


def register_tree_attention() -> None:
    """Add ``"dflash_tree"`` to transformers' attention-function registry (once)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(TREE_ATTENTION, tree_attention_forward)
        _registered = True


class TargetStructureError(TypeError):
    """The model does not expose the parts the adapter drives."""


def decoder_parts(model):
    """``(decoder, layers, norm, lm_head, rotary_emb)`` of a causal-LM, or a clear error."""
    decoder = getattr(model, "model", None)
    missing = []
    if decoder is None:
        missing.append("model")
    else:
        for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
            if getattr(decoder, name, None) is None:
                missing.append(f"model.{name}")
    if getattr(model, "lm_head", None) is None:
        missing.append("lm_head")
    if missing:
        raise TargetStructureError(
            f"{type(model).__name__} cannot be used as a target: it lacks {', '.join(missing)}. A target must expose "
            "model.embed_tokens, model.layers, model.norm, model.rotary_emb and lm_head (Qwen3, Llama and most "
            "transformers decoders do)"
        )
    return decoder, decoder.layers, decoder.norm, model.lm_head, decoder.rotary_emb


def _cache_keyword(layer) -> str:
    """The decoder layer's cache argument: ``cache`` (transformers >= 5.24) or ``past_key_values``."""
    params = inspect.signature(layer.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise TargetStructureError(f"{type(layer).__name__}.forward takes neither 'cache' nor 'past_key_values'")


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[T, S]`` bool visibility -> ``[1, 1, T, S]`` additive float mask (0 or dtype min)."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)[None, None]


class TargetAdapter:
    """Runs a HF causal LM for speculative decoding.

    ``capture_layer_ids``: the target layers whose outputs are captured, in
    the order their features are concatenated (the drafter's
    ``target_layer_ids``, optionally followed by extra layers for training).
    """

    def __init__(self, model, capture_layer_ids: Sequence[int] = ()):
        self.model = model
        self.decoder, self.layers, self.norm, self.lm_head, self.rotary_emb = decoder_parts(model)
        self.config = model.config
        self.num_layers = len(self.layers)
        self.capture_layer_ids = validate_target_layer_ids(capture_layer_ids, self.num_layers, warn_repeats=False) if capture_layer_ids else []
        self._cache_kw = _cache_keyword(self.layers[0])
        types = getattr(self.config, "layer_types", None)
        self.layer_types = list(types) if types else ["full_attention"] * self.num_layers
        self.sliding_window = getattr(self.config, "sliding_window", None)
        if self.lm_head.bias is not None:
            raise TargetStructureError("lm_head with a bias is not supported")
        self.fuse_norm = type(self.norm).__name__ in _FUSABLE_NORMS and getattr(self.norm, "weight", None) is not None
        self.norm_eps = float(getattr(self.norm, "variance_epsilon", getattr(self.norm, "eps", 1e-6)))
        self._outputs: Dict[int, torch.Tensor] = {}
        self._hooks = [
            self.layers[k].register_forward_hook(self._make_hook(k)) for k in sorted(set(self.capture_layer_ids))
        ]

    # ----------------------------------------------------------- lifecycle
    def _make_hook(self, k: int):
        def hook(module, args, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            self._outputs[k] = out[0]  # [T, H], a reference: no copy

        return hook

    def close(self) -> None:
        """Remove the capture hooks from the model."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._outputs = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.lm_head.weight.shape[1]

    def new_cache(self, max_len: int) -> TargetKVCache:
        return TargetKVCache(self.config, max_len, dtype=self.dtype, device=self.device)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, H]`` of ``ids [T]`` (also the drafter's block input)."""
        return self.decoder.embed_tokens(ids)

    # ------------------------------------------------------------- forward
    def masks(self, q_pos: torch.Tensor, k_pos: torch.Tensor, visible: Optional[torch.Tensor] = None,
              dense_full: bool = True) -> dict:
        """Additive masks per layer type; ``visible [T, S]`` defaults to causal (k_pos <= q_pos).

        ``dense_full=False`` leaves the full-attention layers without a mask
        (the tree-attention kernel reads the ancestor bits instead).
        """
        if visible is None:
            visible = k_pos[None, :] <= q_pos[:, None]
        masks = {"full_attention": additive_mask(visible, self.dtype) if dense_full else None}
        if "sliding_attention" in self.layer_types:
            in_window = (q_pos[:, None] - k_pos[None, :]) < int(self.sliding_window)
            masks["sliding_attention"] = additive_mask(visible & in_window, self.dtype)
        return masks

    def tree_kernel_usable(self) -> bool:
        """True when verify passes run the Triton tree-attention kernel (else dense-mask attention)."""
        impl = getattr(self.config, "_attn_implementation", None)
        return impl in ("sdpa", "eager", TREE_ATTENTION) and dflash_kernels.get_backend(self.device) == "triton"

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: TargetKVCache,
        visible: Optional[torch.Tensor] = None,
        tree_bits: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Run the decoder on ``ids [T]`` at ``positions [T]``; returns pre-norm hidden ``[T, H]``.

        The new K/V go to rows ``[cache.length, cache.length+T)`` (the caller
        commits what it keeps). ``visible [T, cache.length+T]`` overrides the
        causal visibility. ``tree_bits [T, words]`` (DDTree verification):
        the committed prefix is visible to all T tokens, and tree token j to
        token i iff bit j of ``tree_bits[i]`` is set; served by the
        tree-attention kernel through the ``"dflash_tree"`` attention function
        when :meth:`tree_kernel_usable`, else by a dense additive mask.
        Captured layer outputs are available through :meth:`context_features`
        until the next forward.
        """
        k_pos = torch.cat([torch.arange(cache.length, device=ids.device), positions])
        attention_kwargs = {}
        use_kernel = tree_bits is not None and self.tree_kernel_usable()
        if tree_bits is not None and (not use_kernel or "sliding_attention" in self.layer_types):
            visible = dflash_kernels.tree_attention_mask(tree_bits, cache.length, torch.float32) == 0
        masks = self.masks(positions, k_pos, visible, dense_full=not use_kernel)
        if use_kernel:
            register_tree_attention()
            base = self.config._attn_implementation
            attention_kwargs = dict(dflash_tree_bits=tree_bits, dflash_prefix_len=cache.length,
                                    dflash_base_attention=base if base != TREE_ATTENTION else "sdpa")
            self.config._attn_implementation = TREE_ATTENTION
            try:
                return self._run_layers(ids, positions, cache, masks, attention_kwargs)
            finally:
                self.config._attn_implementation = base
        return self._run_layers(ids, positions, cache, masks, attention_kwargs)

    def _run_layers(self, ids, positions, cache, masks, attention_kwargs) -> torch.Tensor:
        pos = positions[None]
        h = self.embed(ids[None])
        position_embeddings = self.rotary_emb(h, pos)
        self._outputs = {}
        for i, layer in enumerate(self.layers):
            out = layer(
                h,
                attention_mask=masks[self.layer_types[i]],
                position_ids=pos,
                position_embeddings=position_embeddings,
                use_cache=True,
                **{self._cache_kw: cache},
                **attention_kwargs,
            )
            h = out[0] if isinstance(out, (tuple, list)) else out
        return h[0]

    def context_features(self, rows=None, out: Optional[torch.Tensor] = None, trusted_rows: bool = False) -> torch.Tensor:
        """Captured features ``[R, n*H]`` of the last forward at ``rows`` (None: all).

        ``trusted_rows``: the rows come from our own loop (in range by
        construction), so the range check and its device->host sync are skipped.
        """
        if not self.capture_layer_ids:
            raise RuntimeError("this adapter captures no layers")
        if len(self._outputs) == 0:
            raise RuntimeError("no captured hidden states: run forward() first")
        layers = [self._outputs[k] for k in self.capture_layer_ids]
        return dflash_kernels.gather_concat(layers, rows=rows, out=out, check_bounds=not trusted_rows)

    def captured_layer(self, k: int) -> torch.Tensor:
        """The captured output ``[T, H]`` of layer ``k`` in the last forward."""
        return self._outputs[k]

    # --------------------------------------------------- tokens from hidden
    def _head_args(self, hidden: torch.Tensor):
        """Returns (hidden, kwargs) for the lm_head ops: fused norm when the norm is a plain RMSNorm."""
        if self.fuse_norm:
            return hidden, dict(norm_weight=self.norm.weight, eps=self.norm_eps)
        return self.norm(hidden), {}

    def choose(
        self,
        hidden: torch.Tensor,
        temperature: float = 0.0,
        positions: Optional[torch.Tensor] = None,
        generator: Optional[torch.Generator] = None,
    ) -> torch.Tensor:
        """The target's token after each selected row of pre-norm ``hidden [T, H]``.

        Argmax at temperature 0, else a sample from ``softmax(logits / T)``.
        """
        hidden, kw = self._head_args(hidden)
        W = self.lm_head.weight
        if temperature <= 0:
            return dflash_kernels.lm_head_argmax(hidden, W, positions=positions, **kw)
        return dflash_kernels.lm_head_sample(hidden, W, temperature, positions=positions, generator=generator, **kw)

    def logits(self, hidden: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """fp32 logits ``[N, V]`` at the selected rows of pre-norm ``hidden``."""
        hidden, kw = self._head_args(hidden)
        return dflash_kernels.lm_head_logits(hidden, self.lm_head.weight, positions=positions, **kw)
