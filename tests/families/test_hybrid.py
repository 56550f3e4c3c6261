"""Hybrid targets (Qwen3.5, Qwen3-Next, Qwen3.5-MoE): lossless ar / DFlash / DDTree with exact state rollback.

Tiny random models of transformers' own classes (``Qwen3_5ForCausalLM``,
``Qwen3NextForCausalLM``, ``Qwen3_5MoeForCausalLM``; tests/tiny_models.py
``tiny_hybrid_target``: 4 layers alternating Gated-DeltaNet and full
attention, hidden 32, vocabulary 64, linear heads 2 (key) / 4 (value) of 8,
conv kernel 4; transformers' torch fallbacks for the linear layers). What is
proved, and by which test:

* lossless: ``ar``, ``dflash`` (block sizes 4, 8, 16, a scheduled drafter that
  rejects at every block position once and accepts a whole block) and
  ``ddtree`` (budgets 1, 16 and 72 > the vocabulary, branching trees whose
  accepted path leaves the first-child chain) equal ``target.generate()``
  greedy token for token, on the reference ops and on the Triton kernels
  (interpreter): ``test_hybrid_is_lossless``;
* the committed states: after a chain verify and ``commit(n)`` (every ``n``),
  and after a tree verify and ``compact_advance`` of a branch (eager and round passes),
  every linear layer's conv window and recurrent state equal transformers'
  own ``DynamicCache`` after decoding the same tokens one by one:
  ``test_chain_commit_*``, ``test_tree_commit_*``;
* the verify passes' logits equal the model's own forward on the same
  sequences (chain, and both branches of a tree): ``test_adapter_forward_*``;
* the cache protocol (5.17 reads ``cache.layers[i].conv_states[0]``, 5.24
  calls ``get_conv_state``): views alias our buffers; prefill windows equal
  transformers': ``test_cache_speaks_*``;
* sampling is reproducible under a seed; the model is untouched after a
  generation; bad uses are errors with a message; Qwen3-Next's MoE runs one
  host read per round; sliding-window drafter layers work on a hybrid target.
"""

import inspect

import pytest
import torch
from transformers import DynamicCache

import dflash
import dflash_kernels
from dflash.target import TargetAdapter, UnsupportedTargetFeature
from dflash.target.hybrid import HybridKVCache
from zoo import PROMPT, greedy  # the family prompt; its greedy text under inference mode
from tiny_models import RiggedDraft, ScheduledDraft, tiny_draft, tiny_hybrid_target

VOCAB = 64
FAMILIES = ("qwen3_5", "qwen3_next")
STATE_TOL = dict(atol=2e-5, rtol=1e-4)  # fp32: our passes vs transformers' (SDPA vs masked attention upstream)


def backend(name):
    if name == "triton" and "triton" not in dflash_kernels.available_backends(torch.device("cpu")):
        pytest.skip("Triton cannot run here (no GPU and TRITON_INTERPRET is off)")
    return dflash_kernels.force_backend(name)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def target(family):
    return tiny_hybrid_target(family, vocab=VOCAB)


def _hf_cache_kw(model) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def hf_decoded_cache(model, prompt, tokens):
    """transformers' own DynamicCache after prefilling ``prompt`` and decoding ``tokens`` one at a time."""
    kw = _hf_cache_kw(model)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(torch.tensor([prompt]), use_cache=True, **{kw: cache})
        for t in tokens:
            model(torch.tensor([[t]]), use_cache=True, **{kw: cache})
    return cache


def assert_states_equal(ours: HybridKVCache, theirs, what=""):
    for layer, slot in ours.linear.slots.items():
        torch.testing.assert_close(ours.linear.conv[slot, 0].t(), theirs.layers[layer].conv_states[0][0], **STATE_TOL,
                                   msg=lambda m: f"{what} layer {layer} conv window: {m}")
        torch.testing.assert_close(ours.linear.state[slot, 0], theirs.layers[layer].recurrent_states[0][0], **STATE_TOL,
                                   msg=lambda m: f"{what} layer {layer} recurrent state: {m}")


# ----------------------------------------------------------------------------------------- lossless


def _walks_off_the_chain(result) -> bool:
    """Some round accepted a path that is not the first-child chain 0, 1, 2, ... (a real branch was taken)."""
    return any(t["accepted"].tolist() != list(range(t["accepted"].numel())) for t in result.trees)


