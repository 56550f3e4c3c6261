"""The grouped dynamic causal conv (DFlash2): the reference against the math, the Triton kernel (the CPU
interpreter; compiled on a GPU) against the reference, gradients, input errors, and the drafter modules."""

import importlib

import pytest
import torch

import dflash_kernels as dk
from dflash_kernels import force_backend, reference as R

#: where the kernel comparisons run: CUDA when present (compiled kernels with DFLASH_TEST_REAL_TRITON=1),
#: else the CPU (the interpreter)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = "triton" in dk.available_backends(torch.device(DEVICE))
needs_triton = pytest.mark.skipif(not TRITON, reason="Triton needs a GPU or TRITON_INTERPRET=1")

#: fast path vs reference, per input dtype (fp32 sums in either order; one rounding to bf16, which the
#: interpreter truncates)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}

#: (nb, B, H, K, g): B in {2, 5, 16}, K in {1, 2, 4} (K == B included), H not a power of two
SHAPES = [(2, 2, 48, 2, 8), (3, 5, 80, 4, 16), (1, 16, 48, 4, 16), (2, 16, 80, 1, 8), (2, 4, 48, 4, 8)]


def _inputs(nb, B, H, K, g, dtype=torch.float32, seed=0, device="cpu"):
    """x, the projection output [nb, B, 2, K, G] (the op reads its halves in place), base [2, K, H], residual."""
    gen = torch.Generator().manual_seed(seed)
    G = H // g
    x = torch.randn(nb, B, H, generator=gen).to(dtype)
    proj = (torch.randn(nb, B, 2, K, G, generator=gen) * 0.5).to(dtype)
    base = torch.randn(2, K, H, generator=gen).to(dtype)
    residual = torch.randn(nb, B, H, generator=gen).to(dtype)
    return tuple(t.to(device) for t in (x, proj, base, residual))


def _naive(x, dynamic, base, residual=None):
    """The definition, element by element, in fp64."""
    nb, B, H = x.shape
    K, G = dynamic.shape[2:]
    g = H // G
    y = torch.zeros(nb, B, H, dtype=torch.float64) if residual is None else residual.double().clone()
    for t in range(B):
        for o in range(min(K, t + 1)):
            w = base[o].double() + dynamic[:, t, o].double().repeat_interleave(g, -1)
            y[:, t] += w * x[:, t - o].double()
    return y


def test_reference_is_the_definition():
    x, proj, base, residual = _inputs(2, 5, 48, 4, 16)
    torch.testing.assert_close(R.dynamic_conv(x, proj[:, :, 0], base[0]).double(), _naive(x, proj[:, :, 0], base[0]),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(R.dynamic_conv(x, proj[:, :, 1], base[1], residual).double(),
                               _naive(x, proj[:, :, 1], base[1], residual), rtol=1e-5, atol=1e-5)


def test_identity_initialisation_and_block_start():
    """base[0] = 1, every other tap 0: the identity; a tap reaching before the block start reads zeros."""
    x, proj, _, _ = _inputs(2, 5, 48, 4, 8)
    base = torch.zeros(4, 48)
    base[0] = 1
    assert torch.equal(R.dynamic_conv(x, torch.zeros_like(proj[:, :, 0]), base), x)
    base = torch.zeros(4, 48)
    base[3] = 1  # y[t] = x[t - 3]: rows 0..2 see only the zero padding of their own block
    y = dk.dynamic_conv(x, torch.zeros_like(proj[:, :, 0]), base)
    assert torch.equal(y[:, :3], torch.zeros_like(y[:, :3])) and torch.equal(y[:, 3:], x[:, :2])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"nb{s[0]}-B{s[1]}-H{s[2]}-K{s[3]}-g{s[4]}" for s in SHAPES])
def test_triton_matches_reference(shape, dtype):
    x, proj, base, residual = _inputs(*shape, dtype=dtype, device=DEVICE)
    for half, res in ((0, None), (1, residual)):
        dyn = proj[:, :, half]
        assert not dyn.is_contiguous()  # the projection's half, read in place
        got = dk.dynamic_conv(x, dyn, base[half], res, backend="triton")
        want = R.dynamic_conv(x, dyn, base[half], res)
        assert got.dtype == dtype and got.shape == x.shape
        torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@needs_triton
