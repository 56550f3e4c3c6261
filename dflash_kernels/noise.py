"""Counter-based noise of the device-seeded draws: one Philox stream, in each language that must run it.

A draw keyed by a device seed (``lm_head_sample``, ``rejection_sample``, ``select_candidates`` with ``seed`` an
int64 tensor ``[1]``) takes its noise from one stream of 32-bit words::

    x(seed, row, col) = Philox-4x32-10(counter = (col, row, 0, 0), key = (k0, k1))[word 0]
    k0 = seed mod 2**32, k1 = (seed >> 32) mod 2**32      (the seed's 64 bits)
    each round: (hi0, lo0) = M0 * c0, (hi1, lo1) = M1 * c2 (64-bit products),
                c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0), k += (W0, W1) mod 2**32

(Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011). ``row`` is the output row (a sampled
row ``n``; a rejection's draft position ``k``; the selector's ``SELECTOR_ROW0 + sequence``), ``col`` the vocab
id ``j`` (the selector: the position ``j``; a rejection's acceptance uniform: ``col = V``). Then::

    e = (fp32(x) + 0.5) * 2**-32                                    uniform in (0, 1]
    E = e (1 + e (1/2 + e (1/3 + e / 4)))  if e < 1/32,  else -log(1 - e)          ~ Exp(1)
    G = -log(E)                                                     standard Gumbel

A pure function of the seed's value, the row and the col: no generator and no host read, so a captured graph
replays new noise when the caller changes the seed tensor, and the backends draw the same tokens.

One implementation per language the stream must run in (tests/ops/test_noise.py holds them equal, bit for bit on
the words and the uniforms):

* torch (any device; traces under ``torch.compile``; the reference's): :func:`philox_uint32`,
  :func:`uniform_noise`, :func:`gumbel_noise`; on CPU tensors :func:`philox_words` takes the words from C++;
* C++ (``csrc/philox.cpp``): ``torch.ops.dflash.philox_uint32``, the same words in one loop (its fake is here);
* Triton: :func:`philox_uniform` and :func:`philox_gumbel`, called inside the sampling kernels (``tl.philox``
  computes the words in uint32), and :func:`gumbel_noise_block`, a launch of the noise alone.
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from . import _C  # noqa: F401  (registers the C++ op dflash::philox_uint32, csrc/philox.cpp)
from ._dispatch import get_backend, triton_interpreting


#: none: the noise is a building block the sampling ops share (sampling, rejection, selector), not an op of the
#: package; its functions are imported by name
__all__: list = []

def check_seed_tensor(seed, device: torch.device, who: str = "lm_head_sample") -> torch.Tensor:
    """A device seed: an int64 / int32 tensor with one element (``[1]`` or ``[]``) on ``device``.

    Returns it as a 0-d int64 tensor (no host read). Errors name what is wrong and what is allowed.
    """
    if not isinstance(seed, torch.Tensor):
        raise TypeError(f"{who}: a device seed must be a torch.Tensor, got {type(seed).__name__}")
    if seed.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{who}: seed tensor must be int64 (or int32), got {seed.dtype}")
    if seed.numel() != 1 or seed.dim() > 1:
        raise ValueError(f"{who}: seed tensor must have shape [1] or [], got {tuple(seed.shape)}")
    if seed.device != device:
        raise ValueError(f"{who}: seed tensor is on {seed.device} but hidden is on {device}")
    return seed.reshape(()).to(torch.int64)


# --------------------------------------------------------------------------- counter-based noise

#: Philox-4x32 round multipliers and key increments (Salmon et al., "Parallel random numbers: as easy as
#: 1, 2, 3", SC 2011).
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10
_U32 = 0xFFFFFFFF
#: Below this the exponential variate ``-log(1 - e)`` is summed as its series (fp32 keeps its relative precision).
NOISE_SERIES_BELOW = 0.03125


def _mulhilo(m: int, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)`` 32-bit halves of ``m * x`` (``m`` a 32-bit constant, ``x`` int64 holding a uint32).

    Split ``x = xh * 2**16 + xl``: ``p = xl * m`` and ``q = xh * m`` are < 2**48,
    so nothing overflows int64; ``m * x = q * 2**16 + p``, hence ``lo = (p + (q mod
    2**16) * 2**16) mod 2**32`` and ``hi = (q + p >> 16) >> 16``.
    """
    p = (x & 0xFFFF) * m
    q = (x >> 16) * m
    lo = (p + ((q & 0xFFFF) << 16)) & _U32
    hi = (q + (p >> 16)) >> 16
    return hi, lo


