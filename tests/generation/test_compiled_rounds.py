"""Compiled rounds (``generate(compile=True)``): the round's steps as whole graphs, the eager round's tokens.

* graph breaks and graphs are counted with ``torch._dynamo`` counters while
  the steps are traced (``backend="eager"``: tracing only, fast); the draft and
  verify steps of DFlash and DDTree on tiny Qwen3 and Llama targets trace as
  one graph each, with no break;
* a generation whose acceptance varies round by round (a rigged drafter)
  compiles nothing after its first round, and a second generation with the
  same settings compiles nothing at all;
* the inductor-compiled steps give the eager round's tokens and acceptance
  lengths (fp32, greedy and sampled with one seed) and the target's greedy
  output; every family and the hybrids equal eager at T = 0 and T = 0.7;
* the fixed-shape steps run eagerly (``compile="static"``) are lossless on the
  reference ops, on the Triton kernels (interpreter) and in bf16; sampling
  is reproducible under a seed and a replayed step draws new noise.
"""

import pytest
import torch
from torch._dynamo.utils import counters

import dflash
import dflash_kernels
from dflash.decoding import compiled
from dflash.decoding.compiled import CompileUnsupported
from prompts import SHORT_PROMPT as PROMPT, greedy
from tiny_models import TableDraft, tiny_dflash2_draft, tiny_draft, tiny_target


def pair(family="qwen3", *, layers=3, hidden=32, block_size=4, p_right=0.7, second_right=False, n=40,
         dtype=torch.float32):
    target = tiny_target(family, layers=layers, hidden=hidden, dtype=dtype)
    ref = greedy(target, n + 16, PROMPT)
    base = tiny_draft(target, block_size=block_size, target_layer_ids=[0, layers - 1], dtype=dtype)
    return target, TableDraft(base, target.lm_head.weight, ref, p_right=p_right, second_right=second_right), ref


