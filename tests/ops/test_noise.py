"""The device-seeded noise stream (dflash_kernels/noise.py) is one stream in its three languages: the torch
reference's int64 tensor ops, the C++ op ``dflash::philox_uint32`` (CPU) and Triton's ``tl.philox`` (run by the
interpreter without a GPU) give the same words and the same uniforms, bit for bit, on odd shapes, offsets and
keys (high bits set, negative int64 seeds). (The Gumbel launch against the reference, to an ulp of its logs:
tests/generation/test_device_lengths.py.)
"""

import pytest
import torch
import triton
import triton.language as tl

from dflash_kernels import available_backends, noise

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = "triton" in available_backends(torch.device(DEVICE))

#: (rows, cols, first row, first col): odd sizes, offsets past 2**16 and near 2**31
SHAPES = [(1, 1, 0, 0), (3, 7, 5, 11), (5, 33, 70000, 3), (17, 129, 2, 151000), (2, 5, 2 ** 31 - 3, 2 ** 31 - 7)]
SEEDS = [0, 1, 2 ** 32 + 5, -(2 ** 62) - 12345, 2 ** 63 - 1, -1]


def _counters(rows, cols, row0, col0, device):
    return (torch.arange(row0, row0 + rows, dtype=torch.int64, device=device),
            torch.arange(col0, col0 + cols, dtype=torch.int64, device=device))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cpp_words_equal_the_torch_words(shape, seed):
    rows, cols = _counters(*shape, "cpu")
    key = torch.tensor([seed])
    want = noise.philox_uint32(key, rows, cols)
    got = torch.ops.dflash.philox_uint32(key, rows, cols)
    assert got.dtype == torch.int64 and got.shape == (shape[0], shape[1])
    assert torch.equal(got, want)
    assert torch.equal(noise.philox_words(key, rows, cols), want)


@triton.jit
def _uniform_kernel(seed_ptr, out_ptr, n_rows, n_cols, row0, col0, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    c0 = tl.broadcast_to((col0 + cols)[None, :], (BLOCK_R, BLOCK_C))
    c1 = tl.broadcast_to((row0 + rows)[:, None], (BLOCK_R, BLOCK_C))
    e = noise.philox_uniform(tl.load(seed_ptr), c0, c1)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], e, mask=mask)


@pytest.mark.skipif(not TRITON, reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_uniforms_equal_the_reference(shape, seed):
    n_rows, n_cols, row0, col0 = shape
    key = torch.tensor([seed], device=DEVICE)
    out = torch.empty(n_rows, n_cols, dtype=torch.float32, device=DEVICE)
    _uniform_kernel[(1,)](key, out, n_rows, n_cols, row0, col0, BLOCK_R=triton.next_power_of_2(n_rows),
                          BLOCK_C=triton.next_power_of_2(n_cols))
    want = noise.uniform_noise(key.cpu(), *_counters(*shape, "cpu"))
    assert torch.equal(out.cpu(), want)
