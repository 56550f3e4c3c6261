"""``tree_budget="auto"``: a DDTree budget chosen each round among buckets.

* the tree of bucket ``n`` is the first ``n`` nodes of the largest bucket's tree: the prefix equals the
  best-first tree of budget ``n`` (host and device builds, DFlash and DFlash2 trees);
* the path masses the draft step writes equal the path probabilities summed over each bucket's nodes (a
  reference in Python over the heap's own scores);
* the counterfactual acceptance the host reads equals the walk of each prefix tree;
* generation is lossless for any choice (eager, static, traced), one host read per round, no recompile when
  the bucket changes; the policy picks the best expected tokens per second; errors name what is allowed.
"""

import math

import pytest
import torch

import dflash
import dflash_kernels
from dflash.decoding import bucket_costs
from dflash.decoding.budget_policy import BudgetPolicy, monotone
from dflash.decoding.options import AUTO_BUDGETS, LoopOptions, check_tree_budget
from dflash.decoding.payload import MASS_SCALE
from dflash.decoding.round import Round
from dflash.decoding.generation_config import SamplingSettings
from dflash.target import TargetAdapter
from test_compiled_rounds import trace_only  # noqa: F401  (the fixture: dynamo-only compile)
from prompts import greedy
from tiny_models import tiny_dflash2_draft, tiny_draft, tiny_target

PROMPT = [5, 17, 33, 2, 9, 41, 60, 7, 3, 11]  # this file's own, not prompts.PROMPT


@pytest.fixture
def reference_ops():
    with dflash_kernels.force_backend("reference"):
        yield


def pair(block_size=5, dflash2=False):
    target = tiny_target("qwen3", layers=3, hidden=32)
    make = tiny_dflash2_draft if dflash2 else tiny_draft
    return target, make(target, block_size=block_size, target_layer_ids=[0, 1])


# ------------------------------------------------------------------ the settings
def test_tree_budget_values():
    assert check_tree_budget("auto") == AUTO_BUDGETS
    assert check_tree_budget([16, 4, 4]) == (4, 16)
    assert check_tree_budget(7) == 7
    for bad in ("big", [], [0, 4], [4, True], 0, 2.5, None):
        with pytest.raises(ValueError, match="tree_budget must be an int >= 1 .* 'auto'"):
            check_tree_budget(bad)


def test_shape_of_an_auto_budget():
    target, draft = pair()
    shape = LoopOptions(max_new_tokens=4, tree_budget="auto").resolve("ddtree", draft, 96)
    assert shape.tree_budget == 64 and shape.budget_buckets == AUTO_BUDGETS
    fixed = LoopOptions(max_new_tokens=4, tree_budget=8).resolve("ddtree", draft, 96)
    assert fixed.budget_buckets == ()


def test_generate_refuses_a_bad_budget_by_name():
    target, draft = pair()
    with pytest.raises(ValueError, match="tree_budget must be .* got 'sometimes'"):
        dflash.generate(target, draft, PROMPT, method="ddtree", max_new_tokens=4, tree_budget="sometimes")


# ------------------------------------------------------------------ prefixes, masses, counterfactuals
def _round(target, draft, budget, prompt=PROMPT, host_tree=True):
    adapter = TargetAdapter(target, draft.target_layer_ids)
    shape = LoopOptions(max_new_tokens=8, tree_budget=budget).resolve("ddtree", draft, adapter.vocab_size)
    rnd = Round(adapter, draft, shape, target_rows=64, draft_rows=64, sampling=SamplingSettings(0.0),
                host_tree=host_tree)
    rnd.reset(0)
    rnd.start(torch.tensor(prompt))
    return adapter, rnd


