"""Target adapter: drive a Hugging Face decoder with our cache, capture its layers, pick tokens.

A usable target has ``model.embed_tokens``, ``model.layers``, ``model.norm``,
``model.rotary_emb`` and ``lm_head`` (Llama, Qwen2/3, Mistral, Phi-3, Gemma2/3,
Qwen3-MoE, gpt-oss and most decoders of transformers 5.x). What its family does
beyond the generic shape (which layers slide, rope per layer type, softcaps,
sinks, query and embedding scales, MoE experts) comes from the capability table
(:mod:`dflash.target.families`); a feature it cannot vouch for is refused here,
at construction, with an error naming it. We never fork its modeling file:

* the decoder layers are called in order with our :class:`TargetKVCache`
  and no mask: while the adapter is open the model's attention is our one
  attention function (:mod:`dflash.target.attention`), told what each pass
  attends to by an :class:`~dflash.target.attention.AttentionPass`;
* every pass (:meth:`TargetAdapter.run_pass`) returns the mapped layers'
  outputs ``[T, H]``; :meth:`TargetAdapter.context_features` writes the requested
  rows of all of them into one ``[R, n*H]`` buffer with one
  :func:`dflash_kernels.gather_concat` launch;
* the final norm and the lm_head run only at the positions whose token is
  needed, fused with the argmax / sampling (:mod:`dflash_kernels.lm_head`),
  with the family's final-logit softcap ``c * tanh(z / c)`` on the logits; an
  lm_head the fused ops cannot read as a plain weight (a LoRA adapter on it, a
  quantized weight) runs as its own module at those rows instead
  (:mod:`dflash.target.head`, one decision: :attr:`TargetAdapter.head`);
* the model may come wrapped (peft's ``PeftModel``, ``torch.compile``'s
  ``OptimizedModule``, ``DataParallel``): :func:`decoder_parts` finds the
  decoder inside (:mod:`dflash.target.wrappers`); quantizations whose rows
  depend on each other are refused (:mod:`dflash.target.quantized`);
* MoE experts run an implementation without a host read while the adapter is
  open (:func:`dflash.target.families.experts_patches`), restored on close;
* hybrid targets (Qwen3.5, Qwen3-Next: Gated-DeltaNet layers between the
  attention layers) get a :class:`~dflash.target.hybrid.HybridKVCache` and,
  while the adapter is open, our verify forward on their linear-attention
  modules (:func:`dflash.target.hybrid.linear_patches`), restored on close.

What an open adapter changes on the model is the list of patches its family
row names (:attr:`dflash.target.families.Family.patches`), held in the one
registry :mod:`dflash.target.patches` from construction to :meth:`close`:
adapters on one model may nest or overlap (the first applies, the last
restores), and a construction that fails part-way leaves the model as it was.
"""

from __future__ import annotations

import inspect
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

import dflash_kernels

from ..drafter.config import validate_target_layer_ids
from .attention import PASS_KWARG, AttentionPass, active_pass, attention_patches
from .cache import TargetKVCache
from .families import (PATCHES, TargetStructureError, UnsupportedTargetFeature, experts_modules, experts_patches,
                       own_check_attention, resolve_target)
from .head import TargetHead
from .hybrid import LINEAR_PASS_KWARG, HybridKVCache, LinearPass, linear_modules, linear_patches, linear_shape
from .own_forward_check import check_own_forward, own_probe
from .norms import norm_patches
from .rope import rope_patches
from .patches import Patch, hold
from .quantized import check_row_independent, quantizes_activations
from .wrappers import check_wrappers, unwrap_target

__all__ = ["PREFILL_CHUNK", "TargetAdapter", "TargetStructureError", "UnsupportedTargetFeature", "decoder_parts"]

#: Rows per prefill pass; None: the whole prompt in one pass, as transformers' ``generate()`` runs it (the same
#: causal SDPA call over the same keys: the model's own numbers, and its time to first token). A generation whose
#: ``generation_config.prefill_chunk_size`` is set prefills in chunks of that many rows, as transformers then does
#: (the ``chunk_size`` of :meth:`TargetAdapter.prefill`).
PREFILL_CHUNK: Optional[int] = None

