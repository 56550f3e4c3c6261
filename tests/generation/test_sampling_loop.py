"""The loops sample from transformers' processed distribution at every committed position.

Many seeded generations of the shipped tiny pair (its trained drafter proposes the target's likely
tokens, so drafts are often accepted), 3 new tokens each: the first new token (sampled after the prefill)
and the third given the most frequent first two among the runs whose first round accepted a draft (so a
good share of those third tokens were sampled at verify row 1, right after an accepted draft: asserted)
must follow ``softmax(warpers(logits))`` with transformers' warpers for the same (T, top_k, top_p, min_p):
chi-square goodness of fit (tests/ops/test_sampling.py's statistic). Lossless sampling means exactly this
distribution, whatever the drafter proposed. ``top_k=0`` switches transformers' default top-k of 50 off
where a setting has none.
"""

from collections import Counter

import pytest
import torch

import dflash
import dflash_kernels
from dflash.tiny.pair import load_default_pair
from sampling_stats import chi_square_pvalue, hf_probs

SETTINGS = [(0.8, 10, 0.9, None), (1.2, None, 0.8, 0.05), (0.7, 5, None, None)]
RUNS = 2000


@pytest.fixture(scope="module")
def pair():
    target, draft, tok = load_default_pair()
    prompt = tok.encode("def parse_header(line):\n    key, value = line.split(")
    return target, draft, prompt


@pytest.fixture
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models decode fastest on one thread, and far slower beside a busy core
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_committed_tokens_follow_the_processed_distribution(pair, one_thread, method, setting):
    """The default rule of each method: rejection sampling of drafts drawn from the drafter (DFlash chains),
    the walk that follows the target's samples (DDTree)."""
    check_processed_distribution(*pair, method, setting)


@pytest.mark.parametrize("drafter,acceptance", [("dflash", "match"), ("dflash2", "rejection")],
                         ids=["dflash-match", "dflash2-rejection"])
def test_other_chain_rules_follow_the_processed_distribution(pair, one_thread, drafter, acceptance):
    """The matching rule (argmax drafts kept while they equal the target's samples), and the rejection rule over
    a DFlash2 drafter's sparse q (its selector's re-scored distribution over its top-k candidates)."""
    target, draft, prompt = pair
    if drafter == "dflash2":
        target, draft, _ = load_default_pair(drafter="dflash2")
    check_processed_distribution(target, draft, prompt, "dflash", SETTINGS[0], acceptance=acceptance)


def check_processed_distribution(target, draft, prompt, method, setting, **extra):
    """The chi-square checks of the module docstring for one method and sampling setting (``extra``: more
    generate() keywords)."""
    T, k, p, m = setting
    P = len(prompt)
    kw = dict(method=method, max_new_tokens=3, do_sample=True, temperature=T, top_k=k or 0, top_p=p, min_p=m,
              eos_token_id=None, block_size=4, **extra)
    if method == "ddtree":
        kw["tree_budget"] = 6
    runs = []
    with dflash_kernels.force_backend("reference"), torch.inference_mode():
        for seed in range(RUNS):
            res = dflash.generate(target, draft, prompt, seed=seed, **kw)
            runs.append((res.output_ids[0, P:].tolist(), res.acceptance_lengths[0] >= 2))
        logits0 = target(torch.tensor([prompt])).logits[0, -1:]
        accepted_pairs = Counter(tuple(new[:2]) for new, accepted in runs if accepted)
        assert accepted_pairs, "no first round accepted a draft: nothing tests the later rows"
        pair2 = accepted_pairs.most_common(1)[0][0]
        logits2 = target(torch.tensor([prompt + list(pair2)])).logits[0, -1:]
    first = torch.tensor([new[0] for new, _ in runs])
    third = [(new[2], accepted) for new, accepted in runs if tuple(new[:2]) == pair2]
    assert chi_square_pvalue(first, hf_probs(logits0, T, k, p, m)[0]) > 1e-3
    assert len(third) >= 100, f"only {len(third)} runs share the first two tokens {pair2}"
    assert sum(accepted for _, accepted in third) >= len(third) // 4
    assert chi_square_pvalue(torch.tensor([t for t, _ in third]), hf_probs(logits2, T, k, p, m)[0]) > 1e-3