def _chain_schedule(B):
    """Drafts a scheduled round accepts: B-1 (a whole block), then 0, 1, ..., B-2 (a rejection at every position)."""
    return [B - 1] + list(range(B - 1))


def _check_dflash(target, ref, B, schedule, what, prompt=PROMPT):
    n = sum(schedule) + len(schedule) + 2
    base = tiny_draft(target, block_size=B, target_layer_ids=[0, 1])
    res = dflash.generate(target, ScheduledDraft(base, target.lm_head.weight, ref, schedule=schedule), prompt,
                          max_new_tokens=n)
    assert torch.equal(res.output_ids, ref[:, : len(prompt) + n]), f"{what} dflash B={B} differs from generate()"
    assert res.acceptance_lengths[: len(schedule)] == [a + 1 for a in schedule], res.acceptance_lengths


def _check_ddtree(target, ref, budget, n, what, B=8, prompt=PROMPT):
    vocab = target.config.vocab_size
    if budget > vocab:  # near-flat drafter logits: the tree holds every depth-1 token, each round accepts
        tree_draft = tiny_draft(target, block_size=B, target_layer_ids=[0, 1])
        with torch.no_grad():
            tree_draft.norm.weight.mul_(0.02)
    else:  # the right token ranked second about half the time: the walk takes non-first children
        tree_draft = RiggedDraft(tiny_draft(target, block_size=B, target_layer_ids=[0, 1]), target.lm_head.weight,
                                 ref, p_right=0.5, second_right=True)
    res = dflash.generate(target, tree_draft, prompt, method="ddtree", max_new_tokens=n, tree_budget=budget,
                          return_trees=True)
    assert torch.equal(res.output_ids, ref[:, : len(prompt) + n]), f"{what} ddtree budget={budget} differs"
    if 1 < budget <= vocab:
        assert _walks_off_the_chain(res), "no round accepted a branch: the tree states were not exercised"
    if budget > vocab:
        assert min(res.acceptance_lengths[:-1]) >= 2, res.acceptance_lengths


def test_hybrid_is_lossless(family, target):
    """Reference ops: ar; dflash at B = 4, 8, 16 rejecting at every block position and accepting whole blocks;
    ddtree at budgets 1, 16 and 72 (> the vocabulary)."""
    P = len(PROMPT)
    ref = greedy(target, sum(_chain_schedule(16)) + 16 + 2)
    with backend("reference"):
        ar = dflash.generate(target, None, PROMPT, method="ar", max_new_tokens=32)
        assert torch.equal(ar.output_ids, ref[:, : P + 32]), f"{family} ar differs from generate()"
        for B in (4, 8, 16):
            _check_dflash(target, ref, B, _chain_schedule(B), family)
        for budget in (1, 16, 72):
            _check_ddtree(target, ref, budget, 32, family)


#: What each family runs on the Triton kernels (the interpreter costs ~30 ms per kernel op on this CPU: every
#: rejection position of each block size is covered by one family or the other at B = 4, 8, and by the reference
#: test at every B): (dflash (B, schedule) pairs, ddtree budgets; 20 > the vocabulary of 16).
TRITON_PLAN = {
    "qwen3_5": ([(4, _chain_schedule(4)), (8, [7, 0, 3, 6]), (16, [15, 0, 9])], (1, 16, 20)),
    "qwen3_next": ([(4, [3, 0, 2]), (8, _chain_schedule(8)), (16, [15, 4])], (1, 16, 20)),
}


def test_hybrid_is_lossless_on_the_triton_kernels(family):
    """The same on the Triton kernels (interpreter): a 2-layer target (one Gated-DeltaNet, one attention layer),
    vocabulary 16 so that a budget of 20 exceeds it; ar, and the plan above."""
    backend("triton")
    target = tiny_hybrid_target(family, vocab=16, layers=2, linear_k_heads=1, linear_v_heads=2)
    chains, budgets = TRITON_PLAN[family]
    prompt = [t % 16 for t in PROMPT]
    ref = greedy(target, 40, prompt=prompt)
    P = len(prompt)
    with backend("triton"):
        ar = dflash.generate(target, None, prompt, method="ar", max_new_tokens=6)
        assert torch.equal(ar.output_ids, ref[:, : P + 6]), f"{family} ar differs from generate()"
        for B, schedule in chains:
            _check_dflash(target, ref, B, schedule, family, prompt=prompt)
        for budget in budgets:
            _check_ddtree(target, ref, budget, 8, family, B=4, prompt=prompt)


