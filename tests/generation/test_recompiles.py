"""No Triton compile inside a generation once :func:`dflash.warmup` has run.

Under the interpreter nothing compiles, so the test records the compile key
of every launch (tests/triton_launches.py: constexprs, launch options, and
for each int argument outside ``do_not_specialize`` whether it is 1 or
divisible by 16): a 256-token generation with varying acceptance, after the
warm-up, must launch no key the warm-up did not. Before the round redesign
the prefix length, tree-attention split sizes, gather row counts and the
compaction tile were all part of the key.
"""

import pytest
import torch

import dflash
import dflash_kernels
from prompts import greedy
from tiny_models import RiggedDraft, tiny_draft, tiny_target
from triton_launches import LaunchKeys

PROMPT = [5, 17, 33, 2, 9, 41, 60, 7, 3, 11, 13]  # this file's own, not prompts.PROMPT


@pytest.fixture(autouse=True)
def triton_ops():
    if "triton" not in dflash_kernels.available_backends(torch.device("cpu")):
        pytest.skip("Triton cannot run here")
    with dflash_kernels.force_backend("triton"):
        yield


def new_keys_after_warmup(target, draft, gen_kwargs, warm_kwargs):
    with LaunchKeys() as warm:
        dflash.warmup(target, draft, **warm_kwargs)
    with LaunchKeys() as run:
        result = dflash.generate(target, draft, PROMPT, **gen_kwargs)
    return run.keys - warm.keys, result


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_rigged_256_tokens_no_new_variant(method):
    target = tiny_target("qwen3", layers=2, hidden=32)
    ref = greedy(target, 256, PROMPT, inference_mode=True)
    base = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
    rigged = RiggedDraft(base, target.lm_head.weight, ref, p_right=0.7, second_right=method == "ddtree")
    kw = dict(method=method, max_new_tokens=256, block_size=4)
    warm = dict(method=method, block_size=4)
    if method == "ddtree":
        kw["tree_budget"] = warm["tree_budget"] = 6
    new, result = new_keys_after_warmup(target, rigged, kw, warm)
    assert torch.equal(result.output_ids, ref)
    assert len(set(result.acceptance_lengths)) >= 3  # acceptance really varied
    assert not new, f"launches the warm-up did not compile: {sorted(new)}"


@pytest.mark.parametrize("method,temperature", [("dflash", 0.0), ("ddtree", 0.7), ("ar", 0.0)])
def test_real_drafter_no_new_variant(method, temperature):
    target = tiny_target("llama", layers=2, hidden=32)
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1]) if method != "ar" else None
    kw = dict(method=method, max_new_tokens=40, temperature=temperature, seed=3)
    warm = dict(method=method, temperature=temperature, block_size=4)
    if method != "ar":
        kw["block_size"] = 4
    if method == "ddtree":
        kw["tree_budget"] = warm["tree_budget"] = 5
    new, _ = new_keys_after_warmup(target, draft, kw, warm)
    assert not new, f"launches the warm-up did not compile: {sorted(new)}"


