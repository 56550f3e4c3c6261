"""Hybrid targets (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): Gated-DeltaNet layers with exact state rollback.

A hybrid decoder interleaves full-attention layers (K/V in our cache, as for
dense targets) with Gated-DeltaNet linear-attention layers. Such a layer keeps,
per sequence (a batch of ``b`` sequences keeps ``b`` of each, in
:class:`LinearStates`), no K/V but

* a causal-convolution window: its last ``K`` conv inputs ``[K, C]`` (``K =
  linear_conv_kernel_dim``, ``C = 2 Hk Dk + Hv Dv``; transformers keeps ``K``
  columns and the convolution reads the last ``K - 1`` of them), and
* a recurrent state ``S [Hv, Dk, Dv]`` fp32: per value head ``h`` (key head
  ``h // (Hv / Hk)``), with ``q, k`` l2-normalized and ``q`` scaled by
  ``Dk ** -0.5``, one token does ``S' = exp(g) S``, ``S <- S' + k (beta (v -
  S'^T k))^T``, ``o = S^T q``.

The state after token ``t`` depends on every token up to ``t``: a verify pass
that runs ``B`` drafted tokens (or a tree of them) through the layer cannot be
"cropped" afterwards (transformers' ``Cache.crop`` trims conv windows but not
recurrent states). Here a verify pass never touches the committed state:

* **verify** (:func:`verify_forward`, installed on every ``linear_attn`` module
  while an adapter is open, :func:`linear_patches`): the conv over the pass's
  rows as a chain or a tree (:func:`dflash_kernels.causal_conv_tree`: a node's
  taps are itself and its nearest ancestors, then the committed window), the
  recurrence from the committed state (:func:`dflash_kernels.gated_delta_tree`:
  node ``i`` starts from its parent's state), and the outputs; the pass's conv
  inputs, conv outputs (``q | k | v``), ``g`` and ``beta`` are stashed
  per layer in :class:`LinearStates` (``[L_lin, b, T, .]``: a few rows of
  activations per sequence, not ``T`` states); a batch's sequences each run
  their own tree (``parents [b, T]``) from their own window and state;
* **commit** (a decoding round's ``advance(rows, count [b])`` for a chain,
  rows ``0..count[r]-1`` of sequence ``r``, or ``compact_advance(path [b,
  A], path_len [b])`` for a tree, each accepted path; ``commit(n)`` after an
  eager chain pass of one sequence): ONE
  :func:`dflash_kernels.gated_delta_replay_` launch advances every linear
  layer's committed state of every sequence through exactly its accepted
  rows (the row counts read on the device; a count of 0, a stopped sequence
  of a traced round, leaves its states as they are), and
  :func:`dflash_kernels.conv_window_after` moves every window. The state then equals what plain decoding of the committed
  tokens holds. Rows past the count are never applied.

Replay instead of per-step checkpoints (writing the state after every block
position during the verify and selecting one). On a GPU the cost is state
traffic: checkpoints write a ``[Hv, Dk, Dv]`` state per block position and
hold them until the commit, while with the replay a chain's verify writes no
state and the commit runs the accepted rows from the committed state once more
(a tree's verify stores only the states a later node reloads). The pure-torch reference
(not a speed path: it replays all ``B`` steps under a ``torch.where`` to keep
shapes fixed) pays for the recomputed steps instead of the traffic, so there
the balance is the other way round. ``bench/gated_delta_rollback.py``
measures both (README, hybrid targets: the numbers behind the choice).

**In-place passes.** A prefill chunk (kept whole by construction) and a
one-row causal pass (an AR step: ``commit(1)`` is its only use) run the model's
OWN Gated-DeltaNet forward with our cache, which speaks transformers'
linear-attention cache protocol (below): its chunked rule for prefill and its
per-token decode path, so prefill and AR states are exactly transformers'.
Such a pass advances the states in place; committing fewer rows than it ran
is an error (it cannot be rolled back), as is cropping a hybrid cache to any
length but its own or 0. It runs one sequence: a batch prefills each
sequence's prompt through :meth:`HybridKVCache.row` (its K/V rows, windows and
states are views of that sequence's), one after the other, never a padded
batched pass (a pad row would run through a shorter prompt's recurrence).

**Batches** follow :class:`~dflash.cache.KVBuffer`: :meth:`HybridKVCache.narrow`
views the first ``n`` sequences' states, :meth:`HybridKVCache.move_row` copies
one sequence's windows and states into another's place (an eager round drops
a stopped sequence, ``Round.retire``), and a traced round keeps a stopped
sequence, which commits 0 rows.

**transformers' protocol** (both 5.17 and 5.24 read the module's cache this
way): 5.24 calls ``get_conv_state(layer, state_idx=0)``,
``get_recurrent_state(...)`` (None before the first token),
``is_recording_past(layer)``, ``update_conv_state(x [1, C, T], layer,
conv_kernel_size=K)`` (returns ``concat(window, x)``, or ``x`` left-padded
to ``K`` on the first pass; keeps the last ``K`` columns) and
``update_recurrent_state(S [1, Hv, Dk, Dv], layer)``; 5.17 calls
``has_previous_state(layer, state_idx=0)`` and reads
``cache.layers[layer].conv_states[0]`` / ``.recurrent_states[0]`` /
``.record_past`` directly. Both take the state views this module hands out,
which alias our buffers (decode's ``causal_conv1d_update`` writes the window
in place through them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch
import torch.nn.functional as F

import dflash_kernels

from .attention import PASS_KWARG
from .cache import TargetKVCache
from .families import TargetStructureError, UnsupportedTargetFeature
from .patches import Patch

__all__ = ["HybridKVCache", "LINEAR_PASS_KWARG", "LinearPass", "LinearShape", "LinearStates", "linear_patches",
           "linear_shape", "verify_forward"]

#: Layer keyword that carries a :class:`LinearPass` to the linear-attention modules.
LINEAR_PASS_KWARG = "dflash_linear_pass"

#: Conv activations the tree-conv op implements (transformers' Gated-DeltaNet uses ``config.hidden_act``).
ACTIVATIONS = ("silu",)


@dataclass(frozen=True)
class LinearPass:
    """What one pass does in the linear-attention layers.

    ``in_place``: the model's own forward advances the committed states (a
    prefill chunk or a one-row causal pass of one sequence). Otherwise a
    verify pass of ``b`` sequences: the rows form a chain (``parents`` None)
    or each sequence's tree ``parents [b, T]`` int64 on the device
    (``parents[r, i]`` in ``[-1, i)``, -1 = sequence ``r``'s committed state).
    """

    in_place: bool
    parents: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class LinearShape:
    """The Gated-DeltaNet geometry shared by every linear layer of one model."""

    layers: tuple  # indices of the linear-attention decoder layers
    kernel: int  # K: conv taps
    channels: int  # C = 2 Hk Dk + Hv Dv (conv channels: q | k | v)
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim


def linear_modules(layers, linear_layers: Sequence[int]) -> list:
    return [layers[i].linear_attn for i in linear_layers]


def linear_shape(model_name: str, layers, linear_layers: Sequence[int]) -> LinearShape:
    """The geometry of the linear layers, checked for what :func:`verify_forward` implements (else refused)."""

    def refuse(feature, detail=""):
        raise UnsupportedTargetFeature(model_name, feature, detail)

    shapes = set()
    for i in linear_layers:
        m = layers[i].linear_attn
        if not (hasattr(m, "in_proj_qkv") or hasattr(m, "in_proj_qkvz")):
            refuse("linear-attention projections", f"layer {i}: neither in_proj_qkv nor in_proj_qkvz")
        if m.activation not in ACTIVATIONS:
            refuse("linear-attention conv activation", f"layer {i} uses {m.activation!r}; implemented: silu")
        if m.num_v_heads % m.num_k_heads:
            refuse("linear-attention heads", f"layer {i}: {m.num_v_heads} value heads over {m.num_k_heads} key heads")
        weight = m.conv1d.weight
        if type(m.conv1d) is not torch.nn.Conv1d or type(weight) not in (torch.Tensor, torch.nn.Parameter):
            # the verify reads conv1d.weight: an adapter around the conv (peft) or a quantized weight would be skipped
            refuse("linear-attention conv under an adapter or quantization",
                   f"layer {i}: conv1d is a {type(m.conv1d).__module__}.{type(m.conv1d).__name__} with a "
                   f"{type(weight).__name__} weight; the verify reads it as a plain nn.Conv1d weight")
        if weight.dim() != 3 or weight.shape[1] != 1 or weight.shape[0] != m.conv_dim:
            refuse("linear-attention conv", f"layer {i}: conv1d weight {list(weight.shape)} is not depthwise")
        if getattr(m, "repeat_qk_heads", False):
            pass  # transformers 5.17 repeats q/k heads for old FLA kernels only; the math is the same
        shapes.add((int(m.conv_kernel_size), int(m.conv_dim), int(m.num_k_heads), int(m.num_v_heads),
                    int(m.head_k_dim), int(m.head_v_dim)))
    if len(shapes) > 1:
        refuse("linear-attention layers of different shapes", str(sorted(shapes)))
    (kernel, channels, hk, hv, dk, dv), = shapes
    if channels != 2 * hk * dk + hv * dv:
        refuse("linear-attention conv channels", f"{channels} != 2 * {hk} * {dk} + {hv} * {dv}")
    return LinearShape(tuple(linear_layers), kernel, channels, hk, hv, dk, dv)


# ----------------------------------------------------------------------------- states


class _LinearLayerView:
    """``cache.layers[i]`` of a linear layer, as transformers 5.17 reads it (``conv_states[0]`` ``[b, C, K]``,
    ``recurrent_states[0]`` ``[b, Hv, Dk, Dv]``: views of our buffers' current sequences, ``record_past``
    False). The in-place passes that read them run one sequence (``b = 1``: a row view of a batch)."""

    record_past = False
    number_of_states = 1

    def __init__(self, states: "LinearStates", slot: int):
        self._states, self.slot = states, slot
        self.conv_kernel_size = {0: states.shape.kernel}

    @property
    def conv_states(self) -> Dict[int, torch.Tensor]:
        return {0: self._states.conv[self.slot].transpose(1, 2)}

    @property
    def recurrent_states(self) -> Dict[int, torch.Tensor]:
        return {0: self._states.state[self.slot]}

    @property
    def has_previous_state(self) -> Dict[int, bool]:
        return {0: self._states.has_previous()}

    def get_max_length(self) -> int:
        return -1


class _AttentionLayerView:
    """``cache.layers[i]`` of a full-attention layer (its K/V live in the cache's ``kv[slot]``)."""

    record_past = False

    def __init__(self, slot: int):
        self.slot = slot


class LinearStates:
    """Every linear layer's committed conv windows and recurrent states for ``b`` sequences, and the last verify
    pass's stash.

    ``conv [L_lin, b, K, C]`` (model dtype, oldest input first: transformers'
    ``[b, C, K]`` window is ``conv[s].transpose(1, 2)``), ``state [L_lin, b,
    Hv, Dk, Dv]`` fp32 (the layer first, so ``state[s]`` is one layer's ``[b,
    Hv, Dk, Dv]``, what the tree kernel reads, and the whole tensor what one
    replay launch advances). The stash of a verify pass of ``T`` rows per
    sequence: ``x [L_lin, b, T, C]`` (conv inputs), ``y [L_lin, b, T, C]``
    (conv outputs ``q | k | v``), ``g [L_lin, b, T, Hv]`` fp32, ``beta [L_lin,
    b, T, Hv]``; ``pending`` says what the last pass left to commit: None
    (nothing), ``"verify"`` (the stash), ``"in_place"`` (the model's own forward
    already advanced the states over ``rows`` rows).

    Like :class:`~dflash.cache.KVBuffer`, the sequences can be narrowed to the
    first ``n`` (:meth:`narrow`: every tensor above becomes a view of its first
    ``n`` sequences), one sequence moved into another's place (:meth:`move_row`),
    and one sequence viewed alone (:meth:`row`, for its in-place prefill).
    """

    def __init__(self, shape: LinearShape, dtype, device, length_fn, batch: int = 1):
        self.shape, self.dtype, self.device = shape, dtype, device
        n = len(shape.layers)
        self.slots = {layer: s for s, layer in enumerate(shape.layers)}
        self._conv_whole = torch.zeros(n, batch, shape.kernel, shape.channels, dtype=dtype, device=device)
        self._state_whole = torch.zeros(n, batch, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim,
                                        dtype=torch.float32, device=device)
        self.conv, self.state = self._conv_whole, self._state_whole
        self._length = length_fn
        self.pending: Optional[str] = None
        self.pending_rows = 0
        self._stash_rows = -1
        self._stash_whole = None
        self.x = self.y = self.g = self.beta = None
        self._stashes = {}
        self._scratch = None
        self._counts = None

    # -- transformers' "has a previous state": the cache holds committed tokens
    def has_previous(self) -> bool:
        return bool(self._length())

    def window(self, slot: int) -> torch.Tensor:
        """The ``K - 1`` inputs the convolution reads ``[b, K-1, C]`` (a view of ``conv[slot]``)."""
        return self.conv[slot, :, 1:]

    def counts(self, n: int) -> torch.Tensor:
        """A ``[1]`` device tensor holding ``n`` (a slice of a cached arange: no host->device copy)."""
        if self._counts is None or self._counts.numel() <= n:
            self._counts = torch.arange(max(2 * n, 64), dtype=torch.long, device=self.device)
        return self._counts[n : n + 1]

    def stash(self, rows: int) -> None:
        """Buffers for a verify pass of ``rows`` rows per sequence: kept per row count, so rounds whose verify
        size changes between a few fixed sizes (a budget chosen per round) reuse theirs (a traced step's, a
        captured graph's). Allocated for every sequence; :attr:`x` etc. view the current ones."""
        if rows != self._stash_rows:
            if rows not in self._stashes:
                n, s, b = len(self.shape.layers), self.shape, self._state_whole.shape[1]
                self._stashes[rows] = (
                    torch.empty(n, b, rows, s.channels, dtype=self.dtype, device=self.device),
                    torch.empty(n, b, rows, s.channels, dtype=self.dtype, device=self.device),
                    torch.empty(n, b, rows, s.num_v_heads, dtype=torch.float32, device=self.device),
                    torch.empty(n, b, rows, s.num_v_heads, dtype=self.dtype, device=self.device))
            self._stash_whole = self._stashes[rows]
            self._stash_rows = rows
            self._view_stash()

    def _view_stash(self) -> None:
        if self._stash_whole is not None:
            self.x, self.y, self.g, self.beta = (t[:, : self.batch] for t in self._stash_whole)

    def scratch(self, rows: int) -> torch.Tensor:
        """One fp32 ``[b, rows, Hv, Dk, Dv]`` buffer for the tree kernel's per-node states, shared by every
        layer (the current sequences' rows of one buffer for every sequence)."""
        s = self.shape
        if self._scratch is None or self._scratch.shape[1] < rows:
            self._scratch = torch.empty(self._state_whole.shape[1], rows, s.num_v_heads, s.head_k_dim,
                                        s.head_v_dim, dtype=torch.float32, device=self.device)
        return self._scratch[: self.batch]

    def qkv(self):
        """The stash's ``q [L, b, T, Hk, Dk]``, ``k``, ``v [L, b, T, Hv, Dv]``: views of the conv outputs."""
        s = self.shape
        q = self.y[..., : s.key_dim].unflatten(-1, (s.num_k_heads, s.head_k_dim))
        k = self.y[..., s.key_dim : 2 * s.key_dim].unflatten(-1, (s.num_k_heads, s.head_k_dim))
        v = self.y[..., 2 * s.key_dim :].unflatten(-1, (s.num_v_heads, s.head_v_dim))
        return q, k, v

    def apply(self, rows: torch.Tensor, num_rows: torch.Tensor) -> None:
        """Advance every layer of each sequence ``r`` through its stashed rows ``rows[r, :num_rows[r]]`` (``rows
        [T]``: the same rows for every sequence; ``num_rows [b]`` or ``[1]``; device tensors, no host read). A
        count of 0 leaves that sequence's conv window and state as they are."""
        q, k, v = self.qkv()
        dflash_kernels.gated_delta_replay_(self.state, q, k, v, self.g, self.beta, rows, num_rows)
        self.conv.copy_(dflash_kernels.conv_window_after(self.conv, self.x, rows, num_rows))

    # -- the batch's sequences, as KVBuffer's
    @property
    def batch(self) -> int:
        """The sequences held now (``conv``'s second axis: narrowed, or one for a :meth:`row` view)."""
        return self.conv.shape[1]

    def narrow(self, n: int) -> None:
        """Hold the first ``n`` sequences only (views of the whole buffers' first rows)."""
        whole = self._state_whole.shape[1]
        if not 1 <= n <= whole:
            raise ValueError(f"narrow({n}) of linear states of {whole} sequences")
        self.conv, self.state = self._conv_whole[:, :n], self._state_whole[:, :n]
        self._view_stash()

    def move_row(self, src: int, dst: int) -> None:
        """Copy sequence ``src``'s committed conv windows and states (every layer) into sequence ``dst``."""
        self.conv[:, dst].copy_(self.conv[:, src])
        self.state[:, dst].copy_(self.state[:, src])

    def row(self, r: int, length_fn) -> "LinearStates":
        """Sequence ``r`` alone: linear states of one sequence whose ``conv`` / ``state`` are views of ``r``'s
        (what an in-place pass writes lands in this batch's buffers), with a stash of its own and
        ``length_fn`` the row's committed length (transformers' "has a previous state")."""
        if not 0 <= r < self.batch:
            raise ValueError(f"row({r}): these linear states hold {self.batch} sequences (0 .. {self.batch - 1})")
        view = LinearStates.__new__(LinearStates)
        view.__dict__.update(self.__dict__)
        view._conv_whole, view._state_whole = self.conv[:, r : r + 1], self.state[:, r : r + 1]
        view.conv, view.state = view._conv_whole, view._state_whole
        view._length = length_fn
        view.pending, view.pending_rows = None, 0
        view._stash_rows, view._stash_whole, view._stashes, view._scratch = -1, None, {}, None
        view.x = view.y = view.g = view.beta = None
        return view

    def reset(self) -> None:
        self._conv_whole.zero_()
        self._state_whole.zero_()
        self.pending, self.pending_rows = None, 0


class HybridKVCache(TargetKVCache):
    """The target cache of a hybrid model: K/V for the full-attention layers only, plus :class:`LinearStates`.

    ``kv [L_attn, 2, Hkv, max_len, D]`` holds the attention layers in order
    (decoder layer ``i`` -> slot ``kv_slot(i)``; ``kv_batched [b, L_attn, ...]``
    for a batch of ``b`` sequences, each with its own conv windows and states
    in :attr:`linear`); the commit methods keep the same rows of both kinds of
    layers (module docstring), per sequence. Speaks transformers'
    linear-attention cache protocol (5.17 and 5.24) for the one-sequence
    in-place passes (a batch prefills each sequence through :meth:`row`).
    """

    @staticmethod
    def kv_shape(config, shape: LinearShape, max_len: int):
        """``(L_attn, 2, Hkv, max_len, D)``: the K/V of the full-attention layers only."""
        layers, two, kv_heads, rows, head_dim = TargetKVCache.kv_shape(config, max_len)
        return (layers - len(shape.layers), two, kv_heads, rows, head_dim)

    def __init__(self, config, shape: LinearShape, max_len: int, dtype, device, kv=None, batch: int = 1):
        layers, _, kv_heads, _, head_dim = self.kv_shape(config, shape, max_len)
        super(TargetKVCache, self).__init__(layers, kv_heads, head_dim, max_len, dtype, device, kv=kv, batch=batch)
        num_layers = config.num_hidden_layers
        attention = [i for i in range(num_layers) if i not in shape.layers]
        self.num_layers = num_layers
        self._kv_slots = {layer: s for s, layer in enumerate(attention)}
        self.linear = LinearStates(shape, dtype, device, self._holds_tokens, batch=batch)
        self.layers = self._layer_views()

    def _holds_tokens(self) -> bool:
        # a frozen cache holds the committed prompt (never empty): the states are "previous" without a host read
        return self.static or self.length > 0

    def _layer_views(self) -> list:
        return [_LinearLayerView(self.linear, self.linear.slots[i]) if i in self.linear.slots
                else _AttentionLayerView(self._kv_slots[i]) for i in range(self.num_layers)]

    # ------------------------------------------------------------ the batch's sequences
    def row(self, r: int) -> "HybridKVCache":
        """Sequence ``r`` alone (:meth:`KVBuffer.row`), its linear states included (:meth:`LinearStates.row`):
        a batch prefills each sequence's prompt through its row, by the model's own forward."""
        view = super().row(r)
        view.linear = self.linear.row(r, view._holds_tokens)
        view.layers = view._layer_views()
        return view

    def narrow(self, n: int) -> None:
        super().narrow(n)
        self.linear.narrow(n)

    def move_row(self, src: int, dst: int) -> None:
        super().move_row(src, dst)
        self.linear.move_row(src, dst)

    # ------------------------------------------------------------ attention layers
    def kv_slot(self, layer_idx: int) -> int:
        slot = self._kv_slots.get(layer_idx)
        if slot is None:
            raise ValueError(f"layer {layer_idx} is a linear-attention layer: it has no K/V to update")
        return slot

    def __len__(self) -> int:
        return self.num_layers

    # ------------------------------------------------------------ transformers' linear-attention protocol
    def _slot(self, layer_idx: int) -> int:
        slot = self.linear.slots.get(layer_idx)
        if slot is None:
            raise ValueError(f"layer {layer_idx} is not a linear-attention layer of this cache "
                             f"(those are {list(self.linear.slots)})")
        return slot

    def has_previous_state(self, layer_idx: Optional[int] = None, state_idx: Optional[int] = None) -> bool:
        if layer_idx is not None:
            self._slot(layer_idx)
        return self.linear.has_previous()

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Optional[torch.Tensor]:
        """The window ``[b, C, K]`` (a view: decode writes it in place), or None before the first token."""
        self._slot(layer_idx)
        return self.layers[layer_idx].conv_states[0] if self.linear.has_previous() else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Optional[torch.Tensor]:
        """The state ``[b, Hv, Dk, Dv]`` fp32 (a view), or None before the first token."""
        self._slot(layer_idx)
        return self.layers[layer_idx].recurrent_states[0] if self.linear.has_previous() else None

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: Optional[int] = None, **kwargs) -> torch.Tensor:
        """``x [b, C, T]`` -> the inputs the conv runs over: ``concat(window [b, C, K], x)``, or on the first
        pass ``x`` left-padded with zeros to ``K`` columns; the window becomes their last ``K`` columns."""
        slot = self._slot(layer_idx)
        K = self.linear.shape.kernel
        if conv_kernel_size is not None and int(conv_kernel_size) != K:
            raise ValueError(f"layer {layer_idx}: conv_kernel_size {conv_kernel_size} != the cache's {K}")
        window = self.layers[layer_idx].conv_states[0]
        if self.linear.has_previous():
            full = torch.cat([window, conv_states.to(window.dtype)], dim=-1)
        elif conv_states.shape[-1] < K:
            full = F.pad(conv_states, (K - conv_states.shape[-1], 0))
        else:
            full = conv_states
        window.copy_(full[..., -K:])
        self._mark_in_place(conv_states.shape[-1])
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        slot = self._slot(layer_idx)
        self.linear.state[slot].copy_(recurrent_states.reshape(self.linear.state.shape[1:]))
        return self.layers[layer_idx].recurrent_states[0]

    def _mark_in_place(self, rows: int) -> None:
        self.linear.pending, self.linear.pending_rows = "in_place", int(rows)

    # ------------------------------------------------------------ commits
    def begin_pass(self, linear_pass: LinearPass, rows: int) -> None:
        """Called by the adapter before each pass: what the pass's rows will leave to commit."""
        if linear_pass.in_place:
            self._mark_in_place(rows)
            return
        self.linear.stash(rows)
        if not self.static:  # a round pass's commit is on the device (advance / compact_advance)
            self.linear.pending, self.linear.pending_rows = "verify", int(rows)

    def _check_whole(self, n: int) -> None:
        if self.linear.pending == "in_place" and n != self.linear.pending_rows:
            raise RuntimeError(
                f"the linear-attention states of this hybrid cache were advanced in place over "
                f"{self.linear.pending_rows} rows (a prefill chunk or a one-row step runs the model's own "
                f"forward); committing {n} of them cannot roll them back. Verify passes (several causal rows "
                "or a tree) can be committed partially.")

    def commit(self, n: int) -> None:
        """Keep the first ``n`` rows of the last forward (linear layers: the state after those ``n`` rows)."""
        n = int(n)
        self._check_room(n)
        pending = self.linear.pending
        if pending == "verify":
            if n > self.linear.pending_rows:
                raise ValueError(f"cannot commit {n} rows of a {self.linear.pending_rows}-row pass")
            if n > 0:
                self.linear.apply(self.rows[: self.linear.pending_rows], self.linear.counts(n))
        elif pending == "in_place":
            self._check_whole(n)
        elif pending is None and n > 0:
            raise RuntimeError(f"commit({n}): no forward since the last commit on this hybrid cache")
        self.linear.pending = None
        self.length += n
        self.length_t.fill_(self.length)

    def advance(self, rows: torch.Tensor, count: torch.Tensor) -> None:
        """Round commit of a chain: each sequence ``r``'s linear layers advance through ``rows[:count[r]]`` of
        the stash (``rows [T]``, ``count [b]``: device tensors, one replay launch), the attention layers keep
        their rows (:meth:`TargetKVCache.advance`)."""
        self.linear.apply(rows, count)
        super().advance(rows, count)

    def compact_advance(self, rows: torch.Tensor, count: torch.Tensor) -> None:
        """Round commit of tree paths ``rows[r, :count[r]]`` (``rows [b, A]``, or ``[A]`` for one sequence):
        each sequence's linear layers advance through its path's stashed rows, the attention layers' rows are
        compacted (:meth:`TargetKVCache.compact_advance`)."""
        self.linear.apply(rows, count)
        super().compact_advance(rows, count)

    def crop(self, length: int) -> None:
        """Forget rows from ``length`` on: only to the committed length (drops the last pass) or to 0 (reset)."""
        if length == 0:
            super().crop(0)
            self.linear.reset()
            return
        if length == self.length and self.linear.pending != "in_place":
            self.linear.pending = None  # a verify pass left the committed states untouched
            return
        raise ValueError(
            f"a hybrid cache cannot crop its linear-attention states from {self.length} tokens"
            f"{' (and a pass that advanced them in place)' if self.linear.pending == 'in_place' else ''} back to "
            f"{length} (a recurrent state keeps no history); crop to 0 to start over")


# ----------------------------------------------------------------------------- the verify forward


def _project(module, hidden_states: torch.Tensor):
    """``(mixed_qkv [b, T, C], z [b, T, Hv, Dv], b [b, T, Hv], a [b, T, Hv])`` of ``hidden_states [b, T, H]``, by
    the module's own projections (Qwen3.5: separate ``in_proj_qkv/z/b/a``; Qwen3-Next: fused ``in_proj_qkvz`` /
    ``in_proj_ba`` reordered by its ``fix_query_key_value_ordering``)."""
    B, T = hidden_states.shape[:2]
    if hasattr(module, "in_proj_qkvz"):
        q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden_states),
                                                               module.in_proj_ba(hidden_states))
        mixed = torch.cat([t.reshape(B, T, -1) for t in (q, k, v)], dim=-1)
    else:
        mixed = module.in_proj_qkv(hidden_states)
        z = module.in_proj_z(hidden_states)
        b = module.in_proj_b(hidden_states)
        a = module.in_proj_a(hidden_states)
    return mixed, z.reshape(B, T, -1, module.head_v_dim), b.reshape(B, T, -1), a.reshape(B, T, -1)


