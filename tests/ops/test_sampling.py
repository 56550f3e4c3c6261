"""Sampling from the processed distribution (temperature, top-k, top-p, min-p) against transformers.

* the reference's processed probabilities equal transformers' own warpers
  (``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``,
  ``MinPLogitsWarper`` in generate's order) on logits full of exact ties,
  up to a permutation among equal scores (transformers' CPU ``torch.sort`` is
  not stable, so which tied token survives a top-p cut is unspecified there);
* chi-square goodness of fit of ``lm_head_sample`` samples against
  that distribution, on both backends (Triton: the chunked histogram method
  under the interpreter, and its dense fp32 path), several settings;
* a support check on a real vocabulary (V = 151936): every sample lies in
  transformers' kept set;
* reproducibility from ``seed``, and bad arguments naming themselves.
"""

import pytest
import torch

import dflash_kernels
from dflash_kernels import force_backend, lm_head_sample
from dflash_kernels.reference.lm_head import HeadInputs
from dflash_kernels.reference.sampling import model_logits, processed_probs
from dflash_kernels.distribution import sample_processed_plan
from sampling_stats import chi_square_pvalue, hf_probs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tied_logits(rows, vocab, seed, step=0.25, scale=2.0):
    """bf16-exact logits on a coarse grid: many exact ties (at the k-th value, at the nucleus cut)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.round(torch.randn(rows, vocab, generator=g) * scale / step) * step).to(torch.bfloat16)


SETTINGS = [  # (T, top_k, top_p, min_p)
    (1.0, None, None, None), (0.6, 20, 0.95, None), (1.0, None, 0.9, None), (0.7, 5, None, None),
    (1.3, 10, 0.8, 0.05), (1.0, None, None, 0.1), (0.8, 3, None, 0.3), (2.0, None, 0.5, 0.02),
    (1.0, 1, None, None), (1.0, None, 0.01, None), (0.5, 40, 0.99, 0.0), (1.0, 1000, 1.0, 1.0),
]


def assert_same_up_to_tied_permutation(ours, theirs, scores):
    """Equal kept sets, or sets that differ only by ids of one tied score; equal probabilities (to fp32 rounding
    of the softmax sum, whose order a permutation changes)."""
    for r in range(ours.shape[0]):
        a, b = ours[r] > 0, theirs[r] > 0
        if not torch.equal(a, b):
            diff = (a != b).nonzero().flatten()
            tied = scores[r, diff]
            assert torch.all(tied == tied[0]), f"row {r}: kept sets differ beyond a tie: ids {diff.tolist()}"
            assert int(a.sum()) == int(b.sum()), f"row {r}: kept {int(a.sum())} tokens, transformers {int(b.sum())}"
            torch.testing.assert_close(torch.sort(ours[r]).values, torch.sort(theirs[r]).values, rtol=1e-6, atol=0)
        else:
            torch.testing.assert_close(ours[r], theirs[r], rtol=1e-6, atol=0)


@pytest.mark.parametrize("T,top_k,top_p,min_p", SETTINGS)
def test_reference_equals_transformers_warpers(T, top_k, top_p, min_p):
    logits = torch.cat([tied_logits(24, 257, seed=3), tied_logits(8, 257, seed=4, step=1.0, scale=0.7)])
    ours = processed_probs(logits, T, top_k, top_p, min_p)
    theirs = hf_probs(logits, T, top_k, top_p, min_p)
    assert_same_up_to_tied_permutation(ours, theirs, logits.float())


def test_ties_at_the_kth_value_are_all_kept():
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]], dtype=torch.bfloat16)
    probs = processed_probs(logits, 1.0, top_k=2)
    assert (probs[0] > 0).tolist() == [True, True, True, True, False, False]
    assert torch.equal(probs, hf_probs(logits, 1.0, top_k=2))


def test_nucleus_ties_keep_the_highest_ids():
    # mass before each 2.0-token decides: the cut falls inside the tie group
    logits = torch.tensor([[5.0] + [2.0] * 6 + [-9.0]])
    probs = processed_probs(logits, 1.0, top_p=0.9)
    kept = (probs[0] > 0).nonzero().flatten().tolist()
    n_kept = len(kept) - 1
    assert 0 < n_kept < 6 and kept == [0] + list(range(7 - n_kept, 7))
    theirs = hf_probs(logits, 1.0, top_p=0.9)
    assert int((theirs[0] > 0).sum()) == len(kept)


# ------------------------------------------------------------------ chi-square


def sample_inputs(V=40, H=16, seed=11, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, H, generator=g).to(dtype).to(DEVICE)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype).to(DEVICE)
    norm = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype).to(DEVICE)
    return hidden, weight, norm


CHI_SETTINGS_REF = [(1.0, None, 0.9, None), (0.6, 20, 0.95, None), (0.7, 5, None, None), (1.3, 10, 0.8, 0.05),
                    (1.0, None, None, 0.1), (2.0, None, 0.5, 0.02)]
CHI_SETTINGS_TRITON = [((0.6, 20, 0.95, None), torch.bfloat16), ((1.3, 10, 0.8, 0.05), torch.bfloat16),
                       ((2.0, None, 0.7, None), torch.float16), ((1.0, 6, 0.9, 0.05), torch.float32)]


def _chi_case(backend, setting, dtype, n):
    T, k, p, m = setting
    hidden, weight, norm = sample_inputs(dtype=dtype)
    positions = torch.full((n,), 1, dtype=torch.int64, device=DEVICE)
    logits = model_logits(HeadInputs(hidden, weight, norm, 1e-6, positions[:1], None), dtype)
    expected = hf_probs(logits, T, k, p, m)[0]
    with force_backend(backend):
        samples = lm_head_sample(hidden, weight, T, top_k=k, top_p=p, min_p=m, norm_weight=norm,
                                           positions=positions, seed=1234, check_bounds=False)
    assert samples.shape == (n,) and samples.dtype == torch.int64
    return chi_square_pvalue(samples, expected)


@pytest.mark.parametrize("setting", CHI_SETTINGS_REF)
def test_chi_square_reference(setting):
    assert _chi_case("reference", setting, torch.bfloat16, 4000) > 1e-3


@pytest.mark.parametrize("setting,dtype", CHI_SETTINGS_TRITON)
def test_chi_square_triton(setting, dtype):
    n = 800 if dtype != torch.float32 else 3000
    assert _chi_case("triton", setting, dtype, n) > 1e-3


def test_chi_square_detects_a_wrong_distribution():
    # the statistic is strong enough to reject a wrong temperature and a wrong nucleus
    hidden, weight, norm = sample_inputs()
    positions = torch.full((3000,), 1, dtype=torch.int64, device=DEVICE)
    logits = model_logits(HeadInputs(hidden, weight, norm, 1e-6, positions[:1], None), torch.bfloat16)
    with force_backend("reference"):
        samples = lm_head_sample(hidden, weight, 1.0, top_k=8, norm_weight=norm, positions=positions,
                                           seed=5)
    assert chi_square_pvalue(samples, hf_probs(logits, 1.0, 8)[0]) > 1e-3
    assert chi_square_pvalue(samples, hf_probs(logits, 1.6, 8)[0]) < 1e-3


def test_triton_histogram_plan_is_bounded():
    plan = sample_processed_plan(16, 151936, torch.bfloat16)
    assert plan["method"] == "histogram" and plan["rows"] == 16
    assert plan["logits_elements"] <= dflash_kernels.distribution.DEFAULT_CHUNK_ELEMENTS
    small = sample_processed_plan(200, 151936, torch.bfloat16, chunk_elements=1 << 20)
    assert small["rows"] == 64 and small["rows"] * small["vocab"] <= 1 << 20 and small["vocab"] < 151936
    dense = sample_processed_plan(300, 151936, torch.float32, chunk_elements=1 << 22)
    assert dense["method"] == "dense" and dense["rows"] * 151936 <= 1 << 22


def test_triton_vocab_chunks_give_the_same_distribution():
    # several vocab chunks and row chunks: the running tie rank and the running argmax across chunks
    hidden, weight, norm = sample_inputs(V=600)
    positions = torch.full((300,), 2, dtype=torch.int64, device=DEVICE)
    logits = model_logits(HeadInputs(hidden, weight, norm, 1e-6, positions[:1], None), torch.bfloat16)
    expected = hf_probs(logits, 1.0, 50, 0.9, None)[0]
    with force_backend("triton"):
        samples = lm_head_sample(hidden, weight, 1.0, top_k=50, top_p=0.9, norm_weight=norm,
                                           positions=positions, seed=3, chunk_elements=64 * 256)
    assert chi_square_pvalue(samples, expected) > 1e-3


# ------------------------------------------------------------------ real vocabulary


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_support_on_a_real_vocabulary(backend):
    V, H = 151936, 16
    g = torch.Generator().manual_seed(7)
    weight = (torch.randn(V, H, generator=g) * 0.6).to(torch.bfloat16).to(DEVICE)
    hidden = torch.randn(2, H, generator=g).to(torch.bfloat16).to(DEVICE)
    positions = torch.tensor([0] * 6 + [1] * 6, device=DEVICE)
    logits = model_logits(HeadInputs(hidden, weight, None, 1e-6, None, None), torch.bfloat16)
    settings = [(0.6, 20, 0.95, None), (1.0, None, 0.9, None), (0.7, None, None, 0.05)]
    if backend == "triton":  # (the interpreter: one setting; the reference covers all three)
        settings = settings[:1]
    for T, k, p, m in settings:
        kept = hf_probs(logits, T, k, p, m) > 0
        assert int(kept.sum(1).max()) < V  # the filter removes something
        with force_backend(backend):
            samples = lm_head_sample(hidden, weight, T, top_k=k, top_p=p, min_p=m, positions=positions,
                                               seed=17, check_bounds=False)
        assert kept[positions, samples].all(), (T, k, p, m, samples.tolist())


# ------------------------------------------------------------------ API


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_reproducible_with_seed(backend):
    hidden, weight, norm = sample_inputs(V=64)
    positions = torch.arange(3, device=DEVICE).repeat(20)
    kw = dict(top_k=30, top_p=0.9, norm_weight=norm, positions=positions)
    with force_backend(backend):
        a = lm_head_sample(hidden, weight, 1.5, seed=7, **kw)
        b = lm_head_sample(hidden, weight, 1.5, seed=7, **kw)
        c = lm_head_sample(hidden, weight, 1.5, seed=8, **kw)
        g = torch.Generator(device=DEVICE).manual_seed(3)
        d = lm_head_sample(hidden, weight, 1.5, generator=g, **kw)
    assert torch.equal(a, b) and not torch.equal(a, c) and d.shape == a.shape


def test_no_filter_equals_plain_sampling_distribution():
    hidden, weight, norm = sample_inputs(V=24)
    logits = model_logits(HeadInputs(hidden, weight, norm, 1e-6, torch.tensor([0]), None), torch.bfloat16)
    ref = processed_probs(logits, 0.8, 0, 1.0, None)
    torch.testing.assert_close(ref, torch.softmax(logits.float() / 0.8, dim=-1))


@pytest.mark.parametrize("kwargs,match", [
    (dict(top_k=-1), "top_k must be None or an int >= 0"),
    (dict(top_k=2.5), "top_k must be None or an int"),
    (dict(top_p=0.0), r"top_p must be a float in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be a float in \(0, 1\]"),
    (dict(top_p=-0.2), r"top_p must be a float in \(0, 1\]"),
    (dict(min_p=-0.1), r"min_p must be a float in \[0, 1\]"),
    (dict(min_p=1.01), r"min_p must be a float in \[0, 1\]"),
    (dict(min_p="0.1"), "min_p must be None or a float"),
])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_bad_arguments_name_themselves(kwargs, match, backend):
    hidden, weight, _ = sample_inputs(V=16)
    with force_backend(backend), pytest.raises((ValueError, TypeError), match=match):
        lm_head_sample(hidden, weight, 1.0, **kwargs)


def test_bad_temperature_and_seed():
    hidden, weight, _ = sample_inputs(V=16)
    with pytest.raises(ValueError, match="temperature"):
        lm_head_sample(hidden, weight, 0.0, top_k=3)
    with pytest.raises(ValueError, match="either generator or seed"):
        lm_head_sample(hidden, weight, 1.0, min_p=0.0, seed=1, generator=torch.Generator())  # min_p=0: the processed route