#: Rows per prefill pass of a target with a layer that cannot run causal SDPA over a whole prompt (a sliding
#: window, an attention softcap, sinks, a head dim past the kernel's): such a layer's pass builds a ``[T, S]``
#: visibility or scores (``[P, P]`` for a one-pass prompt: 4 GiB of floats at 32k tokens, as transformers' own
#: one-pass prefill builds), which chunks of this many rows bound (a windowed layer's to ``[T, window + T]``).
MASKED_PREFILL_CHUNK = 2048

#: A round pass of one sequence on the CPU attends its committed keys unmasked (``AttentionPass.split``,
#: :func:`dflash_kernels.reference.split_attention`) from this many committed tokens on: there a ``[T, S]`` mask
#: costs the masked kernel up to three times the attention's own time. Below it, and for targets that quantize
#: their activations (whose outputs turn a last-bit difference into another quantization step), the masked
#: attention: the model's own numbers bit for bit.
SPLIT_MIN_PREFIX = 2048


def decoder_parts(model):
    """``(decoder, layers, norm, lm_head, rotary_emb)`` of a causal-LM (found through the wrappers it may wear:
    :func:`~dflash.target.wrappers.unwrap_target`), or a clear error."""
    model = unwrap_target(model)
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
    raise TargetStructureError(f"{type(layer).__name__} cannot be used as a target: its forward takes neither "
                               "'cache' nor 'past_key_values' (the decoder layer keeps no K/V cache we can hand it)")


