"""Every mainstream decoder family as a target: lossless against its own ``generate()``, on both backends.

Tiny random models of each family's own transformers class (fp32, 2 layers,
hidden 32, vocabulary 64; tests/tiny_models.py ``tiny_family_target``):
windows of 5 positions with 12-token prompts and 16-24 new tokens, Gemma
softcaps of 1.5 (scores) and 3.0 (logits), gpt-oss sinks of a few units, MoE
with 4 experts (top-2). For each, ``ar``, ``dflash`` (a rigged drafter: long
acceptances) and ``ddtree`` (a tree budget of 72 > the vocabulary, so every
round accepts a tree node) equal ``target.generate()`` greedy token for token,
on the reference ops and on the Triton kernels (interpreter on a CPU), while
the model's own attention function is made to fail if it is ever called.

| family (transformers class)      | what the family adds                                       | lossless | proved by |
|----------------------------------|------------------------------------------------------------|----------|-----------|
| Llama (LlamaForCausalLM)         | the generic shape                                          | yes | A, B, C |
| Qwen2 (Qwen2ForCausalLM)         | windows per ``layer_types``                                | yes | A, B, C |
| Qwen3 (Qwen3ForCausalLM)         | q/k norms, windows per ``layer_types``                     | yes | A, B, C |
| Mistral (MistralForCausalLM)     | ``sliding_window`` on every layer (no ``layer_types``)     | yes | A, B, C |
| Phi-3 (Phi3ForCausalLM)          | fused qkv, ``sliding_window`` on every layer               | yes | A, B, C |
| Gemma2 (Gemma2ForCausalLM)       | attention + final-logit softcaps, ``query_pre_attn_scalar``, scaled embeddings, (1+w) norms | yes | A, B, C, D |
| Gemma3 (Gemma3ForCausalLM)       | rope per layer type, 5:1 local/global, final softcap, q/k norms | yes | A, B, C, D |
| Qwen3-MoE (Qwen3MoeForCausalLM)  | MoE experts, windows on every layer                        | yes | A, B, C, E |
| gpt-oss (GptOssForCausalLM)      | attention sinks, alternating windows, MoE with biases, yarn rope | yes | A, B, C, E |

A: ``test_family_is_lossless`` (reference and triton) and ``test_family_batch_rows_are_lossless`` (a left-padded
batch of prompts of different lengths, each row its own greedy text; the hybrid families Qwen3.5, Qwen3-Next and
Qwen3.5-MoE too: ``test_hybrid_family_batch_rows_are_lossless``, tests/families/test_hybrid.py for the rest of them); B: ``test_adapter_forward_is_the_models_forward``
(prefill + chain verify + tree verify hidden states and logits vs the model's own forward);
C: ``test_family_table_resolves`` and ``test_the_model_is_untouched_after_generate``;
D: ``test_sampling_with_a_final_softcap_matches_the_softcapped_distribution``;
E: ``test_moe_experts_run_without_a_host_read_per_layer``.
Refusals: ``test_unsupported_features_are_refused_by_name``; unknown families:
``test_unknown_families_of_the_generic_shape_work``. The property-based fuzz is tests/families/test_family_fuzz.py.
Gemma 4 and MiMo-V2-Flash (K/V shapes per layer, per-layer inputs, KV sharing): tests/families/test_per_layer_geometry.py.
"""

import contextlib
import sys
from unittest import mock

import pytest
import torch
from transformers import AttentionInterface

import dflash
import dflash_kernels
from dflash.target import TargetAdapter, UnsupportedTargetFeature
from dflash.target import families
from zoo import PROMPT, greedy  # the family prompt; its greedy text under inference mode
from tiny_models import (ATTN_SOFTCAP, FAMILY_NAMES, FINAL_SOFTCAP, HYBRID_NAMES, RiggedDraft, tiny_draft,
                         tiny_family_target, tiny_hybrid_target)

