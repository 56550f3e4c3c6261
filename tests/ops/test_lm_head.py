"""Fused final RMSNorm + lm_head ops: Triton (interpreter on CPU, compiled on a GPU) against the reference.

Covers logits, argmax, top-k, sampling and cross-entropy over a table of
shapes (hidden 48/64, vocab 1000 and 50257, 1..257 positions, with and without
norm and positions, fp32/bf16/fp16), exact argmax/top-k ids where the inputs
have no near-ties (plus exactly tied inputs: lowest id wins), sampling
reproducibility and a chi-square goodness-of-fit test, the CE gradient against
autograd on the reference, and the error messages of bad inputs. The greedy
choice is made in the logits' dtype (``logit_dtype``, default the model's):
exact ties after rounding, kernel == reference on every row, and equality with
transformers' recipe ``argmax(F.linear(normed, W))`` in bf16. Decode calls
with ``check_bounds=False`` read no tensor value on the host (meta device).
The final-logit softcap (``softcap=c``: ``c * tanh(logits / c)`` on the fp32
logits) in every op against the reference, the CE gradient through the tanh,
ties it creates, and a chi-square test of sampling from the capped softmax.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import dflash_kernels.cross_entropy as cross_entropy_module
import dflash_kernels.lm_head as lm_head_module
from dflash_kernels import (force_backend, lm_head_argmax, lm_head_cross_entropy, lm_head_logits, lm_head_sample,
                            lm_head_topk)
from dflash_kernels import reference as ref
from kernel_stub import KernelStub

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ("triton", "reference")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# (atol, rtol) of fp32 logits against the reference, by input dtype: the GEMM
# operands are identical up to one ulp of the normed hidden state (the norm's
# rounding), the accumulation is fp32 in another order.
LOGIT_TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 1e-2), torch.float16: (4e-3, 2e-3)}
# a reference top-1/top-2 gap below this counts as a near-tie (ids not compared)
TIE_GAP = {torch.float32: 1e-3, torch.bfloat16: 6e-2, torch.float16: 1e-2}


def make_inputs(T, H, V, dtype, *, norm=True, positions=None, seed=0, boost=False):
    """Random hidden [T, H], weight [V, H], norm weight [H]; positions as a tensor.

    With ``boost``, hidden row ``p`` gets a clear winner (token ``(37 p + 11) % V``,
    about 4 above the rest), so greedy ids are comparable without near-ties.
    """
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(T, H, generator=g) * 3).to(dtype)
    weight = torch.randn(V, H, generator=g) / math.sqrt(H)
    norm_weight = (1 + 0.2 * torch.randn(H, generator=g)).to(dtype) if norm else None
    if boost:
        a = (ref.rms_norm(hidden, norm_weight) if norm else hidden).float()
        for p in range(T):
            weight[(37 * p + 11) % V] += 4.0 * a[p] / a[p].dot(a[p])
    weight = weight.to(dtype).to(DEVICE)
    hidden = hidden.to(DEVICE)
    norm_weight = norm_weight.to(DEVICE) if norm else None
    if positions is not None:
        positions = torch.as_tensor(positions, dtype=torch.int64, device=DEVICE)
    return hidden, weight, dict(norm_weight=norm_weight, positions=positions)


def clear_rows(ref_logits, dtype, k=1):
    """Rows whose reference top-(k+1) logits are separated by more than the near-tie gap."""
    top = torch.topk(ref_logits, min(k + 1, ref_logits.shape[1]), dim=1).values
    gaps = top[:, :-1] - top[:, 1:]
    return (gaps > TIE_GAP[dtype]).all(dim=1)


# (T, H, V, positions, norm): decode-sized and 128-row tiles, ragged vocab,
# duplicate and reordered positions.
SHAPES = [
    (1, 48, 1000, None, True),
    (9, 48, 1000, [8, 0, 3, 3, 7, 1, 2], False),
    (16, 64, 1000, None, True),
    (300, 48, 1000, list(range(299, 41, -1)), True),  # 258 positions -> several 128-row tiles
    (257, 48, 1000, None, False),
]
SHAPE_IDS = ["T1-norm", "P7-dup", "T16-norm", "P258-norm", "T257"]
BIG_VOCAB = (7, 48, 50257, [6, 0, 2], True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,H,V,positions,norm", SHAPES, ids=SHAPE_IDS)
def test_logits_and_argmax_match_reference(T, H, V, positions, norm, dtype):
    hidden, weight, kw = make_inputs(T, H, V, dtype, norm=norm, positions=positions, boost=True)
    expected = ref.lm_head_logits(hidden, weight, **kw)
    with force_backend("triton"):
        logits = lm_head_logits(hidden, weight, **kw)
        ids = lm_head_argmax(hidden, weight, **kw)
    atol, rtol = LOGIT_TOL[dtype]
    assert logits.dtype == torch.float32 and logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=atol, rtol=rtol)
    assert ids.dtype == torch.int64 and ids.shape == (expected.shape[0],)
    clear = clear_rows(expected, dtype)
    assert clear.float().mean() > 0.9, "test inputs have too many near-ties to be meaningful"
    assert torch.equal(ids[clear], expected.argmax(dim=1)[clear])


def test_argmax_big_vocab_bf16():
    T, H, V, positions, norm = BIG_VOCAB
    hidden, weight, kw = make_inputs(T, H, V, torch.bfloat16, norm=norm, positions=positions, seed=1, boost=True)
    expected = ref.lm_head_logits(hidden, weight, **kw)
    with force_backend("triton"):
        ids = lm_head_argmax(hidden, weight, **kw)
    clear = clear_rows(expected, torch.bfloat16)
    assert torch.equal(ids[clear], expected.argmax(1)[clear]) and clear.all()


def integer_inputs(T, H, V, dtype, seed=0):
    """Small-integer hidden and weight (exact in every dtype): logits are exact integers, in any summation order."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randint(-2, 3, (T, H), generator=g).to(dtype).to(DEVICE)
    weight = torch.randint(-2, 3, (V, H), generator=g).to(dtype).to(DEVICE)
    return hidden, weight


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_argmax_exact_with_ties_is_lowest_index(backend, dtype):
    hidden, weight = integer_inputs(20, 48, 1000, dtype)
    # exact ties inside one vocab tile (3, 7) and across tiles (5, 900): lowest id must win
    weight[3] = weight[7] = hidden[0] * 2
    weight[900] = weight[5] = hidden[1] * 2
    expected = ref.lm_head_logits(hidden, weight).argmax(dim=1)
    with force_backend(backend):
        ids = lm_head_argmax(hidden, weight)
    assert ids[0] == 3 and ids[1] == 5
    assert torch.equal(ids, expected)  # integer logits: equal everywhere, ties included


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_topk_exact_on_integer_logits(dtype):
    """Integer logits, many exact ties: the fused path (k up to ``topk_fused_max``: 256, fp32 64) returns them
    in the stable descending order, equal logits by ascending id; the chunked path (wider k) the right
    logits."""
    hidden, weight = integer_inputs(5, 48, 1000, dtype, seed=2)
    logits = ref.lm_head_logits(hidden, weight)
    ref_lp = torch.log_softmax(logits, dim=1)
    stable = torch.sort(logits, dim=1, descending=True, stable=True)
    for k in (1, 20, 64, lm_head_module.topk_fused_max(dtype)):
        with force_backend("triton"):
            values, ids = lm_head_topk(hidden, weight, k)
        torch.testing.assert_close(values, torch.topk(ref_lp, k, dim=1).values, atol=1e-5, rtol=0)
        assert torch.equal(ids, stable.indices[:, :k]), k
    k = 300
    with force_backend("triton"):
        values, ids = lm_head_topk(hidden, weight, k, chunk_elements=2 * 256)  # 3 row chunks x 4 vocab chunks
    torch.testing.assert_close(values, torch.topk(ref_lp, k, dim=1).values, atol=1e-5, rtol=0)
    # ids: exactly the right logits; any order among equal logits
    assert torch.equal(logits.gather(1, ids), torch.topk(logits, k, dim=1).values)
    assert all(len(set(row.tolist())) == k for row in ids)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,H,V,positions,norm", SHAPES[:3] + [SHAPES[4]], ids=SHAPE_IDS[:3] + [SHAPE_IDS[4]])
