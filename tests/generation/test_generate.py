"""Generation: lossless DFlash (== the target's own greedy decoding), stops, sampling, bad input."""

import pytest
import torch

import dflash
import dflash_kernels
from dflash import DraftConfigError
from prompts import PROMPT, greedy
from tiny_models import RiggedDraft, tiny_draft, tiny_target

PROMPTS = [PROMPT, [88], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(autouse=True)
def reference_ops():
    """The loops run on the reference ops here (the Triton interpreter is slow); the kernels are
    held to the references in their own tests, and test_generate_triton.py runs the loops on them."""
    with dflash_kernels.force_backend("reference"):
        yield


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target(request):
    return tiny_target(request.param, layers=6)


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_dflash_is_lossless_with_a_random_and_a_rigged_drafter(target, block_size):
    draft = tiny_draft(target, block_size=block_size)
    rounds = []
    for prompt in PROMPTS:
        ref = greedy(target, 48, prompt)
        assert torch.equal(dflash.generate(target, None, prompt, method="ar", max_new_tokens=48).output_ids, ref)
        out = dflash.generate(target, draft, prompt, max_new_tokens=48)
        assert torch.equal(out.output_ids, ref), "random drafter changed the output"
        rigged = RiggedDraft(draft, target.lm_head.weight, ref, p_right=0.85, seed=len(prompt))
        res = dflash.generate(target, rigged, prompt, max_new_tokens=48)
        assert torch.equal(res.output_ids, ref), "rigged drafter changed the output"
        # the first new token comes from the prefill; every round commits 1..B tokens
        assert sum(res.acceptance_lengths) + 1 >= 48 and max(res.acceptance_lengths) <= block_size
        rounds.append(res)
    if block_size >= 4:
        # long acceptances and full blocks are exercised, not only rejections
        assert max(max(r.acceptance_lengths) for r in rounds) == block_size
        assert sum(r.tau for r in rounds) / len(rounds) > 2.0


def test_perfect_drafter_commits_full_blocks(target):
    draft = tiny_draft(target, block_size=8)
    ref = greedy(target, 40, PROMPTS[0])
    res = dflash.generate(target, RiggedDraft(draft, target.lm_head.weight, ref, p_right=1.0), PROMPTS[0],
                          max_new_tokens=40)
    assert torch.equal(res.output_ids, ref)
    assert res.acceptance_lengths[:4] == [8, 8, 8, 8]


def test_max_new_tokens_is_exact(target):
    draft = tiny_draft(target, block_size=8)
    ref = greedy(target, 30, PROMPTS[0])
    rigged = RiggedDraft(draft, target.lm_head.weight, ref, p_right=1.0)
    for n in (1, 2, 7, 8, 9, 30):
        res = dflash.generate(target, rigged, PROMPTS[0], max_new_tokens=n)
        assert res.num_new_tokens == n
        assert torch.equal(res.output_ids, ref[:, : len(PROMPTS[0]) + n])


def test_stop_token_truncates_right_after_it(target):
    draft = tiny_draft(target, block_size=8)
    ref = greedy(target, 30, PROMPTS[0])
    new = ref[0, len(PROMPTS[0]) :].tolist()
    stop = new[5]
    cut = new.index(stop) + 1
    for method, d in (("ar", None), ("dflash", RiggedDraft(draft, target.lm_head.weight, ref, p_right=1.0))):
        res = dflash.generate(target, d, PROMPTS[0], method=method, max_new_tokens=30, stop_token_ids=[stop])
        assert res.generated_ids[0].tolist() == new[:cut]


def test_sampling_is_reproducible_under_a_seed(target):
    draft = tiny_draft(target, block_size=4)
    kw = dict(max_new_tokens=24, temperature=0.8)
    a = dflash.generate(target, draft, PROMPTS[0], seed=3, **kw)
    b = dflash.generate(target, draft, PROMPTS[0], seed=3, **kw)
    c = dflash.generate(target, draft, PROMPTS[0], seed=4, **kw)
    assert torch.equal(a.output_ids, b.output_ids)
    assert not torch.equal(a.output_ids, c.output_ids)
    ar1 = dflash.generate(target, None, PROMPTS[0], method="ar", seed=3, **kw)
    ar2 = dflash.generate(target, None, PROMPTS[0], method="ar", seed=3, **kw)
    assert torch.equal(ar1.output_ids, ar2.output_ids)


def test_statistics_are_filled(target):
    draft = tiny_draft(target, block_size=4)
    res = dflash.generate(target, draft, PROMPTS[0], max_new_tokens=12)
    s = res.summary()
    assert s["rounds"] == len(res.acceptance_lengths) >= 1
    assert res.tau == sum(res.acceptance_lengths) / len(res.acceptance_lengths)
    for key in ("time_to_first_token", "draft_time", "verify_time", "commit_time", "total_time"):
        assert s[key] > 0, key
    assert res.time_per_output_token > 0 and res.tokens_per_second > 0


def test_spec_generate_drop_in(target):
    draft = tiny_draft(target, block_size=4)
    ref = greedy(target, 16, PROMPTS[0])
    out = draft.spec_generate(target=target, input_ids=torch.tensor([PROMPTS[0]]), max_new_tokens=16,
                              stop_token_ids=None, temperature=0.0)
    assert torch.equal(out, ref)


def test_sliding_window_target_and_drafter_stay_lossless():
    target = tiny_target("qwen3", layers=6, sliding_window=6)
    draft = tiny_draft(target, block_size=4, layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    ref = greedy(target, 24, PROMPTS[2])
    assert torch.equal(dflash.generate(target, draft, PROMPTS[2], max_new_tokens=24).output_ids, ref)
    rigged = RiggedDraft(draft, target.lm_head.weight, ref, p_right=0.9)
    assert torch.equal(dflash.generate(target, rigged, PROMPTS[2], max_new_tokens=24).output_ids, ref)


def _bad_cases():
    t = tiny_target("qwen3", layers=6)
    other = tiny_target("qwen3", layers=6, vocab=80)
    d = tiny_draft(t)
    fc_wrong = tiny_draft(t)
    fc_wrong.fc = torch.nn.Linear(3 * 64, 64, bias=False)
    deep = tiny_draft(tiny_target("qwen3", layers=8))
    out_of_range = tiny_draft(t)
    out_of_range.target_layer_ids = [1, 7]
    ok = [1, 2, 3]
    return [
        ("layer id out of range", t, out_of_range, ok, {}, DraftConfigError, "out of range"),
        ("target depth", t, deep, ok, {}, DraftConfigError, "8-layer target"),
        ("fc width", t, fc_wrong, ok, {}, DraftConfigError, "fc takes 192 features"),
        ("vocab", other, d, ok, {}, DraftConfigError, "vocab_size 96 != target vocabulary 80"),
        ("block size", t, d, ok, dict(block_size=1), ValueError, "block_size must be >= 2"),
        ("max_new_tokens 0", t, d, ok, dict(max_new_tokens=0), ValueError, "max_new_tokens must be an int >= 1"),
        ("empty prompt", t, d, [], {}, ValueError, "prompt is empty"),
        ("ragged rows", t, d, [[1, 2], [3]], {}, ValueError, "rows of input_ids have different lengths"),
        ("id >= vocab", t, d, [1, 96], {}, ValueError, "outside the target vocabulary"),
        ("negative temperature", t, d, ok, dict(temperature=-1.0), ValueError, "temperature must be >= 0"),
        ("unknown method", t, d, ok, dict(method="beam"), ValueError, "unknown method 'beam'"),
        ("no drafter", t, None, ok, {}, ValueError, "needs a drafter"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_names_the_problem(case):
    _, target, draft, prompt, kw, exc, message = case
    kw = {"max_new_tokens": 4, **kw}
    with pytest.raises(exc, match=message):
        dflash.generate(target, draft, prompt, **kw)


def recomputed_position_acceptance(res, block_size):
    """a_k from acceptance_lengths (every round's accepted drafts = its committed tokens - 1), the final
    round from what its verify accepted (the stop rules may have cut its commit short)."""
    accepted = [a - 1 for a in res.acceptance_lengths[:-1]] + res.accepted_depths[-1:]
    return [sum(n >= k for n in accepted) / len(accepted) for k in range(1, block_size)]


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_position_acceptance_of_a_generation(target, method):
    block_size = 6
    draft = tiny_draft(target, block_size=block_size)
    kw = dict(method=method, tree_budget=8) if method == "ddtree" else dict(method=method)
    shapes = set()
    for i, prompt in enumerate(PROMPTS):
        ref = greedy(target, 40, prompt)
        res = dflash.generate(target, RiggedDraft(draft, target.lm_head.weight, ref, p_right=0.75, seed=i), prompt,
                              max_new_tokens=40, **kw)
        values = res.position_acceptance
        assert res.block_size == block_size and len(values) == block_size - 1
        assert res.accepted_depths[:-1] == [a - 1 for a in res.acceptance_lengths[:-1]]
        assert res.accepted_depths[-1] >= res.acceptance_lengths[-1] - 1
        assert values == pytest.approx(recomputed_position_acceptance(res, block_size), abs=0)
        assert all(0.0 <= v <= 1.0 for v in values) and values == sorted(values, reverse=True)
        assert res.summary()["position_acceptance"] == values
        shapes.add(tuple(values))
    assert len(shapes) > 1 and any(0 < v < 1 for s in shapes for v in s)  # acceptance really varied


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_position_acceptance_counts_a_round_cut_short(target, method):
    """A perfect drafter, B = 8, 10 new tokens: the prefill commits 1, round 1 commits 8, round 2's verify
    accepts all 7 drafts but only 1 token may commit; both rounds reached every position."""
    draft = tiny_draft(target, block_size=8)
    ref = greedy(target, 16, PROMPTS[0])
    kw = dict(method=method, tree_budget=7) if method == "ddtree" else dict(method=method)
    res = dflash.generate(target, RiggedDraft(draft, target.lm_head.weight, ref, p_right=1.0), PROMPTS[0],
                          max_new_tokens=10, **kw)
    assert res.acceptance_lengths == [8, 1] and res.accepted_depths == [7, 7]
    assert res.position_acceptance == [1.0] * 7


def test_ar_results_have_no_position_acceptance(target):
    res = dflash.generate(target, None, PROMPTS[0], method="ar", max_new_tokens=5)
    assert res.block_size == 1 and res.position_acceptance == [] and res.summary()["position_acceptance"] == []


def test_every_entry_point_reads_the_one_defaults():
    """generate, apply, stream, warmup, the loop's options and the CLI take each option's default from one
    table, DEFAULTS: no entry point restates a value of its own."""
    import dataclasses
    import inspect

    from dflash.cli import build_parser
    from dflash.decoding.options import DEFAULTS, LoopOptions

    table = dataclasses.asdict(DEFAULTS)
    for fn in (dflash.generate, dflash.apply, dflash.stream, dflash.warmup):
        params = inspect.signature(fn).parameters
        for name, value in table.items():
            if name in params and not (fn is dflash.apply and name == "method"):
                assert params[name].default == value, (fn.__name__, name)
    # apply's method None: the default method with a drafter (only assistant_model calls without one)
    assert inspect.signature(dflash.apply).parameters["method"].default is None
    loop = {f.name: f.default for f in dataclasses.fields(LoopOptions)}
    for name in ("tree_budget", "block_size", "mask_token_id", "stage_timing", "acceptance", "draft_window"):
        assert loop[name] == table[name], name
    args = build_parser().parse_args(["generate", "--prompt", "x"])
    for name in ("method", "tree_budget", "block_size", "acceptance", "draft_window", "compile"):
        assert getattr(args, name) == table[name], name


def test_apply_and_generate_run_the_same_default_rounds(target):
    """With no method, the drop-in runs what generate runs: the same method, budget and stage timing."""
    draft = tiny_draft(target, block_size=4)
    ref = dflash.generate(target, draft, PROMPTS[0], max_new_tokens=12, do_sample=False)
    with dflash.apply(target, draft) as handle:
        out = target.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=12, do_sample=False)
    ours = handle.last_result
    assert torch.equal(out, ref.output_ids)
    assert (ours.method, ours.block_size, ours.acceptance_lengths) == (ref.method, ref.block_size,
                                                                      ref.acceptance_lengths)
    assert ours.draft_time > 0 and ref.draft_time > 0  # both timed their stages