VOCAB = 64
BUDGET = 72  # > VOCAB: every depth-1 token can enter the tree


def backend(name):
    if name == "triton" and "triton" not in dflash_kernels.available_backends(torch.device("cpu")):
        pytest.skip("Triton cannot run here (no GPU and TRITON_INTERPRET is off)")
    return dflash_kernels.force_backend(name)


@contextlib.contextmanager
def forbid_own_attention(target):
    """Make the implementation the model was loaded with fail if one of our passes reaches it (the check against
    the model's own forward, which runs it on purpose, is done first: its verdict is kept per model)."""
    TargetAdapter(target).close()
    own = mock.Mock(side_effect=AssertionError("the model's own attention ran during our pass"))
    impl = target.config._attn_implementation
    modeling = sys.modules[type(target).__module__]
    with mock.patch.dict(AttentionInterface._global_mapping, {impl: own} if impl != "eager" else {}), \
            mock.patch.object(modeling, "eager_attention_forward", own):
        yield own


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def target(family):
    return tiny_family_target(family, vocab=VOCAB)


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_family_is_lossless(family, target, backend_name):
    n = 24 if backend_name == "reference" else 16  # the interpreter is slow; still 3x past the window
    ref = greedy(target, n)
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
    rigged = RiggedDraft(draft, target.lm_head.weight, ref, p_right=0.75)
    # reference ops: a random drafter with near-flat logits (its final norm scaled down), so the 72 best nodes
    # hold every depth-1 token and each round accepts one; the interpreter: a rigged one (fewer, deeper rounds)
    if backend_name == "reference":
        tree_draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
        with torch.no_grad():
            tree_draft.norm.weight.mul_(0.02)
    else:
        tree_draft = RiggedDraft(draft, target.lm_head.weight, ref, p_right=0.6, second_right=True)
    with backend(backend_name), forbid_own_attention(target) as own:
        ar = dflash.generate(target, None, PROMPT, method="ar", max_new_tokens=n)
        chain = dflash.generate(target, rigged, PROMPT, max_new_tokens=n)
        tree = dflash.generate(target, tree_draft, PROMPT, method="ddtree", max_new_tokens=n, tree_budget=BUDGET)
    assert own.call_count == 0
    assert torch.equal(ar.output_ids, ref), f"{family} ar differs from generate()"
    assert torch.equal(chain.output_ids, ref), f"{family} dflash differs from generate()"
    assert torch.equal(tree.output_ids, ref), f"{family} ddtree differs from generate()"
    assert max(chain.acceptance_lengths) >= 3  # real acceptances, not only bonus tokens
    # a budget above the vocabulary: each round but the cut last one accepts at least one tree node
    assert min(tree.acceptance_lengths[:-1]) >= 2, tree.acceptance_lengths


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_family_batch_rows_are_lossless(family, target, backend_name):
    """A batch of three prompts (12, 7 and 9 tokens: each row at its own positions, windows and per-row prefixes
    in the attention), left-padded: every row of dflash and ddtree equals the model's generate() on that prompt
    alone."""
    _check_batch_rows(family, target, backend_name, 12 if backend_name == "reference" else 6)


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
@pytest.mark.parametrize("hybrid", HYBRID_NAMES)
def test_hybrid_family_batch_rows_are_lossless(hybrid, backend_name):
    """The same batch on the hybrid families (Qwen3.5, Qwen3-Next, Qwen3.5-MoE: Gated-DeltaNet layers, a conv
    window and a recurrent state per sequence). On the Triton kernels (interpreter) a 2-layer target (one
    Gated-DeltaNet layer, one attention layer), vocabulary 16, runs the batched tree scan, replay and conv."""
    if backend_name == "reference":
        target, vocab, n = tiny_hybrid_target(hybrid, vocab=VOCAB), VOCAB, 12
    else:
        target, vocab, n = tiny_hybrid_target(hybrid, vocab=16, layers=2, linear_k_heads=1, linear_v_heads=2), 16, 6
    _check_batch_rows(hybrid, target, backend_name, n, vocab)


