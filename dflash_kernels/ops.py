"""``torch.library`` registrations of the public ops: ``torch.ops.dflash.<name>``.

Each op here is a :func:`torch.library.custom_op` whose implementation calls
the public function of the same name (so it validates its inputs the same way
and runs on the same backend, Triton or the reference, as
:func:`dflash_kernels.get_backend` picks), plus what ``torch.compile`` needs to
trace a call without looking inside it:

* a fake (meta) implementation giving the output shapes, dtypes and devices
  from the input shapes alone (``register_fake``);
* the mutated arguments in the schema (``mutates_args``): ``compact_kv_``
  writes ``kv``, ``gather_concat_out`` writes ``out``; both return nothing
  (``-> ()``), the one form of a mutating custom op that every supported torch
  registers (tagged in-place / ``out=`` ops that return their mutated input, and
  keyword-only tensor arguments, exist only from torch 2.13), so their fakes
  return None too and callers keep their own reference to the buffer;
* a backward for ``lm_head_cross_entropy`` (``register_autograd``): the
  gradient with respect to ``hidden`` through the row gather and the final
  norm, ``weight`` / ``norm_weight`` / the loss ``weights`` frozen, as the
  public function's autograd does.

Why ``custom_op`` and not ``triton_op``: ``triton_op`` traces its Python body
under ``torch.compile`` with fake tensors, and the launchers read host values
of their inputs (``gather_concat``'s pointer table of ``data_ptr()`` s, the
lm_head's vocab chunk loops, the debug checks) and launch kernels directly
rather than through ``torch.library.wrap_triton``; the public functions would
have to change for that. A ``custom_op`` is opaque to the compiler: the graph
holds one node per call and the launcher runs at run time.

Schema types: Python ints are ``SymInt``, floats ``float``, optional tensors
``Tensor?``, ``gather_concat``'s layers ``Tensor[]``, dtypes ``ScalarType``.
Differences from the public signatures, where the schema cannot express
theirs: ``positions`` / ``rows`` must be tensors (not Python lists); the
sampler takes an int ``seed`` (no ``torch.Generator`` in a schema);
``walk_tree`` returns its bonus token as a 0-d int64 CPU tensor instead of a
Python int; ``gather_concat(out=...)`` is the separate op
``gather_concat_out(layers, out, rows, check_bounds)``, and the mutating ops
return nothing.

Static forms (a compiled / CUDA-graph decoding step, where no Python value
may change from round to round): ``tree_attention_static`` (the committed
length a device tensor, K/V the whole cache views), ``lm_head_sample_static``
and ``lm_head_sample_processed_static`` (the seed a device tensor, the noise
a pure function of its value), ``compact_kv_static_`` (the first destination
row a device tensor); ``build_tree_device_static`` (registered in
:mod:`dflash_kernels.static_ops`: the device tree build over index tables the
round owns). Their inputs are never read on the host (no range
checks: ``check_bounds`` / ``check`` are off), and their launches depend on
shapes only.

Output sizes: every op's output shape follows from input shapes and ints,
including the C++ ``build_tree`` (its heap pops the whole tree before it runs
dry, so ``N = tree_size(D, K, budget)`` always), except ``walk_tree`` (the C++
walk's accepted path length is data-dependent): its fake gives the path an
unbacked size from ``torch.library.get_ctx().new_dynamic_size()``. It is a
host op (CPU results, a device-to-host copy for GPU inputs), as is
``build_tree``; the round on the device uses ``build_tree_device`` /
``walk_tree_device``, whose shapes are static.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import gather as _gather
from . import kv_compaction as _kv
from . import lm_head as _lm
from . import sampling as _sampling
from . import tree as _tree
from . import tree_device as _tree_device
from .reference.lm_head import resolve_logit_dtype
# (not ``from . import tree_attention``: the package attribute of that name is the function)
from .tree_attention import (tree_attention as _tree_attention, tree_attention_mask as _tree_attention_mask,
                             tree_attention_static as _tree_attention_static)

__all__: list = []  # the ops live in torch.ops.dflash

_NS = "dflash"


def _rows(positions: Optional[Tensor], hidden: Tensor):
    """Selected row count: ``positions``' length, else every row of ``hidden``."""
    return hidden.shape[0] if positions is None else positions.shape[0]


