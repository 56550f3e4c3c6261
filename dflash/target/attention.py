"""The one attention function of every target pass (prefill, AR step, chain verify, tree verify).

Registered as ``"dflash"`` in transformers' ``AttentionInterface``. While a
:class:`~dflash.target.adapter.TargetAdapter` is open, the model's config names
it (set once when the adapter opens, restored when the last one on that model
closes, by :func:`attention_patches` held in :mod:`dflash.target.patches`:
never flipped during a pass, so a pass can be traced or captured). Our passes hand every
layer an :class:`AttentionPass` through the layers' attention kwargs; a call
without one (the user running the model while an adapter is open) goes to the
implementation the model was loaded with, unchanged.

What a pass attends to. Its ``T`` rows sit after ``prefix_len`` committed keys
(key ``j < prefix_len`` has position ``j``); the layer's ``key/value`` are
views ``[1, Hkv, prefix_len + T, D]`` of our cache. Query ``i`` sees

* every committed key (subject to the layer's window),
* among the pass's own keys: ``j <= i`` (causal: prefill chunks, AR steps,
  the DFlash chain), or the ancestors-or-self given by ``bits`` (DDTree),
* with a sliding window ``w``: only keys with ``pos_q - pos_k < w``.

Scores are ``s = q.k * scale`` (the module's own ``scaling``: Gemma's
``query_pre_attn_scalar ** -0.5``), then, per the family table
(:mod:`dflash.target.families`), ``c * tanh(s / c)`` with an attention
softcap ``c`` (Gemma2), and with sink logits ``b_h`` (gpt-oss) the softmax
over the visible keys gains one value-less term:
``p_ij = exp(s_ij) / (exp(b_h) + sum_k exp(s_ik))``. Each layer's window,
softcap and sinks come from the pass, and are checked against what the
module hands its attention function (``sliding_window``, ``softcap``,
``s_aux``): a disagreement raises
:class:`~dflash.target.families.UnsupportedTargetFeature`.

Paths (no layer ever receives a dense mask from us):

* the first prefill chunk (``prefix_len == 0``, causal, no window, no
  softcap, no sinks): ``F.scaled_dot_product_attention(is_causal=True,
  enable_gqa=True)`` on every backend (flash / cuDNN on a GPU; GQA native, no
  ``repeat_kv``);
* every other pass on the Triton backend: :func:`dflash_kernels.tree_attention`
  (chain mode for causal passes, the ancestor bits for trees, the window,
  softcap and sinks applied inside the kernel, the GQA group packed into its
  query tiles);
* the reference backend: SDPA with ``enable_gqa=True`` and a boolean mask of
  this pass only, ``[T, prefix_len + T]``
  (:func:`dflash_kernels.reference.tree_visibility`; built once per pass and
  window, shared by the layers: :attr:`AttentionPass.memo`), never a ``[T, T]``
  prefill mask beyond one chunk; layers with a softcap or sinks (which SDPA
  cannot express) go to :func:`dflash_kernels.reference.tree_attention`;
* a layer whose head dim is past the kernel's 256 (Gemma 4's global layers), or whose values are narrower
  than its keys (MiMo-V2-Flash), takes the reference backend's path on the Triton backend too
  (:data:`KERNEL_MAX_HEAD_DIM`).

Layers of one model may differ in K/V heads and head dim (Gemma 4, MiMo-V2-Flash): each gets its own corner
of the padded cache (:class:`~dflash.cache.KVBuffer`), a view with the storage's strides; every path reads
those strides as they are (nothing is copied).
"""

from __future__ import annotations

from dataclasses import dataclass, field
import contextlib
from typing import Iterator, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F

import dflash_kernels
from dflash_kernels import reference as kernel_reference

from .families import UnsupportedTargetFeature
from .patches import Patch, original

ATTENTION_NAME = "dflash"
PASS_KWARG = "dflash_pass"

#: The largest head dim the tree-attention kernel takes (:func:`dflash_kernels.tree_attention`, which also needs the
#: keys' and values' head dims equal). A layer with wider heads (Gemma 4's global layers: ``global_head_dim =
#: 512``) or narrower values (MiMo-V2-Flash: 192-dim keys, 128-dim values) runs the reference backend's torch path
#: on every backend (SDPA with the pass's mask, or :func:`dflash_kernels.reference.tree_attention`): the same attention,
#: without the kernel's speed.
KERNEL_MAX_HEAD_DIM = 256

#: The :class:`AttentionPass` of the target pass running now (innermost last), for decoder layers that do not
#: hand their attention module the layer's keyword arguments (StableLM, Nemotron call ``self_attn(...)`` with a
#: fixed argument list): their attention function still serves our pass, never the model's own implementation
#: with no mask (which would attend causally from the top-left corner over the cached rows: a different text).
_ACTIVE: List["AttentionPass"] = []

