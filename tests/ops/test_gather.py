"""gather_concat: Triton (interpreter on CPU) against the torch reference, exact in every dtype."""

import pytest
import torch

from dflash_kernels import force_backend, gather_concat
from dflash_kernels import reference as ref
from kernel_stub import KernelStub

BACKENDS = ("triton", "reference")


def _layers(n, T, H, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, H, generator=g).to(dtype) for _ in range(n)]


def _expected(layers, rows):
    sel = [layer if rows is None else layer[torch.as_tensor(rows, dtype=torch.long)] for layer in layers]
    return torch.cat(sel, dim=1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,T,H,rows", [
    (1, 5, 48, None),
    (5, 9, 48, [8, 0, 3, 3, 7]),
    (3, 70, 100, list(range(69, -1, -2))),  # ragged H, more rows than one BLOCK_R
    (9, 4, 16, [2]),  # more layers than any fixed pointer limit
    (2, 3, 2048, [1, 2]),  # H above one BLOCK_H
])
def test_matches_cat_of_selected_rows(backend, dtype, n, T, H, rows):
    layers = _layers(n, T, H, dtype)
    with force_backend(backend):
        got = gather_concat(layers, rows)
    assert got.shape == (T if rows is None else len(rows), n * H)
    assert got.dtype == dtype
    assert torch.equal(got, _expected(layers, rows))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_as_tensor_int32_and_int64(backend):
    layers = _layers(4, 12, 48, torch.bfloat16)
    for rows in (torch.tensor([11, 0, 5]), torch.tensor([11, 0, 5], dtype=torch.int32)):
        with force_backend(backend):
            got = gather_concat(layers, rows)
        assert torch.equal(got, _expected(layers, rows.long()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_layer_views(backend):
    # hidden states captured into one [L, T, H] buffer, or a column slice of a wider buffer
    stacked = torch.randn(6, 10, 48).to(torch.bfloat16)
    wide = torch.randn(10, 3 * 48).to(torch.bfloat16)
    layers = [stacked[1], stacked[4], wide[:, 48:96], stacked[5][::2].repeat(2, 1)]
    assert not layers[2].is_contiguous()
    with force_backend(backend):
        got = gather_concat(layers, [9, 1, 4])
    assert torch.equal(got, _expected(layers, [9, 1, 4]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_is_a_row_slice_of_a_bigger_buffer(backend):
    layers = _layers(3, 7, 48, torch.float16)
    buf = torch.full((12, 3 * 48), 7.0, dtype=torch.float16)
    with force_backend(backend):
        got = gather_concat(layers, [6, 2], out=buf[4:6])
    assert got.data_ptr() == buf[4].data_ptr()
    assert torch.equal(buf[4:6], _expected(layers, [6, 2]))
    assert bool((buf[:4] == 7).all()) and bool((buf[6:] == 7).all()), "wrote outside the given rows"
    # a column-padded buffer: row stride larger than n*H
    padded = torch.zeros(7, 3 * 48 + 16, dtype=torch.float16)
    with force_backend(backend):
        gather_concat(layers, None, out=padded[:, :3 * 48])
    assert torch.equal(padded[:, :3 * 48], _expected(layers, None))
    assert bool((padded[:, 3 * 48:] == 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_rows_give_empty_output(backend):
    layers = _layers(2, 5, 48, torch.float32)
    with force_backend(backend):
        got = gather_concat(layers, [])
    assert got.shape == (0, 96)


def test_reference_module_is_the_same_op():
    layers = _layers(3, 6, 48, torch.bfloat16)
    assert torch.equal(ref.gather_concat(layers, [1, 5]), _expected(layers, [1, 5]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make_args,error,match", [
    (lambda L: ([], None, None), ValueError, "at least one"),
    (lambda L: (torch.stack(L), None, None), TypeError, "sequence"),
    (lambda L: (L + [torch.randn(6, 48)], None, None), ValueError, r"layers\[3\] has shape"),
    (lambda L: (L + [torch.randn(5, 48, dtype=torch.float16)], None, None), TypeError, r"layers\[3\] has dtype"),
    (lambda L: ([L[0].t().contiguous().t()] + L[1:], None, None), ValueError, "unit stride"),
    (lambda L: (L[0:1] + [L[1][0]], None, None), ValueError, "2-D"),
    (lambda L: (L, [0, 5], None), IndexError, r"rows\[1\] = 5 is out of range"),
    (lambda L: (L, [-1], None), IndexError, r"rows\[0\] = -1"),
    (lambda L: (L, torch.tensor([0.0]), None), TypeError, "integers"),
    (lambda L: (L, torch.tensor([[0]]), None), ValueError, "1-D"),
    (lambda L: (L, [1], torch.empty(2, 144)), ValueError, r"out has shape"),
    (lambda L: (L, [1], torch.empty(1, 144, dtype=torch.float16)), TypeError, "out has dtype"),
    (lambda L: (L, [1], torch.empty(144, 2).t()[:1]), ValueError, "unit stride"),
])
def test_bad_inputs_raise_clear_errors(backend, make_args, error, match):
    layers = _layers(3, 5, 48, torch.float32)
    args = make_args(layers)
    with force_backend(backend), pytest.raises(error, match=match):
        gather_concat(*args)




def test_trusted_rows_read_nothing_on_the_host(monkeypatch):
    """``gather_concat(..., check_bounds=False)`` on meta tensors (no values: any host read raises).

    That is the decode loop's call (accepted rows on the device, trusted). With
    ``check_bounds=True`` the same call reads the rows and fails: the meta
    device does detect reads.
    """
    import dflash_kernels.gather as gather_module

    stub = KernelStub()
    monkeypatch.setattr(gather_module, "_gather_concat_kernel", stub)
    layers = [torch.empty(64, 256, dtype=torch.bfloat16, device="meta") for _ in range(5)]
    rows = torch.empty(7, dtype=torch.int64, device="meta")
    out = torch.empty(20, 5 * 256, dtype=torch.bfloat16, device="meta")[3:10]
    with force_backend("triton"):
        assert gather_concat(layers, rows, out=out, check_bounds=False) is out
        assert len(stub.launches) == 1
        with pytest.raises(RuntimeError, match="meta"):
            gather_concat(layers, rows, out=out, check_bounds=True)


def test_row_count_is_not_specialized():
    """R (a + 1 accepted rows per DFlash round, a varies) must not select a new binary each round."""
    import dflash_kernels.gather as gather_module

    kernel = gather_module._gather_concat_kernel
    declared = getattr(kernel, "do_not_specialize", None)
    if declared is None:  # interpreter object
        declared = kernel.kwargs["do_not_specialize"]
    assert "R" in {kernel.arg_names[n] if isinstance(n, int) else n for n in declared}


def test_out_sharing_memory_with_a_layer_is_refused():
    """The kernel's race freedom assumes ``out`` never overlaps an input: the launcher enforces it."""
    buf = torch.zeros(8, 32)
    layers = [buf[:, :16], buf[:, 16:]]
    with pytest.raises(ValueError, match="shares memory with layers"):
        gather_concat(layers, out=buf)
    separate = torch.empty(8, 32)
    assert torch.equal(gather_concat(layers, out=separate), torch.cat(layers, -1))