# --------------------------------------------------------------------------- gather


@torch.library.custom_op(f"{_NS}::gather_concat", mutates_args=())
def gather_concat(layers: List[Tensor], rows: Optional[Tensor] = None, check_bounds: bool = True) -> Tensor:
    """:func:`dflash_kernels.gather_concat` into a new ``[R, n*H]`` tensor."""
    return _gather.gather_concat(layers, rows, None, check_bounds=check_bounds)


@gather_concat.register_fake
def _gather_concat_fake(layers, rows=None, check_bounds=True):
    first = layers[0]
    n_rows = first.shape[0] if rows is None else rows.shape[0]
    return first.new_empty(n_rows, len(layers) * first.shape[1])


@torch.library.custom_op(f"{_NS}::gather_concat_out", mutates_args={"out"})
def gather_concat_out(layers: List[Tensor], out: Tensor, rows: Optional[Tensor] = None,
                      check_bounds: bool = True) -> None:
    """:func:`dflash_kernels.gather_concat` with ``out=``: writes the ``[R, n*H]`` buffer ``out`` (any row
    stride) in place; returns nothing (the caller holds ``out``)."""
    _gather.gather_concat(layers, rows, out, check_bounds=check_bounds)


@gather_concat_out.register_fake
def _gather_concat_out_fake(layers, out, rows=None, check_bounds=True):
    return None


# --------------------------------------------------------------------------- lm_head


@torch.library.custom_op(f"{_NS}::lm_head_logits", mutates_args=())
def lm_head_logits(hidden: Tensor, weight: Tensor, norm_weight: Optional[Tensor] = None,
                   positions: Optional[Tensor] = None, eps: float = 1e-6, check_bounds: bool = True,
                   logit_dtype: Optional[torch.dtype] = torch.float32, softcap: Optional[float] = None) -> Tensor:
    """:func:`dflash_kernels.lm_head_logits`: ``[N, V]`` logits in ``logit_dtype`` (None: F.linear's dtype)."""
    return _lm.lm_head_logits(hidden, weight, norm_weight=norm_weight, eps=eps, positions=positions,
                              check_bounds=check_bounds, logit_dtype=logit_dtype, softcap=softcap)


@lm_head_logits.register_fake
def _lm_head_logits_fake(hidden, weight, norm_weight=None, positions=None, eps=1e-6, check_bounds=True,
                         logit_dtype=torch.float32, softcap=None):
    dtype = resolve_logit_dtype(hidden, weight, logit_dtype)
    return hidden.new_empty(_rows(positions, hidden), weight.shape[0], dtype=dtype)


@torch.library.custom_op(f"{_NS}::lm_head_argmax", mutates_args=())
def lm_head_argmax(hidden: Tensor, weight: Tensor, norm_weight: Optional[Tensor] = None,
                   positions: Optional[Tensor] = None, eps: float = 1e-6, check_bounds: bool = True,
                   logit_dtype: Optional[torch.dtype] = None, softcap: Optional[float] = None) -> Tensor:
    """:func:`dflash_kernels.lm_head_argmax`: int64 ``[N]`` greedy tokens."""
    return _lm.lm_head_argmax(hidden, weight, norm_weight=norm_weight, eps=eps, positions=positions,
                              check_bounds=check_bounds, logit_dtype=logit_dtype, softcap=softcap)


@lm_head_argmax.register_fake
def _lm_head_argmax_fake(hidden, weight, norm_weight=None, positions=None, eps=1e-6, check_bounds=True,
                         logit_dtype=None, softcap=None):
    return hidden.new_empty(_rows(positions, hidden), dtype=torch.int64)


