"""Rejection sampling of a drafted chain (dflash_kernels.rejection_sample): the fast path equals the reference,
the edge cases of q, and the rule's losslessness on fixed distributions.

* the chunked fast path (Triton backend; the interpreter here) picks the reference's tokens and accepted
  count for the same seed: dense and sparse q, fp32 (full-vocabulary rows) and bf16 (histogram) logits,
  with and without top-k / top-p / min-p, budgets that split the vocabulary and the rows into chunks;
* q(x) = 0 accepts x iff p(x) > 0, p(x) = 0 always rejects, q = p accepts every draft;
* over many seeds, with drafts drawn from q, the first committed token follows p_0 and the second (when
  the first draft was accepted) follows p_1: chi-square, for a dense q and for a sparse q that misses
  part of p's support;
* bad arguments are refused with errors that name them.
"""

import pytest
import torch

import dflash_kernels as dk
from dflash_kernels.reference import rejection as ref
from dflash_kernels.reference.sampling import processed_probs
from sampling_stats import chi_square_pvalue

BACKENDS = dk.available_backends(torch.device("cpu"))
FILTERS = [{}, dict(top_k=9, top_p=0.85, min_p=0.02)]


def chain(D, V=37, H=12, dtype=torch.float32, seed=0, noise=0.4):
    """Target rows [D + 1, H], an lm_head [V, H], a norm weight, drafter rows [D, H] near the target's."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(D + 1, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.6
    norm = torch.rand(H, generator=g) + 0.5
    q_hidden = hidden[:D] * norm + noise * torch.randn(D, H, generator=g)
    return hidden.to(dtype), weight.to(dtype), norm.to(dtype), q_hidden.to(dtype)


def sparse_q(q_hidden, weight, K, seed=0):
    """A sparse q over the drafter rows' top-K ids (in a random order) with random probabilities."""
    g = torch.Generator().manual_seed(seed + 100)
    top = torch.topk(q_hidden.float() @ weight.float().T, K, dim=1).indices
    ids = top.gather(1, torch.stack([torch.randperm(K, generator=g) for _ in range(top.shape[0])]))
    probs = torch.softmax(torch.randn(ids.shape, generator=g) * 1.5, dim=1)
    return ids, probs


def draft(form, hidden, weight, norm, q_hidden, T, filters, seed):
    """``(proposals, q kwargs)``: drafts drawn from q (dense: the processed draft rows; sparse: q_probs)."""
    if form == "dense":
        # the processed route even for the plain case (min_p=0 keeps every token)
        x = dk.lm_head_sample(q_hidden, weight, T, seed=torch.tensor([seed]), backend="reference",
                              **(filters or dict(min_p=0.0)))
        return x, dict(q_hidden=q_hidden)
    ids, probs = sparse_q(q_hidden, weight, 4)
    pick = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed))[:, 0]
    return ids.gather(1, pick[:, None])[:, 0], dict(q_ids=ids, q_probs=probs)


@pytest.mark.skipif("triton" not in BACKENDS, reason="Triton cannot run here")
@pytest.mark.parametrize("filters", FILTERS, ids=["plain", "filtered"])
@pytest.mark.parametrize("form", ["dense", "sparse"])
@pytest.mark.parametrize("dtype,D,chunk", [(torch.float32, 1, None), (torch.float32, 6, 80),
                                           (torch.bfloat16, 6, None), (torch.bfloat16, 5, 300)])
def test_fast_path_equals_reference(dtype, D, chunk, form, filters):
    """``chunk`` 80 / 300 elements: fp32 rows two at a time; bf16 vocabulary chunks of 256 ids (V = 301)."""
    V = 301 if chunk == 300 else 37
    hidden, weight, norm, q_hidden = chain(D, V=V, dtype=dtype, seed=D)
    T = 0.9 if V == 37 else 0.3  # peaked enough that drafts are accepted over the wider vocabulary
    accepted = set()
    for s in range(6):
        x, q = draft(form, hidden, weight, norm, q_hidden, T, filters, seed=s)
        kw = dict(norm_weight=norm, seed=torch.tensor([1000 + s]), **filters, **q)
        want = ref.rejection_sample(hidden, weight, x, T, **kw)
        got = dk.rejection_sample(hidden, weight, x, T, backend="triton", chunk_elements=chunk, **kw)
        assert torch.equal(got[1], want[1]), (s, got, want)
        assert torch.equal(got[0], want[0]), (s, got, want)
        assert got[0].shape == (D + 1,) and got[1].shape == (1,)
        accepted.add(int(want[1]))
    assert len(accepted) > 1 or D == 1  # the seeds exercise more than one prefix length


@pytest.mark.parametrize("backend", BACKENDS)
def test_q_zero_and_p_zero(backend):
    """Target top-k = 1 (p a point mass on each row's argmax), a sparse q that never holds the argmax:
    the argmax drafted at row 0 has q(x) = 0 < p(x) and is accepted; a draft with p(x) = 0 at row 1 is
    rejected and replaced by the argmax (the residual is p itself)."""
    D = 3
    hidden, weight, norm, _ = chain(D, seed=5)
    top = dk.lm_head_argmax(hidden, weight, norm_weight=norm, backend="reference")
    others = torch.stack([torch.tensor([v for v in range(37) if v != int(t)][:4]) for t in top[:D]])
    probs = torch.full((D, 4), 0.25)
    x = torch.stack([top[0], others[1, 0], others[2, 0]])
    for s in range(4):
        choices, accepted = dk.rejection_sample(hidden, weight, x, 0.8, top_k=1, norm_weight=norm, q_ids=others,
                                                q_probs=probs, seed=torch.tensor([s]), backend=backend)
        assert int(accepted) == 1
        assert choices[:2].tolist() == [int(top[0]), int(top[1])]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("filters", FILTERS, ids=["plain", "filtered"])