class TargetAdapter:
    """Runs a HF causal LM for speculative decoding.

    ``capture_layer_ids``: the target layers whose outputs are captured, in
    the order their features are concatenated (the drafter's
    ``target_layer_ids``, optionally followed by extra layers for training).
    """

    def __init__(self, model, capture_layer_ids: Sequence[int] = ()):
        check_wrappers(model)
        #: the transformers model inside the wrappers the caller holds it in (itself when it wears none)
        self.model = model = unwrap_target(model)
        self.decoder, self.layers, self.norm, self.lm_head, self.rotary_emb = decoder_parts(model)
        #: the model's modules, listed once for every structural question (here, and the compiled pool's key)
        self.modules = modules = list(model.modules())
        check_row_independent(model, modules)
        self._quantized_activations = quantizes_activations(model, modules)
        #: the lm_head and how it runs (fused ops on its weight, or the module itself: :mod:`dflash.target.head`)
        self.head = TargetHead(self.lm_head)
        self.config = model.config
        self.num_layers = len(self.layers)
        self.capture_layer_ids = validate_target_layer_ids(capture_layer_ids, self.num_layers, warn_repeats=False) if capture_layer_ids else []
        self._cache_kw = _cache_keyword(self.layers[0])
        #: what this model's passes must do (windows, rope, softcaps, sinks, experts): the family table, resolved
        moe = experts_modules(model, modules)
        self.spec = spec = resolve_target(model, self.decoder, self.layers, self.norm, self.lm_head, self.rotary_emb,
                                          moe)
        self.family = spec.family.name
        self.layer_types = spec.layer_types
        self.sliding_window = getattr(self.config, "sliding_window", None)
        #: sliding window of each layer (None: full attention), read by the attention function
        self.windows = spec.windows
        #: final-logit softcap of the target's head (None: none); the drafter's logits do not get it
        self.final_softcap = spec.final_softcap
        self.fuse_norm = spec.fuse_norm
        #: the fused norm's epsilon (None: the final norm runs as its module, see :mod:`dflash.target.final_norm`)
        self.norm_eps = spec.norm_eps
        self._has_attn_features = any(c is not None for c in spec.attn_softcaps) or any(
            s is not None for s in spec.sinks)
        #: whether a layer attends with a visibility beyond causal SDPA's (a window, a softcap, sinks): its
        #: prefill runs in chunks (:data:`MASKED_PREFILL_CHUNK`)
        self.masked_layers = self._has_attn_features or any(w is not None for w in self.windows)
        self._outputs: Dict[int, torch.Tensor] = {}
        self._experts_configs = list({id(m.config): m.config for m in moe}.values())
        self._norm_patches = norm_patches(modules) + rope_patches(modules)
        #: hybrid targets: the Gated-DeltaNet geometry and modules (None / empty for dense targets)
        self.linear_shape = (linear_shape(type(model).__name__, self.layers, spec.linear_layers)
                             if spec.linear_layers else None)
        self._linear_modules = linear_modules(self.layers, spec.linear_layers)
        # once per model: our passes compute its own forward, or it is refused (its side runs unpatched)
        probe = own_probe(model, self.layers, self.dtype, self.device, self.vocab_size,
                          attention=own_check_attention(self.config, spec),
                          switches=lambda: experts_patches(self._experts_configs, spec.experts))
        self._held = hold(self.patches())  # the model changes from here on
        try:
            check_own_forward(self, probe)
        except BaseException:
            self._held.release()
            raise

    # ----------------------------------------------------------- lifecycle
    def patches(self) -> List[Patch]:
        """What this adapter changes on the model while open: the patches its family row names, in order."""
        build = {
            "attention": lambda: attention_patches(self.config),
            "experts": lambda: experts_patches(self._experts_configs, self.spec.experts),
            "linear_forward": lambda: linear_patches(self._linear_modules),
        }
        unknown = [name for name in self.spec.family.patches if name not in build]
        if unknown:
            raise TargetStructureError(f"the {self.family} row names patches no adapter builds: {unknown} "
                                       f"(known: {', '.join(PATCHES)})")
        return [p for name in self.spec.family.patches for p in build[name]()] + self._norm_patches

    def close(self) -> None:
        """Release this adapter's patches (the last adapter open on the model gives it back its own
        attention and experts implementations and forwards). A second call does nothing."""
        self._outputs = {}
        self._held.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The hidden states' dtype: the lm_head weight's, or for a quantized one (a packed 4-bit weight is
        uint8) the embedding's."""
        for weight in (self.lm_head.weight, getattr(self.decoder.embed_tokens, "weight", None)):
            if isinstance(weight, torch.Tensor) and weight.dtype.is_floating_point:
                return weight.dtype
        return self.norm.weight.dtype

    @property
    def vocab_size(self) -> int:
        return self.head.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.head.hidden_size

    @property
    def hybrid(self) -> bool:
        """Whether the target has linear-attention (Gated-DeltaNet) layers."""
        return self.linear_shape is not None

    def cache_shape(self, max_len: int):
        """The ``kv`` shape of :meth:`new_cache` (the attention layers' K/V only, for hybrid targets)."""
        if self.hybrid:
            return HybridKVCache.kv_shape(self.config, self.linear_shape, max_len)
        return TargetKVCache.kv_shape(self.config, max_len, self.spec.kv_geometry)

    def new_cache(self, max_len: int, kv: Optional[torch.Tensor] = None, batch: int = 1) -> TargetKVCache:
        """The target's cache of ``max_len`` positions for ``batch`` sequences (a :class:`HybridKVCache` for hybrid
        targets: their linear-attention states per sequence too); ``kv``: caller storage of :meth:`cache_shape` (with the batch in front when
        ``batch > 1``; see :class:`~dflash.cache.KVBuffer`)."""
        if self.hybrid:
            return HybridKVCache(self.config, self.linear_shape, max_len, dtype=self.dtype, device=self.device,
                                 kv=kv, batch=batch)
        return TargetKVCache(self.config, max_len, dtype=self.dtype, device=self.device, kv=kv, batch=batch,
                             geometry=self.spec.kv_geometry, kv_layers=self.spec.kv_layers)

    def embed(self, ids: torch.Tensor, raw_scale: Optional[float] = None) -> torch.Tensor:
        """Token embeddings ``[..., H]`` of ``ids [...]`` (``[T]``, or ``[b, T]``; also the drafter's block input).

        ``raw_scale``: None, the embedding module's output (with a family's own
        scale, e.g. Gemma's ``sqrt(H)``); a float ``s``, the rows of the
        embedding weight times ``s`` (a z-lab drafter's ``input_embedding_scale``).
        """
        embedding = self.decoder.embed_tokens
        if raw_scale is None:
            return embedding(ids)
        if _embedding_is_dense(embedding):
            return F.embedding(ids, embedding.weight) * raw_scale
        if self.spec.family.embed_scale:  # the module's rows carry the family's scale: not the raw rows
            raise UnsupportedTargetFeature(type(self.model).__name__, "a raw-scaled drafter input over a wrapped "
                                           "scaled embedding", f"{type(embedding).__name__} is not a plain "
                                           "embedding and scales its rows itself")
        return embedding(ids) * raw_scale  # its own forward: an adapter on it (LoRA) or a quantized weight

    # ------------------------------------------------------------- forward
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: TargetKVCache,
        tree_bits: Optional[torch.Tensor] = None,
        tree_parents: Optional[torch.Tensor] = None,
        whole: bool = False,
    ) -> torch.Tensor:
        """:meth:`run_pass`, keeping the captured layers for :meth:`context_features`; returns ``hidden [T, H]``."""
        hidden, captured = self.run_pass(ids, positions, cache, tree_bits, tree_parents, whole)
        self._outputs = dict(zip(self.capture_layer_ids, captured))
        return hidden

    def run_pass(self, ids: torch.Tensor, positions: torch.Tensor, cache: TargetKVCache,
                 tree_bits: Optional[torch.Tensor] = None, tree_parents: Optional[torch.Tensor] = None,
                 whole: bool = False):
        """The decoder on ``ids [T]`` at ``positions [T]``: ``(hidden [T, H] pre-norm, captured)``, with
        ``captured[i] [T, H]`` the output of layer ``capture_layer_ids[i]``. The one pass of every caller.

        A batch of ``b`` sequences on a frozen batched cache: ``ids`` and ``positions`` ``[b, T]`` (``tree_bits
        [b, T, words]``, ``tree_parents [b, T]``), outputs ``[b, T, H]``; each sequence attends over its own
        cache rows only, at its own committed length.

        The new K/V go to the rows after the committed ones (the caller
        commits what it keeps): on an eager cache rows ``[length, length+T)``,
        on a frozen one (a decoding round, see :class:`TargetKVCache`) rows
        ``length_t + arange(T)``, nothing read on the host, so the pass can be
        traced and captured. Every committed row is visible; among the new
        rows, row ``i`` sees rows ``j <= i`` (causal: prefill, AR step, DFlash
        chain) or, with ``tree_bits [T, words]`` (DDTree), the rows whose bit
        is set in ``tree_bits[i]`` (positions then are ``start + depth``).
        Sliding-window layers also hide keys ``window`` or more positions back.
        No mask is built here: the attention function reads the pass's
        :class:`~dflash.target.attention.AttentionPass` (on a frozen cache
        with the reference backend, one ``[b, T, S]`` visibility per distinct
        window, shared by the layers).

        Hybrid targets: a tree pass also needs ``tree_parents [T]`` (``[b, T]``
        for a batch; int64 on the device, ``-1`` for the root): the
        linear-attention layers advance each node from its parent's state. ``whole=True`` says the caller
        commits every row (prefill): such a pass, like a one-row causal pass
        on an eager cache, runs the model's own Gated-DeltaNet forward, which
        advances the states in place; any other pass leaves them to the
        commit (:mod:`dflash.target.hybrid`).
        """
        single = ids.dim() == 1
        if single:
            ids, positions = ids[None], positions[None]
            tree_bits = None if tree_bits is None else tree_bits[None]
            tree_parents = None if tree_parents is None else tree_parents[None]
        b, T = ids.shape
        if b != cache.batch:
            raise ValueError(f"a pass of {b} sequences on a cache of {cache.batch}")
        if not cache.static and b != 1:
            raise ValueError("an eager pass (the prefill) runs one sequence at a time: prefill a batch row by row "
                             "through cache.row(r)")
        backend = dflash_kernels.get_backend(self.device)
        features = self._has_attn_features
        visible = None
        static = cache.static
        split = static and self._split_pass(cache, b, T, backend)
        if split:
            # one sequence on the CPU at a long prefix, its committed length exact on the host: every committed
            # key unmasked (:func:`dflash_kernels.reference.split_attention`), no [T, S] mask
            static = False
        elif static and backend != "triton":
            S = cache.key_rows(T)
            tree_pos = positions if tree_bits is not None else None
            # one causal row over exactly its keys (an eager AR step of one sequence) sees them all: no mask where no
            # window
            sees_all = cache.key_bound and tree_bits is None and T == 1 and b == 1
            visible = {w: None if sees_all and w is None else
                       dflash_kernels.tree_visibility(tree_bits, cache.length_t, T, n_keys=S, positions=tree_pos,
                                                      window=w)
                       for w in set(self.windows)}
        attention_pass = AttentionPass(
            prefix_len=cache.length_t if static else cache.length,
            bits=tree_bits if static or tree_bits is None else tree_bits[0],
            positions=(positions if static else positions[0]) if tree_bits is not None else None,
            windows=self.windows,
            backend=backend,
            softcaps=self.spec.attn_softcaps if features else (),
            sinks=self.spec.sinks if features else (),
            visible=visible,
            split=split,
        )
        kw = {self._cache_kw: cache, PASS_KWARG: attention_pass}
        if self.hybrid:
            kw[LINEAR_PASS_KWARG] = self._linear_pass(b, T, cache, tree_bits, tree_parents, whole)
        h = self.embed(ids)
        if self.spec.family.embed_norm:
            h = self.norm(h)
        per_layer = self._per_layer_inputs(ids, h)
        if self.spec.family.kv_sharing:  # what "store" layers hand the "reuse" layers of their type, this pass only
            kw["shared_kv_states"] = {}
        rope = self._position_embeddings(h, positions)
        wanted = set(self.capture_layer_ids)
        outputs = {}
        if cache.static:  # the rows every layer writes, once for the pass
            cache.pass_dest = cache.length_t[:, None] + cache.rows[:T]
        try:
            with active_pass(attention_pass):  # for layers that do not forward **kw to their attention
                for idx, (layer, position_embeddings) in enumerate(zip(self.layers, rope)):
                    if per_layer is not None:
                        kw["per_layer_input"] = per_layer[:, :, idx]
                    out = layer(h, attention_mask=None, position_ids=positions,
                                position_embeddings=position_embeddings, use_cache=True, **kw)
                    h = out[0] if isinstance(out, (tuple, list)) else out
                    if idx in wanted:
                        outputs[idx] = h[0] if single else h
        finally:
            cache.pass_dest = None
        return h[0] if single else h, [outputs[k] for k in self.capture_layer_ids]

    def _split_pass(self, cache, b: int, T: int, backend: str) -> bool:
        """Whether a round pass on the frozen ``cache`` attends its committed keys unmasked: one sequence on the
        CPU with the reference backend, its keys bounded by the host mirror (eager rounds:
        :attr:`KVBuffer.key_bound`), whose committed length is then exact (``length_t == length``, read by no one:
        the CPU is the host), at least :data:`SPLIT_MIN_PREFIX` of them, room for the pass's ``T`` rows (the
        layers' keys are then exactly ``[0, length + T)``), and a target that does not quantize its activations."""
        return (b == 1 and cache.key_bound and backend != "triton" and cache.length_t.device.type == "cpu"
                and SPLIT_MIN_PREFIX <= cache.length and cache.length + T <= cache.max_len
                and not self._quantized_activations)

    def _per_layer_inputs(self, ids: torch.Tensor, h: torch.Tensor) -> Optional[torch.Tensor]:
        """Gemma 4's per-layer inputs ``[b, T, L, P]`` (None for other families), as its decoder's forward computes
        them: the per-layer embedding of the ids combined with a projection of the embeddings ``h``."""
        if not self.spec.family.per_layer_inputs or not getattr(self.decoder, "hidden_size_per_layer_input", None):
            return None
        return self.decoder.project_per_layer_inputs(h, self.decoder.get_per_layer_inputs(ids, h))

    def _linear_pass(self, b: int, T: int, cache, tree_bits, tree_parents, whole: bool) -> LinearPass:
        """The hybrid layers' part of a pass of ``b`` sequences (see :meth:`forward`), announced to the cache."""
        if not isinstance(cache, HybridKVCache):
            raise TypeError(f"a hybrid target needs its HybridKVCache (adapter.new_cache), got {type(cache).__name__}")
        if tree_bits is not None:
            if tree_parents is None:
                raise ValueError("a tree pass on a hybrid target needs tree_parents= (the [T] parent index of each "
                                 "row, -1 for the root; [b, T] for a batch): its linear-attention layers advance "
                                 "each node from its parent's state")
            if tree_parents.shape != (b, T):
                want = f"[T] = [{T}]" if b == 1 else f"[b, T] = [{b}, {T}]"
                got = list(tree_parents.shape[1:]) if b == 1 and tree_parents.shape[0] == 1 else list(tree_parents.shape)
                raise ValueError(f"tree_parents must be {want}, got {got}")
            linear_pass = LinearPass(False, tree_parents.to(device=self.device, dtype=torch.long))
        else:
            linear_pass = LinearPass(whole or (T == 1 and not cache.static))
        cache.begin_pass(linear_pass, T)
        return linear_pass

    def _position_embeddings(self, h: torch.Tensor, pos: torch.Tensor) -> list:
        """Each layer's rotary ``(cos, sin)`` at ``pos [b, T]``: one table for all layers, or one per layer type
        (Gemma3).

        A multimodal-rope text model (Qwen3.5: ``rope_sections = 3``) takes the
        positions once per section, ``[3, b, T]`` (text: all sections equal)."""
        if self.spec.rope_sections:
            pos = pos[None].expand(self.spec.rope_sections, -1, -1)
        if self.spec.rope_types is None:
            return [self.rotary_emb(h, pos)] * self.num_layers
        tables = {t: self.rotary_emb(h, pos, t) for t in self.spec.rope_types}
        return [tables[t] for t in self.layer_types]

    def prefill(self, ids: torch.Tensor, cache: TargetKVCache, chunk_size: Optional[int] = None):
        """Prefill ``ids [P]`` in causal chunks of ``chunk_size`` rows (a generation's ``prefill_chunk_size``; default
        :data:`PREFILL_CHUNK`, else, for a target with a masked layer (:attr:`masked_layers`),
        :data:`MASKED_PREFILL_CHUNK`; None: the whole prompt in one pass), committing them.

        Returns ``(last_hidden [1, H], features)``: the pre-norm hidden state of
        the last prompt row and, when the adapter captures layers, the context
        features ``[P, n*H]`` of every prompt row (gathered chunk by chunk into
        one buffer), else None.
        """
        P = ids.numel()
        if chunk_size is None:
            chunk_size = PREFILL_CHUNK
        if chunk_size is None and self.masked_layers:
            chunk_size = MASKED_PREFILL_CHUNK
        chunk_size = max(P, 1) if chunk_size is None else int(chunk_size)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        features = None
        if self.capture_layer_ids:
            width = len(self.capture_layer_ids) * self.hidden_size
            features = torch.empty(P, width, dtype=self.dtype, device=self.device)
        hidden = None
        for s in range(0, P, chunk_size):
            e = min(P, s + chunk_size)
            hidden = self.forward(ids[s:e], torch.arange(s, e, device=ids.device), cache, whole=True)
            cache.commit(e - s)
            if features is not None:
                self.context_features(out=features[s:e], trusted_rows=True)
        return hidden[-1:], features

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
    def head_inputs(self, hidden: torch.Tensor):
        """``(hidden, kwargs)`` for any :mod:`dflash_kernels` lm_head op on the target's rows: the final norm
        (fused as ``norm_weight``/``eps`` when the module computes exactly the ops' RMSNorm, else applied here as
        the module) and the family's
        final-logit softcap (``softcap``). Every choice of a target token goes through this."""
        kw = {} if self.final_softcap is None else dict(softcap=self.final_softcap)
        if self.fuse_norm:
            return hidden, dict(norm_weight=self.norm.weight, eps=self.norm_eps, **kw)
        return self.norm(hidden), kw

    def choose(
        self,
        hidden: torch.Tensor,
        temperature: float = 0.0,
        positions: Optional[torch.Tensor] = None,
        generator: Optional[torch.Generator] = None,
        seed: Optional[int] = None,
    ) -> torch.Tensor:
        """The target's token after each selected row of pre-norm ``hidden [T, H]``.

        With logits ``z = W norm(h)`` (softcapped to ``c * tanh(z / c)`` when the
        family has a final-logit softcap ``c``, as its CausalLM head does):
        argmax at temperature 0 (of the logits in the lm_head's dtype, lowest id
        on ties, as transformers' ``generate()``), else a sample from
        ``softmax(z / T)`` (``seed`` or ``generator`` make it reproducible).
        ``positions`` come from our own loops and are not range-checked.
        """
        hidden, kw = self.head_inputs(hidden)
        if temperature <= 0:
            return self.head.argmax(hidden, positions=positions, check_bounds=False, **kw)
        return self.head.sample(hidden, temperature, positions=positions, generator=generator, seed=seed,
                                check_bounds=False, **kw)

    def logits(self, hidden: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """fp32 logits ``[N, V]`` at the selected rows of pre-norm ``hidden`` (final-logit softcap applied)."""
        hidden, kw = self.head_inputs(hidden)
        return self.head.logits(hidden, positions=positions, **kw)


def _embedding_is_dense(embedding) -> bool:
    """Whether ``embedding.weight`` is the embedding's rows as they are: an ``nn.Embedding`` (or a subclass) whose
    weight is a plain dense float tensor (not a quantized subclass; not an adapter wrapper around it)."""
    weight = getattr(embedding, "weight", None)
    return (isinstance(embedding, torch.nn.Embedding) and type(weight) in (torch.Tensor, torch.nn.Parameter)
            and weight.dtype.is_floating_point)