@dataclass(frozen=True)
class AttentionPass:
    """What the ``T`` rows of one target pass attend to (the same object for every layer).

    ``prefix_len``: committed keys before the pass's rows (a device tensor in a fixed-shape pass: :attr:`static`). ``bits``: ``[T, W]``
    int32 ancestor-or-self bitmask (tree verify) or None (causal).
    ``positions``: ``[T]`` absolute positions of the rows when they are not
    ``prefix_len + arange(T)`` (tree verify: ``start + depth``); only read by
    windowed layers. ``windows[l]``, ``softcaps[l]``, ``sinks[l]``: layer
    ``l``'s sliding window, attention softcap and sink logits ``[Hq]``, or
    None (empty sequences: none on any layer). ``backend``: ``"triton"`` or
    ``"reference"``.
    """

    prefix_len: Union[int, torch.Tensor]
    bits: Optional[torch.Tensor]
    positions: Optional[torch.Tensor]
    windows: Sequence[Optional[int]]
    backend: str
    softcaps: Sequence[Optional[float]] = ()
    sinks: Sequence[Optional[torch.Tensor]] = ()
    #: fixed-shape passes, reference backend: ``{window: visible [T, S] bool}`` built once, shared by the layers
    visible: Optional[dict] = None
    #: a round pass at a long prefix (reference backend, CPU): the committed keys attended unmasked and merged
    #: with the pass's own by log-sum-exp (:func:`dflash_kernels.reference.split_attention`: the same attention up
    #: to rounding); else the masked attention, the model's own numbers bit for bit
    split: bool = False
    #: what the pass's layers share, made by the first layer that needs it: on the reference backend an eager
    #: pass's ``[T, keys]`` mask per window (``("mask", window)``: it depends on the pass, never on the layer:
    #: one build per pass, not one per layer)
    memo: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def static(self) -> bool:
        """A fixed-shape pass (compiled rounds): ``prefix_len`` is a ``[1]`` device tensor and the layers'
        key/value are the whole cache ``[1, Hkv, S, D]``; keys at rows ``>= prefix_len + T`` are masked."""
        return isinstance(self.prefix_len, torch.Tensor)

    def window(self, layer_idx) -> Optional[int]:
        return self.windows[layer_idx] if layer_idx is not None else None

    def softcap(self, layer_idx) -> Optional[float]:
        return self.softcaps[layer_idx] if layer_idx is not None and self.softcaps else None

    def sink(self, layer_idx) -> Optional[torch.Tensor]:
        return self.sinks[layer_idx] if layer_idx is not None and self.sinks else None


def in_active_pass() -> bool:
    """Whether one of our passes is running (:func:`active_pass`)."""
    return len(_ACTIVE) > 0  # (dynamo of torch 2.11 cannot trace bool() of a list)


def current_pass() -> Optional["AttentionPass"]:
    """The innermost of our passes running now (:func:`active_pass`), or None outside them."""
    return _ACTIVE[-1] if len(_ACTIVE) > 0 else None


@contextlib.contextmanager
def active_pass(attention_pass: "AttentionPass") -> Iterator[None]:
    """Make ``attention_pass`` the pass of every attention call without one until the block ends (see
    :data:`_ACTIVE`); :meth:`~dflash.target.adapter.TargetAdapter.run_pass` runs its layers inside it."""
    _ACTIVE.append(attention_pass)
    try:
        yield
    finally:
        _ACTIVE.pop()


def _original_attention(module):
    """The attention function the model was loaded with (transformers' registry, else eager)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = original(module.config, "_attn_implementation") or "sdpa"
    if name != ATTENTION_NAME and name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    if name == ATTENTION_NAME:  # loaded with ours: its own rules are SDPA's
        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    import sys

    return sys.modules[type(module).__module__].eager_attention_forward


def _check_module_kwargs(module, kwargs, window, softcap, sinks) -> None:
    """The module's own attention arguments must agree with the family table's (never a silent difference)."""
    layer = getattr(module, "layer_idx", None)
    name = type(module).__name__
    if "sliding_window" in kwargs and kwargs["sliding_window"] != window:
        raise UnsupportedTargetFeature(name, "sliding window",
                                       f"layer {layer} passes sliding_window={kwargs['sliding_window']}, the family "
                                       f"table says {window}")
    if "softcap" in kwargs and kwargs["softcap"] != softcap:
        raise UnsupportedTargetFeature(name, "attention softcap",
                                       f"layer {layer} passes softcap={kwargs['softcap']}, the family table says "
                                       f"{softcap}")
    if "s_aux" in kwargs and kwargs["s_aux"] is not sinks:
        raise UnsupportedTargetFeature(name, "attention sinks",
                                       f"layer {layer} passes sink logits (s_aux) the family table does not know")


def dflash_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface entry: ``query [1, Hq, T, D]``, ``key/value [1, Hkv, S, D]``.

    Returns ``(out [1, T, Hq, D], None)``. The pass comes from the kwargs, or,
    when the decoder layer did not forward them, from :func:`active_pass`;
    without either (not one of our passes: the user's own forward while an
    adapter is open) it calls the model's own implementation.
    """
    attention_pass: Optional[AttentionPass] = kwargs.pop(PASS_KWARG, None)
    if attention_pass is None and _ACTIVE:
        attention_pass = _ACTIVE[-1]
    if attention_pass is None:
        return _original_attention(module)(module, query, key, value, attention_mask, scaling=scaling,
                                           dropout=dropout, **kwargs)
    layer = getattr(module, "layer_idx", None)
    window, softcap, sinks = attention_pass.window(layer), attention_pass.softcap(layer), attention_pass.sink(layer)
    _check_module_kwargs(module, kwargs, window, softcap, sinks)
    backend = attention_pass.backend if _kernel_takes(key, value) else "reference"
    if attention_pass.static:
        if attention_pass.visible is not None and softcap is None and sinks is None:
            out = dflash_kernels.masked_attention(query, key, value, attention_pass.visible[window], scale=scaling)
            return out.transpose(1, 2), None
        if not _kernel_takes(key, value):  # past the kernel (and its input checks): the torch reference
            out = kernel_reference.tree_attention(query, key, value, attention_pass.bits, attention_pass.prefix_len,
                                                  scale=scaling, positions=attention_pass.positions, window=window,
                                                  **_features(softcap, sinks))
            return out.transpose(1, 2), None
        out = dflash_kernels.tree_attention(
            query, key, value, attention_pass.bits, attention_pass.prefix_len, scale=scaling,
            positions=attention_pass.positions, window=window, softcap=softcap, sinks=sinks,
            backend=attention_pass.backend)
        return out.transpose(1, 2), None
    out = pass_attention(query, key, value, attention_pass, window, scaling, softcap=softcap, sinks=sinks,
                         backend=backend)
    return out.transpose(1, 2), None