@pytest.mark.parametrize("k", [8, 100, 200, 300], ids=["k8", "k100", "k200", "k300-chunked"])
def test_topk_matches_reference(T, H, V, positions, norm, dtype, k):
    """k = 8 takes the fused kernel; k = 100 and 200 (128 and 256 running keys) too in bf16 / fp16, the
    chunked path with fp32's GEMM; k = 300 the chunked path (in 4 chunks of 256 ids)."""
    hidden, weight, kw = make_inputs(T, H, V, dtype, norm=norm, positions=positions, seed=3)
    logits = ref.lm_head_logits(hidden, weight, **kw)
    ref_vals, ref_ids = ref.lm_head_topk(hidden, weight, k, **kw)
    with force_backend("triton"):
        n = logits.shape[0]
        values, ids = lm_head_topk(hidden, weight, k, chunk_elements=n * 256, **kw)
    assert values.shape == ids.shape == (logits.shape[0], k)
    assert values.dtype == torch.float32 and ids.dtype == torch.int64
    atol, rtol = LOGIT_TOL[dtype]
    torch.testing.assert_close(values, ref_vals, atol=atol, rtol=rtol)
    assert bool((values[:, :-1] >= values[:, 1:]).all()), "not sorted best first"
    ref_lp = torch.log_softmax(logits, dim=1)
    torch.testing.assert_close(ref_lp.gather(1, ids), values, atol=atol, rtol=rtol)
    clear = clear_rows(logits, dtype, k=k)
    assert torch.equal(ids[clear], ref_ids[clear])
    if k <= lm_head_module.topk_fused_max(dtype) and DEVICE == "cpu":
        # every id exactly, near-ties included: the k largest of the same fp32 logits (the interpreter's sums
        # run in one order; compiled kernels of other tiles may round a sum differently)
        assert torch.equal(ids, _exact_topk_ids(hidden, weight, k, kw))


def _exact_topk_ids(hidden, weight, k, kw):
    """The k largest logits' ids by (logit, lower id) from the fused kernel's own fp32 logits (the Triton
    logits op: the same tile GEMM), so near-ties are compared too."""
    with force_backend("triton"):
        logits = lm_head_logits(hidden, weight, **kw)
    return torch.sort(logits, dim=1, descending=True, stable=True).indices[:, :k]


def test_topk_big_vocab_bf16():
    T, H, V, positions, norm = BIG_VOCAB
    hidden, weight, kw = make_inputs(T, H, V, torch.bfloat16, norm=norm, positions=positions, seed=4)
    ref_vals, ref_ids = ref.lm_head_topk(hidden, weight, 16, **kw)
    with force_backend("triton"):
        values, ids = lm_head_topk(hidden, weight, 16, **kw)
    torch.testing.assert_close(values, ref_vals, atol=3e-2, rtol=1e-2)
    logits = ref.lm_head_logits(hidden, weight, **kw)
    clear = clear_rows(logits, torch.bfloat16, k=16)
    assert torch.equal(ids[clear], ref_ids[clear])


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_k_equals_vocab(backend):
    hidden, weight, kw = make_inputs(3, 48, 40, torch.float32)
    with force_backend(backend):
        values, ids = lm_head_topk(hidden, weight, 40, **kw)
    assert torch.equal(ids.sort(dim=1).values, torch.arange(40, device=DEVICE).expand(3, 40))
    torch.testing.assert_close(values.exp().sum(dim=1), torch.ones(3, device=DEVICE), atol=1e-5, rtol=0)


# ------------------------------------------------------------------ sampling

CHI2_CRITICAL_DF7_P001 = 24.322  # chi-square quantile for 7 degrees of freedom at p = 0.001


def chi_square(samples, probs):
    counts = torch.bincount(samples.cpu(), minlength=probs.numel()).double()
    expected = probs.cpu().double() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [0.7, 2.0])
def test_sample_matches_softmax_distribution(backend, temperature):
    V, n = 8, 4000
    hidden, weight, kw = make_inputs(3, 16, V, torch.float32, norm=True, seed=5)
    weight = weight * 0.4
    positions = torch.full((n,), 1, dtype=torch.int64, device=DEVICE)
    logits = ref.lm_head_logits(hidden, weight, norm_weight=kw["norm_weight"], positions=positions[:1])[0]
    probs = torch.softmax(logits / temperature, dim=0)
    assert probs.min() > 0.02, "every token must be likely enough for a chi-square test"
    with force_backend(backend):
        samples = lm_head_sample(hidden, weight, temperature, norm_weight=kw["norm_weight"], positions=positions,
                                 seed=1234)
    assert samples.dtype == torch.int64 and samples.shape == (n,)
    assert chi_square(samples, probs) < CHI2_CRITICAL_DF7_P001


def test_sample_chi_square_detects_a_wrong_distribution():
    # the statistic above is strong enough to reject the wrong temperature
    V, n = 8, 4000
    hidden, weight, kw = make_inputs(3, 16, V, torch.float32, norm=True, seed=5)
    weight = weight * 0.4
    positions = torch.full((n,), 1, dtype=torch.int64, device=DEVICE)
    logits = ref.lm_head_logits(hidden, weight, norm_weight=kw["norm_weight"], positions=positions[:1])[0]
    with force_backend("triton"):
        samples = lm_head_sample(hidden, weight, 0.7, norm_weight=kw["norm_weight"], positions=positions, seed=1234)
    assert chi_square(samples, torch.softmax(logits / 2.0, dim=0)) > CHI2_CRITICAL_DF7_P001