def _check_batch_rows(family, target, backend_name, n, vocab=VOCAB):
    prompts = [[t % vocab for t in p] for p in (PROMPT, PROMPT[3:10], PROMPT[:9][::-1])]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
    with backend(backend_name), forbid_own_attention(target) as own:
        chain = dflash.generate(target, draft, ids, attention_mask=mask, max_new_tokens=n)
        tree = dflash.generate(target, draft, ids, attention_mask=mask, method="ddtree", max_new_tokens=n,
                               tree_budget=6)
    assert own.call_count == 0
    for r, prompt in enumerate(prompts):
        ref = greedy(target, n, prompt)
        assert torch.equal(chain.rows[r].output_ids, ref), f"{family} dflash row {r} differs from generate()"
        assert torch.equal(tree.rows[r].output_ids, ref), f"{family} ddtree row {r} differs from generate()"


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_adapter_forward_is_the_models_forward(family, target, backend_name):
    """Prefill, a chain verify and a tree verify through our passes vs the model's own forward on the same tokens."""
    ids = torch.tensor(PROMPT + [30, 31, 32, 40, 41, 42])
    P = len(PROMPT)
    with torch.inference_mode():
        own = target(ids[None], output_hidden_states=True)
    want_logits = own.logits[0]
    want_hidden = own.hidden_states[1][0]  # layer 0's output
    with backend(backend_name), torch.inference_mode(), TargetAdapter(target, [0]) as adapter:
        cache = adapter.new_cache(64)
        last, _ = adapter.prefill(ids[:P], cache)
        torch.testing.assert_close(adapter.logits(last), want_logits[P - 1 : P], atol=1e-4, rtol=1e-4)
        # chain verify of the next 3 tokens
        h = adapter.forward(ids[P : P + 3], torch.arange(P, P + 3), cache)
        torch.testing.assert_close(adapter.logits(h), want_logits[P : P + 3], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(adapter.captured_layer(0), want_hidden[P : P + 3], atol=1e-4, rtol=1e-4)
        cache.commit(3)
        # tree verify: root + two branches; the branch [root, a, b] is the model's sequence
        parents = torch.tensor([-1, 0, 1, 0, 3])
        tokens = torch.tensor([ids[P + 3], ids[P + 4], ids[P + 5], 7, 9])
        depths = torch.tensor([0, 1, 2, 1, 2])
        bits = dflash_kernels.ancestor_bits(parents)
        h = adapter.forward(tokens, P + 3 + depths, cache, tree_bits=bits)
        torch.testing.assert_close(adapter.logits(h[:3]), want_logits[P + 3 : P + 6], atol=1e-4, rtol=1e-4)
    # the other branch is the model's forward on its own sequence
    other = torch.cat([ids[: P + 4], torch.tensor([7, 9])])
    with torch.inference_mode():
        other_logits = target(other[None]).logits[0]
    with backend(backend_name), torch.inference_mode(), TargetAdapter(target) as adapter:
        cache = adapter.new_cache(64)
        adapter.prefill(ids[: P + 3], cache)
        h = adapter.forward(tokens, P + 3 + depths, cache, tree_bits=bits)
        torch.testing.assert_close(adapter.logits(h[[0, 3, 4]]), other_logits[P + 3 :], atol=1e-4, rtol=1e-4)


EXPECTED = {
    # family: (windows of the 2 layers, attention softcap, final softcap, sinks, rope per layer type, MoE)
    "llama": ([None, None], None, None, False, False, False),
    "qwen2": ([5, None], None, None, False, False, False),
    "qwen3": ([5, None], None, None, False, False, False),
    "mistral": ([5, 5], None, None, False, False, False),
    "phi3": ([5, 5], None, None, False, False, False),
    "gemma2": ([5, None], ATTN_SOFTCAP, FINAL_SOFTCAP, False, False, False),
    "gemma3": ([5, None], None, FINAL_SOFTCAP, False, True, False),
    "qwen3_moe": ([5, 5], None, None, False, False, True),
    "gpt_oss": ([5, None], None, None, True, False, True),
}


def test_family_table_resolves(family, target):
    windows, attn_cap, final_cap, sinks, rope_types, moe = EXPECTED[family]
    with TargetAdapter(target) as adapter:
        spec = adapter.spec
        assert spec.family.known and spec.family is families.FAMILIES[target.config.model_type]
        assert adapter.windows == windows
        assert spec.attn_softcaps == [attn_cap, attn_cap]
        assert spec.final_softcap == final_cap and adapter.final_softcap == final_cap
        assert all((s is not None) == sinks for s in spec.sinks)
        if sinks:  # the module's own parameters, not copies
            assert all(s is layer.self_attn.sinks for s, layer in zip(spec.sinks, target.model.layers))
        assert (spec.rope_types is not None) == rope_types
        assert bool(families.experts_modules(target)) == moe


def test_gemma_query_scale_and_embedding_scale_are_the_models():
    """``query_pre_attn_scalar`` lives in the module's ``scaling``; the scaled embedding in ``embed_tokens``."""
    for family in ("gemma2", "gemma3"):
        target = tiny_family_target(family, vocab=VOCAB)
        cfg = target.config
        assert all(layer.self_attn.scaling == cfg.query_pre_attn_scalar ** -0.5 for layer in target.model.layers)
        assert cfg.query_pre_attn_scalar != cfg.head_dim
        ids = torch.tensor([3, 4, 5])
        with TargetAdapter(target) as adapter, torch.inference_mode():
            emb = adapter.embed(ids)
            torch.testing.assert_close(emb, target.model.embed_tokens.weight[ids] * cfg.hidden_size ** 0.5)
        with pytest.raises(UnsupportedTargetFeature, match="query scaling"):
            target.model.layers[0].self_attn.scaling = cfg.head_dim ** -0.5
            TargetAdapter(target)


def test_the_model_is_untouched_after_generate(family, target):
    """Our passes change nothing the model keeps: attention and experts implementations, its own forward."""
    impl = target.config._attn_implementation
    experts = getattr(target.config, "_experts_implementation", None)
    x = torch.tensor([PROMPT])
    with torch.inference_mode():
        before = target(x).logits
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
    with dflash_kernels.force_backend("reference"):
        dflash.generate(target, draft, PROMPT, method="ddtree", max_new_tokens=6, tree_budget=5)
    with torch.inference_mode():
        after = target(x).logits
    assert torch.equal(before, after)
    assert target.config._attn_implementation == impl
    assert getattr(target.config, "_experts_implementation", None) == experts


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of ``counts`` against ``probs`` (bins with expectation < 5 pooled)."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_sampling_with_a_final_softcap_matches_the_softcapped_distribution(backend_name):
    """T > 0 through ``TargetAdapter.choose``: samples follow softmax(c tanh(z / c) / T), the model's own logits."""
    target = tiny_family_target("gemma2", vocab=16, hidden=32)
    ids = torch.tensor(PROMPT[:6]) % 16
    T = 0.7
    n = 6000
    with torch.inference_mode():
        own = target(ids[None]).logits[0, -1].double()  # the model's logits: softcap applied
        raw = target.lm_head(target.model(ids[None]).last_hidden_state)[0, -1].double()  # before the cap
    assert (own.abs() <= FINAL_SOFTCAP + 1e-6).all() and raw.abs().max() > FINAL_SOFTCAP
    with backend(backend_name), torch.inference_mode(), TargetAdapter(target) as adapter:
        last, _ = adapter.prefill(ids, adapter.new_cache(16))
        rows = last.expand(n, -1).contiguous()
        draws = torch.cat([adapter.choose(rows[i : i + 1000], temperature=T, seed=s)
                           for s, i in enumerate(range(0, n, 1000))])
    counts = torch.bincount(draws, minlength=16)
    p_capped = torch.softmax(own / T, -1)
    p_uncapped = torch.softmax(raw / T, -1)
    assert _chi_square_p(counts, p_capped) > 1e-3, (counts, p_capped * n)
    assert _chi_square_p(counts, p_uncapped) < 1e-6  # the test can tell the two apart


def _reads_per_round(fn):
    from host_reads import reads_per_round

    return reads_per_round(fn, "commit")


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_moe_experts_run_without_a_host_read_per_layer(family):
    """A target loaded with transformers' eager experts (a host read per MoE layer per forward) runs the grouped
    experts while the adapter is open: one host read per round, still lossless, eager restored after."""
    target = tiny_family_target(family, vocab=VOCAB, experts="eager", layers=3)
    assert target.config._experts_implementation == "eager"
    ref = greedy(target, 12)
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
    kw = dict(method="ddtree", max_new_tokens=12, tree_budget=6, seed=0)
    out = {}

    def run():
        out["r"] = dflash.generate(target, draft, PROMPT, **kw)

    with dflash_kernels.force_backend("reference"):
        TargetAdapter(target).close()  # the check against the model's own forward (it switches the experts too)
        seen = []
        real = families.experts_patches

        def spy(configs, implementation):
            seen.append(implementation)
            return real(configs, implementation)

        with mock.patch("dflash.target.adapter.experts_patches", spy):
            per_round, reads, _ = _reads_per_round(run)
        assert seen == ["grouped_mm"]
        assert max(per_round) <= 1, f"host reads per round {per_round}: {reads}"
        assert torch.equal(out["r"].output_ids, ref)
        assert target.config._experts_implementation == "eager"
        # the counter does see eager's reads: without the switch every round reads once per MoE layer
        with mock.patch("dflash.target.adapter.experts_patches", lambda configs, implementation: []):
            eager_rounds, _, _ = _reads_per_round(run)
        assert min(eager_rounds) > 3


def test_grouped_mm_fallback_is_avoided(monkeypatch):
    """Where grouped_mm would fall back to its host loop, the model's own experts run (batched_mm would gather
    the expert weights per row: no memory for a prefill chunk); tests/families/test_moe_experts_choice.py has the rule."""
    monkeypatch.setattr(families, "grouped_mm_fast_path", lambda device, dtype: False)
    for current in ("eager", "grouped_mm", "batched_mm"):
        assert families.choose_experts_implementation(current, torch.device("cpu"), torch.float32) is None
    target = tiny_family_target("qwen3_moe", vocab=VOCAB, experts="eager")
    ref = greedy(target, 10)
    with dflash_kernels.force_backend("reference"):
        out = dflash.generate(target, None, PROMPT, method="ar", max_new_tokens=10)
    assert torch.equal(out.output_ids, ref) and target.config._experts_implementation == "eager"


def _renamed(model, model_type):
    model.config.model_type = model_type  # an instance attribute: the family table no longer knows it
    return model


def test_unknown_families_of_the_generic_shape_work():
    """Unknown ``model_type``: windows from ``layer_types`` (else the modules, else every layer), softcaps and sinks
    by transformers' names (a renamed Gemma2 and gpt-oss: both softcaps, sinks)."""
    for family, windows in (("llama", [None, None]), ("qwen3", [5, None]), ("mistral", [5, 5]),
                            ("gemma2", [5, None]), ("gpt_oss", [5, None])):
        target = _renamed(tiny_family_target(family, vocab=VOCAB), f"my_{family}")
        ref = greedy(target, 16)
        draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
        with TargetAdapter(target) as adapter:
            assert not adapter.spec.family.known and adapter.windows == windows
        with dflash_kernels.force_backend("reference"):
            for method in ("ar", "dflash", "ddtree"):
                res = dflash.generate(target, None if method == "ar" else draft, PROMPT, method=method,
                                      max_new_tokens=16)
                assert torch.equal(res.output_ids, ref), (family, method)


def _refusals():
    def gemma3_bidirectional():
        return tiny_family_target("gemma3", vocab=VOCAB, use_bidirectional_attention=True)

    def unknown_with_final_softcap():
        model = _renamed(tiny_family_target("llama", vocab=VOCAB), "my_decoder")
        model.config.final_logit_softcapping = 2.0  # small enough to bend the logits the probe compares
        return model

    def linear_attention_layers():
        model = tiny_family_target("qwen3", vocab=VOCAB)
        model.config.layer_types = ["linear_attention", "full_attention"]
        return model

    def chunked_attention():
        model = tiny_family_target("llama", vocab=VOCAB)
        model.config.attention_chunk_size = 8
        return model

    def lm_head_bias():
        model = tiny_family_target("llama", vocab=VOCAB)
        model.lm_head.bias = torch.nn.Parameter(torch.zeros(VOCAB))
        return model

    return [
        ("gemma3 bidirectional", gemma3_bidirectional, "bidirectional attention"),
        # the config names a final softcap its own head never applies: the forward check refuses it
        ("a final softcap the model ignores, unknown family", unknown_with_final_softcap,
         "a forward that differs from the model's own"),
        ("linear attention", linear_attention_layers, "layer type 'linear_attention'"),
        ("chunked attention", chunked_attention, "chunked attention"),
        ("lm_head bias", lm_head_bias, "lm_head bias"),
    ]


@pytest.mark.parametrize("case", _refusals(), ids=lambda c: c[0])
def test_unsupported_features_are_refused_by_name(case):
    _, build, feature = case
    model = build()
    impl = model.config._attn_implementation
    with pytest.raises(UnsupportedTargetFeature, match=f"unsupported feature: {feature}"):
        TargetAdapter(model)
    with pytest.raises(UnsupportedTargetFeature, match=feature):
        dflash.generate(model, None, PROMPT, method="ar", max_new_tokens=2)
    assert model.config._attn_implementation == impl  # refused before anything was switched


def test_a_module_disagreeing_with_the_table_is_an_error_not_a_wrong_answer():
    """The attention modules' own arguments are checked every pass: a Qwen3 whose config lost its layer_types
    after construction still windows layer 0 in its module; the table's answer (no window) is refused."""
    target = tiny_family_target("qwen3", vocab=VOCAB)
    target.config.layer_types = ["full_attention", "full_attention"]
    with dflash_kernels.force_backend("reference"), pytest.raises(UnsupportedTargetFeature, match="sliding window"):
        dflash.generate(target, None, PROMPT, method="ar", max_new_tokens=2)
    target = tiny_family_target("gemma2", vocab=VOCAB)
    target.model.layers[1].self_attn.attn_logit_softcapping = 9.0
    with dflash_kernels.force_backend("reference"), pytest.raises(UnsupportedTargetFeature, match="attention softcap"):
        dflash.generate(target, None, PROMPT, method="ar", max_new_tokens=2)


def test_a_softcap_blind_attention_implementation_is_named():
    """transformers 5.17 loads Gemma2 with SDPA, which drops the attention softcap: we apply it and say so."""
    target = tiny_family_target("gemma2", vocab=VOCAB)
    ref = greedy(target, 8)  # eager: the softcap applied
    target.config._attn_implementation = "sdpa"
    with pytest.warns(UserWarning, match="ignores the attention softcap"):
        with dflash_kernels.force_backend("reference"):
            out = dflash.generate(target, None, PROMPT, method="ar", max_new_tokens=8)
    assert torch.equal(out.output_ids, ref) and target.config._attn_implementation == "sdpa"