def _kernel_takes(key, value) -> bool:
    """Whether the tree-attention kernel takes a layer of these K/V: one head dim for both, at most
    :data:`KERNEL_MAX_HEAD_DIM`."""
    return key.shape[-1] == value.shape[-1] <= KERNEL_MAX_HEAD_DIM


def _features(softcap, sinks) -> dict:
    """The kernels' softcap / sinks keywords, only when set (plain layers call the kernels as before)."""
    kw = {}
    if softcap is not None:
        kw["softcap"] = softcap
    if sinks is not None:
        kw["sinks"] = sinks
    return kw


def pass_attention(query, key, value, attention_pass: AttentionPass, window: Optional[int], scaling,
                   softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                   backend: Optional[str] = None) -> torch.Tensor:
    """``[1, Hq, T, D]`` attention of one layer in one pass (see the module docstring for the paths); ``backend``:
    the pass's unless the layer's head dim is past the kernel's (:data:`KERNEL_MAX_HEAD_DIM`).

    On the reference path a windowed layer reads only keys ``>= prefix_len - window + 1`` (no row of the pass,
    all at positions ``>= prefix_len``, sees an older one): the mask covers ``[T, window + T]`` at most, whatever
    the prefix; when every remaining key is within the window of every row, the layer is attended as unwindowed.
    """
    T = query.shape[2]
    prefix = attention_pass.prefix_len
    positions = attention_pass.positions
    causal = attention_pass.bits is None
    plain = softcap is None and sinks is None
    triton = (backend or attention_pass.backend) == "triton"
    layer_window = window
    if causal and prefix == 0 and window is None and plain:
        return F.scaled_dot_product_attention(query, key, value, is_causal=T > 1, scale=scaling, enable_gqa=True)
    if triton:
        return dflash_kernels.tree_attention(query, key, value, attention_pass.bits, prefix, scale=scaling,
                                             positions=positions, window=window, **_features(softcap, sinks))
    if window is not None:
        start = max(0, prefix - window + 1)
        if start:  # windows are relative: shifting every position by ``start`` keeps the rule
            key, value, prefix = key[:, :, start:], value[:, :, start:], prefix - start
            positions = None if positions is None else positions - start
        if prefix + T <= window:  # the farthest pair (row at prefix + T - 1, key 0) is within the window
            window = None
    if not plain:
        return kernel_reference.tree_attention(query, key, value, attention_pass.bits, prefix, scale=scaling,
                                               positions=positions, window=window, **_features(softcap, sinks))
    if window is None and attention_pass.split:
        return kernel_reference.split_attention(query, key, value, prefix, attention_pass.bits, scale=scaling)
    if causal and T == 1 and window is None:  # a single causal row sees every key: no mask
        return F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=True)
    # keyed by the layer's own window: prefix, T, bits and positions are the pass's, the shift above the window's
    mask = attention_pass.memo.get(("mask", layer_window))
    if mask is None:
        mask = attention_pass.memo[("mask", layer_window)] = kernel_reference.tree_visibility(
            attention_pass.bits, prefix, T, positions=positions, window=window, device=query.device)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)


def register_attention() -> None:
    """Add ``"dflash"`` to transformers' attention-function registry (when it is not there)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if ATTENTION_NAME not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(ATTENTION_NAME, dflash_attention_forward)


def attention_patches(config) -> list:
    """The patch that points ``config`` at the ``"dflash"`` function while an adapter holds it
    (:mod:`dflash.target.patches`: the last release restores the model's own implementation)."""
    register_attention()
    return [Patch(config, "_attn_implementation", ATTENTION_NAME, label="attention implementation")]