@pytest.mark.parametrize("host_tree", [True, False])
@pytest.mark.parametrize("dflash2", [False, True])
@torch.inference_mode()
def test_each_bucket_is_the_fixed_budget_tree(reference_ops, host_tree, dflash2):
    """The first n nodes of the largest bucket's tree = the tree a round of fixed budget n drafts."""
    target, draft = pair(dflash2=dflash2)
    buckets = (2, 3, 5, 9)
    adapter, auto = _round(target, draft, list(buckets), host_tree=host_tree)
    auto.draft()
    assert auto.bucket_nodes == list(buckets)
    for n in buckets:
        _, fixed = _round(target, draft, n, host_tree=host_tree)
        fixed.draft()
        assert torch.equal(auto.tokens[:, :n], fixed.tokens), n
        assert torch.equal(auto.depths[:, :n], fixed.depths), n
        assert torch.equal(auto.parents[:, : n + 1], fixed.parents), n
    adapter.close()


@torch.inference_mode()
def test_host_and_device_builds_draft_one_tree_on_exact_ties(reference_ops, monkeypatch):
    """Every draft log-prob tied (the drafter's final norm zeroed: every logit 0; two children a node, so the
    tree is deeper than one level and same-depth nodes of different parents tie): an eager CPU round's C++
    build and the device build a traced round runs draft the same tree, numbering included (one tie rule)."""
    import dflash.decoding.round as round_module

    monkeypatch.setattr(round_module, "tree_branching", lambda *args: 2)
    target, draft = pair()
    draft.norm.weight.zero_()
    trees = []
    for host in (True, False):
        adapter, rnd = _round(target, draft, 12, host_tree=host)
        assert rnd.host_tree == host  # an eager CPU round on the reference backend builds on the host by default
        rnd.draft()
        trees.append((rnd.tokens.clone(), rnd.depths.clone(), rnd.parents.clone()))
        adapter.close()
    (tokens, depths, parents), device = trees
    assert torch.equal(tokens, device[0]) and torch.equal(depths, device[1]) and torch.equal(parents, device[2])
    ranks = parents[0, 1:].tolist()
    assert ranks == sorted(ranks) and len(set(depths[0].tolist())) > 1  # parents in order, deeper than one level


def _masses(rnd):
    """The round's ``path_mass`` of its one sequence, out of the payload's fixed point."""
    return [m / MASS_SCALE for m in rnd.path_mass[0].tolist()]


def _reference_masses(rnd, own_logprob):
    """Per bucket, the sum of exp(path score) over the bucket's nodes (plain Python, parent by parent; the round's
    one sequence)."""
    parents = rnd.parents[0].tolist()
    score = [0.0]
    for i in range(1, rnd.N + 1):
        score.append(score[parents[i]] + own_logprob(i))
    return [sum(math.exp(score[i]) for i in range(1, n + 1)) for n in rnd.bucket_nodes]


@pytest.mark.parametrize("host_tree", [True, False])  # the C++ build's float64 scores; the device build's fp32
@torch.inference_mode()
def test_path_masses_are_the_path_probabilities(reference_ops, host_tree):
    target, draft = pair(block_size=7)  # D = 6: pointer jumping's last round covers depths 5-6 only partly
    adapter, rnd = _round(target, draft, [2, 5, 12, 40], host_tree=host_tree)
    rnd.draft()
    ids = torch.cat([rnd.last[:, None], rnd.mask_block], 1)
    out = draft.draft_block(adapter.embed(ids, raw_scale=draft.input_embedding_scale), rnd.ctx, rnd.ctx_count,
                            rnd.dcache)
    head = draft.head_hidden(out)[0, 1:]
    logprobs = torch.log_softmax(head.float() @ adapter.lm_head.weight.float().T, -1)
    tokens, depths = rnd.tokens[0].tolist(), rnd.depths[0].tolist()
    want = _reference_masses(rnd, lambda i: float(logprobs[depths[i - 1] - 1, tokens[i - 1]]))
    got = _masses(rnd)
    assert got == pytest.approx(want, abs=1e-5)
    assert all(a <= b + 1e-6 for a, b in zip(got, got[1:]))  # grows with the bucket
    assert all(0.0 <= m <= rnd.D for m in got)
    adapter.close()