@torch.library.custom_op(f"{_NS}::lm_head_topk", mutates_args=())
def lm_head_topk(hidden: Tensor, weight: Tensor, k: int, norm_weight: Optional[Tensor] = None,
                 positions: Optional[Tensor] = None, eps: float = 1e-6, check_bounds: bool = True,
                 chunk_elements: Optional[int] = None, softcap: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """:func:`dflash_kernels.lm_head_topk`: ``(logprobs fp32 [N, k], ids int64 [N, k])``."""
    return _lm.lm_head_topk(hidden, weight, k, norm_weight=norm_weight, eps=eps, positions=positions,
                            check_bounds=check_bounds, chunk_elements=chunk_elements, softcap=softcap)


@lm_head_topk.register_fake
def _lm_head_topk_fake(hidden, weight, k, norm_weight=None, positions=None, eps=1e-6, check_bounds=True,
                       chunk_elements=None, softcap=None):
    n = _rows(positions, hidden)
    return (hidden.new_empty(n, k, dtype=torch.float32), hidden.new_empty(n, k, dtype=torch.int64))


@torch.library.custom_op(f"{_NS}::lm_head_sample", mutates_args=())
def lm_head_sample(hidden: Tensor, weight: Tensor, temperature: float, seed: int,
                   norm_weight: Optional[Tensor] = None, positions: Optional[Tensor] = None, eps: float = 1e-6,
                   check_bounds: bool = True, logit_dtype: Optional[torch.dtype] = None,
                   softcap: Optional[float] = None) -> Tensor:
    """:func:`dflash_kernels.lm_head_sample` with ``seed=seed``: int64 ``[N]`` draws, equal for equal seeds
    (a schema has no ``torch.Generator``; the seed is a required int, so the op is deterministic)."""
    return _lm.lm_head_sample(hidden, weight, temperature, norm_weight=norm_weight, eps=eps, positions=positions,
                              seed=seed, check_bounds=check_bounds, logit_dtype=logit_dtype, softcap=softcap)


@lm_head_sample.register_fake
def _lm_head_sample_fake(hidden, weight, temperature, seed, norm_weight=None, positions=None, eps=1e-6,
                         check_bounds=True, logit_dtype=None, softcap=None):
    return hidden.new_empty(_rows(positions, hidden), dtype=torch.int64)


@torch.library.custom_op(f"{_NS}::lm_head_sample_static", mutates_args=())
def lm_head_sample_static(hidden: Tensor, weight: Tensor, temperature: float, seed: Tensor,
                          norm_weight: Optional[Tensor] = None, positions: Optional[Tensor] = None, eps: float = 1e-6,
                          logit_dtype: Optional[torch.dtype] = None, softcap: Optional[float] = None) -> Tensor:
    """:func:`dflash_kernels.lm_head_sample_static`: int64 ``[N]`` draws keyed by the device tensor ``seed``
    (int64 ``[1]``, read in-kernel); ``positions`` are not range-checked (no host read)."""
    return _lm.lm_head_sample_static(hidden, weight, temperature, seed, norm_weight=norm_weight, eps=eps,
                                     positions=positions, check_bounds=False, logit_dtype=logit_dtype,
                                     softcap=softcap)


@lm_head_sample_static.register_fake
def _lm_head_sample_static_fake(hidden, weight, temperature, seed, norm_weight=None, positions=None, eps=1e-6,
                                logit_dtype=None, softcap=None):
    return hidden.new_empty(_rows(positions, hidden), dtype=torch.int64)


@torch.library.custom_op(f"{_NS}::lm_head_sample_processed_static", mutates_args=())
def lm_head_sample_processed_static(hidden: Tensor, weight: Tensor, temperature: float, top_k: Optional[int],
                                    top_p: Optional[float], min_p: Optional[float], seed: Tensor,
                                    norm_weight: Optional[Tensor] = None, positions: Optional[Tensor] = None,
                                    eps: float = 1e-6, logit_dtype: Optional[torch.dtype] = None,
                                    softcap: Optional[float] = None) -> Tensor:
    """:func:`dflash_kernels.lm_head_sample_processed_static`: int64 ``[N]`` draws from the processed
    distribution (temperature, top-k, top-p, min-p), keyed by the device tensor ``seed``."""
    return _sampling.lm_head_sample_processed_static(hidden, weight, temperature, seed, top_k=top_k, top_p=top_p,
                                                     min_p=min_p, norm_weight=norm_weight, eps=eps,
                                                     positions=positions, logit_dtype=logit_dtype, softcap=softcap)


@lm_head_sample_processed_static.register_fake
def _lm_head_sample_processed_static_fake(hidden, weight, temperature, top_k, top_p, min_p, seed, norm_weight=None,
                                          positions=None, eps=1e-6, logit_dtype=None, softcap=None):
    return hidden.new_empty(_rows(positions, hidden), dtype=torch.int64)


@torch.library.custom_op(f"{_NS}::lm_head_cross_entropy", mutates_args=())
def lm_head_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, weights: Optional[Tensor] = None,
                          norm_weight: Optional[Tensor] = None, positions: Optional[Tensor] = None,
                          eps: float = 1e-6, ignore_index: int = -100, check_bounds: bool = True,
                          chunk_elements: Optional[int] = None, softcap: Optional[float] = None) -> Tensor:
    """:func:`dflash_kernels.lm_head_cross_entropy`: fp32 ``[N]`` losses (the forward only; the backward is
    ``dflash::lm_head_cross_entropy_backward``, registered with ``register_autograd``)."""
    return _lm.lm_head_cross_entropy(hidden.detach(), weight.detach(), targets, weights=weights,
                                     norm_weight=norm_weight, eps=eps, positions=positions,
                                     ignore_index=ignore_index, check_bounds=check_bounds,
                                     chunk_elements=chunk_elements, softcap=softcap)