def test_triton_any_strides_and_fp32_base():
    """x and residual as strided views, a transposed dynamic, an fp32 base with bf16 activations."""
    x, proj, base, residual = _inputs(2, 5, 80, 2, 16, device=DEVICE)
    wide = torch.randn(2, 5, 160, device=DEVICE)
    xs, rs = wide[:, :, ::2], wide[:, :, 1::2]
    dyn = proj[:, :, 0].transpose(2, 3).contiguous().transpose(2, 3)
    torch.testing.assert_close(dk.dynamic_conv(xs, dyn, base[0], rs, backend="triton"),
                               R.dynamic_conv(xs, dyn, base[0], rs), **TOL[torch.float32])
    xb, db = x.bfloat16(), proj[:, :, 1].bfloat16()
    torch.testing.assert_close(dk.dynamic_conv(xb, db, base[1], backend="triton").float(),
                               R.dynamic_conv(xb, db, base[1]).float(), **TOL[torch.bfloat16])


def test_gradcheck_reference_fp64():
    x, proj, base, residual = (t.double().requires_grad_() for t in _inputs(2, 4, 16, 3, 8))
    dyn = proj[:, :, 1]
    assert torch.autograd.gradcheck(lambda *a: R.dynamic_conv(*a), (x, dyn, base[1], residual))


def test_gradcheck_registered_backward_fp64():
    """The custom op's analytic backward (reference.dynamic_conv_backward) in fp64."""
    x, proj, base, residual = (t.double().requires_grad_() for t in _inputs(2, 4, 16, 3, 8, seed=1))
    with force_backend("reference"):
        assert torch.autograd.gradcheck(lambda *a: torch.ops.dflash.dynamic_conv(*a), (x, proj[:, :, 0], base[0],
                                                                                       residual))
        assert torch.autograd.gradcheck(lambda *a: torch.ops.dflash.dynamic_conv(*a, None), (x, proj[:, :, 1],
                                                                                             base[1]))