@torch.inference_mode()
def test_path_masses_sum_every_ancestor_of_deep_trees(reference_ops):
    """The masses over trees as deep as the block allows (D = 6, 7 and 15), from the scores of either build (the
    host's float64, the device's fp32): every node's path sums all its ancestors' log-probs."""
    target, draft = pair()
    gen = torch.Generator().manual_seed(0)
    for block in (7, 8, 16):
        adapter, rnd = _round(target, tiny_draft(target, block_size=block, target_layer_ids=[0, 1]), [3, 9, 30])
        D, K = rnd.D, rnd.K
        lp = torch.cat([-0.001 * torch.rand(D, 1, generator=gen),  # rank 0 near certain: a path D deep first
                        -1 - 3 * torch.rand(D, K - 1, generator=gen)], 1).sort(dim=1, descending=True).values
        ids = torch.stack([torch.randperm(1000, generator=gen)[:K] for _ in range(D)])
        for on_device in (False, True):
            rnd._take_trees(dflash_kernels.build_tree(lp[None], ids[None], rnd.budget, on_device=on_device))
            assert int(rnd.depths.max()) == D, block
            tokens, depths = rnd.tokens[0].tolist(), rnd.depths[0].tolist()

            def own(i):
                d = depths[i - 1]
                return float(lp[d - 1, ids[d - 1].tolist().index(tokens[i - 1])])

            assert _masses(rnd) == pytest.approx(_reference_masses(rnd, own), rel=1e-5), (block, on_device)
        adapter.close()


@torch.inference_mode()
def test_path_masses_of_a_dflash2_tree(reference_ops):
    """A DFlash2 tree's node probability is the selector's, given the parent's candidate."""
    target, draft = pair(dflash2=True)
    adapter, rnd = _round(target, draft, [2, 5, 12])
    captured = {}
    real = dflash_kernels.selector_child_logprobs

    def spy(unary, candidates, *args):
        child = real(unary, candidates, *args)
        captured.update(child=child[0], candidates=candidates[0])  # the batch's one sequence
        return child

    import dflash.decoding.round as round_module
    orig = round_module.dflash_kernels.selector_child_logprobs
    round_module.dflash_kernels.selector_child_logprobs = spy
    try:
        rnd.draft()
    finally:
        round_module.dflash_kernels.selector_child_logprobs = orig
    child, cand = captured["child"], captured["candidates"].tolist()
    tokens, depths, parents = rnd.tokens[0].tolist(), rnd.depths[0].tolist(), rnd.parents[0].tolist()

    def own(i):
        d = depths[i - 1]
        j = cand[d - 1].index(tokens[i - 1])
        p = parents[i]
        slot = 0 if p == 0 else cand[d - 2].index(tokens[p - 1])
        return float(child[d - 1, slot, j])

    assert _masses(rnd) == pytest.approx(_reference_masses(rnd, own), abs=1e-5)
    adapter.close()


@torch.inference_mode()
def test_bucket_acceptance_is_each_prefix_trees_walk(reference_ops):
    target, draft = pair()
    adapter, rnd = _round(target, draft, [1, 2, 4, 9])
    rnd.snapshot()
    rnd.draft()
    host = rnd.verify(-1).tolist()  # the largest bucket verified
    accepted = rnd.payload.bucket_acceptance(host)
    assert accepted[-1] == len(rnd.payload.committed(host)) - 1
    for v, n in enumerate(rnd.bucket_nodes):  # the walk of each prefix tree, on the same target choices
        rnd.restore()
        rnd.draft()
        small = rnd.verify(v).tolist()
        assert len(rnd.payload.committed(small)) - 1 == accepted[v], (v, n)
    adapter.close()