@pytest.fixture
def trace_only(monkeypatch):
    """Compile with dynamo alone (no inductor): counts graphs and breaks in seconds."""
    monkeypatch.setattr(compiled, "COMPILE_OPTIONS", dict(backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def reference_ops():
    with dflash_kernels.force_backend("reference"):
        yield


def _method_kw(method):
    return dict(tree_budget=6) if method == "ddtree" else {}


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_steps_trace_as_one_graph_each_without_breaks(trace_only, reference_ops, family, method):
    target, draft, ref = pair(family, second_right=method == "ddtree")
    result = dflash.generate(target, draft, PROMPT, method=method, max_new_tokens=40, compile=True,
                             **_method_kw(method))
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 2  # the draft step and the verify step
    assert torch.equal(result.output_ids, ref[:, : len(PROMPT) + 40])
    assert len(set(result.acceptance_lengths)) > 1  # acceptance varied: shapes did not
    assert result.compile_time > 0


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_no_recompile_within_or_across_generations(trace_only, reference_ops, method):
    target, draft, ref = pair(second_right=method == "ddtree")
    kw = dict(method=method, max_new_tokens=40, compile=True, **_method_kw(method))
    first = dflash.generate(target, draft, PROMPT, **kw)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == (1 if method == "ar" else 2)
    # another prompt length (same cache bucket), another acceptance pattern: no new graph, no set-up
    other = PROMPT[:5]
    second = dflash.generate(target, draft, other, **kw)
    assert counters["stats"]["unique_graphs"] == graphs
    assert second.compile_time == 0.0
    assert torch.equal(first.output_ids, ref[:, : len(PROMPT) + 40])
    assert torch.equal(second.output_ids, greedy(target, 40, other))


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_compiled_reference_rounds_attend_over_the_committed_rows_only(trace_only, reference_ops, method,
                                                                       monkeypatch):
    """On the reference attention a traced round reads only the rows the host bounds (``length + T``), not its
    whole cache bucket, in one graph for every length: cache rows past every row the generation can reach hold
    NaN, which any read of them (masked or not) would carry into the output."""
    from dflash.decoding.round import Round

    target, draft, ref = pair(second_right=method == "ddtree")
    start = Round.start

    def poisoned_start(self, prompts, chunk_size=None):
        last = start(self, prompts, chunk_size)
        for cache in self._caches():
            cache.kv_batched[..., len(PROMPT) + 40 + 16:, :] = float("nan")
            assert cache.max_len > len(PROMPT) + 40 + 16  # the bucket's tail is there to poison
        return last

    monkeypatch.setattr(Round, "start", poisoned_start)
    kw = dict(method=method, max_new_tokens=40, compile=True, **_method_kw(method))
    for prompt in (PROMPT, PROMPT[:4]):
        result = dflash.generate(target, draft, prompt, **kw)
        assert torch.equal(result.output_ids, greedy(target, 40, prompt))
    assert counters["stats"]["unique_graphs"] == (1 if method == "ar" else 2)


def test_a_module_replaced_between_calls_makes_a_new_compiled_round(trace_only, reference_ops):
    """A pooled round's graphs check only their tensors (the other guards are dropped for speed): a module of the
    target replaced between calls (here by one that computes something else with the same weight) must not run
    in the old graph, which would silently give the old model's tokens."""
    target, draft, _ = pair()
    kw = dict(method="dflash", max_new_tokens=24, compile=True)
    dflash.generate(target, draft, PROMPT, **kw)

    class Shifted(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) + 0.25

    old = target.model.layers[1].mlp.down_proj
    new = Shifted(old.in_features, old.out_features, bias=False)
    with torch.no_grad():
        new.weight.copy_(old.weight)
    target.model.layers[1].mlp.down_proj = new
    result = dflash.generate(target, draft, PROMPT, **kw)
    assert result.compile_time > 0  # a new entry, compiled for the new model
    assert torch.equal(result.output_ids, greedy(target, 24, PROMPT))


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_inductor_compiled_equals_eager(reference_ops, method, temperature):
    """inductor's graphs (C++ wrapper) give the eager round's tokens, greedy and sampled with one seed."""
    torch._dynamo.reset()
    target, draft, ref = pair(layers=2, second_right=method == "ddtree")
    kw = dict(method=method, max_new_tokens=32, **_method_kw(method))
    if temperature:
        kw.update(do_sample=True, temperature=temperature, seed=7)
    eager = dflash.generate(target, draft, PROMPT, **kw)
    fast = dflash.generate(target, draft, PROMPT, compile=True, **kw)
    assert torch.equal(fast.output_ids, eager.output_ids)
    if not temperature:
        assert torch.equal(fast.output_ids, ref[:, : len(PROMPT) + 32])
    assert fast.acceptance_lengths == eager.acceptance_lengths
    assert fast.compile_time > 0
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_static_steps_are_lossless(backend, method):
    if backend not in dflash_kernels.available_backends(torch.device("cpu")):
        pytest.skip("Triton cannot run here")
    target, draft, ref = pair(second_right=method == "ddtree", n=24)
    with dflash_kernels.force_backend(backend):
        for block_size in ((None,) if method == "ar" else (2, 4)):
            kw = _method_kw(method) if block_size is None else dict(_method_kw(method), block_size=block_size)
            eager = dflash.generate(target, draft, PROMPT, method=method, max_new_tokens=24, **kw)
            static = dflash.generate(target, draft, PROMPT, method=method, max_new_tokens=24, compile="static", **kw)
            assert torch.equal(static.output_ids, ref[:, : len(PROMPT) + 24]), (method, block_size)
            assert static.acceptance_lengths == eager.acceptance_lengths


@pytest.mark.parametrize("budget", [1, 16, 200])
def test_static_ddtree_budgets(reference_ops, budget):
    target, draft, ref = pair(second_right=True, block_size=8, n=24)
    out = dflash.generate(target, draft, PROMPT, method="ddtree", max_new_tokens=24, compile="static",
                          tree_budget=budget)
    assert torch.equal(out.output_ids, ref[:, : len(PROMPT) + 24])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_static_steps_half_precision_tiny_pair(reference_ops, dtype):
    """The trained tiny pair in bf16 / fp16 (random models tie their half-precision logits at almost every
    step, see tests/generation/test_bf16_parity.py): the fixed-shape rounds give ``generate()``'s tokens."""
    from dflash.tiny.pair import load_default_pair

    target, draft, tok = load_default_pair(dtype=dtype)
    for text in ["def parse(", "class Config:\n    "]:
        prompt = tok.encode(text)
        ref = greedy(target, 24, prompt)
        for method in ("ar", "dflash", "ddtree"):
            out = dflash.generate(target, draft, prompt, method=method, max_new_tokens=24, compile="static",
                                  **_method_kw(method))
            assert torch.equal(out.output_ids, ref), (method, dtype, text)


def test_sampling_reproducible_and_fresh_noise(trace_only, reference_ops):
    target, draft, _ = pair()
    kw = dict(method="dflash", max_new_tokens=24, do_sample=True, temperature=1.0)
    a = dflash.generate(target, draft, PROMPT, compile="static", seed=3, **kw)
    b = dflash.generate(target, draft, PROMPT, compile="static", seed=3, **kw)
    c = dflash.generate(target, draft, PROMPT, compile=True, seed=3, **kw)  # traced steps: the same noise
    d = dflash.generate(target, draft, PROMPT, compile="static", seed=4, **kw)
    e = dflash.generate(target, draft, PROMPT, seed=3, **kw)  # eager: the same round, the same noise
    assert torch.equal(a.output_ids, b.output_ids) and torch.equal(a.output_ids, c.output_ids)
    assert torch.equal(a.output_ids, e.output_ids)
    assert not torch.equal(a.output_ids, d.output_ids)
    # each verify advances the device seed: a round never reuses the previous round's noise
    steps = [s for k, s in target._dflash_compiled_rounds.items() if "static" in k][0]
    assert int(steps.rnd.seed) != 4


def test_untraceable_target_is_refused_clearly(trace_only, reference_ops):
    target, draft, _ = pair()
    mlp = target.model.layers[1].mlp
    plain = mlp.forward

    def host_read(x):
        if float(x.sum()) > 1e30:  # a host read inside a layer: cannot be one graph
            return x
        return plain(x)

    mlp.forward = host_read
    with pytest.raises(CompileUnsupported, match="compile=False"):
        dflash.generate(target, draft, PROMPT, method="dflash", max_new_tokens=8, compile=True)
    # the eager path still runs it
    assert dflash.generate(target, draft, PROMPT, method="dflash", max_new_tokens=8).num_new_tokens == 8


def test_bad_compile_arguments(reference_ops):
    target, draft, _ = pair()
    with pytest.raises(ValueError, match="compile must be one of"):
        dflash.generate(target, draft, PROMPT, max_new_tokens=4, compile="fast")
    with pytest.raises(ValueError, match="return_trees"):
        dflash.generate(target, draft, PROMPT, method="ddtree", max_new_tokens=4, compile=True, return_trees=True)


def test_kv_write_op():
    kv = torch.randn(3, 2, 2, 16, 8)
    rows = torch.tensor([4, 5, 6])
    k, v = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    torch.library.opcheck(torch.ops.dflash.kv_write_, (kv.clone(), 1, rows, k, v))
    expect = kv.clone()
    expect[1, 0, :, 4:7] = k
    expect[1, 1, :, 4:7] = v
    torch.ops.dflash.kv_write_(kv, 1, rows, k, v)
    assert torch.equal(kv, expect)



@pytest.mark.parametrize("family", __import__("tiny_models").HYBRID_NAMES)
def test_hybrid_targets_compile_and_equal_eager(trace_only, reference_ops, family):
    """Hybrid targets (Gated-DeltaNet layers) run the same round compiled: one graph per step, no break, and
    the eager tokens greedy and at T = 0.7 with one seed, for DFlash and DDTree."""
    from tiny_models import tiny_hybrid_target

    target = tiny_hybrid_target(family)
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, target.config.num_hidden_layers - 1])
    ref = greedy(target, 16, PROMPT)
    for method in ("dflash", "ddtree"):
        for sample in ({}, dict(do_sample=True, temperature=0.7, seed=5)):
            kw = dict(method=method, max_new_tokens=16, **sample, **_method_kw(method))
            eager = dflash.generate(target, draft, PROMPT, **kw)
            fast = dflash.generate(target, draft, PROMPT, compile=True, **kw)
            assert torch.equal(fast.output_ids, eager.output_ids), (family, method, sample)
            if not sample:
                assert torch.equal(eager.output_ids, ref), (family, method)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 2 * 2 * 2  # per method and sampling mode: draft + verify