def test_recorder_sees_a_specialized_int():
    """The recorder is not blind: the pre-redesign compaction tile (next_pow2 of the row count) is a new key."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_rows(x_ptr, n_rows, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n_rows), mask=offs < n_rows)

    x = torch.zeros(32)
    with LaunchKeys() as first:
        copy_rows[(1,)](x, 3, BLOCK=triton.next_power_of_2(3))
    with LaunchKeys() as second:
        copy_rows[(1,)](x, 16, BLOCK=triton.next_power_of_2(16))
    assert second.keys - first.keys


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_softcap_and_sink_variants_are_warmed(family):
    """Gemma 2 (attention softcap, windows on every other layer) and gpt-oss (sinks, windows): the warm-up
    launches their attention variants too."""
    from tiny_models import tiny_family_target

    target = tiny_family_target(family, layers=2, hidden=32)
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
    kw = dict(method="ddtree", max_new_tokens=24, block_size=4, tree_budget=5)
    new, _ = new_keys_after_warmup(target, draft, kw, dict(method="ddtree", block_size=4, tree_budget=5))
    assert not new, f"launches the warm-up did not compile: {sorted(new)}"


@pytest.fixture
def gpu_like_splits(monkeypatch):
    """Split the key axis of every pass over a long prefix, as the launcher does on a GPU (under the
    interpreter it never splits), so the split variants a generation would need are recorded too."""
    import importlib

    launcher = importlib.import_module("dflash_kernels.tree_attention")
    real = launcher._launch

    def launch(q, k, v, bits, prefix_len, *args, num_splits=None, **kwargs):
        if num_splits is None and isinstance(prefix_len, int) and prefix_len >= 24:
            num_splits = 2
        return real(q, k, v, bits, prefix_len, *args, num_splits=num_splits, **kwargs)

    monkeypatch.setattr(launcher, "_launch", launch)


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_prompt_lengths_and_small_trees_no_new_variant(method, monkeypatch, gpu_like_splits):
    """Prompts whose last prefill chunk is short (1 .. chunk rows) and DDTree trees smaller than the budget
    (a vocabulary of 8 cannot fill a budget of 20 at depth 1) launch no variant the warm-up did not.

    bf16 with G = 2 query heads per kv head, so the attention tile really depends on the row count
    (16 / 32 / 64-row tiles for 2 .. 48 packed rows); the second layer has a window, so a prompt's first
    chunk runs the kernel too. The prefill chunk is made 24 rows to keep the prompts short.
    """
    import importlib

    monkeypatch.setattr(importlib.import_module("dflash.target.adapter"), "PREFILL_CHUNK", 24)
    target = tiny_target("qwen3", layers=2, hidden=64, vocab=8, sliding_window=6, dtype=torch.bfloat16)
    B = 2 if method == "ddtree" else 4
    draft = None if method == "ar" else tiny_draft(target, block_size=B, target_layer_ids=[0, 1],
                                                     dtype=torch.bfloat16)
    # last chunks of 5, 10 and 2 rows; no pad id (0), which transformers would mask
    prompts = [[1 + (5 * i + 3) % 6 for i in range(n)] for n in (5, 34, 50)]
    budgets = [20, 5] if method == "ddtree" else [None]
    tree_sizes = set()
    for budget in budgets:
        warm = dict(method=method, block_size=B, max_prompt_len=50)
        kw = dict(method=method, max_new_tokens=6)
        if method != "ar":
            kw["block_size"] = B
        if budget is not None:
            warm["tree_budget"] = kw["tree_budget"] = budget
        with LaunchKeys() as warmed:
            dflash.warmup(target, draft, **warm)
        with LaunchKeys() as run:
            for prompt in prompts:
                result = dflash.generate(target, draft, prompt, **kw)
                tree_sizes.update(result.tree_sizes)
        new = run.keys - warmed.keys
        assert not new, f"launches the warm-up did not compile (budget {budget}): {sorted(new)}"
    if method == "ddtree":
        assert 8 in tree_sizes  # the budget-20 trees: 8 nodes, fewer than the budget


def test_attention_row_counts_cover_every_tile():
    """One count per distinct variant: bf16 at D = 128 and G = 4 over 1 .. 2048 tokens reaches every row tile,
    and every count in the range shares its variant with one of the representatives."""
    from dflash.decoding.warmup import _row_key, attention_row_counts, tree_rows
    from dflash_kernels.tree_attention import BLOCK_M_CHOICES, tree_attention_config

    reps = attention_row_counts(1, 2048, 4, 128, torch.bfloat16)
    assert {tree_attention_config(128, torch.bfloat16, 4 * T)["BLOCK_M"] for T in reps} == set(BLOCK_M_CHOICES)
    keys = {_row_key(T, 4, 128, torch.bfloat16) for T in reps}
    assert len(keys) == len(reps)
    assert all(_row_key(T, 4, 128, torch.bfloat16) in keys for T in range(1, 2049))
    # D = 8: the output's head stride 8 T is a multiple of 16 only for even T: both parities are kept.
    assert len(attention_row_counts(1, 8, 1, 8, torch.float32)) == 2
    assert attention_row_counts(1, 8, 1, 8, torch.float32) == (1, 2)
    assert tree_rows(2, 20, 8) == 9 and tree_rows(2, 5, 8) == 6 and tree_rows(4, 6, 96) == 7