# ------------------------------------------------------------------ generation
def cycle_buckets(monkeypatch):
    """Make the policy pick a new bucket every round (0, 1, 2, ... round robin)."""
    turn = iter(range(10 ** 6))

    def cycle(self, length=0):
        v = next(turn) % len(self.short)
        self.choices.append(v)
        return v

    monkeypatch.setattr(BudgetPolicy, "choose", cycle)


@pytest.mark.parametrize("mode", [False, "static"])
@pytest.mark.parametrize("dflash2", [False, True])
def test_auto_is_lossless(reference_ops, mode, dflash2):
    target, draft = pair(dflash2=dflash2)
    ref = greedy(target, 30, PROMPT)
    out = dflash.generate(target, draft, PROMPT, method="ddtree", max_new_tokens=30, tree_budget=[1, 3, 8, 20],
                          compile=mode)
    assert torch.equal(out.output_ids, ref)
    assert set(out.tree_sizes) <= {1, 3, 8, 20}


def test_every_bucket_choice_is_lossless(reference_ops, monkeypatch):
    """Whatever the policy picks (here: a new bucket every round), the tokens are the target's."""
    target, draft = pair()
    ref = greedy(target, 30, PROMPT)
    cycle_buckets(monkeypatch)
    out = dflash.generate(target, draft, PROMPT, method="ddtree", max_new_tokens=30, tree_budget=[1, 2, 5, 11])
    assert torch.equal(out.output_ids, ref)
    assert set(out.tree_sizes) == {1, 2, 5, 11}


def test_sampled_auto_runs(reference_ops):
    """Sampled rounds choose buckets too (each round's tree is verified by the same walk as a fixed budget's)."""
    target, draft = pair()
    kw = dict(method="ddtree", max_new_tokens=20, tree_budget=[2, 6], temperature=0.8, seed=5)
    out = dflash.generate(target, draft, PROMPT, **kw)
    assert out.num_new_tokens == 20 and set(out.tree_sizes) <= {2, 6}


def test_one_host_read_per_round_under_auto(reference_ops):
    from host_reads import reads_per_round
    target, draft = pair()
    result = {}

    def run():
        result["r"] = dflash.generate(target, draft, PROMPT, method="ddtree", max_new_tokens=16,
                                      tree_budget=[2, 4, 9], stage_timing=True)

    dflash.generate(target, draft, PROMPT, method="ddtree", max_new_tokens=4, tree_budget=[2, 4, 9])  # costs
    per_round, reads, marks = reads_per_round(run, "commit")
    assert len(marks) == result["r"].num_rounds >= 3
    assert max(per_round) == min(per_round) == 1, (per_round, reads)


def test_costs_are_measured_once_per_settings(reference_ops, monkeypatch):
    target, draft = pair()
    calls = []
    real = bucket_costs.measure_round_costs

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(bucket_costs, "measure_round_costs", counted)
    kw = dict(method="ddtree", max_new_tokens=6, tree_budget=[2, 5])
    first = dflash.generate(target, draft, PROMPT, **kw)
    second = dflash.generate(target, draft, PROMPT, **kw)
    assert len(calls) == 1
    assert first.compile_time > 0 and second.compile_time == 0
    dflash.generate(target, draft, PROMPT, method="ddtree", max_new_tokens=6, tree_budget=[2, 6])
    assert len(calls) == 2  # other buckets, other settings


def test_traced_auto_one_graph_per_bucket_and_no_recompile(reference_ops, trace_only, monkeypatch):
    from torch._dynamo.utils import counters
    target, draft = pair()
    ref = greedy(target, 30, PROMPT)
    cycle_buckets(monkeypatch)
    kw = dict(method="ddtree", max_new_tokens=30, tree_budget=[2, 5, 11], compile=True)
    out = dflash.generate(target, draft, PROMPT, **kw)
    assert torch.equal(out.output_ids, ref)
    assert set(out.tree_sizes) == {2, 5, 11}
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1 + 3  # the draft and one verify per bucket, compiled at set-up
    assert not counters["graph_break"]
    again = dflash.generate(target, draft, PROMPT, **kw)
    assert torch.equal(again.output_ids, ref)
    assert counters["stats"]["unique_graphs"] == graphs  # switching buckets round to round compiles nothing