@pytest.mark.parametrize("family", __import__("tiny_models").FAMILY_NAMES)
def test_every_family_traces_without_breaks_and_stays_lossless(trace_only, reference_ops, family):
    """Windows, rope per layer type, softcaps, sinks, scaled embeddings, MoE experts: the static steps of
    every supported family trace as one graph each (no break) and give the target's greedy tokens."""
    from tiny_models import tiny_family_target

    target = tiny_family_target(family)
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, target.config.num_hidden_layers - 1])
    ref = greedy(target, 16, PROMPT)
    for method in ("dflash", "ddtree"):
        for mode in ("static", True):
            out = dflash.generate(target, draft, PROMPT, method=method, max_new_tokens=16, compile=mode,
                                  **_method_kw(method))
            assert torch.equal(out.output_ids, ref), (family, method, mode)
        sample = dict(method=method, max_new_tokens=16, do_sample=True, temperature=0.7, seed=11,
                      **_method_kw(method))
        eager = dflash.generate(target, draft, PROMPT, **sample)
        fast = dflash.generate(target, draft, PROMPT, compile=True, **sample)
        assert torch.equal(fast.output_ids, eager.output_ids), (family, method, "T=0.7")
    assert dict(counters["graph_break"]) == {}


def test_many_settings_in_one_process(trace_only, reference_ops):
    """Each pooled setting compiles its own copy of the steps: more settings than dynamo's per-function
    recompile limit (8) in one process still compile, each to one graph per step."""
    target, draft, ref = pair(n=8)
    for block_size in range(2, 12):
        out = dflash.generate(target, draft, PROMPT, method="dflash", max_new_tokens=8, block_size=block_size,
                              compile=True)
        assert torch.equal(out.output_ids, ref[:, : len(PROMPT) + 8]), block_size
    assert counters["stats"]["unique_graphs"] == 2 * 10


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_kernel_path_traces_without_breaks(trace_only, method):
    """The GPU path's graph: the steps on the Triton backend (the interpreter here) trace through the
    torch.ops.dflash custom ops as one graph each, no break, and stay lossless."""
    if "triton" not in dflash_kernels.available_backends(torch.device("cpu")):
        pytest.skip("Triton cannot run here")
    target, draft, ref = pair(second_right=method == "ddtree", n=12)
    with dflash_kernels.force_backend("triton"):
        out = dflash.generate(target, draft, PROMPT, method=method, max_new_tokens=12, compile=True,
                              **_method_kw(method))
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 2
    assert torch.equal(out.output_ids, ref[:, : len(PROMPT) + 12])