def test_qwen3_5_moe_is_lossless():
    """Qwen3.5-MoE (35B-A3B, 122B-A10B): Gated-DeltaNet layers with routed + shared experts on every layer."""
    target = tiny_hybrid_target("qwen3_5_moe", vocab=VOCAB)
    ref = greedy(target, 24)
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
    with backend("reference"):
        for method, d in (("ar", None), ("dflash", RiggedDraft(draft, target.lm_head.weight, ref, p_right=0.8)),
                          ("ddtree", RiggedDraft(draft, target.lm_head.weight, ref, p_right=0.5, second_right=True))):
            res = dflash.generate(target, d, PROMPT, method=method, max_new_tokens=24)
            assert torch.equal(res.output_ids, ref), method


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_sampling_is_reproducible_under_a_seed(family, target, method):
    draft = RiggedDraft(tiny_draft(target, block_size=4, target_layer_ids=[0, 1]), target.lm_head.weight,
                        greedy(target, 24), p_right=0.7)
    kw = dict(method=method, max_new_tokens=16, temperature=0.9)

    def run(seed):
        # the rigged drafter draws its mistakes from its own generator: rewound, it drafts the same, so the
        # output is a function of the seed (under the rejection rule the committed tokens depend on the drafts)
        draft.rng.manual_seed(0)
        return dflash.generate(target, draft, PROMPT, seed=seed, **kw).output_ids

    with backend("reference"):
        a, b = run(3), run(3)
        c = [run(s) for s in (4, 5, 6)]
    assert torch.equal(a, b)
    assert any(not torch.equal(a, x) for x in c), "different seeds gave the same samples"


# ----------------------------------------------------------------------------------------- states


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_chain_commit_leaves_the_state_of_sequential_decoding(family, target, backend_name):
    """Verify 6 tokens, commit n of them: every linear layer holds transformers' state after exactly n tokens."""
    block = [30, 31, 32, 40, 41, 42]
    P = len(PROMPT)
    with backend(backend_name), torch.inference_mode(), TargetAdapter(target) as adapter:
        for n in range(1, len(block) + 1):
            cache = adapter.new_cache(32)
            adapter.prefill(torch.tensor(PROMPT), cache)
            before = cache.linear.state.clone()
            adapter.forward(torch.tensor(block), torch.arange(P, P + len(block)), cache)
            assert torch.equal(cache.linear.state, before), "a verify pass changed the committed state"
            cache.commit(n)
            assert cache.length == P + n
            assert_states_equal(cache, hf_decoded_cache(target, PROMPT, block[:n]), f"commit({n})")


TREE_PARENTS = [-1, 0, 1, 0, 3, 4, 3, 1]  # root; chain 1-2; a branch 3-4-5 with a sibling 6 of 4; 7 a child of 1
TREE_TOKENS = [12, 30, 31, 7, 9, 11, 13, 44]


def _tree(adapter, cache):
    parents = torch.tensor(TREE_PARENTS)
    depths = torch.zeros(len(TREE_PARENTS), dtype=torch.long)
    for i, p in enumerate(TREE_PARENTS[1:], 1):
        depths[i] = depths[p] + 1
    bits = dflash_kernels.ancestor_bits(parents)
    start = cache.length
    hidden = adapter.forward(torch.tensor(TREE_TOKENS), start + depths, cache, tree_bits=bits, tree_parents=parents)
    return hidden