def test_hybrid_target_auto_is_lossless(reference_ops):
    from tiny_models import tiny_hybrid_target
    target = tiny_hybrid_target("qwen3_5")
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
    ref = greedy(target, 20, PROMPT)
    for mode in (False, "static"):
        out = dflash.generate(target, draft, PROMPT, method="ddtree", max_new_tokens=20, tree_budget=[1, 3, 7],
                              compile=mode)
        assert torch.equal(out.output_ids, ref), mode


def test_dropin_takes_auto(reference_ops):
    target, draft = pair()
    ref = greedy(target, 12, PROMPT)
    state = dflash.apply(target, draft, method="ddtree", tree_budget="auto")
    try:
        assert state.loop_kwargs["tree_budget"] == AUTO_BUDGETS
        with torch.no_grad():
            out = target.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)
        assert torch.equal(out, ref)
    finally:
        dflash.unapply(target)


# ------------------------------------------------------------------ the policy
def test_monotone():
    assert monotone([1, 3, 2, 4]) == [1, 2.5, 2.5, 4]
    assert monotone([3, 2, 1]) == [2, 2, 2]
    assert monotone([1, 2]) == [1, 2]


def test_policy_picks_the_best_tokens_per_second():
    policy = BudgetPolicy([1.0, 1.2, 2.0])
    policy.start()
    assert policy.choose() == 1  # the middle bucket before any round
    policy.observe(1, [1, 2, 2], [1.4, 2.15, 2.69])
    # E = 1 + r * m; r = 1 for the buckets seen exactly here when the drafter's masses are right on average
    e = policy.expected()
    rates = [x / c for x, c in zip(e, policy.costs(0))]
    assert policy.choose() == max(range(3), key=rates.__getitem__)


def test_policy_opens_a_generation_with_the_last_ones_usual_bucket():
    policy = BudgetPolicy([1.0, 1.2, 2.0])
    policy.start()
    assert policy.choose() == 1  # nothing known: the middle bucket
    for _ in range(5):
        policy.observe(policy.choices[-1], [1, 1, 1], [0.2, 0.3, 0.35])
        policy.choose()
    assert policy.choices.count(0) > len(policy.choices) // 2  # low masses: the cheapest bucket wins
    policy.start()
    assert policy.choose() == 0  # the next text opens where the last one mostly was, not at the middle
    assert policy.fresh().choose() == 1  # a sampled generation's policy knows nothing learned


def test_policy_corrects_a_wrong_set_up_measurement_by_exploring():
    """The set-up measured bucket 1 cheaper than bucket 0, but its rounds take 1.3 s against bucket 0's 1.0 s:
    without trying bucket 0 again the policy would keep bucket 1 (both share the residual bucket 1's rounds
    teach); the runner-up's rounds every EXPLORE_EVERY choices show bucket 0's own cost, and it takes over."""
    from dflash.decoding.budget_policy import EXPLORE_EVERY

    policy = BudgetPolicy([1.0, 0.95])
    policy.start()
    seconds = [1.0, 1.3]
    for _ in range(8 * EXPLORE_EVERY):
        v = policy.choose()
        policy.observe(v, [1, 1], [1.0, 1.0], seconds=seconds[v])
    recent = policy.choices[-2 * EXPLORE_EVERY:]
    assert recent.count(0) > len(recent) // 2, recent
    # and a policy that is right from the start stays right, paying one round in EXPLORE_EVERY
    policy = BudgetPolicy([1.0, 1.3])
    policy.start()
    for _ in range(4 * EXPLORE_EVERY):
        v = policy.choose()
        policy.observe(v, [1, 1], [1.0, 1.0], seconds=[1.0, 1.3][v])
    assert policy.choices[1:].count(1) <= 4