def verify_forward(module, hidden_states: torch.Tensor, cache: HybridKVCache, linear_pass: LinearPass):
    """One linear layer over a verify pass of ``b`` sequences: outputs ``[b, T, H]``; the committed states are
    only read.

    Sequence ``r``'s outputs equal the model's own decode run token by token
    along each row's root -> row path (``linear_pass.parents[r]``; a chain
    when ``parents`` is None) from ``r``'s committed conv window and state.
    Stashes the rows' conv inputs and ``q | k | v``, ``g``, ``beta`` (``[b, T,
    .]`` per layer) for the commit.
    """
    states = cache.linear
    s = states.slots[module.layer_idx]
    B, T = hidden_states.shape[:2]
    mixed, z, b, a = _project(module, hidden_states)
    parents = linear_pass.parents
    y = dflash_kernels.causal_conv_tree(mixed, states.window(s), module.conv1d.weight.squeeze(1), parents,
                                        bias=module.conv1d.bias, activation=module.activation)  # [b, T, C]
    shape = states.shape
    q = y[..., : shape.key_dim].unflatten(-1, (shape.num_k_heads, shape.head_k_dim))
    k = y[..., shape.key_dim : 2 * shape.key_dim].unflatten(-1, (shape.num_k_heads, shape.head_k_dim))
    v = y[..., 2 * shape.key_dim :].unflatten(-1, (shape.num_v_heads, shape.head_v_dim))
    beta = b.sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    kw = {}
    if parents is not None and dflash_kernels.get_backend(y.device) == "triton":
        # one per-node state buffer for every layer; only the states a later node reloads are stored
        kw = dict(scratch=states.scratch(T), store_states="branches")
    out = dflash_kernels.gated_delta_tree(q, k, v, g, beta, states.state[s], parents, **kw)  # [b, T, Hv, Dv]
    states.x[s].copy_(mixed)
    states.y[s].copy_(y)
    states.g[s].copy_(g)
    states.beta[s].copy_(beta)
    core = module.norm(out.reshape(-1, shape.head_v_dim), z.reshape(-1, shape.head_v_dim))
    return module.out_proj(core.reshape(B, T, -1))


