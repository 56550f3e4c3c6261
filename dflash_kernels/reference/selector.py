"""The DFlash2 candidate selector's chain over the drafted positions, in pure torch.

Shapes (``S`` sequences, optional; ``D`` drafted positions; ``k`` candidates
per position; ``r`` selector rank; ``V`` vocabulary)::

    unary       [S, D, k]  float  the candidates' drafter scores (logits or log-probs)
    candidates  [S, D, k]  int    their token ids
    projected   [S, D, r]  float  hidden_projection(h) of the final block states
    predecessor [V, r], successor [V, r]   the codebooks
    anchor      [S]        int    the token before position 0 of each sequence

    s_j[i] = unary[j, i] + sum_r predecessor[prev_j, r] * projected[j, r] * successor[candidates[j, i], r]
    q_j    = filtered(softmax(s_j / T))   (T = 1 when greedy: softmax(s_j), never filtered)
    i_j    = argmax_i s_j[i], lowest slot on ties            (greedy, T == 0)
           = min(#{i : cdf_j[i] <= u_j}, last_j)              (sampling, cdf_j = cumsum(q_j), u_j in (0, 1])
    x_j    = candidates[j, i_j];  prev_0 = anchor, prev_{j+1} = x_j

``filtered`` (sampling only; each off by default) applies the target's warpers, in transformers'
order, to the ``k`` candidates' distribution (:func:`filter_candidate_probs`): top-k, then top-p, then
min-p, renormalizing after each. A draft drawn from a ``q`` as close as the target's processed ``p``
proposes no token the target's filters remove, so the verifier's ``min(1, p / q)`` rejects less; any
``q`` is lossless as long as the verifier gets the one the draft was drawn from (the returned ``q``).

``last_j`` is the last slot with ``q_j > 0``: a uniform at or past the
rounded total ``cdf_j[k-1]`` (probability ~1e-7) takes that slot, never one
whose probability underflowed to 0 (the verifier divides by ``q``).

All arithmetic in fp32. Sampling is inverse-CDF with one uniform per position:
with a device ``seed`` the uniforms are Philox words of counter ``(j,
SELECTOR_ROW0 + s)`` (:func:`selector_uniforms`: the package's
:func:`~dflash_kernels.reference.uniform_noise` at rows no lm_head draw uses,
so a seed shared with the round's other draws still gives independent
numbers), so a seed fixes the tokens on both backends.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..noise import check_seed_tensor, uniform_noise
from .sampling import check_sampling_args

__all__ = ["SELECTOR_ROW0", "check_selector", "filter_candidate_probs", "select_candidates", "select_chain",
           "selector_uniforms"]

#: Philox row counter of sequence 0's selector uniforms (far above any lm_head output row).
SELECTOR_ROW0 = 0x5E1EC000

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_INTS = (torch.int64, torch.int32)


def check_selector(unary, candidates, projected, predecessor, successor, anchor, temperature,
                   who: str = "select_candidates") -> Tuple[bool, float]:
    """Validate the selector's inputs (shapes, dtypes, devices; no tensor values read).

    Returns ``(batched, temperature)``: whether the inputs carry the leading ``S`` dimension, and the
    temperature as a float (0 = greedy).
    """
    for name, t, kinds, what in (("unary", unary, _FLOATS, "a float"), ("candidates", candidates, _INTS, "int64/int32"),
                                 ("projected", projected, _FLOATS, "a float"),
                                 ("predecessor", predecessor, _FLOATS, "a float"),
                                 ("successor", successor, _FLOATS, "a float"), ("anchor", anchor, _INTS, "int64/int32")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in kinds:
            raise ValueError(f"{who}: {name} must have {what} dtype, got {t.dtype}")
        if t.device != unary.device:
            raise ValueError(f"{who}: {name} is on {t.device} but unary is on {unary.device}")
    if unary.dim() not in (2, 3):
        raise ValueError(f"{who}: unary must be [D, k] or [S, D, k], got shape {tuple(unary.shape)}")
    batched = unary.dim() == 3
    if candidates.shape != unary.shape:
        raise ValueError(f"{who}: candidates must have unary's shape {tuple(unary.shape)}, got {tuple(candidates.shape)}")
    if unary.shape[-1] < 1:
        raise ValueError(f"{who}: need k >= 1 candidates per position, got shape {tuple(unary.shape)}")
    if predecessor.dim() != 2 or successor.shape != predecessor.shape:
        raise ValueError(f"{who}: predecessor and successor must both be [V, r], got {tuple(predecessor.shape)} and "
                         f"{tuple(successor.shape)}")
    r = predecessor.shape[1]
    if tuple(projected.shape) != tuple(unary.shape[:-1]) + (r,):
        raise ValueError(f"{who}: projected must be {list(unary.shape[:-1]) + [r]} (the codebook rank r = {r} per "
                         f"position), got {tuple(projected.shape)}")
    want_anchor = ((unary.shape[0],) if batched else (1,))
    if tuple(anchor.shape) not in (want_anchor, () if not batched else want_anchor):
        raise ValueError(f"{who}: anchor must be [{want_anchor[0]}] (one token per sequence), got "
                         f"{tuple(anchor.shape)}")
    try:
        t = float(temperature)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{who}: temperature must be a float, got {type(temperature).__name__}") from exc
    if not (t >= 0) or t == float("inf"):
        raise ValueError(f"{who}: temperature must be a finite float >= 0 (0 = greedy), got {temperature!r}")
    return batched, t


def selector_uniforms(seed: torch.Tensor, sequences: int, positions: int) -> torch.Tensor:
    """fp32 ``[S, D]`` in (0, 1]: ``uniform_noise(seed, SELECTOR_ROW0 + arange(S), arange(D))``."""
    rows = torch.arange(sequences, device=seed.device, dtype=torch.int64) + SELECTOR_ROW0
    return uniform_noise(seed, rows, torch.arange(positions, device=seed.device, dtype=torch.int64))


def filter_candidate_probs(q: torch.Tensor, top_k: Optional[int] = None, top_p: Optional[float] = None,
                           min_p: Optional[float] = None) -> torch.Tensor:
    """fp32 ``[..., k]``: the candidates' distribution ``q [..., k]`` through top-k, top-p and min-p (None / 0 /
    1: off), renormalized after each, as transformers' warpers order them.

    Slots are ranked by ``q`` descending, ties by slot (the lower slot ranks first):
    ``above[i, j] = q_j > q_i or (q_j == q_i and j < i)``. Top-k keeps the slots of rank ``< top_k``; top-p
    keeps slot ``i`` while the mass ranked above it is ``< top_p`` (transformers removes a token when the mass
    at or below it is ``<= 1 - top_p``: the same set); min-p keeps ``q_i >= min_p * max q``. The best slot
    always stays. Pairwise ``[..., k, k]``, no sort (``k`` is the selector's few candidates).
    """
    q = q.float()
    k = q.shape[-1]
    slot = torch.arange(k, device=q.device)
    qi, qj = q[..., :, None], q[..., None, :]
    above = (qj > qi) | ((qj == qi) & (slot[None, :] < slot[:, None]))  # [..., k (i), k (j)]
    if top_k is not None and 0 < top_k < k:
        q = torch.where(above.sum(-1) < top_k, q, 0.0)
        q = q / q.sum(-1, keepdim=True)
    if top_p is not None and top_p < 1.0:
        mass = torch.where(above, q[..., None, :], 0.0).sum(-1)
        q = torch.where(mass < top_p, q, 0.0)
        q = q / q.sum(-1, keepdim=True)
    if min_p is not None and min_p > 0.0:
        q = torch.where(q >= min_p * q.amax(-1, keepdim=True), q, 0.0)
        q = q / q.sum(-1, keepdim=True)
    return q


def select_chain(unary, candidates, projected, predecessor, successor, anchor, temperature: float = 0.0,
                 uniforms: Optional[torch.Tensor] = None, top_k: Optional[int] = None, top_p: Optional[float] = None,
                 min_p: Optional[float] = None):
    """The chain of the module docstring with explicit ``uniforms`` (``[D]`` / ``[S, D]`` in [0, 1]; needed
    when sampling, ignored when greedy); ``top_k`` / ``top_p`` / ``min_p`` filter ``q`` when sampling
    (:func:`filter_candidate_probs`).

    Returns ``(tokens [.., D] int64, index [.., D] int64 (the chosen slot), q [.., D, k] fp32)``, without the
    ``S`` dimension when the inputs have none.
    """
    batched, t = check_selector(unary, candidates, projected, predecessor, successor, anchor, temperature,
                                "select_chain")
    if not batched:
        unary, candidates, projected = unary[None], candidates[None], projected[None]
        if uniforms is not None:
            uniforms = uniforms.reshape(1, -1)
    S, D, k = unary.shape
    if t > 0:
        if uniforms is None or tuple(uniforms.shape) != (S, D):
            raise ValueError(f"select_chain: sampling (temperature {t}) needs uniforms of shape "
                             f"{[S, D] if batched else [D]}, got {None if uniforms is None else tuple(uniforms.shape)}")
    top_k, top_p, min_p = check_sampling_args(top_k, top_p, min_p)
    min_p = min_p or None
    filtered = any(f is not None for f in (top_k, top_p, min_p))
    prev = anchor.reshape(-1).to(torch.int64).expand(S)
    pred_w, succ_w = predecessor.float(), successor.float()
    tokens, index, qs = [], [], []
    for j in range(D):
        context = pred_w[prev] * projected[:, j].float()  # [S, r]
        scores = unary[:, j].float() + torch.einsum("skr,sr->sk", succ_w[candidates[:, j].long()], context)
        q = torch.softmax(scores / (t if t > 0 else 1.0), dim=-1)
        if t > 0:
            if filtered:
                q = filter_candidate_probs(q, top_k, top_p, min_p)
            below = q.cumsum(-1) <= uniforms[:, j, None].float()
            last = torch.where(q > 0, torch.arange(k, device=q.device), 0).amax(-1)  # never a q = 0 slot
            i = torch.minimum(below.sum(-1), last)
        else:
            i = scores.argmax(-1)
        prev = candidates[:, j].gather(1, i[:, None])[:, 0].long()
        tokens.append(prev)
        index.append(i)
        qs.append(q)
    tokens, index, q = torch.stack(tokens, 1), torch.stack(index, 1), torch.stack(qs, 1)
    if not batched:
        return tokens[0], index[0], q[0]
    return tokens, index, q


def select_candidates(unary, candidates, projected, predecessor, successor, anchor, temperature: float = 0.0,
                      seed: Optional[torch.Tensor] = None, top_k: Optional[int] = None, top_p: Optional[float] = None,
                      min_p: Optional[float] = None):
    """:func:`select_chain` with the uniforms of a device ``seed`` (int64 ``[1]``; required when sampling):
    :func:`selector_uniforms`. Returns ``(tokens, index, q)`` as :func:`select_chain`."""
    batched, t = check_selector(unary, candidates, projected, predecessor, successor, anchor, temperature)
    uniforms = None
    if t > 0:
        if seed is None:
            raise ValueError("select_candidates: sampling (temperature > 0) needs a device seed (int64 [1])")
        seed = check_seed_tensor(seed, unary.device, "select_candidates")
        S, D = (unary.shape[0], unary.shape[1]) if batched else (1, unary.shape[0])
        uniforms = selector_uniforms(seed, S, D)
        if not batched:
            uniforms = uniforms[0]
    return select_chain(unary, candidates, projected, predecessor, successor, anchor, t, uniforms, top_k, top_p,
                        min_p)