@lm_head_cross_entropy.register_fake
def _lm_head_cross_entropy_fake(hidden, weight, targets, weights=None, norm_weight=None, positions=None, eps=1e-6,
                                ignore_index=-100, check_bounds=True, chunk_elements=None, softcap=None):
    return hidden.new_empty(_rows(positions, hidden), dtype=torch.float32)


def _ce_grad_rows(grad_loss, x, weight, targets, weights, norm_weight, eps, ignore_index, chunk_elements, softcap):
    """``d (sum_r grad_loss_r * loss_r) / d x`` for the selected rows ``x [N, H]`` (before the norm).

    Per row chunk (at most ``chunk_elements`` fp32 logits, the forward's bound): the capped fp32 logits
    ``z`` from :func:`dflash_kernels.lm_head_logits` (same backend as the forward), ``dz = g * w *
    (softmax(z) - onehot(t))`` (0 at ``ignore_index``), times ``1 - (z / c)^2`` under the softcap, then
    ``da = dz @ weight`` in fp32 (the reference's ``a.float() @ weight.float().T``, the weight upcast a few
    vocab rows at a time). Then back through HF's RMSNorm with its casts, exactly the steps autograd takes
    through :func:`dflash_kernels.reference.rms_norm`.
    """
    n, h = x.shape
    vocab = weight.shape[0]
    grad_a = torch.zeros(n, h, dtype=torch.float32, device=x.device)
    if n > 0:
        scale = (targets != ignore_index).float() * grad_loss.float()
        if weights is not None:
            scale = scale * weights.detach().float()
        safe_targets = targets.clamp(0, vocab - 1)
        rows_per = max(1, min(n, int(chunk_elements or _lm.DEFAULT_CHUNK_ELEMENTS) // vocab))
        vocab_per = max(1, (1 << 24) // max(1, h))
        for r0 in range(0, n, rows_per):
            r1 = min(n, r0 + rows_per)
            z = _lm.lm_head_logits(x[r0:r1], weight, norm_weight=norm_weight, eps=eps, check_bounds=False,
                                   softcap=softcap)
            dz = torch.softmax(z, dim=-1)
            dz[torch.arange(r1 - r0, device=x.device), safe_targets[r0:r1]] -= 1.0
            dz *= scale[r0:r1, None]
            if softcap is not None:
                dz *= 1.0 - (z / softcap) ** 2
            for v0 in range(0, vocab, vocab_per):
                grad_a[r0:r1] += dz[:, v0:v0 + vocab_per] @ weight[v0:v0 + vocab_per].detach().float()
    grad_a = grad_a.to(x.dtype)  # the gradient of a.float() in a's dtype (a has x's dtype)
    if norm_weight is None:
        return grad_a
    nw = norm_weight.detach()
    # a = (nw * normed.to(x.dtype)).to(x.dtype): each cast's gradient is cast back to its input's dtype.
    grad_normed = (grad_a.to(torch.promote_types(nw.dtype, x.dtype)) * nw).to(x.dtype).float()
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    # normed = xf * r, r = (mean(xf^2) + eps)^-1/2:  d/dxf = r * g - xf * r^3 * mean(g * xf)
    grad_x = r * grad_normed - xf * r.pow(3) * (grad_normed * xf).mean(-1, keepdim=True)
    return grad_x.to(x.dtype)


@torch.library.custom_op(f"{_NS}::lm_head_cross_entropy_backward", mutates_args=())
def lm_head_cross_entropy_backward(grad_loss: Tensor, hidden: Tensor, weight: Tensor, targets: Tensor,
                                   weights: Optional[Tensor] = None, norm_weight: Optional[Tensor] = None,
                                   positions: Optional[Tensor] = None, eps: float = 1e-6, ignore_index: int = -100,
                                   chunk_elements: Optional[int] = None, softcap: Optional[float] = None) -> Tensor:
    """Gradient of ``sum(grad_loss * lm_head_cross_entropy(hidden, ...))`` with respect to ``hidden``
    (``[T, H]``, hidden's dtype): recomputes the logits chunk by chunk (no ``[N, V]`` tensor kept from the
    forward), so a training step runs the lm_head GEMM three times where the public Triton path runs it
    twice (it computes the gradient inside the forward). Rows a position selects twice get both gradients."""
    targets = targets.to(torch.int64)
    pos = None if positions is None else positions.to(device=hidden.device, dtype=torch.int64)
    x = hidden.detach() if pos is None else hidden.detach().index_select(0, pos)
    grad_x = _ce_grad_rows(grad_loss, x, weight.detach(), targets, weights, norm_weight, eps, ignore_index,
                           chunk_elements, softcap)
    if pos is None:
        return grad_x.contiguous()
    return torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device).index_add_(0, pos, grad_x)


@lm_head_cross_entropy_backward.register_fake
def _lm_head_cross_entropy_backward_fake(grad_loss, hidden, weight, targets, weights=None, norm_weight=None,
                                         positions=None, eps=1e-6, ignore_index=-100, chunk_elements=None,
                                         softcap=None):
    return hidden.new_empty(hidden.shape)


def _ce_setup_context(ctx, inputs, output):
    hidden, weight, targets, weights, norm_weight, positions, eps, ignore_index, _, chunk_elements, softcap = inputs
    ctx.save_for_backward(hidden, weight, targets, weights, norm_weight, positions)
    ctx.scalars = (eps, ignore_index, chunk_elements, softcap)


def _ce_backward(ctx, grad_loss):
    hidden, weight, targets, weights, norm_weight, positions = ctx.saved_tensors
    eps, ignore_index, chunk_elements, softcap = ctx.scalars
    grad_hidden = None
    if ctx.needs_input_grad[0]:
        grad_hidden = torch.ops.dflash.lm_head_cross_entropy_backward(
            grad_loss, hidden, weight, targets, weights, norm_weight, positions, eps, ignore_index,
            chunk_elements, softcap)
    return grad_hidden, None, None, None, None, None, None, None, None, None, None


lm_head_cross_entropy.register_autograd(_ce_backward, setup_context=_ce_setup_context)


# --------------------------------------------------------------------------- tree structure


@torch.library.custom_op(f"{_NS}::ancestor_bits", mutates_args=())
def ancestor_bits(parents: Tensor, check: bool = True) -> Tensor:
    """:func:`dflash_kernels.ancestor_bits`: int32 ``[N+1, ceil((N+1)/32)]`` on parents' device."""
    return _tree.ancestor_bits(parents, check=check)


@ancestor_bits.register_fake
def _ancestor_bits_fake(parents, check=True):
    n = parents.shape[0]
    return parents.new_empty(n, (n + 31) // 32, dtype=torch.int32)


@torch.library.custom_op(f"{_NS}::tree_positions", mutates_args=())
def tree_positions(depths: Tensor, start: int) -> Tensor:
    """:func:`dflash_kernels.tree_positions`: int64 ``[N+1]`` positions of ``[root, nodes...]``."""
    return _tree.tree_positions(depths, start)


@tree_positions.register_fake
def _tree_positions_fake(depths, start):
    return depths.new_empty(depths.shape[0] + 1, dtype=torch.int64)


def _static_tree_size(top_logprobs: Tensor, budget) -> int:
    """``tree_size(D, K, budget)`` from the draft's shape (concrete ints: a symbolic one is specialized)."""
    depth, k = top_logprobs.shape
    return _tree_device.tree_size(int(depth), int(k), int(budget))


@torch.library.custom_op(f"{_NS}::build_tree", mutates_args=())
def build_tree(top_logprobs: Tensor, top_ids: Tensor, budget: int) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`dflash_kernels.build_tree` (C++ heap, host op): ``(token_ids [N], depths [N], parents [N+1])``
    int64 on the CPU. ``N = tree_size(D, K, budget)``: the heap pushes a node's next sibling and first child
    at every pop, so it empties only after the whole ``D``-level tree was popped; the fake is static."""
    return _tree.build_tree(top_logprobs, top_ids, budget)


@build_tree.register_fake
def _build_tree_fake(top_logprobs, top_ids, budget):
    n = _static_tree_size(top_logprobs, budget)
    new = lambda size: torch.empty(size, dtype=torch.int64, device="cpu")  # noqa: E731
    return new(n), new(n), new(n + 1)


@torch.library.custom_op(f"{_NS}::walk_tree", mutates_args=())
def walk_tree(parents: Tensor, token_ids: Tensor, target_choice: Tensor) -> Tuple[Tensor, Tensor]:
    """:func:`dflash_kernels.walk_tree` (C++, host op): ``(accepted [M] int64, bonus [] int64)``, both on
    the CPU; the bonus token is a 0-d tensor where the public function returns an int. ``M`` (1..D+1)
    depends on the values: the fake gives it an unbacked size (``new_dynamic_size(min=1)``)."""
    accepted, bonus = _tree.walk_tree(parents, token_ids, target_choice)
    return accepted, torch.tensor(bonus, dtype=torch.int64)


@walk_tree.register_fake
def _walk_tree_fake(parents, token_ids, target_choice):
    length = torch.library.get_ctx().new_dynamic_size(min=1)
    return (torch.empty(length, dtype=torch.int64, device="cpu"), torch.empty((), dtype=torch.int64, device="cpu"))


@torch.library.custom_op(f"{_NS}::build_tree_device", mutates_args=())
def build_tree_device(top_logprobs: Tensor, top_ids: Tensor, budget: int) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`dflash_kernels.build_tree_device`: ``(token_ids [N], depths [N], parents [N+1])`` int64 on
    the inputs' device, ``N = tree_size(D, K, budget)``."""
    return _tree.build_tree_device(top_logprobs, top_ids, budget)


@build_tree_device.register_fake
def _build_tree_device_fake(top_logprobs, top_ids, budget):
    n = _static_tree_size(top_logprobs, budget)
    new = lambda size: top_logprobs.new_empty(size, dtype=torch.int64)  # noqa: E731
    return new(n), new(n), new(n + 1)


@torch.library.custom_op(f"{_NS}::walk_tree_device", mutates_args=())
def walk_tree_device(parents: Tensor, token_ids: Tensor, target_choice: Tensor, max_depth: int,
                     bits: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`dflash_kernels.walk_tree_device`: ``(path [D+1], path_len [1], committed [D+1])`` int64."""
    return _tree.walk_tree_device(parents, token_ids, target_choice, max_depth, bits)


@walk_tree_device.register_fake
def _walk_tree_device_fake(parents, token_ids, target_choice, max_depth, bits=None):
    new = lambda size: parents.new_empty(size, dtype=torch.int64)  # noqa: E731
    return new(max_depth + 1), new(1), new(max_depth + 1)


# --------------------------------------------------------------------------- attention


@torch.library.custom_op(f"{_NS}::tree_attention", mutates_args=())
def tree_attention(query: Tensor, key: Tensor, value: Tensor, bits: Optional[Tensor], prefix_len: int,
                   scale: Optional[float] = None, positions: Optional[Tensor] = None, window: Optional[int] = None,
                   softcap: Optional[float] = None, sinks: Optional[Tensor] = None) -> Tensor:
    """:func:`dflash_kernels.tree_attention`: query-shaped output in the query's dtype (K/V any strides,
    e.g. views of the cache: read, never copied or written)."""
    return _tree_attention(query, key, value, bits, prefix_len, scale, positions=positions, window=window,
                                softcap=softcap, sinks=sinks)


@tree_attention.register_fake
def _tree_attention_fake(query, key, value, bits, prefix_len, scale=None, positions=None, window=None,
                         softcap=None, sinks=None):
    return query.new_empty(query.shape)


@torch.library.custom_op(f"{_NS}::tree_attention_static", mutates_args=())
def tree_attention_static(query: Tensor, key: Tensor, value: Tensor, bits: Optional[Tensor], prefix_len: Tensor,
                          scale: Optional[float] = None, positions: Optional[Tensor] = None,
                          window: Optional[int] = None, softcap: Optional[float] = None,
                          sinks: Optional[Tensor] = None) -> Tensor:
    """:func:`dflash_kernels.tree_attention_static`: the committed length ``prefix_len`` an int64 device tensor
    ``[1]`` (read in-kernel), K/V the whole cache views ``[.., Hkv, S_max, D]``; query-shaped output."""
    return _tree_attention_static(query, key, value, bits, prefix_len, scale, positions=positions, window=window,
                                  softcap=softcap, sinks=sinks)


@tree_attention_static.register_fake
def _tree_attention_static_fake(query, key, value, bits, prefix_len, scale=None, positions=None, window=None,
                                softcap=None, sinks=None):
    return query.new_empty(query.shape)


@torch.library.custom_op(f"{_NS}::tree_attention_mask", mutates_args=())
def tree_attention_mask(bits: Tensor, prefix_len: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """:func:`dflash_kernels.tree_attention_mask`: the additive ``[T, prefix_len + T]`` mask of ``dtype``."""
    return _tree_attention_mask(bits, prefix_len, dtype)


@tree_attention_mask.register_fake
def _tree_attention_mask_fake(bits, prefix_len, dtype=torch.float32):
    t = bits.shape[0]
    return bits.new_empty(t, prefix_len + t, dtype=dtype)


# --------------------------------------------------------------------------- KV compaction


@torch.library.custom_op(f"{_NS}::compact_kv_", mutates_args={"kv"})
def compact_kv_(kv: Tensor, src_positions: Tensor, dst_start: int, num_rows: Optional[Tensor] = None,
                check: bool = True) -> None:
    """:func:`dflash_kernels.compact_kv_`: moves the accepted rows of ``kv`` in place (returns nothing)."""
    _kv.compact_kv_(kv, src_positions, dst_start, num_rows=num_rows, check=check)


@compact_kv_.register_fake
def _compact_kv_fake(kv, src_positions, dst_start, num_rows=None, check=True):
    return None


@torch.library.custom_op(f"{_NS}::compact_kv_static_", mutates_args={"kv"})
def compact_kv_static_(kv: Tensor, src_positions: Tensor, dst_start: Tensor,
                       num_rows: Optional[Tensor] = None) -> None:
    """:func:`dflash_kernels.compact_kv_static_`: ``dst_start`` (int64 ``[1]``), ``num_rows`` and the absolute
    ``src_positions`` device tensors, read in-kernel, unchecked (no host read); moves the rows in place
    (returns nothing)."""
    _kv.compact_kv_static_(kv, src_positions, dst_start, num_rows, check=False)


@compact_kv_static_.register_fake
def _compact_kv_static_fake(kv, src_positions, dst_start, num_rows=None):
    return None