TREE_PATHS = [[0], [0, 1, 2], [0, 3, 4, 5], [0, 3, 6], [0, 1, 7]]


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_tree_commit_leaves_the_state_of_the_path(family, target, backend_name):
    """After a tree verify, keeping a root -> node path (the compaction with a padded path and a device count)
    leaves the states transformers holds after decoding that path's tokens: after an eager pass and after a
    round pass on the frozen cache (device lengths)."""
    prompt = PROMPT[:-1]  # the root (TREE_TOKENS[0]) is the last committed token, not yet in the cache
    cases = [(path, side) for path in TREE_PATHS for side in ("eager", "round")]
    if backend_name == "triton":  # the interpreter is slow: each path once, both sides on the deepest branch
        cases = [(p, "round" if i % 2 else "eager") for i, p in enumerate(TREE_PATHS)] + [([0, 3, 4, 5], "eager")]
    with backend(backend_name), torch.inference_mode(), TargetAdapter(target) as adapter:
        for path, side in cases:
            cache = adapter.new_cache(32)
            adapter.prefill(torch.tensor(prompt), cache)
            if side == "round":
                cache.freeze()
            _tree(adapter, cache)
            padded = torch.tensor(path + [0] * (5 - len(path)))  # the DDTree walk's padded path and its count
            cache.compact_advance(padded, torch.tensor([len(path)]))
            cache.mirror(len(prompt) + len(path))
            assert int(cache.length_t) == len(prompt) + len(path)
            assert cache.length == len(prompt) + len(path)
            want = hf_decoded_cache(target, prompt, [TREE_TOKENS[i] for i in path])
            assert_states_equal(cache, want, f"path {path} ({side})")


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_adapter_forward_is_the_models_forward(family, target, backend_name):
    """Prefill, a chain verify and a tree verify through our passes vs the model's own forward."""
    ids = torch.tensor(PROMPT + [30, 31, 32, 40, 41, 42])
    P = len(PROMPT)
    with torch.inference_mode():
        own = target(ids[None], output_hidden_states=True)
    want_logits, want_hidden = own.logits[0], own.hidden_states[1][0]
    other = torch.cat([ids[: P + 4], torch.tensor([7, 9])])  # the tree's other branch as a sequence
    with torch.inference_mode():
        other_logits = target(other[None]).logits[0]
    with backend(backend_name), torch.inference_mode(), TargetAdapter(target, [0]) as adapter:
        cache = adapter.new_cache(64)
        last, _ = adapter.prefill(ids[:P], cache)
        torch.testing.assert_close(adapter.logits(last), want_logits[P - 1 : P], atol=1e-4, rtol=1e-4)
        h = adapter.forward(ids[P : P + 3], torch.arange(P, P + 3), cache)
        torch.testing.assert_close(adapter.logits(h), want_logits[P : P + 3], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(adapter.captured_layer(0), want_hidden[P : P + 3], atol=1e-4, rtol=1e-4)
        cache.commit(3)
        # tree: root + two branches; the branch [root, a, b] is the model's sequence
        parents = torch.tensor([-1, 0, 1, 0, 3])
        tokens = torch.tensor([ids[P + 3], ids[P + 4], ids[P + 5], 7, 9])
        depths = torch.tensor([0, 1, 2, 1, 2])
        bits = dflash_kernels.ancestor_bits(parents)
        h = adapter.forward(tokens, P + 3 + depths, cache, tree_bits=bits, tree_parents=parents)
        torch.testing.assert_close(adapter.logits(h[:3]), want_logits[P + 3 : P + 6], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(adapter.logits(h[[0, 3, 4]]), other_logits[P + 3 :], atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------------- protocol


def test_cache_speaks_transformers_linear_attention_protocol(family, target):
    """The model's own Gated-DeltaNet forward on our cache (prefill chunks, one-token steps) leaves transformers'
    own states; 5.17's direct reads (``layers[i].conv_states[0]`` ...) alias the buffers 5.24's getters return."""
    cont = [30, 31, 32]
    want = hf_decoded_cache(target, PROMPT, cont)
    with backend("reference"), torch.inference_mode(), TargetAdapter(target) as adapter:
        cache = adapter.new_cache(32)
        layer = next(iter(cache.linear.slots))
        assert not cache.has_previous_state(layer, state_idx=0) and cache.get_conv_state(layer) is None
        adapter.prefill(torch.tensor(PROMPT), cache, chunk_size=5)  # three chunks: pad, then concatenations
        for i, t in enumerate(cont):
            adapter.forward(torch.tensor([t]), torch.tensor([len(PROMPT) + i]), cache)  # an AR step: in place
            cache.commit(1)
        assert_states_equal(cache, want, "prefill + steps")
        view = cache.layers[layer]
        assert cache.has_previous_state(layer, state_idx=0) and view.record_past is False
        assert not cache.is_recording_past(layer)
        for a, b in ((view.conv_states[0], cache.get_conv_state(layer, state_idx=0)),
                     (view.recurrent_states[0], cache.get_recurrent_state(layer, state_idx=0))):
            assert a.data_ptr() == b.data_ptr()
        assert view.conv_states[0].shape == (1, cache.linear.shape.channels, cache.linear.shape.kernel)
        assert view.conv_states[0].data_ptr() == cache.linear.conv[view.slot].data_ptr()
    # the attention layers hold K/V, the linear layers none: the buffer has one slot per attention layer
    n_attn = sum(t != "linear_attention" for t in target.config.layer_types)
    assert cache.kv.shape[0] == n_attn


def test_the_model_is_untouched_after_generate(family, target):
    x = torch.tensor([PROMPT])
    with torch.inference_mode():
        before = target(x).logits
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
    with backend("reference"):
        dflash.generate(target, draft, PROMPT, method="ddtree", max_new_tokens=6, tree_budget=5)
        dflash.generate(target, draft, PROMPT, max_new_tokens=6)
    assert all("forward" not in layer.linear_attn.__dict__ for layer in target.model.layers
               if hasattr(layer, "linear_attn"))
    with torch.inference_mode():
        assert torch.equal(before, target(x).logits)


def test_family_table_resolves(family, target):
    with TargetAdapter(target) as adapter:
        spec = adapter.spec
        assert spec.family.known and spec.family.linear_attention
        assert spec.linear_layers == [0, 2] and adapter.windows == [None] * 4
        assert spec.rope_sections == (3 if family == "qwen3_5" else 0)
        assert adapter.hybrid and not adapter.fuse_norm  # (1 + w) RMSNorm: applied as the module
        shape = adapter.linear_shape
        assert (shape.num_k_heads, shape.num_v_heads, shape.head_k_dim, shape.kernel) == (2, 4, 8, 4)


# ----------------------------------------------------------------------------------------- errors


def test_bad_uses_are_errors_with_a_message(target):
    P = len(PROMPT)
    with backend("reference"), torch.inference_mode(), TargetAdapter(target) as adapter:
        cache = adapter.new_cache(32)
        adapter.prefill(torch.tensor(PROMPT), cache)
        adapter.forward(torch.tensor([3]), torch.tensor([P]), cache)  # a one-row pass advances in place
        with pytest.raises(RuntimeError, match="cannot roll them back"):
            cache.commit(0)
        cache.commit(1)
        with pytest.raises(RuntimeError, match="no forward since the last commit"):
            cache.commit(1)
        with pytest.raises(ValueError, match="cannot crop its linear-attention states"):
            cache.crop(P - 2)
        parents = torch.tensor([-1, 0])
        with pytest.raises(ValueError, match="needs tree_parents"):
            adapter.forward(torch.tensor([3, 4]), torch.tensor([P + 1, P + 2]), cache,
                            tree_bits=dflash_kernels.ancestor_bits(parents))
        with pytest.raises(TypeError, match="HybridKVCache"):
            from dflash.target import TargetKVCache
            adapter.forward(torch.tensor([3, 4]), torch.tensor([P + 1, P + 2]),
                            TargetKVCache(target.config, 32, dtype=torch.float32, device="cpu"))
        adapter.forward(torch.tensor([3, 4]), torch.tensor([P + 1, P + 2]), cache)  # a verify pass: droppable
        cache.crop(cache.length)
        adapter.forward(torch.tensor([3]), torch.tensor([P + 1]), cache)  # in place: not droppable
        with pytest.raises(ValueError, match="advanced them in place"):
            cache.crop(cache.length)
        cache.crop(0)  # starting over is allowed: zero states
        assert cache.length == 0 and not cache.linear.state.any() and not cache.linear.conv.any()


def test_a_linear_layer_of_an_unknown_class_is_refused():
    target = tiny_hybrid_target("qwen3_5", vocab=VOCAB)

    class OtherMixer(torch.nn.Module):
        layer_idx = 0

    target.model.layers[0].linear_attn = OtherMixer()
    with pytest.raises(UnsupportedTargetFeature, match="linear-attention layer"):
        TargetAdapter(target)


# ----------------------------------------------------------------------------------------- drafter, MoE


def test_sliding_window_drafter_layers_on_a_hybrid_target(target):
    """Published hybrid drafters declare sliding-window layers (Qwen3.6: [S, S, S, S, F], window 2048): a drafter
    with ``layer_types`` and a window shorter than the context drafts on a hybrid target, losslessly."""
    types = ["sliding_attention"] * 4 + ["full_attention"]
    draft = tiny_draft(target, block_size=4, layers=5, target_layer_ids=[0, 1], layer_types=types, sliding_window=6)
    assert [layer.sliding_window for layer in draft.layers] == [6, 6, 6, 6, None]
    ref = greedy(target, 24)
    with backend("reference"):
        for method in ("dflash", "ddtree"):
            assert torch.equal(dflash.generate(target, draft, PROMPT, method=method, max_new_tokens=24).output_ids,
                               ref)


def test_qwen3_next_moe_runs_one_host_read_per_round():
    """Qwen3-Next loaded with transformers' eager experts (a host read per MoE layer) runs grouped experts while
    the adapter is open; its shared expert and router read nothing: one host read per round."""
    from host_reads import reads_per_round

    target = tiny_hybrid_target("qwen3_next", vocab=VOCAB, experts="eager")
    ref = greedy(target, 12)
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
    out = {}

    def run():
        out["r"] = dflash.generate(target, draft, PROMPT, method="ddtree", max_new_tokens=12, tree_budget=6)

    with backend("reference"):
        per_round, reads, _ = reads_per_round(run, "commit")
    assert max(per_round) <= 1, f"host reads per round {per_round}: {reads}"
    assert torch.equal(out["r"].output_ids, ref)
    assert target.config._experts_implementation == "eager"


# ----------------------------------------------------------------------------------------- the GPU check script


def _load_hybrid_check():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "gpu_hybrid_check.py"
    spec = importlib.util.spec_from_file_location("bench_gpu_hybrid_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_gpu_hybrid_check_runs_at_tiny_shapes(tmp_path, capsys):
    check = _load_hybrid_check()
    with backend("reference"):
        assert check.main(["--device", "cpu", "--tiny", "--json", str(tmp_path / "h.json")]) == 0
    out = capsys.readouterr().out
    assert "every check matches" in out and "chain rollback commit" in out and "tree commit" in out
    import json
    report = json.loads((tmp_path / "h.json").read_text())
    assert all(c["ok"] for c in report["checks"]) and "decode step" in report["latency_s"]
    # the analytic bytes at Qwen3.5-27B shapes: a 3 MiB fp32 state, 16 checkpoints 48 MiB
    b = check.rollback_bytes(check.QWEN35_27B, 16, 64, 7)
    assert b["state_bytes"] == 3 * 2 ** 20 and b["checkpoint_chain"] == 48 * 2 ** 20


def test_gpu_hybrid_check_fails_when_the_rollback_is_skipped(monkeypatch, capsys):
    """A commit that keeps the pre-verify state (no replay) must be caught by the script's state checks."""
    check = _load_hybrid_check()
    monkeypatch.setattr(HybridKVCache, "commit", lambda self, n: setattr(self, "length", self.length + int(n)))
    with backend("reference"):
        assert check.main(["--device", "cpu", "--tiny", "--reps", "1"]) == 1
    assert "FAIL chain commit" in capsys.readouterr().err


def test_training_capture_on_a_hybrid_target(target):
    """The trainer's target pass (crop(0), one causal pass of the whole sequence, never committed) on a reused
    hybrid cache gives the model's own hidden states every time."""
    from dflash.training.train import capture_target

    with torch.inference_mode():
        seqs = [torch.tensor(PROMPT), torch.tensor(PROMPT[::-1] + [7])]
        wants = [target(s[None], output_hidden_states=True).hidden_states for s in seqs]
    with backend("reference"), torch.inference_mode(), TargetAdapter(target, [1, 2]) as adapter:
        cache = adapter.new_cache(32)
        for _ in range(2):
            for s, want in zip(seqs, wants):  # layer k's output is hidden_states[k + 1]
                cap = capture_target(adapter, s, 1, 2, cache)
                torch.testing.assert_close(cap.context, want[2][0], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(cap.logit_hidden, want[3][0], atol=1e-4, rtol=1e-4)