@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_reproducible_with_seed_and_generator(backend):
    hidden, weight, kw = make_inputs(40, 48, 1000, torch.bfloat16, seed=6)
    with force_backend(backend):
        a = lm_head_sample(hidden, weight, 1.5, seed=7, **kw)
        b = lm_head_sample(hidden, weight, 1.5, seed=7, **kw)
        c = lm_head_sample(hidden, weight, 1.5, seed=8, **kw)
        g1 = torch.Generator(device=DEVICE).manual_seed(99)
        g2 = torch.Generator(device=DEVICE).manual_seed(99)
        d1 = lm_head_sample(hidden, weight, 1.5, generator=g1, **kw)
        d2 = lm_head_sample(hidden, weight, 1.5, generator=g2, **kw)
        e1 = lm_head_sample(hidden, weight, 1.5, generator=g1, **kw)  # the generator advanced
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.equal(d1, d2)
    assert not torch.equal(d1, e1)
    assert bool(((a >= 0) & (a < 1000)).all())


def test_sample_row_chunks_keep_rows_independent(monkeypatch):
    # rows beyond 2**31 / V Philox counters go to another launch with another key
    hidden, weight, kw = make_inputs(12, 48, 1000, torch.float32, seed=9)
    positions = torch.zeros(12, dtype=torch.int64, device=DEVICE)
    with force_backend("triton"):
        whole = lm_head_sample(hidden, weight, 5.0, positions=positions, seed=3)
        monkeypatch.setattr(lm_head_module, "_sample_rows_per_launch", lambda vocab: 5)
        chunked = lm_head_sample(hidden, weight, 5.0, positions=positions, seed=3)
        again = lm_head_sample(hidden, weight, 5.0, positions=positions, seed=3)
    assert torch.equal(whole[:5], chunked[:5])  # the first launch is unchanged
    assert torch.equal(chunked, again)
    assert len(set(chunked.tolist())) > 6, "identical rows must still draw independently"


def test_low_temperature_sampling_is_argmax():
    hidden, weight, kw = make_inputs(9, 48, 1000, torch.float32, seed=10, boost=True)
    with force_backend("triton"):
        greedy = lm_head_argmax(hidden, weight, **kw)
        cold = lm_head_sample(hidden, weight, 1e-4, seed=1, **kw)
    assert torch.equal(greedy, cold)


# ------------------------------------------------------------------ cross-entropy

CE_TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (5e-3, 5e-3)}
GRAD_TOL = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (2e-2, 2e-2), torch.float16: (3e-3, 5e-3)}


def ce_case(dtype, T, H, V, positions, norm, seed, with_weights=True, ignore=True):
    hidden, weight, kw = make_inputs(T, H, V, dtype, norm=norm, positions=positions, seed=seed)
    n = T if positions is None else len(positions)
    g = torch.Generator().manual_seed(seed + 100)
    targets = torch.randint(0, V, (n,), generator=g)
    if ignore:
        targets[1::3] = -100
    weights = torch.rand(n, generator=g) + 0.5 if with_weights else None
    return hidden, weight, kw, targets.to(DEVICE), (weights.to(DEVICE) if weights is not None else None)


