"""The DFlash2 drafter: DFlash layers wrapped in grouped dynamic causal convolutions, plus a candidate selector.

Shapes (``H`` hidden, ``B`` block size, ``nb`` blocks, ``K`` taps, ``g``
channels per group, ``G = H / g`` groups, ``V`` vocabulary, ``r`` selector
rank, ``k`` selector candidates, ``D = B - 1`` drafted positions):

* :class:`GroupedDynamicCausalConv` around a sublayer ``f`` (attention or MLP)
  of a block ``x [nb, B, H]``::

      d      = kernel_projection(x)            [nb, B, 2, K, G]   (per-position dynamic kernels)
      conv(y, w, base)[b, t, c] = sum_{o < K, o <= t} (base[o, c] + w[b, t, o, c // g]) * y[b, t - o, c]
      prepare(x) = conv(x, d[:, :, 0], base_kernel[0]),  d[:, :, 1]
      finish(y)  = conv(y, d[:, :, 1], base_kernel[1])

  The taps run along the block only (causal: output ``t`` reads inputs
  ``t - o``; nothing crosses a block boundary, context rows are never
  convolved). ``base_kernel [2, K, H]``; identity initialisation is
  ``base[:, 0] = 1``, every other tap and the projection 0 (a DFlash layer).
  Both convs are :func:`dflash_kernels.dynamic_conv` (one launch each on the
  Triton backend, the taps summed in fp32 and rounded once; ``finish`` takes
  the layer's residual and returns ``residual + conv``, fused in the same
  launch); the projection is one GEMM whose halves the op reads in place.
* :class:`CandidateSelector` over the drafter's logits ``z [D, V]`` at block
  positions ``1..D`` and final block states ``h [D, H]``::

      u_j, c_j = top-k of z_j                    [D, k] values and token ids
      p_j      = hidden_projection(h_j)          [D, r]
      s_j[i]   = u_j[i] + < predecessor_codebook[prev_j] * p_j , successor_codebook[c_j[i]] >
      x_j      = c_j[argmax s_j]  (greedy)   or  a draw of c_j from q_j = filtered(softmax(s_j / T))
      prev_1 = the anchor token, prev_{j+1} = x_j

  ``filtered``: the target's top-k / top-p / min-p over the ``k`` candidates
  (:func:`dflash_kernels.reference.filter_candidate_probs`; off when the
  call sets none). ``q_j`` is the drafter's distribution the verifier uses in
  rejection sampling (zero outside ``c_j`` and where the filters cut). The chain is
  :func:`dflash_kernels.select_candidates` (one launch for all ``D``
  positions on the Triton backend; sampling by inverse CDF with one uniform
  per position, from a device seed), or, given explicit uniforms,
  :func:`dflash_kernels.reference.select_chain`. Adding a constant to every ``u_j[i]`` of
  one position changes neither the argmax nor ``q_j``, so log-probabilities
  of the logits serve as ``u`` as well as the logits themselves.

Config keys (read from ``dflash_config`` first, then the top level, as the
published configs place them): ``conv_kernel_size``, ``conv_group_size``,
``selector_rank``, ``selector_top_k``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

import dflash_kernels
from dflash_kernels.reference import select_chain

from .config import DraftConfigError, dflash_value

__all__ = ["CandidateSelector", "GroupedDynamicCausalConv", "DFLASH2_KEYS", "is_dflash2", "select_reference"]

#: the config keys a DFlash2 drafter adds to a DFlash one
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def is_dflash2(config) -> bool:
    """Whether a drafter config describes a DFlash2 drafter (it sets every key of :data:`DFLASH2_KEYS`).

    A config that sets some of them but not all is a :class:`DraftConfigError` naming the missing ones.
    """
    present = [k for k in DFLASH2_KEYS if dflash_value(config, k) is not None]
    if present and len(present) != len(DFLASH2_KEYS):
        missing = [k for k in DFLASH2_KEYS if k not in present]
        raise DraftConfigError(f"drafter config sets the DFlash2 keys {present} but not {missing}: a DFlash2 drafter "
                               f"needs all of {', '.join(DFLASH2_KEYS)}")
    return bool(present)


class GroupedDynamicCausalConv(nn.Module):
    """Per-position grouped causal convolution along the block (module docstring); one per sublayer."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if kernel_size < 1:
            raise DraftConfigError(f"conv_kernel_size must be >= 1, got {kernel_size}")
        if group_size < 1 or hidden_size % group_size:
            raise DraftConfigError(f"conv_group_size {group_size} must divide hidden_size {hidden_size}")
        self.kernel_size, self.group_size = int(kernel_size), int(group_size)
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Identity: the wrapped sublayer sees its input and returns its output unchanged."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0].fill_(1.0)
            self.kernel_projection.weight.zero_()

    def dynamic(self, x: torch.Tensor) -> torch.Tensor:
        """``[nb, B, 2, K, G]`` per-position kernels of ``x [nb, B, H]``."""
        nb, B, _ = x.shape
        return self.kernel_projection(x).view(nb, B, 2, self.kernel_size, self.groups)

    def prepare(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(conv(x, d0, base0) [nb, B, H], d1 [nb, B, K, G])`` for ``x [nb, B, H]`` (``d1`` a view of the
        projection output)."""
        d = self.dynamic(x)
        return dflash_kernels.dynamic_conv(x, d[:, :, 0], self.base_kernel[0]), d[:, :, 1]

    def finish(self, y: torch.Tensor, d1: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``conv(y, d1, base1)`` for the sublayer's output ``y [nb, B, H]``; ``residual + conv(...)`` (one
        fused launch) when ``residual [nb, B, H]`` is given."""
        return dflash_kernels.dynamic_conv(y, d1, self.base_kernel[1], residual)


def select_reference(unary: torch.Tensor, candidates: torch.Tensor, projected: torch.Tensor,
                     predecessor: torch.Tensor, successor: torch.Tensor, anchor: torch.Tensor,
                     temperature: float = 0.0, uniforms: Optional[torch.Tensor] = None):
    """The selector's chain, position by position (the module docstring's math): the kernels layer's
    :func:`dflash_kernels.reference.select_chain`.

    ``unary, candidates [D, k]``, ``projected [D, r]`` (``hidden_projection(h)``),
    ``predecessor, successor [V, r]`` (the codebooks), ``anchor [1]`` int64.
    Greedy (``temperature == 0``): the best candidate, lowest index on ties.
    Sampling: candidate ``i`` of position ``j`` is the first whose cumulative
    ``q_j`` exceeds ``uniforms[j]`` (``[D]`` in ``[0, 1)``). Returns ``(tokens
    [D] int64, index [D] int64 (the chosen candidate's slot), q [D, k] fp32)``
    (``q`` the softmax of the scores at ``temperature``, or of the scores
    themselves when greedy).
    """
    return select_chain(unary, candidates, projected, predecessor, successor, anchor, temperature, uniforms)


class CandidateSelector(nn.Module):
    """Re-scores the top ``selector_top_k`` candidates of each drafted position (module docstring)."""

    def __init__(self, config):
        super().__init__()
        rank, top_k = dflash_value(config, "selector_rank"), dflash_value(config, "selector_top_k")
        self.rank, self.top_k = int(rank), int(top_k)
        if self.rank < 1:
            raise DraftConfigError(f"selector_rank must be >= 1, got {rank}")
        if not 1 <= self.top_k <= config.vocab_size:
            raise DraftConfigError(f"selector_top_k must be in 1..vocab_size ({config.vocab_size}), got {top_k}")
        self.predecessor_codebook = nn.Embedding(config.vocab_size, self.rank)
        self.successor_codebook = nn.Embedding(config.vocab_size, self.rank)
        self.hidden_projection = nn.Linear(config.hidden_size, self.rank, bias=False)
        std = float(getattr(config, "initializer_range", 0.02))
        with torch.no_grad():
            for w in (self.predecessor_codebook.weight, self.successor_codebook.weight,
                      self.hidden_projection.weight):
                w.normal_(0.0, std)

    def score_candidates(self, unary: torch.Tensor, hidden: torch.Tensor, prev: torch.Tensor,
                         candidates: torch.Tensor) -> torch.Tensor:
        """Teacher-forced scores ``[..., k]``: ``unary [..., k]`` plus the bilinear term of ``hidden [..., H]``
        with the codebook rows of ``prev [...]`` (each position's given predecessor) and ``candidates [..., k]``."""
        context = self.predecessor_codebook(prev) * self.hidden_projection(hidden)  # [..., r]
        return unary + torch.einsum("...r,...kr->...k", context, self.successor_codebook(candidates))

    def forward(self, unary: torch.Tensor, hidden: torch.Tensor, prev: torch.Tensor,
                candidates: torch.Tensor) -> torch.Tensor:
        """:meth:`score_candidates` (the training objective's call, through the module so that a sharded
        selector gathers its weights)."""
        return self.score_candidates(unary, hidden, prev, candidates)

    def select(self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor, anchor: torch.Tensor,
               temperature: float = 0.0, uniforms: Optional[torch.Tensor] = None,
               seed: Optional[torch.Tensor] = None):
        """The chain of :func:`select_reference` for final block states ``hidden [D, H]`` (or ``[S, D, H]``)
        and their top-k ``unary, candidates [D, k]`` (``[S, D, k]``).

        Sampling draws from explicit ``uniforms`` (the reference chain) or, without them, from the device
        ``seed`` (int64 ``[1]``) through :func:`dflash_kernels.select_candidates` on the backend
        :func:`dflash_kernels.get_backend` picks; greedy always runs that op.
        """
        projected = self.hidden_projection(hidden)
        pred, succ = self.predecessor_codebook.weight, self.successor_codebook.weight
        if uniforms is not None:
            return select_chain(unary, candidates, projected, pred, succ, anchor, temperature, uniforms)
        return dflash_kernels.select_candidates(unary, candidates, projected, pred, succ, anchor, temperature, seed)