def philox_uint32(seed: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """int64 ``[R, C]`` of uint32 values: Philox-4x32-10 of counter ``(cols[c], rows[r], 0, 0)``, key ``seed``.

    ``seed``: int tensor with one element (its 64 bits are the key ``(k0, k1) =
    (low 32, high 32)``); ``rows [R]``, ``cols [C]``: non-negative ints < 2**32.
    Each round: ``(hi0, lo0) = M0 * c0``, ``(hi1, lo1) = M1 * c2``, ``c = (hi1 ^ c1
    ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)``, ``k += (W0, W1)`` mod 2**32; the result is
    word ``c0`` after 10 rounds. Plain int64 tensor ops (no overflow: see
    :func:`_mulhilo`), so it runs on any device and traces under
    ``torch.compile``; the Triton kernels compute the same words in uint32.
    """
    s = seed.reshape(()).to(torch.int64)
    k0 = s & _U32
    k1 = (s >> 32) & _U32
    c0 = cols.to(torch.int64)[None, :] & _U32
    c1 = rows.to(torch.int64)[:, None] & _U32
    shape = (rows.numel(), cols.numel())
    c0 = c0.expand(shape)
    c1 = c1.expand(shape)
    c2 = torch.zeros(shape, dtype=torch.int64, device=c0.device)
    c3 = c2
    for _ in range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & _U32
        k1 = (k1 + PHILOX_W1) & _U32
    return c0


def uniform_noise(seed: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """fp32 ``[R, C]`` in (0, 1]: ``e = (fp32(x) + 0.5) * 2**-32``, ``x = philox_uint32(seed, rows, cols)``.

    (fp32 rounds ``x`` to 24 significant bits, so ``e`` keeps a relative
    precision of 2**-24 down to 2**-33; ``e = 1`` has probability 2**-25 and
    gives the noise ``-inf``, a token that cannot win that draw.)
    """
    x = philox_words(seed, rows, cols).to(torch.float32)
    return (x + 0.5) * (2.0 ** -32)


def philox_words(seed: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """:func:`philox_uint32`'s words: on CPU tensors the C++ op ``torch.ops.dflash.philox_uint32``
    (csrc/philox.cpp: the same integers, bit for bit, in one loop instead of ~100 small tensor ops; one
    opaque node when traced), elsewhere the tensor ops themselves."""
    if seed.device.type == "cpu":  # the package's import registered the op (dflash_kernels.ops loads _C)
        return torch.ops.dflash.philox_uint32(seed, rows, cols)
    return philox_uint32(seed, rows, cols)


def gumbel_noise(seed: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """fp32 ``[R, C]`` standard Gumbel noise ``G = -log(E)``, ``E = -log(1 - e)`` ~ Exp(1).

    ``e`` = :func:`uniform_noise`.

    ``E`` for ``e < NOISE_SERIES_BELOW`` is the series ``e (1 + e (1/2 + e (1/3 +
    e / 4)))`` (relative error < e^4 / 5 < 2e-7), elsewhere ``-log(1 - e)``:
    the winners of a Gumbel-max draw have small ``E``, where ``1 - e`` would
    lose the precision. A pure function of (seed value, row, vocab id).
    """
    e = uniform_noise(seed, rows, cols)
    series = e * (1.0 + e * (0.5 + e * (0.3333333432674408 + e * 0.25)))
    expo = torch.where(e < NOISE_SERIES_BELOW, series, -torch.log(1.0 - e))
    return -torch.log(expo)


@torch.library.register_fake("dflash::philox_uint32")
def _philox_uint32_fake(seed, rows, cols):
    """The C++ op of csrc/philox.cpp: int64 ``[R, C]`` words."""
    return rows.new_empty((rows.shape[0], cols.shape[0]), dtype=torch.int64)


# --------------------------------------------------------------------------- Triton


#: Integer arguments of :func:`_gumbel_noise_kernel` that vary from call to call (``do_not_specialize``), and its
#: seed pointer, which may sit at any offset of a bigger buffer (no alignment specialization).
DO_NOT_SPECIALIZE = {"_gumbel_noise_kernel": ("n_rows", "n_cols", "row0", "col0")}
UNALIGNED_PTRS = {"_gumbel_noise_kernel": ("seed_ptr",)}
#: The interpreter's widest column tile (its per-program cost is the Python loop, not the tile).
INTERPRETER_MAX_BLOCK_C = 1024


@triton.jit
def philox_uniform(seed, cols, rows):
    """fp32 uniforms in (0, 1] of the counters ``(cols, rows, 0, 0)`` (int32 tensors of one shape) under the key
    ``seed`` (an int64 scalar): ``e = (fp32(x) + 0.5) * 2**-32``, ``x`` the Philox-4x32-10 word (``tl.philox``,
    the Random123 Philox), bit for bit :func:`uniform_noise`."""
    zero = tl.zeros(cols.shape, dtype=tl.int32)
    x, _, _, _ = tl.philox(seed, cols, rows, zero, zero)
    return (x.to(tl.float32) + 0.5) * 2.3283064365386963e-10


@triton.jit
def philox_gumbel(seed, rows, cols):
    """fp32 Gumbel noise ``[R, C]`` of output rows ``rows [R, 1]`` and vocab ids ``cols [1, C]`` (int32).

    ``seed``: an int64 scalar (loaded from memory), the Philox key (low,
    high 32 bits). Counter ``(col, row, 0, 0)``, 10 rounds (``tl.philox``,
    the Random123 Philox-4x32), word 0 ``x``; ``e = (fp32(x) + 0.5) *
    2**-32``; ``E = e (1 + e (1/2 + e (1/3 + e/4)))`` below
    ``NOISE_SERIES_BELOW``, else ``-log(1 - e)``; ``G = -log(E)``. Bit for bit
    the integer steps of :func:`dflash_kernels.reference.gumbel_noise`
    (the logs may differ by an ulp).
    """
    c0 = tl.broadcast_to(cols, (rows.shape[0], cols.shape[1]))
    c1 = tl.broadcast_to(rows, (rows.shape[0], cols.shape[1]))
    e = philox_uniform(seed, c0, c1)
    series = e * (1.0 + e * (0.5 + e * (0.3333333432674408 + e * 0.25)))
    expo = tl.where(e < 0.03125, series, -tl.log(1.0 - e))  # 0.03125 = NOISE_SERIES_BELOW
    return -tl.log(expo)

@triton.jit(do_not_specialize=DO_NOT_SPECIALIZE["_gumbel_noise_kernel"],
            do_not_specialize_on_alignment=UNALIGNED_PTRS["_gumbel_noise_kernel"])
def _gumbel_noise_kernel(
    seed_ptr,  # int64 [1]: the seed, read in-kernel
    out_ptr, stride_o,  # fp32 [n_rows, n_cols]
    n_rows, n_cols,
    row0, col0,  # out[r, c] is the noise of output row row0 + r and vocab id col0 + c
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """``out[r, c] = G(seed, row0 + r, col0 + c)`` (:func:`philox_gumbel`); one [BLOCK_R, BLOCK_C] tile.

    Loads ``seed_ptr`` (never written) and stores only its own tile of the fresh ``out``.
    """
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    seed = tl.load(seed_ptr)
    g = philox_gumbel(seed, (row0 + rows)[:, None], (col0 + cols)[None, :])
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :], g, mask=mask)


#: Tile of :func:`_gumbel_noise_kernel` (compiled; the interpreter takes wider column tiles).
NOISE_BLOCK_R = 16
NOISE_BLOCK_C = 128
NOISE_NUM_WARPS = 4


def gumbel_noise_block(seed: torch.Tensor, row0: int, n_rows: int, col0: int, n_cols: int) -> torch.Tensor:
    """fp32 ``[n_rows, n_cols]`` Gumbel noise of output rows ``row0 + r`` and vocab ids ``col0 + c``.

    ``seed``: int64 tensor ``[1]`` / ``[]`` (read on the device, never on the
    host). The values are :func:`dflash_kernels.reference.gumbel_noise`'s:
    ``reference.gumbel_noise(seed, row0 + arange(n_rows), col0 + arange(n_cols))``
    (Philox-4x32-10; the integer steps bit for bit, the logs to an ulp). The
    Triton backend computes them in one launch (:func:`_gumbel_noise_kernel`),
    the reference backend in int64 tensor ops.
    """
    if not isinstance(seed, torch.Tensor):
        raise TypeError(f"gumbel_noise_block: seed must be an int64 tensor [1], got {type(seed).__name__}")
    seed = check_seed_tensor(seed, seed.device, "gumbel_noise_block")
    device = seed.device
    if get_backend(device) == "reference":
        return gumbel_noise(seed, torch.arange(row0, row0 + n_rows, device=device),
                                       torch.arange(col0, col0 + n_cols, device=device))
    out = torch.empty(n_rows, n_cols, dtype=torch.float32, device=device)
    if n_rows == 0 or n_cols == 0:
        return out
    block_c = NOISE_BLOCK_C
    if triton_interpreting():
        block_c = max(block_c, min(INTERPRETER_MAX_BLOCK_C, triton.next_power_of_2(n_cols)))
    grid = (triton.cdiv(n_rows, NOISE_BLOCK_R), triton.cdiv(n_cols, block_c))
    _gumbel_noise_kernel[grid](seed.reshape(1), out, out.stride(0), n_rows, n_cols, row0, col0,
                               BLOCK_R=NOISE_BLOCK_R, BLOCK_C=block_c, num_warps=NOISE_NUM_WARPS)
    return out
