"""The target's head at the rows whose token is needed: the fused lm_head ops, or the lm_head module itself.

Every token choice of a generation (the target's argmax or sample, the drafter's proposals and top-K through
the target's lm_head, rejection sampling) and the training losses go through one :class:`TargetHead`, made
once per lm_head. One decision, :func:`head_is_dense`, picks its path:

* ``"fused"``: the lm_head is a plain ``nn.Linear`` (its class's own forward, no bias, no hooks) whose weight is
  a plain dense tensor of a float dtype. The :mod:`dflash_kernels` ops read that weight: final norm, GEMM and
  the argmax / sample / top-K fused, no ``[rows, V]`` logits stored on the Triton path.
* ``"module"``: anything else -- a LoRA / DoRA-wrapped lm_head (peft's ``lora.Linear``: ``.weight`` is the base
  weight, reading it would silently drop the adapter), a quantized weight (a torchao tensor subclass such as
  ``Int8Tensor`` / ``Float8Tensor``, a bitsandbytes ``Params4bit`` / ``Int8Params`` of a ``Linear4bit`` /
  ``Linear8bitLt``), forward hooks, a subclass with its own forward. The module runs on the needed rows only
  (normed as the fused ops norm them), ``logits = lm_head(rows)`` ``[N, V]`` in its own output dtype -- the
  logits the model's own forward returns at those rows -- and the choice is made from them by the fused
  ops' rules (:mod:`dflash_kernels.reference`): argmax with the lowest id on ties; a device seed's Gumbel-max
  draw with the same Philox noise per (seed, row, id); transformers' processed distribution (temperature,
  top-k, top-p, min-p); the rejection rule (:func:`dflash_kernels.reference.rejection.rejection_from_probs`);
  top-K of the log-softmax; cross-entropy (the module's trainable parameters are detached: the drafter's loss
  leaves the target's adapters without gradient). A final-logit softcap ``c`` is applied to the fp32 of the
  module's logits, then rounded back to their dtype for the argmax and the samples.

``result.head_path`` of a generation says which path ran.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

import dflash_kernels
from dflash_kernels.reference.lm_head import (check_k, check_seed_tensor, check_temperature, gumbel_noise, rms_norm,
                                              seed_from, soft_cap)
from dflash_kernels.reference.rejection import rejection_from_probs
from dflash_kernels.reference.sampling import check_sampling_args, processed_probs, processed_scores

__all__ = ["HEAD_PATHS", "TargetHead", "head_is_dense", "head_shape"]

#: the two ways a head runs (``result.head_path``)
HEAD_PATHS = ("fused", "module")

#: weight dtypes the fused ops read
DENSE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def head_is_dense(lm_head) -> bool:
    """Whether the fused ops may read ``lm_head.weight`` as the whole head: ``lm_head`` is an ``nn.Linear``
    running ``nn.Linear.forward`` (no instance forward, no forward hooks, no bias) and its weight a plain dense
    ``torch.Tensor`` / ``nn.Parameter`` (not a subclass) of a float dtype. Anything else runs as a module."""
    if not isinstance(lm_head, torch.nn.Linear) or type(lm_head).forward is not torch.nn.Linear.forward:
        return False
    if "forward" in vars(lm_head) or lm_head._forward_hooks or lm_head._forward_pre_hooks:
        return False
    if getattr(lm_head, "bias", None) is not None:
        return False
    weight = lm_head.weight
    return (type(weight) in (torch.Tensor, torch.nn.Parameter) and weight.layout == torch.strided
            and weight.dtype in DENSE_DTYPES)


def head_shape(lm_head) -> Tuple[int, int]:
    """``(V, H)`` of an lm_head of either path: ``out_features`` / ``in_features`` (``nn.Linear``, its
    bitsandbytes subclasses and peft's wrappers keep them: a packed 4-bit weight's shape is not ``[V, H]``),
    else the weight's shape."""
    out_features, in_features = getattr(lm_head, "out_features", None), getattr(lm_head, "in_features", None)
    if isinstance(out_features, int) and isinstance(in_features, int):
        return out_features, in_features
    shape = lm_head.weight.shape
    return int(shape[0]), int(shape[1])