def test_q_equal_to_p_accepts_every_draft(backend, filters):
    """Dense q from the target's own (normed) rows: q = p, so u q < p always holds; the bonus is from p_D."""
    D = 4
    hidden, weight, _, _ = chain(D, seed=6)
    for s in range(4):
        x = dk.lm_head_sample(hidden[:D], weight, 0.7, seed=torch.tensor([s]), backend="reference",
                              **(filters or dict(min_p=0.0)))  # the processed route, as the draft's
        choices, accepted = dk.rejection_sample(hidden, weight, x, 0.7, q_hidden=hidden[:D].clone(),
                                                seed=torch.tensor([50 + s]), backend=backend, **filters)
        assert int(accepted) == D
        assert torch.equal(choices[:D], x)
        p_bonus = processed_probs(hidden[D:] @ weight.T, 0.7, **filters)[0]
        assert p_bonus[choices[D]] > 0


@pytest.mark.parametrize("form", ["dense", "sparse"])
def test_committed_tokens_follow_p(form):
    """Drafts from q, many seeds: committed token 0 ~ p_0; token 1 given that draft 1 was accepted ~ p_1
    (the rows' p do not depend on the prefix here, so these are exactly the lossless marginals)."""
    D, T, filters, runs = 2, 0.9, dict(top_k=12, top_p=0.95), 3000
    hidden, weight, norm, q_hidden = chain(D, seed=7, noise=0.3)
    p = processed_probs((hidden * torch.rsqrt(hidden.pow(2).mean(1, keepdim=True) + 1e-6) * norm) @ weight.T, T,
                        **filters)
    first, second = [], []
    with dk.force_backend("reference"):
        for s in range(runs):
            x, q = draft(form, hidden, weight, norm, q_hidden, T, filters, seed=2 * s)  # one key per draw
            choices, accepted = dk.rejection_sample(hidden, weight, x, T, norm_weight=norm,
                                                    seed=torch.tensor([2 * s + 1]), **filters, **q)
            first.append(int(choices[0]))
            if int(accepted) >= 1:
                second.append(int(choices[1]))
    assert 0.1 * runs < len(second) < 0.9 * runs  # drafts are accepted and rejected
    assert chi_square_pvalue(torch.tensor(first), p[0]) > 1e-3
    assert chi_square_pvalue(torch.tensor(second), p[1]) > 1e-3


def test_bad_arguments():
    hidden, weight, norm, q_hidden = chain(3)
    x, seed = torch.tensor([1, 2, 3]), torch.tensor([0])
    ids, probs = sparse_q(q_hidden, weight, 4)
    cases = [
        (dict(), "exactly one form"),
        (dict(q_hidden=q_hidden, q_ids=ids, q_probs=probs), "exactly one form"),
        (dict(q_ids=ids), "needs both"),
        (dict(q_hidden=q_hidden[:2]), "q_hidden must be [D, H]"),
        (dict(q_ids=ids[:, :2], q_probs=probs), "shaped like q_ids"),
        (dict(q_ids=ids + 40, q_probs=probs), "outside the vocabulary"),
    ]
    for kw, needle in cases:
        with pytest.raises((ValueError, IndexError), match=needle.replace("[", r"\[")):
            dk.rejection_sample(hidden, weight, x, 0.8, seed=seed, **kw)
    with pytest.raises(ValueError, match=r"hidden must be \[D \+ 1, H\]"):
        dk.rejection_sample(hidden[:3], weight, x, 0.8, q_hidden=q_hidden, seed=seed)
    with pytest.raises(TypeError, match="seed must be an int64 tensor"):
        dk.rejection_sample(hidden, weight, x, 0.8, q_hidden=q_hidden, seed=3)
    with pytest.raises(TypeError, match="proposals must be an int64 tensor"):
        dk.rejection_sample(hidden, weight, x.int(), 0.8, q_hidden=q_hidden, seed=seed)
    with pytest.raises(ValueError, match="temperature must be a finite float > 0"):
        dk.rejection_sample(hidden, weight, x, 0.0, q_hidden=q_hidden, seed=seed)


def test_acceptance_rules_benchmark_runs_at_smoke_size(capsys):
    """``python bench/acceptance_rules.py`` (the README's tau table), one prompt of a few tokens."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "acceptance_rules.py"
    spec = importlib.util.spec_from_file_location("acceptance_rules", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        module.main(["--num-prompts", "1", "--prompt-len", "16", "--max-new-tokens", "6", "--drafters", "drafter2"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "| drafter2 | DFlash2DraftModel |" in out


def test_generate_refuses_a_bad_acceptance_rule():
    """dflash.generate names the rule and the methods it applies to (the drop-in and the CLI are tested in their
    own files)."""
    import dflash
    from tiny_models import tiny_draft, tiny_target

    target = tiny_target("qwen3", layers=3, hidden=32)
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
    with pytest.raises(ValueError, match="acceptance must be one of 'rejection', 'match'"):
        dflash.generate(target, draft, [1, 2, 3], method="dflash", max_new_tokens=3, acceptance="x")
    with pytest.raises(ValueError, match="not to method 'ddtree'"):
        dflash.generate(target, draft, [1, 2, 3], method="ddtree", max_new_tokens=3, acceptance="rejection")
    with pytest.raises(dflash.UnsupportedGeneration, match="acceptance does not apply to method 'ar'"):
        dflash.generate(target, None, [1, 2, 3], method="ar", max_new_tokens=3, acceptance="match")