CE_SHAPES = [
    (1, 48, 1000, None, True),
    (9, 48, 1000, [8, 0, 3, 3, 7, 1, 2], True),  # duplicate position: gradients add up
    (16, 64, 1000, None, False),
    (257, 48, 1000, None, True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,H,V,positions,norm", CE_SHAPES, ids=["T1", "P7-dup", "T16-nonorm", "T257"])
def test_cross_entropy_value_and_grad(T, H, V, positions, norm, dtype):
    hidden, weight, kw, targets, weights = ce_case(dtype, T, H, V, positions, norm, seed=T)
    n = targets.numel()
    grad_out = torch.linspace(0.5, 2.0, n, device=DEVICE)

    h_ref = hidden.clone().requires_grad_(True)
    loss_ref = ref.lm_head_cross_entropy(h_ref, weight, targets, weights=weights, **kw)
    (loss_ref * grad_out).sum().backward()

    h = hidden.clone().requires_grad_(True)
    with force_backend("triton"):
        # row chunks of 3 positions for small cases, of 128 for the 257-row case
        loss = lm_head_cross_entropy(h, weight, targets, weights=weights, chunk_elements=(128 if n > 16 else 3) * V,
                                     **kw)
    (loss * grad_out).sum().backward()

    assert loss.dtype == torch.float32 and loss.shape == (n,)
    atol, rtol = CE_TOL[dtype]
    torch.testing.assert_close(loss.detach(), loss_ref.detach(), atol=atol, rtol=rtol)
    assert bool((loss[targets == -100] == 0).all())
    assert h.grad.dtype == dtype
    gatol, grtol = GRAD_TOL[dtype]
    torch.testing.assert_close(h.grad.float(), h_ref.grad.float(), atol=gatol, rtol=grtol)
    assert h_ref.grad.abs().max() > 0.02  # the comparison is not vacuous


def test_cross_entropy_big_vocab_bf16_no_grad_path():
    # hidden without requires_grad: the Triton norm kernel builds the operand; no gradient is computed
    hidden, weight, kw, targets, weights = ce_case(torch.bfloat16, 7, 48, 50257, [6, 0, 2], True, seed=11)
    expected = ref.lm_head_cross_entropy(hidden, weight, targets, weights=weights, **kw)
    with force_backend("triton"):
        loss = lm_head_cross_entropy(hidden, weight, targets, weights=weights, **kw)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_weight_and_norm_weight_are_frozen(backend):
    hidden, weight, kw, targets, _ = ce_case(torch.float32, 6, 48, 1000, None, True, seed=12)
    weight.requires_grad_(True)
    kw["norm_weight"].requires_grad_(True)
    h = hidden.clone().requires_grad_(True)
    with force_backend(backend):
        loss = lm_head_cross_entropy(h, weight, targets, **kw)
    loss.sum().backward()
    assert h.grad is not None
    assert weight.grad is None and kw["norm_weight"].grad is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_custom_ignore_index_and_no_weights(backend):
    hidden, weight, kw, targets, _ = ce_case(torch.float32, 8, 48, 1000, None, False, seed=13, ignore=False)
    targets[2] = 5
    with force_backend(backend):
        loss = lm_head_cross_entropy(hidden, weight, targets, ignore_index=5, **kw)
    expected = torch.nn.functional.cross_entropy(ref.lm_head_logits(hidden, weight, **kw), targets, reduction="none",
                                                 ignore_index=5)
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-4)
    assert loss[2] == 0


def test_cross_entropy_chunk_plan_bounds_memory():
    # 8192 positions x 151936 vocab: the unfused logits alone are 8192 * 151936 * 4 bytes
    full = 8192 * 151936 * 4
    plan = cross_entropy_module.cross_entropy_chunk_plan(8192, 151936, 4096, torch.bfloat16)
    assert plan["chunk_bytes"] < full / 8
    assert plan["rows_per_chunk"] * 151936 <= lm_head_module.DEFAULT_CHUNK_ELEMENTS


def test_cross_entropy_peak_allocation_is_one_chunk():
    # What the op really allocates (forward with gradient), measured by the
    # torch profiler on CPU tensors at a scaled-down shape: 1024 bf16
    # positions in chunks of 64 rows. The fused op's peak is one chunk (fp32
    # logits + the bf16 softmax-minus-onehot buffer) plus [N, H]-sized
    # tensors, under an eighth of the unfused fp32 logits; the reference's
    # peak exceeds the logits.
    if DEVICE != "cpu":
        pytest.skip("the profiler accounting below is for CPU allocations")
    T, H, V, rows = 1024, 16, 1000, 64
    hidden, weight, kw, targets, weights = ce_case(torch.bfloat16, T, H, V, None, False, seed=14)
    full_logits = T * V * 4
    plan = cross_entropy_module.cross_entropy_chunk_plan(T, V, H, torch.bfloat16, rows * V)
    assert plan["rows_per_chunk"] == rows
    peaks = {}
    for backend in BACKENDS:
        h = hidden.clone().requires_grad_(True)
        with force_backend(backend):
            run = lambda: lm_head_cross_entropy(h, weight, targets, weights=weights,  # noqa: E731
                                                chunk_elements=rows * V, **kw)
            # warm-up: the first profiled bf16 CPU matmul allocates a one-off workspace
            peak_live_bytes(lambda: lm_head_cross_entropy(h[:rows], weight, targets[:rows]))
            peaks[backend] = peak_live_bytes(run)
    assert plan["chunk_bytes"] <= peaks["triton"], "the profiler missed the chunk buffers"
    assert peaks["triton"] < full_logits / 8, f"fused CE peak {peaks['triton']} B vs logits {full_logits} B"
    assert peaks["reference"] > full_logits


def peak_live_bytes(fn) -> int:
    """Largest sum of live CPU allocations made while ``fn()`` runs (torch profiler memory records)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    stamp = (lambda e: e.start_ns()) if records and hasattr(records[0], "start_ns") else (lambda e: e.start_us())
    records.sort(key=stamp)
    live = peak = 0
    for e in records:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


# ------------------------------------------------------------------ errors


def _base():
    hidden = torch.randn(5, 48, device=DEVICE)
    weight = torch.randn(100, 48, device=DEVICE)
    return hidden, weight


ERROR_CASES = [
    ("hidden 1-D", lambda h, w: (lm_head_logits, (h[0], w), {}), ValueError, "hidden must be 2-D"),
    ("int hidden", lambda h, w: (lm_head_logits, (h.long(), w), {}), TypeError, "hidden has dtype"),
    ("H mismatch", lambda h, w: (lm_head_argmax, (h, w[:, :40]), {}), ValueError, "hidden sizes must match"),
    ("device mismatch", lambda h, w: (lm_head_argmax, (h, w.to("meta")), {}), ValueError, "weight is on meta"),
    ("empty vocab", lambda h, w: (lm_head_argmax, (h, w[:0]), {}), ValueError, "empty vocabulary"),
    ("empty hidden size", lambda h, w: (lm_head_argmax, (h[:, :0], w[:, :0]), {}), ValueError, "hidden size 0"),
    ("norm shape", lambda h, w: (lm_head_argmax, (h, w), {"norm_weight": torch.ones(47, device=DEVICE)}),
     ValueError, r"norm_weight must have shape \[H\]"),
    ("positions range", lambda h, w: (lm_head_argmax, (h, w), {"positions": [0, 5]}), IndexError,
     r"positions\[1\] = 5 is out of range"),
    ("positions negative", lambda h, w: (lm_head_topk, (h, w, 3), {"positions": [-1]}), IndexError,
     r"positions\[0\] = -1"),
    ("positions float", lambda h, w: (lm_head_argmax, (h, w), {"positions": torch.tensor([0.0])}), TypeError,
     "integers"),
    ("k > V", lambda h, w: (lm_head_topk, (h, w, 101), {}), ValueError, "k = 101 exceeds the vocabulary size V = 100"),
    ("k = 0", lambda h, w: (lm_head_topk, (h, w, 0), {}), ValueError, "k must be >= 1"),
    ("temperature 0", lambda h, w: (lm_head_sample, (h, w, 0.0), {}), ValueError, "temperature must be a finite"),
    ("temperature < 0", lambda h, w: (lm_head_sample, (h, w, -1.0), {}), ValueError, "use lm_head_argmax"),
    ("seed and generator", lambda h, w: (lm_head_sample, (h, w, 1.0), {"seed": 1, "generator": torch.Generator()}),
     ValueError, "not both"),
    ("targets range", lambda h, w: (lm_head_cross_entropy, (h, w, torch.tensor([0, 1, 100, 3, 4], device=DEVICE)),
                                    {}), IndexError, r"targets\[2\] = 100 is out of range"),
    ("targets shape", lambda h, w: (lm_head_cross_entropy, (h, w, torch.zeros(4, dtype=torch.long, device=DEVICE)),
                                    {}), ValueError, r"targets must have shape \[N\] = \[5\]"),
    ("targets float", lambda h, w: (lm_head_cross_entropy, (h, w, torch.zeros(5, device=DEVICE)), {}), TypeError,
     "integer token ids"),
    ("weights shape", lambda h, w: (lm_head_cross_entropy, (h, w, torch.zeros(5, dtype=torch.long, device=DEVICE)),
                                    {"weights": torch.ones(3, device=DEVICE)}), ValueError, r"weights must have shape"),
    ("eps", lambda h, w: (lm_head_argmax, (h, w), {"eps": -1.0}), ValueError, "eps must be"),
    ("logit dtype", lambda h, w: (lm_head_argmax, (h, w), {"logit_dtype": torch.int32}), TypeError,
     "logit_dtype must be None, torch.float32, torch.bfloat16 or torch.float16"),
    ("logit dtype str", lambda h, w: (lm_head_sample, (h, w, 1.0), {"logit_dtype": "bf16"}), TypeError,
     "logit_dtype must be None"),
] + [
    (f"softcap {name} {fn.__name__}", lambda h, w, fn=fn, extra=extra, value=value: (fn, (h, w) + extra,
                                                                                       {"softcap": value}),
     ValueError, "softcap must be None or a finite float > 0")
    for fn, extra in ((lm_head_logits, ()), (lm_head_argmax, ()), (lm_head_topk, (3,)), (lm_head_sample, (1.0,)),
                      (lm_head_cross_entropy, (torch.zeros(5, dtype=torch.long, device=DEVICE),)))
    for name, value in (("0", 0.0), ("negative", -30.0), ("bool", True), ("nan", float("nan")), ("str", "30"))
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make,error,match", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_bad_inputs_raise_clear_errors(backend, make, error, match):
    fn, args, kwargs = make(*_base())
    with force_backend(backend), pytest.raises(error, match=match):
        fn(*args, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_positions_give_empty_results(backend):
    hidden, weight = _base()
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    with force_backend(backend):
        assert lm_head_logits(hidden, weight, positions=empty).shape == (0, 100)
        assert lm_head_argmax(hidden, weight, positions=empty).shape == (0,)
        values, ids = lm_head_topk(hidden, weight, 4, positions=empty)
        assert values.shape == ids.shape == (0, 4)
        assert lm_head_sample(hidden, weight, 1.0, positions=empty, seed=0).shape == (0,)
        assert lm_head_cross_entropy(hidden, weight, empty, positions=empty).shape == (0,)


# ------------------------------------------------------------------ greedy choice in the logits' dtype


def rounding_tie_inputs(dtype, V=1000):
    """hidden [2, 48] and weight [V, 48] (no norm) whose top two logits tie once rounded to ``dtype``.

    Row 0: ids 3 and 7 (one vocab tile), logits 2048.5 and 2048.75; row 1:
    ids 5 and 900 (different tiles), 2048.25 and 2048.75. Every value is exact
    in bf16/fp16, the products and sums exact in fp32; at 2048 the bf16 and
    fp16 spacings are 16 and 2, so each pair rounds to the same 2048. The
    larger fp32 logit has the larger id; every other logit is below 1.
    """
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(V, 48, generator=g) * 0.01
    hidden = torch.zeros(2, 48)
    hidden[0, :2] = 1.0
    hidden[1, 2:4] = 1.0
    weight[3, :2] = torch.tensor([2048.0, 0.5])
    weight[7, :2] = torch.tensor([2048.0, 0.75])
    weight[5, 2:4] = torch.tensor([2048.0, 0.25])
    weight[900, 2:4] = torch.tensor([2048.0, 0.75])
    return hidden.to(dtype).to(DEVICE), weight.to(dtype).to(DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rounded_logits_tie_to_the_lowest_id(backend, dtype):
    """Default (the model's dtype): a tie after rounding, lowest id; fp32 mode: the larger fp32 logit.

    Fails on the old kernel, which compared fp32 logits only (picks 7 and 900).
    """
    hidden, weight = rounding_tie_inputs(dtype)
    fp32_logits = hidden.float() @ weight.float().T
    assert fp32_logits[0, 7] > fp32_logits[0, 3] and fp32_logits[1, 900] > fp32_logits[1, 5]
    assert torch.equal(torch.argmax(F.linear(hidden, weight), dim=-1).cpu(), torch.tensor([3, 5]))  # transformers
    with force_backend(backend):
        default = lm_head_argmax(hidden, weight)
        explicit = lm_head_argmax(hidden, weight, logit_dtype=dtype)
        exact = lm_head_argmax(hidden, weight, logit_dtype=torch.float32)
        rounded_logits = lm_head_logits(hidden, weight, logit_dtype=None)
    assert default.tolist() == [3, 5] and explicit.tolist() == [3, 5]
    assert exact.tolist() == [7, 900]
    assert rounded_logits.dtype == dtype and rounded_logits[0, 3] == rounded_logits[0, 7] == 2048


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampling_uses_the_rounded_logits(backend):
    """At a low temperature the tied pair is drawn about evenly; in fp32 mode the larger logit always wins.

    The rounding happens before the temperature scaling (as transformers samples from the bf16 logits).
    """
    hidden, weight = rounding_tie_inputs(torch.bfloat16)
    positions = torch.zeros(400, dtype=torch.int64, device=DEVICE)
    with force_backend(backend):
        rounded = lm_head_sample(hidden, weight, 0.01, positions=positions, seed=5)
        exact = lm_head_sample(hidden, weight, 0.01, positions=positions, seed=5, logit_dtype=torch.float32)
    counts = torch.bincount(rounded.cpu(), minlength=8)
    assert counts[3] + counts[7] == 400 and 120 < counts[3] < 280
    assert bool((exact == 7).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,H,V,positions,norm", SHAPES, ids=SHAPE_IDS)
def test_argmax_equals_reference_on_every_row(T, H, V, positions, norm, dtype):
    """Kernel == reference on all rows (near-ties included: no clear-winner boost) in the default logit dtype."""
    hidden, weight, kw = make_inputs(T, H, V, dtype, norm=norm, positions=positions, seed=21)
    expected = ref.lm_head_argmax(hidden, weight, **kw)
    with force_backend("triton"):
        ids = lm_head_argmax(hidden, weight, **kw)
    assert torch.equal(ids, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_argmax_matches_the_transformers_recipe(dtype):
    """``torch.argmax(F.linear(normed, W))`` in the model's dtype (what generate() does), on many random rows.

    The fp32-logit argmax disagrees with it on some of these rows (checked
    below), so this fails on the old kernel.
    """
    T, H, V = 256, 64, 2000
    g = torch.Generator().manual_seed({torch.bfloat16: 3, torch.float16: 1}[dtype])  # 5 / 1 fp32-argmax misses
    hidden = (torch.randn(T, H, generator=g) * 3).to(dtype)
    weight = (torch.randn(V, H, generator=g) / math.sqrt(H)).to(dtype)
    norm_weight = (1 + 0.2 * torch.randn(H, generator=g)).to(dtype)
    normed = ref.rms_norm(hidden, norm_weight)
    want = torch.argmax(F.linear(normed, weight), dim=-1)
    fp32_choice = torch.argmax(normed.float() @ weight.float().T, dim=-1)
    assert (fp32_choice != want).any(), "these inputs must contain rows where the fp32 argmax differs"
    hidden, weight, norm_weight = hidden.to(DEVICE), weight.to(DEVICE), norm_weight.to(DEVICE)
    for backend in BACKENDS:
        with force_backend(backend):
            ids = lm_head_argmax(hidden, weight, norm_weight=norm_weight)
            ids_fp32 = lm_head_argmax(hidden, weight, norm_weight=norm_weight, logit_dtype=torch.float32)
        assert torch.equal(ids.cpu(), want), backend
        assert torch.equal(ids_fp32.cpu(), fp32_choice), backend


def test_default_logit_dtype_is_what_f_linear_returns():
    from dflash_kernels.reference.lm_head import resolve_logit_dtype

    bf, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    for h, w, want in ((bf, bf, bf), (fp16, fp16, fp16), (fp32, fp32, fp32), (fp32, bf, fp32), (fp16, bf, fp32)):
        assert resolve_logit_dtype(torch.empty(1, dtype=h), torch.empty(1, dtype=w), None) == want
    assert resolve_logit_dtype(torch.empty(1, dtype=bf), torch.empty(1, dtype=bf), fp32) == fp32


# ------------------------------------------------------------------ no host reads in the decode loop




def test_argmax_with_trusted_positions_reads_nothing_on_the_host(monkeypatch):
    """``lm_head_argmax(..., positions=..., check_bounds=False)`` on meta tensors (no values: any host read raises).

    With ``check_bounds=True`` the same call does read the positions, and fails: the meta device detects reads.
    """
    norm_stub, argmax_stub = KernelStub(), KernelStub()
    monkeypatch.setattr(lm_head_module, "_norm_rows_kernel", norm_stub)
    monkeypatch.setattr(lm_head_module, "_argmax_kernel", argmax_stub)
    hidden = torch.empty(40, 256, dtype=torch.bfloat16, device="meta")
    weight = torch.empty(1000, 256, dtype=torch.bfloat16, device="meta")
    norm_weight = torch.empty(256, dtype=torch.bfloat16, device="meta")
    positions = torch.empty(9, dtype=torch.int64, device="meta")
    with force_backend("triton"):
        ids = lm_head_argmax(hidden, weight, norm_weight=norm_weight, positions=positions, check_bounds=False)
        assert ids.shape == (9,) and ids.dtype == torch.int64
        assert len(norm_stub.launches) == 1 and len(argmax_stub.launches) == 1
        assert str(argmax_stub.launches[0][2]["LOGIT_DTYPE"]) == "bf16"
        with pytest.raises(RuntimeError, match="meta"):
            lm_head_argmax(hidden, weight, norm_weight=norm_weight, positions=positions, check_bounds=True)


# ------------------------------------------------------------------ final-logit softcap

SOFTCAP = 3.0  # logits here are a few units (boosted winners ~5): capped at 3 they change a lot, without saturating
SOFTCAP_SHAPES = [SHAPES[1], SHAPES[2], SHAPES[4]]
SOFTCAP_SHAPE_IDS = [SHAPE_IDS[1], SHAPE_IDS[2], SHAPE_IDS[4]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T,H,V,positions,norm", SOFTCAP_SHAPES, ids=SOFTCAP_SHAPE_IDS)
def test_softcap_logits_argmax_topk_match_reference(T, H, V, positions, norm, dtype):
    hidden, weight, kw = make_inputs(T, H, V, dtype, norm=norm, positions=positions, seed=31, boost=True)
    kw["softcap"] = SOFTCAP
    expected = ref.lm_head_logits(hidden, weight, **kw)
    raw = ref.lm_head_logits(hidden, weight, norm_weight=kw["norm_weight"], positions=positions)
    torch.testing.assert_close(expected, SOFTCAP * torch.tanh(raw / SOFTCAP))
    assert (expected - raw).abs().max() > 1.0 and expected.abs().max() < SOFTCAP
    with force_backend("triton"):
        logits = lm_head_logits(hidden, weight, **kw)
        rounded = lm_head_logits(hidden, weight, logit_dtype=None, **kw)
        ids = lm_head_argmax(hidden, weight, **kw)
        values, top_ids = lm_head_topk(hidden, weight, 8, chunk_elements=expected.shape[0] * 256, **kw)
    atol, rtol = LOGIT_TOL[dtype]
    torch.testing.assert_close(logits, expected, atol=atol, rtol=rtol)
    assert rounded.dtype == dtype
    torch.testing.assert_close(rounded.float(), expected.to(dtype).float(), atol=atol, rtol=rtol)
    assert torch.equal(ids, ref.lm_head_argmax(hidden, weight, **kw))  # every row, in the model's dtype
    ref_vals, ref_ids = ref.lm_head_topk(hidden, weight, 8, **kw)
    torch.testing.assert_close(values, ref_vals, atol=atol, rtol=rtol)
    torch.testing.assert_close(torch.log_softmax(expected, 1).gather(1, top_ids), values, atol=atol, rtol=rtol)
    clear = clear_rows(expected, dtype, k=8)
    assert torch.equal(top_ids[clear], ref_ids[clear])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T,H,V,positions,norm", [CE_SHAPES[1], CE_SHAPES[3]], ids=["P7-dup", "T257"])
def test_softcap_cross_entropy_value_and_grad(T, H, V, positions, norm, dtype):
    """Loss and d loss / d hidden against autograd through the reference's tanh."""
    hidden, weight, kw, targets, weights = ce_case(dtype, T, H, V, positions, norm, seed=T + 1)
    hidden = hidden * 2  # larger logits: the cap's derivative 1 - tanh^2 is far from 1
    kw["softcap"] = 2.0
    n = targets.numel()
    grad_out = torch.linspace(0.5, 2.0, n, device=DEVICE)
    h_ref = hidden.clone().requires_grad_(True)
    loss_ref = ref.lm_head_cross_entropy(h_ref, weight, targets, weights=weights, **kw)
    (loss_ref * grad_out).sum().backward()
    h = hidden.clone().requires_grad_(True)
    with force_backend("triton"):
        loss = lm_head_cross_entropy(h, weight, targets, weights=weights, chunk_elements=(128 if n > 16 else 3) * V,
                                     **kw)
        no_grad = lm_head_cross_entropy(hidden, weight, targets, weights=weights, **kw)
    (loss * grad_out).sum().backward()
    atol, rtol = CE_TOL[dtype]
    torch.testing.assert_close(loss.detach(), loss_ref.detach(), atol=atol, rtol=rtol)
    torch.testing.assert_close(no_grad, loss_ref.detach(), atol=atol, rtol=rtol)
    gatol, grtol = GRAD_TOL[dtype]
    torch.testing.assert_close(h.grad.float(), h_ref.grad.float(), atol=gatol, rtol=grtol)
    # the cap matters for the gradient: the uncapped one is far off
    h_raw = hidden.clone().requires_grad_(True)
    kw_raw = dict(kw, softcap=None)
    (ref.lm_head_cross_entropy(h_raw, weight, targets, weights=weights, **kw_raw) * grad_out).sum().backward()
    assert (h_raw.grad.float() - h_ref.grad.float()).norm() > 0.1 * h_ref.grad.float().norm()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softcap_saturation_ties_pick_the_lowest_id(backend, dtype):
    """Logits 128 (id 9) and 256 (id 2, 600) all cap to exactly 1.0 at softcap 1: the lowest of them wins."""
    hidden, weight = integer_inputs(3, 48, 1000, dtype, seed=4)
    hidden[:, :] = 0
    hidden[:, 0] = 1
    weight[:, 0] = 0
    weight[9, 0], weight[2, 0], weight[600, 0] = 128, 256, 256  # every other logit is 0
    with force_backend(backend):
        capped = lm_head_argmax(hidden, weight, softcap=1.0, logit_dtype=torch.float32)
        plain = lm_head_argmax(hidden, weight, logit_dtype=torch.float32)
        logits = lm_head_logits(hidden, weight, softcap=1.0)
    assert plain.tolist() == [2, 2, 2] and capped.tolist() == [2, 2, 2]
    assert logits[0, 9] == logits[0, 2] == logits[0, 600] == 1.0
    weight[2, 0] = 0  # now 9 and 600 tie once capped; 600 wins uncapped
    with force_backend(backend):
        capped = lm_head_argmax(hidden, weight, softcap=1.0)
        plain = lm_head_argmax(hidden, weight)
    assert capped.tolist() == [9, 9, 9] and plain.tolist() == [600, 600, 600]


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_then_bf16_rounding_ties_pick_the_lowest_id(backend):
    """Logits 8 (id 3) and 8.125 (id 7) cap at 4 to 3.8561 and 3.8651, which round to the same bf16 (3.859):
    the argmax in bf16 is id 3 (capped before the rounding), in fp32 id 7."""
    hidden = torch.zeros(2, 48)
    hidden[:, :2] = 1.0
    weight = torch.zeros(1000, 48)
    weight[:, 0] = torch.linspace(-4, 4, 1000)
    weight[3, :2] = torch.tensor([8.0, 0.0])
    weight[7, :2] = torch.tensor([8.0, 0.125])
    hidden, weight = hidden.to(torch.bfloat16).to(DEVICE), weight.to(torch.bfloat16).to(DEVICE)
    capped = 4.0 * torch.tanh(torch.tensor([8.0, 8.125]) / 4.0)
    assert capped[0] < capped[1] and capped.to(torch.bfloat16)[0] == capped.to(torch.bfloat16)[1]
    with force_backend(backend):
        ids = lm_head_argmax(hidden, weight, softcap=4.0)
        exact = lm_head_argmax(hidden, weight, softcap=4.0, logit_dtype=torch.float32)
        uncapped = lm_head_argmax(hidden, weight)  # 8 and 8.125 are apart in bf16
        rows = lm_head_sample(hidden, weight, 0.01, softcap=4.0, positions=torch.zeros(300, dtype=torch.long,
                                                                                       device=DEVICE), seed=2)
    assert ids.tolist() == [3, 3] and exact.tolist() == [7, 7] and uncapped.tolist() == [7, 7]
    counts = torch.bincount(rows.cpu(), minlength=8)
    assert counts[3] + counts[7] == 300 and 80 < counts[3] < 220  # a tie: drawn about evenly


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_softcap_sample_matches_capped_softmax_distribution(backend, temperature):
    """``lm_head_sample(..., softcap=c)`` draws from ``softmax(c * tanh(logits / c) / T)``; the same test
    rejects the uncapped distribution (so it fails on an op that ignores the cap)."""
    V, n, c = 8, 4000, 1.0
    hidden, weight, kw = make_inputs(3, 16, V, torch.float32, norm=True, seed=5)
    positions = torch.full((n,), 1, dtype=torch.int64, device=DEVICE)
    logits = ref.lm_head_logits(hidden, weight, norm_weight=kw["norm_weight"], positions=positions[:1])[0]
    probs = torch.softmax(c * torch.tanh(logits / c) / temperature, dim=0)
    uncapped = torch.softmax(logits / temperature, dim=0)
    assert probs.min() > 0.02, "every token must be likely enough for a chi-square test"
    with force_backend(backend):
        samples = lm_head_sample(hidden, weight, temperature, norm_weight=kw["norm_weight"], positions=positions,
                                 seed=4321, softcap=c)
    assert chi_square(samples, probs) < CHI2_CRITICAL_DF7_P001
    assert chi_square(samples, uncapped) > 10 * CHI2_CRITICAL_DF7_P001


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 96), (33, 257)])
def test_rms_norm_is_the_hf_modules_bit_for_bit(dtype, rows, hidden):
    """The reference norm (one ``torch.rms_norm`` call) gives transformers' own RMSNorm module's bits, for the
    final norm the heads fold in and for the drafter's norms."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    g = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    module = Qwen3RMSNorm(hidden, eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=g))
    want = module(x)
    got = ref.rms_norm(x, module.weight.detach(), 1e-6)
    assert got.dtype == want.dtype
    assert torch.equal(got, want)


# ------------------------------------------------------------------ vocab splits and the ticket merge

SPLIT_ROWS = (1, 7, 17, 65, 257)


def _split_plan(monkeypatch, programs, vocab_tiles=None):
    """Force the heads' split plan: ``programs`` per launch, and (optionally) narrow interpreter tiles so that
    the vocabulary has many of them (more splits than one merge step of BLOCK_S)."""
    monkeypatch.setattr(lm_head_module, "HEAD_PROGRAMS_CPU", programs)
    if vocab_tiles is not None:
        monkeypatch.setattr(lm_head_module, "_INTERPRETER_VOCAB_TILES", vocab_tiles)


@pytest.mark.parametrize("softcap", [None, SOFTCAP], ids=["plain", "softcap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", SPLIT_ROWS)
def test_split_heads_equal_reference_bit_for_bit(monkeypatch, rows, dtype, softcap):
    """Argmax and the device-seed draw at odd row counts and V = 1000 (no multiple of a tile), with 1, 5 and
    up to 16 vocab splits per row tile: equal to the reference on every row; the host-seed draw is the same
    whatever the plan (noise keyed by row and vocab id)."""
    T = rows + 3
    positions = list(range(T - 1, T - 1 - rows, -1))
    hidden, weight, kw = make_inputs(T, 48, 1000, dtype, positions=positions, seed=rows)
    kw["softcap"] = softcap
    greedy_ref = ref.lm_head_argmax(hidden, weight, **kw)
    seed = torch.tensor([77], dtype=torch.int64, device=DEVICE)
    drawn_ref = ref.lm_head_sample(hidden, weight, 0.8, check_bounds=False, seed=seed, **kw)
    host = []
    for programs, vocab_tiles in ((1, None), (5 * triton_row_tiles(rows), None), (16 * triton_row_tiles(rows), 64)):
        _split_plan(monkeypatch, programs, vocab_tiles)
        with force_backend("triton"):
            assert torch.equal(lm_head_argmax(hidden, weight, **kw), greedy_ref)
            assert torch.equal(lm_head_sample(hidden, weight, 0.8, seed=seed, **kw), drawn_ref)
            host.append(lm_head_sample(hidden, weight, 0.8, seed=1234, **kw))
    assert torch.equal(host[0], host[1]) and torch.equal(host[0], host[2])
    assert not bool(lm_head_module._tickets(torch.device(DEVICE), 1).any()), "every launch leaves its tickets at 0"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [7, 65])
def test_more_splits_than_one_merge_step(monkeypatch, rows, dtype):
    """V = 4500 in 64/128-wide tiles, a split per tile or two: more splits than the BLOCK_S partials one merge
    step reads, so the last program folds several steps (the later ones never win a tie)."""
    hidden, weight, kw = make_inputs(rows, 48, 4500, dtype, seed=3)
    weight[17] = weight[4400] = (hidden[0].float() / hidden[0].float().norm() * 4).to(dtype)  # a tie across splits
    greedy_ref = ref.lm_head_argmax(hidden, weight, **kw)
    assert greedy_ref[0] == 17
    seed = torch.tensor([5], dtype=torch.int64, device=DEVICE)
    drawn_ref = ref.lm_head_sample(hidden, weight, 1.0, check_bounds=False, seed=seed, **kw)
    _split_plan(monkeypatch, 64 * triton_row_tiles(rows), 1000)
    cfg = lm_head_module.head_config(rows, dtype)
    _, splits = lm_head_module.vocab_split_plan(triton_row_tiles(rows), -(-4500 // cfg["BLOCK_N"]),
                                                64 * triton_row_tiles(rows))
    assert splits > cfg["BLOCK_S"]
    with force_backend("triton"):
        assert torch.equal(lm_head_argmax(hidden, weight, **kw), greedy_ref)
        assert torch.equal(lm_head_sample(hidden, weight, 1.0, seed=seed, **kw), drawn_ref)


def triton_row_tiles(rows):
    return -(-rows // lm_head_module.head_config(rows, torch.bfloat16)["BLOCK_M"])


def test_split_plan_fills_one_wave_with_contiguous_slices():
    """Every vocab tile in exactly one non-empty split; at most ``programs`` programs (one row tile at least)."""
    for row_tiles in (1, 2, 5, 64):
        for vocab_tiles in (1, 3, 1187, 2374):
            for programs in (1, 3, 264):
                per, splits = lm_head_module.vocab_split_plan(row_tiles, vocab_tiles, programs)
                assert (splits - 1) * per < vocab_tiles <= splits * per
                assert row_tiles * splits <= max(programs, row_tiles)
    assert lm_head_module.vocab_split_plan(5, 1187, 264) == (23, 52)  # 257 rows, Qwen3 vocab, 132 SMs
    assert lm_head_module.vocab_split_plan(1, 2374, 264) == (9, 264)  # 15 rows


def test_topk_fused_writes_no_logits(monkeypatch):
    """Top-64 at 257 rows of a real vocabulary: the norm prologue and one top-K launch whose partials are
    ``splits x 64`` keys per row, no logits kernel and nothing larger than the normed ``[N, H]`` operand; a k past
    ``topk_fused_max`` takes the chunked logits path. Meta tensors and stub kernels."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numels = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ in ("empty", "empty_strided", "zeros", "full"):
                self.numels.append(out.numel())
            return out

    stubs = {name: KernelStub() for name in ("_norm_rows_kernel", "_topk_kernel", "_logits_kernel")}
    for name, stub in stubs.items():
        monkeypatch.setattr(lm_head_module, name, stub)
    meta = lambda *s, dtype=torch.bfloat16: torch.empty(*s, dtype=dtype, device="meta")  # noqa: E731
    N, V = 257, 151936
    hidden, weight, norm = meta(N, 4096), meta(V, 4096), meta(4096)
    with force_backend("triton"), Allocations() as mode:
        values, ids = lm_head_topk(hidden, weight, 64, norm_weight=norm)
    assert values.shape == ids.shape == (N, 64)
    assert len(stubs["_topk_kernel"].launches) == 1 and not stubs["_logits_kernel"].launches
    assert max(mode.numels) == N * 4096, mode.numels  # the largest buffer is the normed GEMM operand
    with force_backend("triton"):
        lm_head_topk(hidden, weight, lm_head_module.topk_fused_max(torch.bfloat16) + 1, norm_weight=norm)
    assert len(stubs["_topk_kernel"].launches) == 1 and stubs["_logits_kernel"].launches


