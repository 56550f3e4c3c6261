"""What each decoder family does differently: the one capability table the adapter and attention read.

The adapter drives ``model.layers`` by hand (embed, rotary embedding, the
layers with our cache and attention function, the final norm and lm_head at
the rows we need), so everything a family's own ``forward`` does beyond the
generic Llama shape must be known here, or refused. The facts below are read
from transformers' modeling files (5.17 and 5.24 agree on all of them).

Per family (:data:`FAMILIES`, keyed by ``config.model_type``):

* **windows**: which layers slide. ``"layer_types"``: layer ``l`` sees keys
  with ``pos_q - pos_k < w`` (``w = config.sliding_window``) iff
  ``config.layer_types[l] == "sliding_attention"`` (Qwen2/3, Gemma2/3,
  gpt-oss). ``"all"``: Mistral, Phi-3 and Qwen3-MoE have no ``layer_types``;
  their attention passes ``sliding_window=config.sliding_window`` on every
  layer, so every layer slides when it is set (Qwen3-MoE: with
  ``use_sliding_window``).
* **rope per layer type**: Gemma3's ``rotary_emb(x, pos, layer_type)`` keeps
  one frequency table per layer type (local layers theta 1e4, global 1e6);
  layer ``l`` gets the ``(cos, sin)`` of its own type.
* **attention softcap** (config key): scores ``s = q.k * scale`` become
  ``c * tanh(s / c)`` before the mask and the softmax (Gemma2,
  ``attn_logit_softcapping``; transformers 5.17 loads Gemma2 with SDPA, which
  ignores it: we apply it and warn, see :data:`SOFTCAP_BLIND_IMPLEMENTATIONS`). Gemma3's config has the key too but its
  attention never passes it on (the model ignores it; so do we).
* **final-logit softcap** (config key): the CausalLM head returns
  ``c * tanh(W h / c)`` (Gemma2/3, ``final_logit_softcapping``). The target's
  choices (argmax, samples, logits) use it; the drafter's proposals and
  DDTree's top-K do not (the drafter borrows the bare lm_head, as it was
  trained: see :attr:`TargetSpec.final_softcap`).
* **sinks** (attribute of ``self_attn``): one logit ``b_h`` per query head
  joins each softmax denominator and no value:
  ``p_ij = exp(s_ij) / (exp(b_h) + sum_k exp(s_ik))`` (gpt-oss ``sinks``,
  passed to the attention function as ``s_aux``).
* **query scale**: ``scale = query_pre_attn_scalar ** -0.5`` (Gemma2/3) or
  ``head_dim ** -0.5``; the attention module's ``scaling`` attribute holds it
  and is what the attention function receives; checked at construction.
* **embedding scale**: Gemma multiplies the token embeddings by
  ``sqrt(hidden_size)`` inside ``embed_tokens`` (a ``*ScaledWordEmbedding``,
  rounded to the weight dtype), so ``TargetAdapter.embed`` -- the target's
  forward input and the drafter's block input alike -- carries it; checked.
* **fused norm**: not a row field. The final norm is fused into the lm_head
  ops only when the module computes exactly their ``w * normed(x).to(dtype)``
  (Llama style), which :func:`dflash.target.final_norm.fusable_norm` checks by
  running it; Gemma's ``(1 + w)`` norm, gpt-oss' ``(w * normed(x)).to(dtype)``,
  LayerNorms (StableLM, Nemotron's ``1 + w``, Cohere) and weightless norms
  run as modules instead.
* **linear attention** (hybrid targets: Qwen3.5, Qwen3.5-MoE, Qwen3-Next):
  layers whose ``layer_types`` entry is ``"linear_attention"`` hold a
  Gated-DeltaNet module ``linear_attn`` of the class the row names instead of
  a ``self_attn``; they keep a convolution window and a recurrent state, not
  K/V (:mod:`dflash.target.hybrid`: the cache, and the verify forward that is
  installed on those modules while an adapter is open). Their MoE layers
  (Qwen3-Next, Qwen3.5-MoE) add a shared expert behind a sigmoid gate: plain
  linear layers, no host read, next to the routed experts (below).
* **rope sections**: Qwen3.5's text rotary embedding is multimodal-rope shaped:
  it takes position ids ``[3, batch, T]`` (temporal, height, width; all equal
  for text) and transformers 5.17 cannot broadcast ``[batch, T]`` there, so the
  adapter hands it ``positions`` expanded to ``rope_sections`` rows.
* **K/V geometry per layer**: read from each attention module (:func:`_kv_geometry`); when the layers differ
  (Gemma 4's ``global_head_dim`` layers, MiMo-V2-Flash's doubled sliding K/V heads and narrower values) the
  cache is padded to the largest and each layer gets its corner (:class:`~dflash.cache.KVBuffer`).
* **per-layer inputs / KV sharing** (Gemma 4): the decoder computes a ``per_layer_input`` for every layer from
  the ids and the embeddings, which the adapter computes the same way; ``reuse`` layers attend over the K/V the
  last ``store`` layer of their type returned from the cache, handed on in one ``shared_kv_states`` dict per
  pass.
* **MoE**: the experts dispatch on ``config._experts_implementation``
  (transformers' ``@use_experts_implementation``). The ``"eager"`` loop reads
  the hit experts back to the host once per MoE layer per forward; while an
  adapter is open the experts run ``"grouped_mm"`` (one grouped GEMM over
  expert-sorted rows, offsets from ``histc`` on the device) where torch's
  grouped GEMM runs without a host read (:func:`grouped_mm_fast_path`: CUDA
  compute capability 9.x / 10.x with bf16 experts, or the CPU), restored on
  close (:func:`experts_patches`); elsewhere the model's own implementation is
  kept (:func:`choose_experts_implementation` says why).
* **patches** (derived from the row, :attr:`Family.patches`): what an open
  adapter changes on the model, each a patch held in
  :mod:`dflash.target.patches` (applied by the first adapter opened on the
  model, restored by the last one closed): ``attention`` (every family: the
  config names our attention function), ``experts`` (MoE families, and
  unknown ones, whose modules are probed: the implementation above, when it
  changes), ``linear_forward`` (hybrids: the Gated-DeltaNet verify forward).

Unknown ``model_type``: the generic entry (Llama shape; windows per
``layer_types`` when the config has them, else from the attention modules'
``sliding_window`` attributes, else every layer; rope per layer type when
``rotary_emb.forward`` takes a ``layer_type``; MoE when experts dispatch on the
config; the softcaps and sinks by transformers' names:
``attn_logit_softcapping``, ``final_logit_softcapping``, ``self_attn.sinks``).
A feature the table cannot vouch for is refused at construction with an
:class:`UnsupportedTargetFeature` naming it (:func:`resolve_target`); every
pass cross-checks what each attention module passes its attention function
(``sliding_window``, ``softcap``, ``s_aux``) against the table; and when a
model is first adapted our passes are compared with its own forward
(:mod:`dflash.target.own_forward_check`): a disagreement is an error, never a
silently different answer.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .final_norm import fusable_norm
from .patches import Patch, original

#: transformers attention implementations that silently drop a ``softcap`` argument (SDPA has no such input;
#: transformers 5.17 still loads Gemma2 with it, 5.24 refuses).
SOFTCAP_BLIND_IMPLEMENTATIONS = ("sdpa",)

#: The two layer types the attention function implements.
LAYER_TYPES = ("full_attention", "sliding_attention")

#: The layer type of Gated-DeltaNet layers (hybrid targets; only families whose row names the module class).
LINEAR_ATTENTION = "linear_attention"


class TargetStructureError(TypeError):
    """The model does not expose the parts the adapter drives."""


class UnsupportedTargetFeature(TargetStructureError):
    """The target uses a feature the adapter does not implement (named in the message)."""

    def __init__(self, model_name: str, feature: str, detail: str = ""):
        self.feature = feature
        super().__init__(f"{model_name} cannot be used as a target: unsupported feature: {feature}"
                         + (f" ({detail})" if detail else ""))


@dataclass(frozen=True)
class Family:
    """One row of the capability table (see the module docstring for each field's meaning)."""

    name: str
    windows: str = "layer_types"  # "layer_types" | "all" | "auto" (generic)
    rope_per_layer_type: bool = False
    attn_softcap: Optional[str] = None  # config key of the score softcap the attention module passes on
    final_softcap: Optional[str] = None  # config key of the final-logit softcap of the CausalLM head
    sinks: Optional[str] = None  # attribute of self_attn: per-query-head sink logits [Hq]
    query_scale: str = "head_dim"  # "head_dim" | "query_pre_attn_scalar" | "module" (generic: not checked)
    embed_scale: bool = False  # embed_tokens scales by sqrt(hidden_size) itself
    moe: bool = False
    known: bool = True
    linear_attention: Optional[str] = None  # class name of the Gated-DeltaNet module of "linear_attention" layers
    rope_sections: int = 0  # the rotary embedding takes position ids [rope_sections, batch, T] (Qwen3.5: 3)
    embed_norm: bool = False  # the decoder applies its final norm to the embeddings too, before the layers
    per_layer_inputs: bool = False  # each layer takes a per_layer_input the decoder computes from the ids (Gemma 4)
    kv_sharing: bool = False  # layers hand K/V on through a shared_kv_states dict of the pass (Gemma 4)

    @property
    def patches(self) -> Tuple[str, ...]:
        """What an open adapter changes on a model of this family (:data:`PATCHES`), in the order applied."""
        names = ["attention"]
        if self.moe or not self.known:  # an unknown family may hold experts modules: probed, switched if so
            names.append("experts")
        if self.linear_attention:
            names.append("linear_forward")
        return tuple(names)


#: The patches a family row can name (:attr:`Family.patches`), each held while an adapter is open
#: (:mod:`dflash.target.patches`): the config's attention implementation (every family: our one attention
#: function, :func:`dflash.target.attention.attention_patches`), the experts implementation of MoE families
#: (:func:`experts_patches`), and the Gated-DeltaNet modules' forward of hybrid families
#: (:func:`dflash.target.hybrid.linear_patches`).
PATCHES = ("attention", "experts", "linear_forward")


#: The capability table, keyed by ``config.model_type``.
FAMILIES: Dict[str, Family] = {
    "llama": Family("Llama"),
    "qwen2": Family("Qwen2"),
    "qwen3": Family("Qwen3"),
    "mistral": Family("Mistral", windows="all"),
    "phi3": Family("Phi-3", windows="all"),
    "gemma2": Family("Gemma2", attn_softcap="attn_logit_softcapping", final_softcap="final_logit_softcapping",
                     query_scale="query_pre_attn_scalar", embed_scale=True),
    "gemma3_text": Family("Gemma3", rope_per_layer_type=True, final_softcap="final_logit_softcapping",
                          query_scale="query_pre_attn_scalar", embed_scale=True),
    "qwen3_moe": Family("Qwen3-MoE", windows="all", moe=True),
    "gpt_oss": Family("gpt-oss", sinks="sinks", moe=True),
    # hybrids: (1 + w) RMSNorms (not fusable), gated attention (the module applies its output gate itself)
    "qwen3_5_text": Family("Qwen3.5", linear_attention="Qwen3_5GatedDeltaNet", rope_sections=3),
    "qwen3_5_moe_text": Family("Qwen3.5-MoE", linear_attention="Qwen3_5MoeGatedDeltaNet", rope_sections=3,
                               moe=True),
    "qwen3_next": Family("Qwen3-Next", linear_attention="Qwen3NextGatedDeltaNet", moe=True),
    # nanochat: model.norm (weightless RMSNorm) on the embeddings before the layers too; a final-logit softcap
    "nanochat": Family("nanochat", final_softcap="final_logit_softcapping", embed_norm=True),
    # Gemma 4: per-layer K/V geometry (global layers: global_head_dim), query scale 1 (q/k norms), per-layer
    # inputs, KV sharing ("reuse" layers read the K/V an earlier "store" layer of their type returned from the cache),
    # optional MoE block beside the MLP; attention_k_eq_v and layer_scalar live inside the modules
    "gemma4_text": Family("Gemma 4", rope_per_layer_type=True, final_softcap="final_logit_softcapping",
                          query_scale="module", embed_scale=True, moe=True, per_layer_inputs=True, kv_sharing=True),
}

#: Unknown families: the generic decoder shape, features probed from the modules.
GENERIC = Family("generic decoder", windows="auto", query_scale="module", known=False)


def _truthy(config, key) -> bool:
    return bool(getattr(config, key, None))


#: Config features no family implements here: (config predicate, feature name).
REFUSED = (
    # Gemma 4's "vision" (image tokens attend both ways) is the multimodal model's mask: its text model is causal
    (lambda c: _truthy(c, "use_bidirectional_attention") and not (
        getattr(c, "model_type", None) == "gemma4_text" and c.use_bidirectional_attention == "vision"),
     "bidirectional attention (use_bidirectional_attention)"),
    (lambda c: getattr(c, "attention_chunk_size", None) is not None, "chunked attention (attention_chunk_size)"),
    (lambda c: getattr(c, "kv_lora_rank", None) is not None, "multi-head latent attention (kv_lora_rank)"),
    # the head scales its logits after the GEMM (in the model dtype: a second rounding, which the fused argmax and
    # sampling ops do not reproduce, so ties could break differently)
    (lambda c: getattr(c, "logit_scale", None) not in (None, 1, 1.0), "scaled logits (logit_scale)"),
    (lambda c: getattr(c, "logits_scaling", None) not in (None, 1, 1.0), "scaled logits (logits_scaling)"),
)


@dataclass
class TargetSpec:
    """What one model's passes must do, resolved from its family row, its config and its modules.

    ``windows[l]``, ``attn_softcaps[l]``, ``sinks[l]`` (the module's own
    parameter, not a copy): layer ``l``'s sliding window, score softcap and
    sink logits, or None. ``rope_types``: the layer types to compute rotary
    tables for (None: one table for every layer). ``final_softcap``: applied
    to the target's logits in every choice (not to the drafter's).
    ``experts``: the experts implementation to run while an adapter is open
    (None: not an MoE model, or the model's own is kept: see
    :func:`choose_experts_implementation`).
    ``linear_layers``: the indices of the Gated-DeltaNet layers (hybrid
    targets; empty otherwise). ``rope_sections``: rows of position ids the
    rotary embedding takes (0: ``[batch, T]`` as usual). ``kv_geometry``, ``kv_layers``: the K/V ``(Hkv, Dk,
    Dv)`` of each layer that keeps K/V, and those layers' indices, when the layers differ in shape or some keep
    none (Gemma 4's KV sharing); None: a slot of the config's one geometry per layer (:func:`_kv_geometry`).
    """

    family: Family
    layer_types: List[str]
    windows: List[Optional[int]]
    attn_softcaps: List[Optional[float]]
    sinks: List[Optional[torch.Tensor]]
    rope_types: Optional[Tuple[str, ...]]
    final_softcap: Optional[float]
    fuse_norm: bool
    norm_eps: Optional[float]
    experts: Optional[str]
    linear_layers: List[int] = field(default_factory=list)
    rope_sections: int = 0
    kv_geometry: Optional[List[Tuple[int, int, int]]] = None
    kv_layers: Optional[List[int]] = None


def _float_or_none(value) -> Optional[float]:
    return None if value is None else float(value)


def _family_of(config) -> Family:
    return FAMILIES.get(getattr(config, "model_type", None), GENERIC)


def _takes_layer_type(rotary_emb) -> bool:
    try:
        return "layer_type" in inspect.signature(rotary_emb.forward).parameters
    except (TypeError, ValueError):
        return False


def experts_modules(model, modules=None) -> list:
    """Modules dispatching on ``config._experts_implementation`` (transformers' ``@use_experts_implementation``);
    ``modules``: ``model.modules()`` when the caller already listed them."""
    return [m for m in (model.modules() if modules is None else modules)
            if hasattr(m, "has_gate") and hasattr(m, "is_transposed") and hasattr(getattr(m, "config", None),
                                                                                  "_experts_implementation")]


def _torch_version() -> Tuple[int, int]:
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return major, minor


def grouped_mm_fast_path(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM runs experts of ``dtype`` on ``device`` with no host read.

    CUDA: ``aten::_grouped_mm`` (``_grouped_mm_cuda``, torch 2.11 and 2.13
    alike) takes its CUTLASS kernel only when both operands and the output
    are bf16 and the device's compute capability major is 9 or 10 (the
    kernels are built for sm_90 and sm_100 only); anything else, sm_80 and
    sm_120 included, goes to ``_grouped_mm_fallback``, which copies the
    offsets to the host (``offs.cpu()``: a device-to-host sync) and loops over
    the groups, once per grouped GEMM, two per MoE layer. transformers casts
    the rows to the experts' weight dtype, so ``dtype`` is that weight dtype.
    ROCm builds without the CK kernel fall back too: not claimed.
    CPU: torch > 2.10 has a CPU kernel (older ones need 16-byte-aligned
    tensors or have none); its loop runs where the data is, so there is no
    device to wait for.
    """
    if not (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False
    if device.type == "cuda":
        if getattr(torch.version, "hip", None):
            return False
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)
    if device.type == "cpu":
        return _torch_version() > (2, 10)
    return False


def experts_dtype(module) -> Optional[torch.dtype]:
    """The dtype of an experts module's weights (what transformers casts the rows to), or None."""
    for name in ("gate_up_proj", "up_proj", "down_proj"):
        weight = getattr(module, name, None)
        if isinstance(weight, torch.Tensor) and weight.dtype.is_floating_point:
            return weight.dtype
    for p in module.parameters(recurse=False):
        if p.dtype.is_floating_point:
            return p.dtype
    return None


def choose_experts_implementation(current: Optional[str], device: torch.device,
                                  dtype: Optional[torch.dtype]) -> Optional[str]:
    """The implementation to switch to while open, or None to keep ``current``.

    ``"eager"`` (a host read per MoE layer) becomes ``"grouped_mm"`` where
    torch's grouped GEMM has no host read for these experts
    (:func:`grouped_mm_fast_path`); anything else is kept. Not grouped_mm
    elsewhere: there torch falls back to a loop that syncs on its offsets
    once per grouped GEMM, two per MoE layer, where the eager loop syncs
    once. Not ``"batched_mm"`` either: it gathers a full copy of the expert
    weights for every (row, expert) pair (``S x out x in``: over 100 GB for
    one 2048-row prefill chunk of gpt-oss-20b), so the model's own
    implementation stays. ``dtype``: the experts' weight dtype (None:
    unknown, kept).
    """
    if current in (None, "eager") and dtype is not None and grouped_mm_fast_path(device, dtype):
        return "grouped_mm"
    return None


def _layer_windows(family: Family, config, layers, layer_types) -> List[Optional[int]]:
    """Window of each layer (None: full attention), by the family's rule."""
    w = getattr(config, "sliding_window", None)
    w = None if w is None else int(w)
    if family.windows == "all":
        return [w] * len(layers)
    if family.windows == "auto":
        if getattr(config, "layer_types", None):  # transformers' convention: windows where the type slides
            return [w if t == "sliding_attention" else None for t in layer_types]
        if all(hasattr(layer.self_attn, "sliding_window") for layer in layers):
            return [None if layer.self_attn.sliding_window is None else int(layer.self_attn.sliding_window)
                    for layer in layers]
        if not getattr(config, "layer_types", None):
            return [w] * len(layers)  # transformers' convention without layer_types: every layer slides
    return [w if t == "sliding_attention" else None for t in layer_types]


def _layer_kinds(name: str, family: Family, config, layers) -> Tuple[List[str], List[int]]:
    """``(layer_types, linear_layers)``: each layer's type (all full attention without ``layer_types``) and the
    indices of the Gated-DeltaNet layers; every layer must hold the mixer its type names, with its own index."""
    types = getattr(config, "layer_types", None)
    layer_types = list(types) if types else ["full_attention"] * len(layers)
    if len(layer_types) != len(layers):
        raise UnsupportedTargetFeature(name, "layer_types", f"{len(layer_types)} entries for {len(layers)} layers")
    allowed = LAYER_TYPES + ((LINEAR_ATTENTION,) if family.linear_attention else ())
    unknown = sorted(set(layer_types) - set(allowed))
    if unknown:
        raise UnsupportedTargetFeature(name, f"layer type {unknown[0]!r}", f"implemented: {', '.join(allowed)}")
    linear_layers = [i for i, t in enumerate(layer_types) if t == LINEAR_ATTENTION]
    for i, layer in enumerate(layers):
        if i in linear_layers:
            mixer = getattr(layer, "linear_attn", None)
            if type(mixer).__name__ != family.linear_attention or getattr(mixer, "layer_idx", None) != i:
                raise UnsupportedTargetFeature(name, "linear-attention layer",
                                               f"layer {i} holds {type(mixer).__name__}, {family.name} layers hold "
                                               f"a {family.linear_attention} whose layer_idx is its index")
            continue
        attn = getattr(layer, "self_attn", None)
        if attn is None or getattr(attn, "layer_idx", None) != i:
            raise UnsupportedTargetFeature(name, "decoder layer without a self_attn whose layer_idx is its index",
                                           f"layer {i}")
    return layer_types, linear_layers


def _softcaps_and_sinks(name: str, family: Family, config, layers, attention_layers, linear_layers=()):
    """``(attention softcap, final-logit softcap, sinks per layer)``: a known family names its keys and
    parameters; an unknown one is read by transformers' names (``attn_logit_softcapping``,
    ``final_logit_softcapping``, ``self_attn.sinks``), each then checked against what its modules pass and
    against the model's own forward. Warns when the model's own attention drops the
    softcap (:data:`SOFTCAP_BLIND_IMPLEMENTATIONS`)."""
    attn_key, final_key, sinks_attr = family.attn_softcap, family.final_softcap, family.sinks
    if not family.known:
        # transformers' own names: what the modules pass is checked on every pass (the attention function), and
        # the whole forward once against the model's own (:mod:`dflash.target.own_forward_check`)
        attn_key, final_key = "attn_logit_softcapping", "final_logit_softcapping"
        if any(isinstance(getattr(l.self_attn, "sinks", None), torch.Tensor) for l in attention_layers):
            sinks_attr = "sinks"
    attn_cap = _float_or_none(getattr(config, attn_key, None)) if attn_key else None
    loaded_attention = original(config, "_attn_implementation")  # an open adapter's switch aside
    if attn_cap is not None and loaded_attention in SOFTCAP_BLIND_IMPLEMENTATIONS:
        warnings.warn(f"{name} was loaded with attn_implementation={loaded_attention!r}, which ignores "
                      f"the attention softcap ({attn_key}={attn_cap}): the model's own forward drops it, our passes "
                      "apply it (as eager and flash attention do, and the checkpoint was trained with). Load it with "
                      "attn_implementation='eager' to compare outputs.", stacklevel=4)
    final_cap = _float_or_none(getattr(config, final_key, None)) if final_key else None
    sinks: List[Optional[torch.Tensor]] = [None] * len(layers)
    if sinks_attr:
        sinks = [None if i in linear_layers or not isinstance(getattr(l.self_attn, sinks_attr, None), torch.Tensor)
                 else getattr(l.self_attn, sinks_attr) for i, l in enumerate(layers)]
        if family.known and any(not isinstance(s, torch.Tensor) for i, s in enumerate(sinks) if i not in linear_layers):
            raise UnsupportedTargetFeature(name, "attention sinks",
                                           f"{family.name} attention modules without a {sinks_attr!r} parameter")
    return attn_cap, final_cap, sinks


def config_value(config, key: str, default=None):
    """``config.<key>``, or ``default`` when it is absent or per-layer (transformers raises on a global read of an
    attribute that varies across layers, e.g. Gemma 4's ``head_dim``)."""
    try:
        return getattr(config, key, default)
    except Exception:  # noqa: BLE001 -- AmbiguousGlobalPerLayerAttributeError and the like: no one value
        return default


def _kv_geometry(name: str, config, layers, linear_layers):
    """``(geometry, kv_layers)``: each K/V-keeping layer's ``(Hkv_l, Dk_l, Dv_l)`` read from its attention module
    (``head_dim``, ``k_proj``, ``v_proj``) and the indices of those layers, or ``(None, None)`` when every attention
    layer keeps K/V of the config's one geometry (the plain cache layout, a slot per layer). Per-layer geometries
    (Gemma 4's global layers: ``global_head_dim``; MiMo-V2-Flash's sliding layers: twice the K/V heads, and its
    ``v_head_dim`` values) get a padded cache whose slot of layer ``l`` is the corner ``[:Hkv_l, :, :D_l]``
    (:class:`~dflash.cache.KVBuffer`). A layer that keeps no K/V of its own (Gemma 4's KV-sharing ``reuse``
    layers: ``is_kv_shared_layer``, no ``k_proj``) gets no slot at all. Refused by name: either on a hybrid
    target."""
    head_dim = config_value(config, "head_dim") or config.hidden_size // config.num_attention_heads
    kv_heads = config_value(config, "num_key_value_heads") or config.num_attention_heads
    geometry, kv_layers = [], []
    for i, layer in enumerate(layers):
        if i in linear_layers:
            continue
        attn = layer.self_attn
        if getattr(attn, "is_kv_shared_layer", False):
            continue  # reads another layer's K/V (handed on by the pass), writes none
        d = getattr(attn, "head_dim", head_dim)
        if not isinstance(d, int) or d <= 0:
            d = head_dim
        k_out = getattr(getattr(attn, "k_proj", None), "out_features", None)
        h = k_out // d if isinstance(k_out, int) else kv_heads
        v_out = getattr(getattr(attn, "v_proj", None), "out_features", None)
        dv = v_out // h if isinstance(v_out, int) and h and v_out % h == 0 else d
        geometry.append((h, d, dv))
        kv_layers.append(i)
    attention = [i for i in range(len(layers)) if i not in linear_layers]
    if kv_layers == attention and all(g == (kv_heads, head_dim, head_dim) for g in geometry):
        return None, None
    if linear_layers:
        raise UnsupportedTargetFeature(name, "per-layer K/V shapes on a hybrid target",
                                       f"K/V (heads, key dims, value dims) of layers {kv_layers}: {geometry}")
    return geometry, kv_layers


def _check_scales(name: str, family: Family, config, decoder, layers, linear_layers) -> None:
    """The query scale (the attention module's ``scaling``, what its attention function receives) and the
    embedding scale (inside ``embed_tokens``: the forward's input and the drafter's block input alike) are the
    family's."""
    if family.query_scale != "module":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base = config.query_pre_attn_scalar if family.query_scale == "query_pre_attn_scalar" else head_dim
        want = float(base) ** -0.5
        for i, layer in enumerate(layers):
            if i in linear_layers:
                continue
            got = getattr(layer.self_attn, "scaling", None)
            if got is None or abs(float(got) - want) > 1e-12 * want:
                raise UnsupportedTargetFeature(name, "query scaling", f"layer {i} scales by {got}, {family.name} by "
                                                                      f"{family.query_scale}**-0.5 = {want}")
    if family.embed_scale and getattr(decoder.embed_tokens, "embed_scale", None) is None:
        raise UnsupportedTargetFeature(name, "embedding scale", f"{family.name} scales embeddings by "
                                       f"sqrt(hidden_size), but {type(decoder.embed_tokens).__name__} does not")


def _rope_types(name: str, family: Family, rotary_emb, layer_types, linear_layers) -> Optional[Tuple[str, ...]]:
    """The layer types to compute rotary tables for (None: one table for every layer)."""
    takes_type = _takes_layer_type(rotary_emb)
    if family.rope_per_layer_type != takes_type and family.known:
        raise UnsupportedTargetFeature(name, "rotary embedding per layer type", f"{family.name} expects "
                                       f"{'a' if family.rope_per_layer_type else 'no'} layer_type argument")
    if not takes_type:
        return None
    known_types = getattr(rotary_emb, "rope_type", None)
    if isinstance(known_types, dict):
        missing = sorted(t for t in set(layer_types) if t != LINEAR_ATTENTION and t not in known_types)
        if missing:
            raise UnsupportedTargetFeature(name, "layers without a rotary embedding",
                                           f"the rotary module has no table for layer type {missing[0]!r} (no-RoPE "
                                           "layers, whose attention scaling depends on the position)")
    if linear_layers:
        raise UnsupportedTargetFeature(name, "rotary embedding per layer type on a hybrid target")
    return tuple(sorted(set(layer_types)))


def _experts_choice(name: str, family: Family, model, lm_head, moe=None) -> Optional[str]:
    """The experts implementation to run while open (None: no experts, or the model's own is kept), chosen from
    the one the model was loaded with (:func:`choose_experts_implementation`); ``moe``: the model's
    :func:`experts_modules` when the caller has them."""
    moe = experts_modules(model) if moe is None else moe
    if not moe:
        return None
    if family.known and not family.moe:
        raise UnsupportedTargetFeature(name, "mixture of experts", f"{family.name} is a dense family")
    weight = next((p for p in moe[0].parameters() if p.dtype.is_floating_point), lm_head.weight)
    loaded = original(moe[0].config, "_experts_implementation")  # an open adapter's switch aside
    return choose_experts_implementation(loaded, weight.device, experts_dtype(moe[0]))


def resolve_target(model, decoder, layers, norm, lm_head, rotary_emb, experts=None) -> TargetSpec:
    """The :class:`TargetSpec` of ``model``, or :class:`UnsupportedTargetFeature` naming what we cannot do
    (``experts``: the model's :func:`experts_modules` when the caller has them)."""
    config = model.config
    name = type(model).__name__
    family = _family_of(config)
    for predicate, feature in REFUSED:
        if predicate(config):
            raise UnsupportedTargetFeature(name, feature)
    if getattr(lm_head, "bias", None) is not None:
        raise UnsupportedTargetFeature(name, "lm_head bias")
    layer_types, linear_layers = _layer_kinds(name, family, config, layers)
    attention_layers = [layer for i, layer in enumerate(layers) if i not in linear_layers]
    attn_cap, final_cap, sinks = _softcaps_and_sinks(name, family, config, layers, attention_layers, linear_layers)
    kv_geometry, kv_layers = _kv_geometry(name, config, layers, linear_layers)
    _check_scales(name, family, config, decoder, layers, linear_layers)
    rope_types = _rope_types(name, family, rotary_emb, layer_types, linear_layers)
    experts = _experts_choice(name, family, model, lm_head, experts)
    eps = fusable_norm(norm)
    return TargetSpec(
        family=family, layer_types=layer_types, windows=_layer_windows(family, config, layers, layer_types),
        attn_softcaps=[attn_cap] * len(layers), sinks=sinks, rope_types=rope_types, final_softcap=final_cap,
        fuse_norm=eps is not None, norm_eps=eps, experts=experts, linear_layers=linear_layers,
        rope_sections=family.rope_sections, kv_geometry=kv_geometry, kv_layers=kv_layers,
    )

def own_check_attention(config, spec: "TargetSpec") -> Optional[str]:
    """The attention implementation the forward check runs the model's own forward with (None: the one it was
    loaded with): ``"eager"`` when that one drops an attention softcap the model has (we apply it, as the
    checkpoint was trained; :data:`SOFTCAP_BLIND_IMPLEMENTATIONS`)."""
    loaded = original(config, "_attn_implementation")
    if loaded in SOFTCAP_BLIND_IMPLEMENTATIONS and any(c is not None for c in spec.attn_softcaps):
        return "eager"
    return None


def experts_patches(configs: Sequence, implementation: Optional[str]) -> list:
    """The patches that run the experts of ``configs`` with ``implementation`` while an adapter holds them
    (:mod:`dflash.target.patches`); none when ``implementation`` is None (the model's own is kept)."""
    if implementation is None:
        return []
    return [Patch(config, "_experts_implementation", implementation, label="experts implementation")
            for config in configs]


def family_table() -> List[Dict[str, object]]:
    """The table as rows (README / docs / tests print it)."""
    rows = []
    for model_type, f in FAMILIES.items():
        rows.append(dict(model_type=model_type, family=f.name, windows=f.windows,
                         rope_per_layer_type=f.rope_per_layer_type, attn_softcap=f.attn_softcap,
                         final_softcap=f.final_softcap, sinks=f.sinks, query_scale=f.query_scale,
                         embed_scale=f.embed_scale, moe=f.moe,
                         linear_attention=f.linear_attention, rope_sections=f.rope_sections, embed_norm=f.embed_norm,
                         per_layer_inputs=f.per_layer_inputs, kv_sharing=f.kv_sharing,
                         patches=f.patches))
    return rows