@pytest.mark.parametrize("drafter", ["dflash", "dflash2"])
@pytest.mark.parametrize("acceptance", ["rejection", "match"])
def test_kernel_path_sampled_chain_traces_and_equals_eager(trace_only, drafter, acceptance):
    """A sampled chain on the Triton backend (the interpreter here): the rejection rule's op (dense q from the
    drafter's head rows, or a DFlash2 selector's sparse q) and the matching rule trace as one graph per step,
    no break, and give the eager round's tokens and acceptance under one seed."""
    if "triton" not in dflash_kernels.available_backends(torch.device("cpu")):
        pytest.skip("Triton cannot run here")
    target = tiny_target(layers=3, hidden=32)
    make = tiny_dflash2_draft if drafter == "dflash2" else tiny_draft
    draft = make(target, block_size=4, layers=1, target_layer_ids=[0, 1])
    kw = dict(method="dflash", max_new_tokens=12, do_sample=True, temperature=0.9, top_k=20, seed=3,
              acceptance=acceptance)
    with dflash_kernels.force_backend("triton"):
        eager = dflash.generate(target, draft, PROMPT, **kw)
        traced = dflash.generate(target, draft, PROMPT, compile=True, **kw)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 2
    assert torch.equal(traced.output_ids, eager.output_ids)
    assert traced.acceptance_lengths == eager.acceptance_lengths