# ----------------------------------------------------------------------------- install / restore

def _dispatcher(module, original):
    """The ``forward`` of a Gated-DeltaNet ``module`` while an adapter is open; ``original`` is the one it had."""

    def forward(hidden_states, *args, **kwargs):
        linear_pass = kwargs.pop(LINEAR_PASS_KWARG, None)
        if linear_pass is None or linear_pass.in_place:
            kwargs.pop(PASS_KWARG, None)  # our attention description is not for the model's own rules
            return original(hidden_states, *args, **kwargs)
        cache = kwargs.get("cache", kwargs.get("cache_params"))
        if not isinstance(cache, HybridKVCache):
            raise TargetStructureError("a dflash verify pass reached a linear-attention layer without a "
                                       "HybridKVCache (use TargetAdapter.new_cache)")
        return verify_forward(module, hidden_states, cache, linear_pass)

    return forward


def linear_patches(modules: Sequence) -> list:
    """The patches that install :func:`verify_forward` on the Gated-DeltaNet ``modules`` while an adapter holds
    them (:mod:`dflash.target.patches`).

    Each module's ``forward`` becomes a dispatcher in its instance ``__dict__``:
    our verify passes run :func:`verify_forward`; in-place passes and every call
    that is not one of our passes (the user's own forward) run the forward it
    had before (an instance-level forward, e.g. accelerate's hooks, included).
    The last release puts that instance entry back, or removes ours.
    """
    return [Patch(m, "forward", wrap=_dispatcher, shadow=True, label="linear-attention forward") for m in modules]