@needs_triton
@pytest.mark.parametrize("with_residual", [False, True])
def test_triton_gradients_match_reference(with_residual):
    """Training through the fast path: the Triton forward plus the registered backward (the Triton backward
    kernel at these group sizes) equal autograd through the reference, for every input (the projection's
    output through its slice)."""
    def run(backend):
        x, proj, base, residual = (t.clone().requires_grad_() for t in _inputs(3, 5, 48, 4, 16, seed=2,
                                                                                device=DEVICE))
        y = dk.dynamic_conv(x, proj[:, :, 1], base[1], residual if with_residual else None, backend=backend)
        (y * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum().backward()
        return [y] + [t.grad for t in (x, proj, base) + ((residual,) if with_residual else ())]

    for got, want in zip(run("triton"), run("reference")):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


#: (nb, B, H, K, g) of the backward: power-of-two groups of 8 / 16 / 128 (one Triton launch), 12 (torch math)
BWD_SHAPES = [(2, 5, 48, 4, 16), (3, 16, 80, 2, 8), (2, 4, 48, 4, 12), (1, 2, 256, 2, 128)]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", BWD_SHAPES, ids=[f"nb{s[0]}-B{s[1]}-H{s[2]}-K{s[3]}-g{s[4]}" for s in BWD_SHAPES])
def test_triton_backward_matches_reference(shape, dtype):
    bwd = importlib.import_module("dflash_kernels.dynamic_conv")
    x, proj, base, grad = _inputs(*shape, dtype=dtype, seed=5, device=DEVICE)
    assert bwd.triton_backward_ok(shape[2], shape[2] // shape[4]) == (shape[4] != 12)
    got = bwd.dynamic_conv_backward(grad, x, proj[:, :, 0], base[0], backend="triton")
    want = R.dynamic_conv_backward(grad, x, proj[:, :, 0], base[0])
    for name, g, w, like in zip(("dx", "ddynamic", "dbase", "dresidual"), got, want, (x, proj[:, :, 0], base[0], x)):
        assert g.dtype == like.dtype and g.shape == like.shape, name
        # dbase sums nb * B products per element: the bf16 tolerance scales with it
        tol = TOL[dtype] if dtype == torch.float32 or name != "dbase" else dict(rtol=3e-2, atol=5e-2)
        torch.testing.assert_close(g.float(), w.float(), **tol, msg=name)


def test_bad_inputs_are_clear_errors():
    x, proj, base, residual = _inputs(2, 4, 48, 2, 16)
    dyn = proj[:, :, 0]
    cases = [
        ((x, torch.randn(2, 4, 2, 5), base[0]), "groups of dynamic must divide the 48 channels"),
        ((x, dyn[:, :1], base[0]), "must be \\[nb, B, K, G\\]"),
        ((x[:, :1], torch.randn(2, 1, 2, 3), base[0]), "2 taps exceed the block of 1 rows"),
        ((x, dyn, base[0, :1]), "base must be \\[K, H\\] = \\[2, 48\\]"),
        ((x, dyn.bfloat16(), base[0]), "dynamic must have x's dtype"),
        ((x[0], dyn, base[0]), "x must be \\[nb, B, H\\]"),
        ((x.long(), dyn, base[0]), "x must be float32, bfloat16"),
        ((x, dyn, base[0], residual[:, :2]), "residual must match x"),
        ((x, dyn, base[0], residual.bfloat16()), "residual must match x"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            dk.dynamic_conv(*args)
        with pytest.raises(ValueError, match=match):
            R.dynamic_conv(*args)


# --------------------------------------------------------------------------- the drafter modules


def test_module_prepare_finish_use_the_op():
    """GroupedDynamicCausalConv on both backends: prepare / finish equal the op on the projection's halves,
    finish with a residual equals residual + finish."""
    from dflash.drafter.dflash2 import GroupedDynamicCausalConv

    torch.manual_seed(3)
    conv = GroupedDynamicCausalConv(48, 3, 16)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(0, 0.1)
    x, y, res = torch.randn(2, 5, 48), torch.randn(2, 5, 48), torch.randn(2, 5, 48)
    d = conv.kernel_projection(x).view(2, 5, 2, 3, 3)
    outs = {}
    for backend in dk.available_backends(torch.device("cpu")):
        with force_backend(backend), torch.no_grad():
            px, d1 = conv.prepare(x)
            outs[backend] = (px, conv.finish(y, d1), conv.finish(y, d1, residual=res))
        torch.testing.assert_close(outs[backend][0], R.dynamic_conv(x, d[:, :, 0], conv.base_kernel[0]))
        torch.testing.assert_close(outs[backend][1], R.dynamic_conv(y, d[:, :, 1], conv.base_kernel[1]))
        torch.testing.assert_close(outs[backend][2], res + outs[backend][1])
    if TRITON:
        for a, b in zip(outs["triton"], outs["reference"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", dk.available_backends(torch.device("cpu")))
def test_compiled_training_step_matches_eager(backend):
    """torch.compile (fullgraph) of a forward + backward through the op: the Triton path's custom op and its
    registered backward trace without a break and give eager's gradients."""
    def step(x, dyn, base, residual):
        return (dk.dynamic_conv(x, dyn, base, residual) ** 2).sum()

    def grads(fn):
        x, proj, base, residual = (t.clone().requires_grad_() for t in _inputs(2, 5, 48, 2, 16, seed=4))
        loss = fn(x, proj[:, :, 1], base[1], residual)
        loss.backward()
        return [loss, x.grad, proj.grad, base.grad, residual.grad]

    torch._dynamo.reset()
    with force_backend(backend):
        want = grads(step)
        got = grads(torch.compile(step, fullgraph=True, backend="aot_eager"))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@needs_triton
def test_dflash2_drafter_forward_on_both_backends():
    """A DFlash2 drafter's forward (every layer's convs around attention and MLP, the residual fused into
    finish) gives the same block states with the kernels as with the reference."""
    from dflash.drafter.config import make_draft_config
    from dflash.drafter.model import DFlash2DraftModel

    config = make_draft_config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=64, vocab_size=50, num_target_layers=6, block_size=4,
                               target_layer_ids=[1, 4],
                               mask_token_id=49, max_position_embeddings=64, conv_kernel_size=3, conv_group_size=8,
                               selector_rank=5, selector_top_k=3)
    torch.manual_seed(6)
    draft = DFlash2DraftModel(config).eval()
    with torch.no_grad():
        for layer in draft.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.normal_(0, 0.5)
                conv.kernel_projection.weight.normal_(0, 0.1)
        feats = torch.randn(6, len(draft.target_layer_ids) * 32)
        block = torch.randn(4, 32)
        outs = {}
        for backend in ("reference", "triton"):
            with force_backend(backend):
                outs[backend] = draft(block, feats, torch.arange(10))
    torch.testing.assert_close(outs["triton"], outs["reference"], rtol=1e-4, atol=1e-4)


def test_triton_on_cpu_without_the_interpreter_is_refused_by_name(monkeypatch):
    """A caller that fixes backend='triton' on CPU tensors where no interpreter runs gets a ValueError saying what
    to do, not Triton's launcher error ("Pointer argument cannot be accessed from Triton")."""
    from dflash_kernels import _dispatch

    monkeypatch.setattr(_dispatch, "triton_interpreting", lambda: False)
    x, proj, base, residual = _inputs(1, 4, 16, 2, 8)
    with pytest.raises(ValueError, match="backend 'triton' runs on CUDA tensors .* on cpu"):
        dk.dynamic_conv(x, proj[:, :, 0], base[0], residual, backend="triton")
    assert dk.dynamic_conv(x, proj[:, :, 0], base[0], residual, backend="reference").shape == x.shape
