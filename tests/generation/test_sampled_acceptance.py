"""Sampled DFlash2 chains draw from the selector's distribution filtered as the target's, and hand the verifier
exactly that distribution; the z-lab sampled-acceptance fixture and its benchmark.

The selector's ``q`` (softmax of its re-scored candidates at the temperature) goes through the target's
top-k / top-p / min-p before the draw (:func:`dflash_kernels.reference.filter_candidate_probs`), so a draft
is never a token the target's filters remove; the rejection rule stays lossless because the verifier gets the
``q`` each draft was drawn from (tests/generation/test_sampling_loop.py checks the committed distribution of a
filtered DFlash2 chain by chi-square). At ``top_k=1`` both ``p`` and ``q`` are point masses, so a sampled
round must commit exactly what the greedy round commits.
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import dflash
import dflash_kernels as dk
from dflash.decoding import round as round_module
from dflash.tiny.pair import load_default_pair
from dflash_kernels import reference as R

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "zlab_sampled"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = dk.available_backends(torch.device(DEVICE))
FILTERS = [dict(top_k=3), dict(top_p=0.8), dict(min_p=0.1), dict(top_k=5, top_p=0.9, min_p=0.02)]


@pytest.fixture
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_candidate_filter_is_the_targets_warpers(filters):
    """On a distribution over k candidates, the filter equals the target's processing (transformers' warpers in
    order, :func:`dflash_kernels.reference.processed_probs`) of its log-probabilities at T = 1."""
    g = torch.Generator().manual_seed(3)
    q = torch.softmax(2.0 * torch.randn(64, 16, generator=g), -1)
    got = R.filter_candidate_probs(q, **filters)
    want = R.processed_probs(q.log(), 1.0, filters.get("top_k"), filters.get("top_p"), filters.get("min_p"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert bool((got.argmax(-1) == q.argmax(-1)).all())  # the best candidate always stays


@pytest.mark.parametrize("backend", BACKENDS)
def test_filtered_draws_follow_the_returned_q(backend):
    """Chi-square: slots drawn at one position over many sequences follow the filtered q the op returns (the q
    the verifier gets), which has no mass where the filters cut; the op ignores the filters when greedy."""
    S, k = 4000 if backend == "reference" else 32, 6
    on = lambda t: t.to(DEVICE)  # noqa: E731
    unary = on(torch.tensor([[1.0, 0.2, -0.5, 0.7, -1.5, 0.0]]).expand(S, 1, k))
    candidates = on(torch.tensor([[3, 1, 4, 2, 0, 5]]).expand(S, 1, k))
    zeros = on(torch.zeros(6, 3))
    args = (unary, candidates, on(torch.zeros(S, 1, 3)), zeros, zeros, on(torch.zeros(S, dtype=torch.int64)))
    _, index, q = dk.select_candidates(*args, 0.9, on(torch.tensor([11])), top_k=4, top_p=0.75, backend=backend)
    plain = torch.softmax(unary[0, 0].float().cpu() / 0.9, -1)
    want = R.filter_candidate_probs(plain, top_k=4, top_p=0.75)
    torch.testing.assert_close(q[0, 0].cpu(), want)
    assert int((want > 0).sum()) < 4  # the top-p cut bites after the top-k one
    index = index[:, 0].cpu()
    assert bool((want[index] > 0).all())
    if backend == "reference":
        counts = torch.bincount(index, minlength=k).double()
        keep = want > 0
        expected = want.double() * S
        chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
        assert chi2 < 18.4, (chi2, counts.tolist(), expected.tolist())  # df <= 2: p = 1e-4
    greedy = dk.select_candidates(*args, 0.0, top_k=1, top_p=0.5, backend=backend)
    torch.testing.assert_close(greedy[2][0, 0].cpu(), torch.softmax(unary[0, 0].float().cpu(), -1))


def test_the_verifier_gets_the_filtered_q(one_thread, monkeypatch):
    """A sampled DFlash2 chain with top-k 2: every q handed to the rejection rule has at most two candidates
    and gives its proposal a positive probability."""
    target, draft, tok = load_default_pair(drafter="dflash2")
    seen = []
    verify = round_module.Round._accept_by_rejection

    def spy(self, hidden):
        seen.append((self.q_ids.clone(), self.q_probs.clone(), self.proposals.clone()))
        return verify(self, hidden)

    monkeypatch.setattr(round_module.Round, "_accept_by_rejection", spy)
    with dk.force_backend("reference"):
        dflash.generate(target, draft, tok.encode("def f(x):\n    return"), max_new_tokens=24, temperature=0.8,
                        top_k=2, seed=0, eos_token_id=None)
    assert seen
    for ids, probs, proposals in seen:
        assert int((probs > 0).sum(-1).max()) <= 2
        torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]))
        q_x = (probs * (ids == proposals[..., None])).sum(-1)
        assert bool((q_x > 0).all())


@pytest.mark.parametrize("drafter", ["dflash", "dflash2"])
def test_top_k_one_sampling_commits_the_greedy_rounds(one_thread, drafter):
    """At top_k=1 the target's p and the drafter's filtered q are point masses (here at a high temperature, where
    an unfiltered q would be flat): every round accepts a draft iff it is the target's argmax and resamples the
    argmax, so tokens and acceptance lengths equal greedy decoding's."""
    target, draft, tok = load_default_pair(drafter=drafter)
    prompt = tok.encode("import json\n\ndef load(path):\n    with open(path) as f:\n")
    with dk.force_backend("reference"):
        greedy = dflash.generate(target, draft, prompt, max_new_tokens=48, eos_token_id=None)
        sampled = dflash.generate(target, draft, prompt, max_new_tokens=48, temperature=3.0, top_k=1, seed=5,
                                  eos_token_id=None)
    assert sampled.output_ids.tolist() == greedy.output_ids.tolist()
    assert list(sampled.acceptance_lengths) == list(greedy.acceptance_lengths)
    assert greedy.tau > 1.5  # drafts are accepted: the rounds' acceptance is what is compared


def test_fixture_holds_the_grid():
    ref = json.loads((FIXTURE / "acceptance.json").read_text())
    prompts = json.loads((FIXTURE / "prompts.json").read_text())["prompts"]
    assert ref["prompts"] == prompts and len(prompts) == 8
    assert len(ref["seeds"]) >= 10
    grid = {(c["drafter"], c["temperature"], c["filter"]) for c in ref["configs"].values()}
    assert grid == {(d, t, f) for d in ("drafter", "drafter2") for t in (0.3, 0.7, 1.0) for f in ref["filters"]}
    for c in ref["configs"].values():
        assert len(c["tau"]) == len(ref["seeds"]) and c["tau_se"] > 0


def test_benchmark_dry_run(capsys, one_thread):
    """``python bench/sampled_acceptance.py --dry-run``: one configuration, one seed, one prompt, a few tokens."""
    path = ROOT / "bench" / "sampled_acceptance.py"
    spec = importlib.util.spec_from_file_location("sampled_acceptance", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "| tiny | drafter (DFlashDraftModel) | 0.3 | none |" in out