def test_topk_config_bounds_the_running_keys():
    cfg = lm_head_module.topk_config(257, torch.bfloat16, 100)
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["K_BLOCK"]) == (64, 128, 128)
    assert lm_head_module.topk_config(15, torch.bfloat16, 3)["K_BLOCK"] == 4
    cfg = lm_head_module.topk_config(257, torch.bfloat16, 256)
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["K_BLOCK"]) == (16, 256, 256)
    with pytest.raises(ValueError, match="at most 256 keys per row with a bfloat16 GEMM, got k = 257"):
        lm_head_module.topk_config(15, torch.bfloat16, 257)
    with pytest.raises(ValueError, match="at most 64 keys per row with a float32 GEMM, got k = 65"):
        lm_head_module.topk_config(15, torch.float32, 65)


def test_head_row_tiles_minimize_padding():
    tiles = {n: lm_head_module.head_config(n, torch.bfloat16)["BLOCK_M"] for n in (1, 15, 16, 17, 64, 65, 128, 257,
                                                                                   1024, 8192)}
    assert tiles == {1: 16, 15: 16, 16: 16, 17: 64, 64: 64, 65: 128, 128: 128, 257: 64, 1024: 128, 8192: 128}


def test_heads_launch_once_with_no_torch_op_after(monkeypatch):
    """Greedy and device-seed Gumbel heads: the norm prologue and one head launch; the only aten ops are the
    output / partial allocations and views (no argmax, gather or cast over partials after the launch).
    Meta tensors and stub kernels: the ops are counted by dispatch, as they would run on a GPU."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    norm_stub, head_stub = KernelStub(), KernelStub()
    monkeypatch.setattr(lm_head_module, "_norm_rows_kernel", norm_stub)
    monkeypatch.setattr(lm_head_module, "_argmax_kernel", head_stub)
    meta = lambda *s, dtype=torch.bfloat16: torch.empty(*s, dtype=dtype, device="meta")  # noqa: E731
    hidden, weight, norm = meta(300, 256), meta(1000, 256), meta(256)
    positions, seed = meta(257, dtype=torch.int64), meta(1, dtype=torch.int64)
    kw = dict(norm_weight=norm, positions=positions, check_bounds=False)
    with force_backend("triton"):
        lm_head_argmax(hidden, weight, **kw)  # allocates the device's ticket counters once
        with Ops() as mode:
            ids = lm_head_argmax(hidden, weight, **kw)
            drawn = lm_head_sample(hidden, weight, 0.7, seed=seed, **kw)
    assert ids.shape == drawn.shape == (257,)
    assert len(norm_stub.launches) == 3 and len(head_stub.launches) == 3
    assert set(mode.ops) <= {"empty", "view", "reshape", "_unsafe_view", "alias", "detach", "promote_types"}, mode.ops


def test_an_outgrown_ticket_buffer_is_never_freed(monkeypatch):
    """A longer call than the ticket buffer holds gets a new buffer; the old one stays alive, because a CUDA
    graph captured before may still replay its atomics on the old address."""
    from dflash_kernels import lm_head as module

    monkeypatch.setattr(module, "_tickets_by_device", {})
    monkeypatch.setattr(module, "_outgrown_tickets", [])
    device = torch.device("cpu")
    first = module._tickets(device, 3)
    assert module._tickets(device, 3) is first
    bigger = module._tickets(device, first.numel() + 1)
    assert bigger is not first and bigger.numel() > first.numel() and not bigger.any()
    assert any(t is first for t in module._outgrown_tickets)