def test_policy_calibration_follows_what_was_accepted():
    """A drafter twice too confident about the big tree: the ratio learned from rounds that show it halves its
    estimate, and the cheaper bucket wins."""
    policy = BudgetPolicy([1.0, 1.5])
    policy.start()
    for _ in range(300):
        policy.choose()
        policy.observe(1, [1, 1], [0.75, 1.6])  # the big bucket verified: it accepts 1 draft, as the small would
    r = policy.ratios()
    assert r[1] == pytest.approx(1 / 1.6, rel=0.1)
    assert r[0] == pytest.approx(1 / 0.75, rel=0.1)
    assert policy.choose() == 0  # (1 + 1) / 1.0 beats (1 + 1) / 1.5


def test_policy_costs_grow_with_the_committed_length():
    """Two measured lengths, interpolated (and extrapolated) linearly per bucket; each length's costs monotone."""
    policy = BudgetPolicy([1.0, 2.0, 1.5], [2.0, 4.0, 5.0], lengths=(10, 110))
    assert policy.measured(10) == pytest.approx([1.0, 1.75, 1.75])
    assert policy.measured(60) == pytest.approx([1.5, 2.875, 3.375])
    assert policy.measured(210) == pytest.approx([3.0, 6.25, 8.25])
    assert policy.measured(0) == pytest.approx([1.0, 1.75, 1.75])  # never below the shorter length's
    # cheap at a short prefix, dear at a long one: the choice follows the length
    policy = BudgetPolicy([1.0, 1.1], [1.0, 3.0], lengths=(0, 100))
    policy.start()
    policy.observe(0, [2, 2], [2.0, 4.0])
    assert policy.choose(0) == 1 and policy.choose(100) == 0


def test_policy_cost_residuals_shared_then_per_bucket():
    """The rounds' own seconds correct the measurement: a residual shared by all buckets, and per bucket once it
    has rounds of its own (shrunk toward the shared one while it has few)."""
    policy = BudgetPolicy([1.0, 2.0])
    policy.start()
    policy.observe(0, [1, 1], [0.5, 0.6], seconds=1.2)
    assert policy.costs(0) == pytest.approx([1.2, 2.2])  # bucket 1 has no rounds: the shared residual
    for _ in range(200):
        policy.observe(1, [1, 1], [0.5, 0.6], seconds=3.0)
    assert policy.costs(0)[1] == pytest.approx(3.0, abs=0.05)  # its own rounds dominate
    kept = list(policy.ratios())
    policy.start()  # a new generation: masses start over, calibration kept
    assert policy.mass == [] and policy.ratios() != [1.0, 1.0] and policy.ratios() == kept


def test_policy_a_stalled_round_does_not_lock_its_bucket_out():
    """A round the machine stalled (ten times its cost, as when another process takes the core) moves the
    residuals as one COST_CLIP past the expected cost would: the cheaper bucket keeps winning, where an unclipped
    stall made it look dearer than the other for the many rounds until the runner-up's exploration came back."""
    from dflash.decoding.budget_policy import COST_CLIP

    policy = BudgetPolicy([1.0, 1.2])
    policy.start()
    seconds = [1.0, 1.2]
    for i in range(40):  # both buckets have rounds of their own (their own residuals weigh most)
        policy.observe(i % 2, [1, 1], [1.0, 1.1], seconds=seconds[i % 2])
    policy.observe(0, [1, 1], [1.0, 1.1], seconds=10.0)  # the stall
    for _ in range(30):
        v = policy.choose(0)  # bucket 0 the better by 5% at the true costs
        policy.observe(v, [1, 1], [1.0, 1.1], seconds=seconds[v])
    assert policy.choices == [0] * 30, policy.choices
    assert policy.costs(0)[0] < 1.0 + COST_CLIP