class TargetHead:
    """An lm_head and the path it runs by (module docstring); the ops mirror :mod:`dflash_kernels`' lm_head ops
    with the weight argument taken by the head.

    ``hidden`` rows are pre-norm target rows when ``norm_weight`` is given (the final norm fused: the
    adapter's :meth:`~dflash.target.adapter.TargetAdapter.head_inputs`), else rows the head reads as they are
    (normed target rows, the drafter's head rows). ``positions`` select rows of ``hidden`` (None: all)."""

    def __init__(self, lm_head):
        self.module = lm_head
        self.path = "fused" if head_is_dense(lm_head) else "module"
        #: the weight the fused ops read (None on the module path)
        self.weight = lm_head.weight if self.path == "fused" else None
        self.vocab_size, self.hidden_size = head_shape(lm_head)
        weight = getattr(lm_head, "weight", None)
        #: the dtype the module path hands the module its rows in (the weight's, when it is a float dtype: rows of
        #: a drafter in another dtype); None: as they come
        self.input_dtype = weight.dtype if isinstance(weight, torch.Tensor) and weight.dtype.is_floating_point else None

    @classmethod
    def of(cls, head) -> "TargetHead":
        """``head`` itself when a :class:`TargetHead`, else the fused head of a dense weight ``[V, H]`` (what the
        training objective's functions took before heads: a weight tensor)."""
        if isinstance(head, TargetHead):
            return head
        if not isinstance(head, torch.Tensor) or head.dim() != 2:
            raise TypeError(f"expected a TargetHead or an lm_head weight [V, H], got {type(head).__name__}")
        linear = torch.nn.Linear(head.shape[1], head.shape[0], bias=False, device="meta")
        self = cls(linear)
        self.module, self.weight = None, head
        return self

    @property
    def fused(self) -> bool:
        return self.path == "fused"

    def __repr__(self):
        kind = "weight" if self.module is None else f"{type(self.module).__module__}.{type(self.module).__name__}"
        return f"TargetHead({kind}, path={self.path!r}, V={self.vocab_size}, H={self.hidden_size})"

    # ------------------------------------------------------------------ the module path's logits
    def _rows(self, hidden: torch.Tensor, positions, norm_weight, eps: float, check_bounds: bool) -> torch.Tensor:
        """The selected rows of ``hidden``, through the fused ops' final norm when ``norm_weight`` is given."""
        if hidden.dim() != 2 or hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden must be [T, H] = [T, {self.hidden_size}], got {tuple(hidden.shape)}")
        rows = hidden
        if positions is not None:
            positions = torch.as_tensor(positions, dtype=torch.long, device=hidden.device).reshape(-1)
            if check_bounds and positions.numel() and bool(((positions < 0) | (positions >= hidden.shape[0])).any()):
                raise IndexError(f"positions must be row indices in [0, {hidden.shape[0]}), got "
                                 f"{positions.tolist()}")
            rows = hidden.index_select(0, positions)
        if norm_weight is not None:
            rows = rms_norm(rows, norm_weight, eps)
        if self.input_dtype is not None and rows.dtype != self.input_dtype:
            rows = rows.to(self.input_dtype)
        return rows

    def module_logits(self, hidden: torch.Tensor, positions=None, norm_weight=None, eps: float = 1e-6,
                      check_bounds: bool = True, frozen: bool = False) -> torch.Tensor:
        """``[N, V]``: the lm_head module on the selected (normed) rows, in its own output dtype. ``frozen``: its
        trainable parameters detached (a loss through it reaches ``hidden`` only)."""
        rows = self._rows(hidden, positions, norm_weight, eps, check_bounds)
        if not frozen:
            return self.module(rows)
        live = {n: p.detach() for n, p in self.module.named_parameters() if p.requires_grad}
        z = torch.func.functional_call(self.module, live, (rows,), strict=False) if live else self.module(rows)
        if rows.requires_grad and not z.requires_grad:
            z = z + self._straight_through(rows, z.dtype)
        return z

    def _straight_through(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Zero, with the gradient of the dequantized weight's logits: for a head whose forward is not
        differentiable in its input (dynamic activation quantization rounds it), a loss through the module's exact
        logits still reaches ``rows`` (the straight-through estimator)."""
        dequantize = getattr(getattr(self.module, "weight", None), "dequantize", None)
        if dequantize is None:
            raise RuntimeError(f"the lm_head {type(self.module).__name__} is not differentiable in its input and its "
                               "weight has no dequantize(): a drafter's loss cannot pass through it")
        dense = torch.nn.functional.linear(rows, dequantize().detach().to(rows.dtype)).to(dtype)
        return dense - dense.detach()

    def _capped(self, hidden, positions, norm_weight, eps, softcap, check_bounds) -> torch.Tensor:
        """The module's logits, softcapped on their fp32 and rounded back to their dtype (what the choices read)."""
        z = self.module_logits(hidden, positions, norm_weight, eps, check_bounds)
        return z if softcap is None else soft_cap(z.float(), softcap).to(z.dtype)

    # ------------------------------------------------------------------ the ops
    def argmax(self, hidden, *, positions=None, norm_weight=None, eps=1e-6, softcap=None, check_bounds=True,
               backend=None) -> torch.Tensor:
        """int64 ``[N]``: the argmax of the logits in the head's dtype, lowest id on ties."""
        if self.fused:
            return dflash_kernels.lm_head_argmax(hidden, self.weight, norm_weight=norm_weight, eps=eps,
                                                 positions=positions, check_bounds=check_bounds, softcap=softcap,
                                                 backend=backend)
        return torch.argmax(self._capped(hidden, positions, norm_weight, eps, softcap, check_bounds), dim=-1)

    def logits(self, hidden, *, positions=None, norm_weight=None, eps=1e-6, softcap=None, check_bounds=True,
               logit_dtype=torch.float32, backend=None) -> torch.Tensor:
        """``[N, V]`` logits (softcapped), fp32 by default or rounded to ``logit_dtype`` (None: the head's own)."""
        if self.fused:
            return dflash_kernels.lm_head_logits(hidden, self.weight, norm_weight=norm_weight, eps=eps,
                                                 positions=positions, check_bounds=check_bounds,
                                                 logit_dtype=logit_dtype, softcap=softcap, backend=backend)
        z = self.module_logits(hidden, positions, norm_weight, eps, check_bounds)
        return soft_cap(z.float(), softcap).to(z.dtype if logit_dtype is None else logit_dtype)

    def topk(self, hidden, k: int, *, positions=None, norm_weight=None, eps=1e-6, softcap=None, check_bounds=True,
             backend=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(logprobs fp32 [N, k], ids [N, k])``: top-k of the log-softmax, best first."""
        if self.fused:
            return dflash_kernels.lm_head_topk(hidden, self.weight, k, norm_weight=norm_weight, eps=eps,
                                               positions=positions, check_bounds=check_bounds, softcap=softcap,
                                               backend=backend)
        check_k(k, self.vocab_size)
        z = self.module_logits(hidden, positions, norm_weight, eps, check_bounds)
        return torch.topk(torch.log_softmax(soft_cap(z.float(), softcap), dim=-1), k, dim=-1, sorted=True)

    def sample(self, hidden, temperature, *, positions=None, generator=None, seed=None, norm_weight=None, eps=1e-6,
               softcap=None, check_bounds=True, backend=None) -> torch.Tensor:
        """int64 ``[N]``: one draw per row from ``softmax(logits / temperature)`` (a device seed: Gumbel-max)."""
        if self.fused:
            return dflash_kernels.lm_head_sample(hidden, self.weight, temperature, norm_weight=norm_weight, eps=eps,
                                                 positions=positions, generator=generator, seed=seed,
                                                 check_bounds=check_bounds, softcap=softcap, backend=backend)
        t = check_temperature(temperature)
        scores = self._capped(hidden, positions, norm_weight, eps, softcap, check_bounds).float()
        if isinstance(seed, torch.Tensor):
            inv_t = torch.full((), 1.0 / t, dtype=torch.float32, device=scores.device)  # as the fused ops round it
            return _gumbel_max(scores * inv_t, check_seed_tensor(seed, scores.device))
        return _multinomial(torch.softmax(scores / t, dim=-1), generator, seed)

    def sample_processed(self, hidden, temperature, *, top_k=None, top_p=None, min_p=None, positions=None,
                         generator=None, seed=None, norm_weight=None, eps=1e-6, softcap=None, check_bounds=True,
                         backend=None) -> torch.Tensor:
        """int64 ``[N]``: one draw per row from transformers' processed distribution of the logits."""
        if self.fused:
            return dflash_kernels.lm_head_sample(
                hidden, self.weight, temperature, top_k=top_k, top_p=top_p, min_p=min_p, norm_weight=norm_weight,
                eps=eps, positions=positions, seed=seed, generator=generator, softcap=softcap,
                check_bounds=check_bounds, backend=backend)
        t = check_temperature(temperature)
        top_k, top_p, min_p = check_sampling_args(top_k, top_p, min_p)
        logits = self._capped(hidden, positions, norm_weight, eps, softcap, check_bounds)
        scores = processed_scores(logits, t, top_k, top_p, min_p)
        if isinstance(seed, torch.Tensor):
            return _gumbel_max(scores, check_seed_tensor(seed, scores.device, "lm_head_sample_processed"))
        return _multinomial(torch.softmax(scores, dim=-1), generator, seed)

    def rejection_sample(self, hidden, proposals, temperature, *, q_hidden=None, q_ids=None, q_probs=None,
                         top_k=None, top_p=None, min_p=None, norm_weight=None, eps=1e-6, softcap=None, seed=None,
                         check_bounds=True, backend=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(choices [D + 1], accepted [1])``: :func:`dflash_kernels.rejection_sample` with this head (a dense
        ``q`` is ``q_hidden``'s rows through the same head, no norm, no softcap)."""
        if self.fused:
            return dflash_kernels.rejection_sample(
                hidden, self.weight, proposals, temperature, q_hidden=q_hidden, q_ids=q_ids, q_probs=q_probs,
                top_k=top_k, top_p=top_p, min_p=min_p, norm_weight=norm_weight, eps=eps, softcap=softcap, seed=seed,
                check_bounds=check_bounds, backend=backend)
        t = check_temperature(temperature)
        filters = check_sampling_args(top_k, top_p, min_p)
        if not isinstance(seed, torch.Tensor):
            raise TypeError(f"rejection_sample: seed must be an int64 tensor [1], got {type(seed).__name__}")
        seed = check_seed_tensor(seed, hidden.device, "rejection_sample")
        D = proposals.shape[0]
        if hidden.shape[0] != D + 1:
            raise ValueError(f"hidden must be [D + 1, H] = [{D + 1}, H], got {tuple(hidden.shape)}")
        logits = self._capped(hidden, None, norm_weight, eps, softcap, check_bounds)
        p = torch.softmax(processed_scores(logits, t, *filters), dim=-1)
        if q_hidden is not None:
            q = processed_probs(self.module_logits(q_hidden, check_bounds=check_bounds), t, *filters)
        else:
            q = torch.zeros(D, self.vocab_size, dtype=torch.float32, device=hidden.device)
            q = q.scatter_add_(1, q_ids, q_probs.float())
        return rejection_from_probs(p, q, proposals, seed)

    def cross_entropy(self, hidden, targets, *, weights=None, positions=None, norm_weight=None, eps=1e-6,
                      softcap=None, ignore_index=-100, check_bounds=True, backend=None) -> torch.Tensor:
        """fp32 ``[N]`` losses ``weights * (logsumexp(logits) - logits[target])``, differentiable wrt ``hidden``
        only (the fused weight and the module's parameters are constants)."""
        if self.fused:
            return dflash_kernels.lm_head_cross_entropy(hidden, self.weight.detach(), targets, weights=weights,
                                                        norm_weight=norm_weight, eps=eps, positions=positions,
                                                        ignore_index=ignore_index, check_bounds=check_bounds,
                                                        softcap=softcap, backend=backend)
        z = self.module_logits(hidden, positions, norm_weight, eps, check_bounds, frozen=True)
        loss = F.cross_entropy(soft_cap(z.float(), softcap), targets, reduction="none", ignore_index=ignore_index)
        return loss if weights is None else loss * weights.detach().float()

    def candidate_logits(self, hidden: torch.Tensor, candidates: torch.Tensor, softcap=None) -> torch.Tensor:
        """``[N, K]`` logits of ``hidden [N, H]``'s rows at the ids ``candidates [N, K]`` (softcapped), in
        ``hidden``'s dtype, differentiable wrt ``hidden`` only: a DFlash2 selector's unary scores in training."""
        if self.fused:
            W = self.weight.detach()
            return soft_cap(torch.einsum("nh,nkh->nk", hidden, W[candidates].to(hidden.dtype)), softcap)
        z = self.module_logits(hidden, frozen=True)
        return soft_cap(z.gather(1, candidates).to(hidden.dtype), softcap)


def _gumbel_max(scores: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """``argmax_j(scores[n, j] + G(seed, n, j))``: the fused ops' device-seed draw (lowest id on ties)."""
    n, vocab = scores.shape
    noise = gumbel_noise(seed, torch.arange(n, device=scores.device), torch.arange(vocab, device=scores.device))
    return torch.argmax(scores + noise, dim=-1)


def _multinomial(probs: torch.Tensor, generator: Optional[torch.Generator], seed) -> torch.Tensor:
    """One draw per row of ``probs`` with ``generator``, or a private generator seeded with ``seed``."""
    if probs.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=probs.device)
    if seed is not None:
        generator = torch.Generator(device=probs.device)
        generator.manual_seed(seed_from(None, seed) % (2 ** 63))
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
