"""The DFlash2 candidate selector's chain in one Triton launch: every drafted position, one program per sequence.

Math and shapes: :mod:`dflash_kernels.reference.selector`. Position ``j``'s
scores need the token chosen at ``j - 1`` (its predecessor codebook row), so
the ``D`` positions are sequential; the reference runs ``~10 D`` torch ops,
the kernel one launch. Program ``s`` (grid ``(S,)``) loads the anchor, then
per position: the ``k`` candidates' unary scores and ids, the bilinear term
``<predecessor[prev] * projected[j], successor[c_i]>`` in ``BLOCK_R`` rank
chunks (a ``[BLOCK_K, BLOCK_R]`` gather of successor rows), the softmax at the
temperature, when sampling with filters (``FILTER``) top-k / top-p / min-p on ``q``
(a ``[BLOCK_K, BLOCK_K]`` pairwise ranking, as
:func:`dflash_kernels.reference.filter_candidate_probs`), the choice (greedy:
``tl.argmax`` with ties to the lowest slot; sampling: inverse CDF, ``tl.cumsum``
of ``q`` against the position's uniform),
and stores token, slot and ``q``; the chosen token stays in a register as the
next position's predecessor. Everything in fp32.

Sampling noise: the uniforms of :func:`dflash_kernels.reference.selector_uniforms`,
computed in-kernel from the device seed by the same Philox-4x32-10 as the
lm_head's noise (:func:`dflash_kernels.noise.philox_uniform`, counter ``(j, SELECTOR_ROW0 + s, 0, 0)``): the
integers are bit for bit the reference's, so both backends choose the same
tokens for the same seed, up to fp32 rounding of ``q`` / its running sum at a
uniform that falls within an ulp of a CDF step.

Loads and stores never overlap: every input (scores, ids, projections, codebooks, anchor, seed) is only
read, and the three outputs are fresh tensors :func:`_launch` allocates (no input aliases them); program ``s``
stores only row ``s`` of each, one slot per position ``j`` (``q``: that position's ``k`` entries), so no two
stores of the grid meet and no load reads a stored value (the chosen token is carried in a register, not
reloaded). The ``FILTER`` ranking is register-only: it adds no load or store.

Token ids in ``candidates`` and ``anchor`` must lie in ``[0, V)``; the kernel
does not check them (the reference raises on an out-of-range index). Not
differentiable: training scores teacher-forced candidates with the
selector module's own torch ops.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import reference as _reference
from ._declare import declare, dispatch
from .noise import check_seed_tensor, philox_uniform
from .reference.sampling import check_sampling_args
from .reference.selector import SELECTOR_ROW0, check_selector

__all__ = ["select_candidates"]

#: Rank chunk: at most this many codebook columns per step (the successor gather is [BLOCK_K, BLOCK_R]).
MAX_BLOCK_R = 64
NUM_WARPS = 4

#: The seed is a device scalar that may sit at any offset of a state buffer: no alignment specialization. (The
#: kernel's ``top_k`` is not specialized either: one binary for every top-k a user may ask.)
UNALIGNED_PTRS = ("seed_ptr",)

#: :data:`SELECTOR_ROW0` as a kernel constant.
_ROW0 = tl.constexpr(SELECTOR_ROW0)

_TRITON_TYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
                torch.int32: "i32"}


@triton.jit(do_not_specialize=("top_k",), do_not_specialize_on_alignment=UNALIGNED_PTRS)
def _selector_kernel(
    unary_ptr, cand_ptr, proj_ptr, pred_ptr, succ_ptr, anchor_ptr, seed_ptr,
    tok_ptr, idx_ptr, q_ptr,  # fresh contiguous [S, D], [S, D], [S, D, k]
    D, k, r, temperature,  # temperature: 1.0 when greedy
    top_k, top_p, min_p,  # FILTER only: top_k in 1..k (k: off), top_p in (0, 1], min_p in [0, 1]
    stride_us, stride_ud, stride_uk,
    stride_cs, stride_cd, stride_ck,
    stride_ps, stride_pd, stride_pr,
    stride_pv, stride_pc, stride_sv, stride_sc,
    stride_as,
    SAMPLE: tl.constexpr, FILTER: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Sequence ``s = program_id(0)``: the chain over its ``D`` positions (module docstring)."""
    s = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < k
    offs_d = tl.arange(0, BLOCK_D)
    if SAMPLE:
        seed = tl.load(seed_ptr)
        rows = tl.zeros((BLOCK_D,), dtype=tl.int32) + (_ROW0 + s)
        uniforms = philox_uniform(seed, offs_d, rows)
    s64 = s.to(tl.int64)
    prev = tl.load(anchor_ptr + s64 * stride_as).to(tl.int64)
    for j in range(D):
        u = tl.load(unary_ptr + s64 * stride_us + j * stride_ud + offs_k * stride_uk, mask=k_ok,
                    other=0.0).to(tl.float32)
        c = tl.load(cand_ptr + s64 * stride_cs + j * stride_cd + offs_k * stride_ck, mask=k_ok, other=0).to(tl.int64)
        dot = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for r0 in range(0, r, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_ok = offs_r < r
            p = tl.load(proj_ptr + s64 * stride_ps + j * stride_pd + offs_r * stride_pr, mask=r_ok,
                        other=0.0).to(tl.float32)
            pw = tl.load(pred_ptr + prev * stride_pv + offs_r * stride_pc, mask=r_ok, other=0.0).to(tl.float32)
            sw = tl.load(succ_ptr + c[:, None] * stride_sv + offs_r[None, :] * stride_sc,
                         mask=k_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
            dot += tl.sum(sw * (pw * p)[None, :], axis=1)
        scores = tl.where(k_ok, u + dot, float("-inf"))
        z = scores / temperature
        e = tl.where(k_ok, tl.exp(z - tl.max(z, axis=0)), 0.0)
        q = e / tl.sum(e, axis=0)
        if FILTER:  # slot j ranks above slot i: q_j > q_i, ties to the lower slot; invalid slots rank nowhere
            qi, qj = q[:, None], q[None, :]
            above = ((qj > qi) | ((qj == qi) & (offs_k[None, :] < offs_k[:, None]))) & k_ok[None, :]
            if top_k < k:
                # the rank counted in fp32 (an int32 row sum gives sm_90 an 8 B stack frame at k = 32)
                q = tl.where(tl.sum(tl.where(above, 1.0, 0.0), axis=1) < top_k.to(tl.float32), q, 0.0)
                q = q / tl.sum(q, axis=0)
            if top_p < 1.0:
                q = tl.where(tl.sum(tl.where(above, q[None, :], 0.0), axis=1) < top_p, q, 0.0)
                q = q / tl.sum(q, axis=0)
            if min_p > 0.0:
                q = tl.where(q >= min_p * tl.max(q, axis=0), q, 0.0)
                q = q / tl.sum(q, axis=0)
        if SAMPLE:
            u_j = tl.sum(tl.where(offs_d == j, uniforms, 0.0), axis=0)
            cdf = tl.cumsum(q, axis=0)
            # min(#{cdf <= u}, the last slot with q > 0): never a slot whose q underflowed to 0. (The max runs
            # on fp32 slot numbers: as an int32 max, ptxas gives sm_80 an 8 B stack frame at one shape.)
            below = tl.sum(tl.where(k_ok & (cdf <= u_j), 1, 0), axis=0)
            last = tl.max(tl.where(q > 0, offs_k.to(tl.float32), 0.0), axis=0).to(tl.int32)
            i = tl.minimum(below, last)
        else:
            i = tl.argmax(scores, axis=0, tie_break_left=True)
        tok = tl.sum(tl.where(offs_k == i, c, 0), axis=0)
        row = s64 * D + j
        tl.store(tok_ptr + row, tok)
        tl.store(idx_ptr + row, i.to(tl.int64))
        tl.store(q_ptr + row * k + offs_k, q, mask=k_ok)
        prev = tok


def block_r(rank: int) -> int:
    """Rank chunk of the kernel: ``r`` rounded up to a power of two, at most :data:`MAX_BLOCK_R`."""
    return min(MAX_BLOCK_R, max(2, triton.next_power_of_2(int(rank))))


def _launch(unary, candidates, projected, predecessor, successor, anchor, t, seed, filters=(None, None, None)):
    S, D, k = unary.shape
    r = predecessor.shape[1]
    dev = unary.device
    tokens = torch.empty((S, D), dtype=torch.int64, device=dev)
    index = torch.empty((S, D), dtype=torch.int64, device=dev)
    q = torch.empty((S, D, k), dtype=torch.float32, device=dev)
    if S == 0 or D == 0:
        return tokens, index, q
    anchor = anchor.reshape(-1)
    top_k, top_p, min_p = filters
    filtered = t > 0 and any(f is not None for f in filters)
    _selector_kernel[(S,)](
        unary, candidates, projected, predecessor, successor, anchor, seed if seed is not None else anchor,
        tokens, index, q, D, k, r, t if t > 0 else 1.0,
        min(top_k or k, k), 1.0 if top_p is None else top_p, 0.0 if min_p is None else min_p,
        *unary.stride(), *candidates.stride(), *projected.stride(), *predecessor.stride(), *successor.stride(),
        anchor.stride(0),
        SAMPLE=t > 0, FILTER=filtered, BLOCK_K=max(2, triton.next_power_of_2(k)), BLOCK_R=block_r(r),
        BLOCK_D=max(2, triton.next_power_of_2(D)), num_warps=NUM_WARPS, num_stages=1,
    )
    return tokens, index, q


def select_candidates(unary: torch.Tensor, candidates: torch.Tensor, projected: torch.Tensor,
                      predecessor: torch.Tensor, successor: torch.Tensor, anchor: torch.Tensor,
                      temperature: float = 0.0, seed: Optional[torch.Tensor] = None, *,
                      top_k: Optional[int] = None, top_p: Optional[float] = None, min_p: Optional[float] = None,
                      backend: Optional[str] = None):
    """The selector's chain over ``D`` drafted positions (one launch on the Triton backend).

    Args:
        unary: ``[D, k]`` or ``[S, D, k]`` float (fp32 or the model's dtype): the candidates' drafter scores.
        candidates: int64 / int32 like ``unary``: their token ids, in ``[0, V)``.
        projected: ``[D, r]`` / ``[S, D, r]`` float: ``hidden_projection`` of the final block states.
        predecessor, successor: ``[V, r]`` float codebooks.
        anchor: int ``[1]`` (``[S]``): the token before the first drafted position.
        temperature: python float, 0 = greedy.
        seed: int64 ``[1]`` device tensor, required when sampling (the uniforms are
            :func:`dflash_kernels.reference.selector_uniforms` of its value).
        top_k, top_p, min_p: when sampling, the target's warpers applied to ``q`` before the draw (None, 0 and
            1 are off; :func:`dflash_kernels.reference.filter_candidate_probs`); ignored when greedy.
        backend: 'triton' or 'reference' to fix the backend, None: :func:`dflash_kernels.get_backend`.

    Returns:
        ``(tokens int64, index int64 (the chosen slot), q fp32)`` of shapes ``[D]``, ``[D]``, ``[D, k]``
        (``[S, D]``, ``[S, D]``, ``[S, D, k]`` for batched inputs); ``q = filtered(softmax(scores / T))``,
        the distribution each token was drawn from; the softmax of the scores themselves when greedy.
    """
    batched, t = check_selector(unary, candidates, projected, predecessor, successor, anchor, temperature)
    top_k, top_p, min_p = check_sampling_args(top_k, top_p, min_p)
    filters = (top_k, top_p, min_p or None) if t > 0 else (None, None, None)
    if t > 0:
        if seed is None:
            raise ValueError("select_candidates: sampling (temperature > 0) needs a device seed (int64 [1])")
        check_seed_tensor(seed, unary.device, "select_candidates")

    def triton_path():
        one = (lambda a: a) if batched else (lambda a: a[None])
        out = _launch(one(unary), one(candidates), one(projected), predecessor, successor, anchor, t,
                      None if t == 0 else seed.reshape(1), filters)
        return out if batched else tuple(o[0] for o in out)

    return dispatch(
        backend, unary.device, triton=triton_path,
        reference=lambda: _reference.select_candidates(unary, candidates, projected, predecessor, successor, anchor,
                                                       t, seed, *filters),
        traced=lambda: torch.ops.dflash.select_candidates(
            unary, candidates, projected, predecessor, successor, anchor, t, seed if t > 0 else None,
            filters[0] or 0, 1.0 if filters[1] is None else filters[1], filters[2] or 0.0))


@declare("select_candidates", fake=lambda a: (a.unary.new_empty(a.unary.shape[:-1], dtype=torch.int64),
                                              a.unary.new_empty(a.unary.shape[:-1], dtype=torch.int64),
                                              a.unary.new_empty(a.unary.shape, dtype=torch.float32)))
def _select_candidates_op(unary: Tensor, candidates: Tensor, projected: Tensor, predecessor: Tensor,
                          successor: Tensor, anchor: Tensor, temperature: float, seed: Optional[Tensor] = None,
                          top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`select_candidates`: ``(tokens [.., D] int64, index [.., D] int64, q [.., D, k] fp32)`` (``top_k``
    0, ``top_p`` 1, ``min_p`` 0: that filter off; no backward)."""
    return select_candidates(unary, candidates, projected, predecessor, successor, anchor, temperature, seed,
                             top_k=top_k, top_p=top_p, min_p=min_p)


# --------------------------------------------------------------------------- compile-test enumeration

#: Selector shapes ``(name, D, k, r, V)``: drafted positions, candidates, rank, vocabulary.
SELECTOR_SHAPES = (("D15 k16 r128", 15, 16, 128, 151936), ("D15 k8 r48", 15, 8, 48, 151936),
                   ("D7 k32 r256", 7, 32, 256, 262144))


def launch_configs(shapes=SELECTOR_SHAPES, dtypes=(torch.bfloat16, torch.float32)) -> List[dict]:
    """Every binary :func:`select_candidates` launches at these shapes (for the sm_90 / sm_80 compile test).

    Contiguous inputs (``unary`` / ``candidates`` ``[S, D, k]`` from a top-k, the
    codebooks ``[V, r]``) with the runtime's integer specialization (unit
    strides constexprs, multiples of 16 hinted); fp32 unary scores with
    model-dtype codebooks and projections, greedy and sampling.
    """
    from .gather import runtime_int_specialization

    out = []
    for shape_name, D, k, r, V in shapes:
        ints = {"D": D, "k": k, "r": r, "stride_us": D * k, "stride_ud": k, "stride_uk": 1,
                "stride_cs": D * k, "stride_cd": k, "stride_ck": 1, "stride_ps": D * r, "stride_pd": r,
                "stride_pr": 1, "stride_pv": r, "stride_pc": 1, "stride_sv": r, "stride_sc": 1, "stride_as": 1}
        types, divisible, ones = runtime_int_specialization(ints)
        for dtype in dtypes:
            t = "*" + _TRITON_TYPE[dtype]
            for sample, filtered in ((False, False), (True, False), (True, True)):
                ptrs = {"unary_ptr": "*fp32", "cand_ptr": "*i64", "proj_ptr": t, "pred_ptr": t, "succ_ptr": t,
                        "anchor_ptr": "*i64", "seed_ptr": "*i64", "tok_ptr": "*i64", "idx_ptr": "*i64",
                        "q_ptr": "*fp32", "temperature": "fp32", "top_k": "i32", "top_p": "fp32", "min_p": "fp32"}
                out.append(dict(
                    name=f"selector[{shape_name} {_TRITON_TYPE[dtype]} sample={sample} filter={filtered}]",
                    kernel=_selector_kernel, signature=dict(ptrs, **types),
                    constexprs=dict(dict(SAMPLE=sample, FILTER=filtered, BLOCK_K=max(2, triton.next_power_of_2(k)),
                                         BLOCK_R=block_r(r), BLOCK_D=max(2, triton.next_power_of_2(D))), **ones),
                    num_warps=NUM_WARPS, num_stages=1, divisible_by_16=divisible))
    return out