def test_policy_refuses_bad_costs():
    with pytest.raises(ValueError, match="costs must be positive"):
        BudgetPolicy([])
    with pytest.raises(ValueError, match="costs must be positive"):
        BudgetPolicy([1.0, 0.0])
    with pytest.raises(ValueError, match="long_costs must be positive"):
        BudgetPolicy([1.0, 2.0], [1.0, -2.0], lengths=(0, 5))
    with pytest.raises(ValueError, match="one value per bucket"):
        BudgetPolicy([1.0, 2.0], [1.0], lengths=(0, 5))
    with pytest.raises(ValueError, match="two increasing committed lengths"):
        BudgetPolicy([1.0, 2.0], [1.0, 2.0], lengths=(5, 5))


def test_costs_are_measured_at_two_lengths(reference_ops):
    """The set-up measurement: the empty caches' length and the longest a round of the largest bucket allows;
    the round's state and the caches' lengths are put back."""
    target, draft = pair()
    adapter, rnd = _round(target, draft, [2, 6])
    rnd.thaw()
    lengths, short, long = bucket_costs.measure_round_costs(rnd, repeats=1)
    assert lengths[0] == 1 and lengths[1] == 1 + min(rnd.cache.max_len - rnd.T, rnd.dcache.max_len - rnd.B) - 1
    assert len(short) == len(long) == 2 and all(c > 0 for c in short + long)
    assert rnd.cache.length == rnd.dcache.length == 0 and int(rnd.cache.length_t) == 0
    adapter.close()


def test_payload_masses_round_trip(reference_ops):
    target, draft = pair()
    adapter, rnd = _round(target, draft, [2, 6])
    with torch.inference_mode():
        rnd.draft()
        host = rnd.verify(0).tolist()
    assert len(host) == rnd.payload.size
    assert rnd.payload.path_masses(host) == pytest.approx(_masses(rnd), abs=1e-6)
    adapter.close()


def test_auto_budget_benchmark_runs_at_smoke_size(capsys, tmp_path, reference_ops):
    """``python bench/auto_budget.py`` (the README's table): one prompt per set, a few tokens (on the reference
    ops: the script's own concern is its table, the kernels are tested apart; under the interpreter it took
    two minutes)."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "auto_budget.py"
    spec = importlib.util.spec_from_file_location("auto_budget", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    out = tmp_path / "auto.json"
    try:
        module.main(["--prompts", "1", "--new-tokens", "6", "--repeats", "1", "--budgets", "2,4",
                     "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    assert set(report) == {"code", "prose"}
    for name in ("code", "prose"):
        assert all(r["equal_to_ar"] for r in report[name]["table"].values())
    assert "| ddtree auto |" in capsys.readouterr().out


def test_prose_prompts_end_before_text():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "auto_budget.py"
    spec = importlib.util.spec_from_file_location("auto_budget_prose", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    prompts = module.prose_prompts(4, prompt_len=64)
    assert len(prompts) == 4 and all(len(p) == 64 for p in prompts)
    assert all(p[-1] == ord("\n") for p in prompts)  # each ends at a line start: the prose line follows


def test_sampled_auto_is_reproducible_under_a_seed(reference_ops, monkeypatch):
    """A sampled generation chooses its buckets from the set-up measurement and its own rounds only (no wall-clock
    residuals, nothing carried over), so the same seed gives the same tokens however the clock runs."""
    import itertools
    import time as time_module

    target, draft = pair()
    kw = dict(method="ddtree", max_new_tokens=24, tree_budget=[2, 5, 11], temperature=0.9, seed=11)
    dflash.generate(target, draft, PROMPT, **kw)  # the set-up measurement
    ticks = itertools.count()
    a = dflash.generate(target, draft, PROMPT, **kw)
    monkeypatch.setattr(time_module, "perf_counter", lambda: next(ticks) * 0.37)  # a very different clock
    b = dflash.generate(target, draft, PROMPT, **kw)
    assert torch.equal(a.output_ids, b.output_ids) and a.tree_sizes == b.tree_sizes
