"""The drafter window (``draft_window=W``): the drafter sees only the last W context rows before its block.

* the drafter pass itself: with the window, each block row's output equals the drafter run (its training
  forward, no cache) on only the last W context rows at their own positions, for full-attention layers and for
  checkpoints' own sliding windows (z-lab's per-row window, causal or not, narrower than the block; speculators'
  anchored window), on both backends (the Triton kernel under the interpreter), for a batch of two sequences of
  different lengths; a window that reaches the first row changes nothing; a narrow one changes the drafts;
* generation stays the target's own greedy decoding (DFlash, DDTree; a left-padded batch; compiled rounds;
  the Triton path), only the acceptance may change;
* bad values are refused by name, at every entry point (generate, apply, the CLI);
* bench/draft_window.py runs at a smoke size.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import dflash
import dflash_kernels
from dflash import DFlashDraftModel, make_draft_config
from dflash.drafter.cache import DraftKVCache
from dflash.decoding.generation_config import UnsupportedGeneration
from dflash.decoding import compiled
from dflash.decoding.options import LoopOptions
from prompts import greedy
from tiny_models import tiny_dflash2_draft, tiny_draft, tiny_target

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
B = 8
WIDTH = 2 * 32  # two target layers of width 32


def drafter(kind: str) -> DFlashDraftModel:
    """A random 2-layer drafter: layer 0 of ``kind``'s window, layer 1 full attention."""
    torch.manual_seed(3)
    sliding = kind != "full"
    cfg = make_draft_config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=64, vocab_size=50, num_target_layers=4, block_size=B, mask_token_id=49,
                            target_layer_ids=[1, 2], max_position_embeddings=256,
                            layer_types=["sliding_attention" if sliding else "full_attention", "full_attention"],
                            sliding_window={"zlab": 5, "zlab_causal": 5, "zlab_wide": 12, "anchored": 4}.get(kind))
    model = DFlashDraftModel(cfg).eval()
    layer = model.layers[0]
    if kind == "zlab_causal":
        layer.causal = True
    if kind == "anchored":  # speculators' rule: every block row keeps the 4 context rows before its anchor
        layer.window_anchored, layer.sliding_window = True, 4 + 1
    return model


def cached_pass(model, feats, ingested, block, window):
    """``draft_block`` over a batch cache: row r holds ``ingested[r]`` rows, then its remaining rows wait."""
    b = len(feats)
    cache = DraftKVCache(model.config, 64, torch.float32, "cpu", batch=b)
    rows = [cache.row(r) for r in range(b)]
    waiting = torch.zeros(b, B, WIDTH)
    counts = []
    for r in range(b):
        model.ingest_context(feats[r][:ingested[r]], rows[r])
        rest = feats[r][ingested[r]:]
        waiting[r, :len(rest)] = rest
        counts.append(len(rest))
    cache.take_lengths(rows)
    cache.freeze()
    return model.draft_block(block, waiting, torch.tensor(counts), cache, draft_window=window)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("kind", ["full", "zlab", "zlab_causal", "zlab_wide", "anchored"])
def test_window_is_the_drafter_on_the_last_rows(backend, kind):
    if backend == "triton" and "triton" not in dflash_kernels.available_backends(torch.device("cpu")):
        pytest.skip("Triton cannot run here")
    model = drafter(kind)
    g = torch.Generator().manual_seed(0)
    lengths, ingested = (9, 14), (6, 12)  # anchors a = 9 and 14: each row's context is positions [0, a)
    feats = [torch.randn(n, WIDTH, generator=g) for n in lengths]
    block = torch.randn(2, B, 32, generator=g)
    with torch.no_grad(), dflash_kernels.force_backend(backend):
        outs = {W: cached_pass(model, feats, ingested, block, W) for W in (None, 1, 3, 6, 14)}
        for r, a in enumerate(lengths):
            for W in (1, 3, 6, 14):
                lo = max(0, a - W)
                alone = model(block[r], feats[r][lo:], torch.arange(lo, a + B))  # no cache: the rows it may see
                torch.testing.assert_close(outs[W][r], alone, rtol=1e-5, atol=1e-5)
            # a window reaching the first row is no window; a narrow one changes what the drafter outputs
            torch.testing.assert_close(outs[14][r], outs[None][r], rtol=1e-5, atol=1e-5)
            assert not torch.allclose(outs[3][r], outs[None][r], atol=1e-3)


def test_window_hides_context_rows_only():
    """The per-layer visibility a round uses: the window never hides a block key, and on a z-lab layer narrower
    than the block the block keeps the layer's own band."""
    model = drafter("zlab_causal")
    positions = torch.tensor([[20 + j for j in range(B)]])
    window, pos, band = model.layers[0].round_window(positions, B, 2)
    assert (window, band) == (5, 5)
    bits = DraftKVCache(model.config, 64, torch.float32, "cpu").block_bits(B, True, band)
    seen = dflash_kernels.tree_visibility(bits, 20, B, positions=pos[0], window=window)
    for j in range(B):
        ctx = [k for k in range(20) if seen[j, k]]
        assert ctx == list(range(max(18, 20 + j - 5 + 1), 20))  # min(W, Wl - 1 - j) rows before the anchor
        assert [i for i in range(B) if seen[j, 20 + i]] == list(range(max(0, j - 4), j + 1))
    full_window, full_pos, _ = model.layers[1].round_window(positions, B, 2)
    seen = dflash_kernels.tree_visibility(None, 20, B, positions=full_pos[0], window=full_window)
    assert seen[:, :18].sum() == 0 and seen[:, 18:20].all()


# ------------------------------------------------------------------ generation stays the target's

PROMPT = [5, 17, 33, 2, 9, 41, 60, 7, 11, 3, 28, 19, 44, 6]  # this file's own, not prompts.PROMPT


@pytest.fixture(autouse=True)
def reference_ops():
    """The loops on the reference ops (fast); the tests of the Triton path force it inside."""
    with dflash_kernels.force_backend("reference"):
        yield


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("qwen3", layers=4, hidden=32)
    return target, tiny_draft(target, block_size=4, target_layer_ids=[1, 2])


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_greedy_generation_is_the_target_s(pair, method):
    target, draft = pair
    ref = greedy(target, 16, PROMPT)
    tree = dict(tree_budget=6) if method == "ddtree" else {}
    plain = dflash.generate(target, draft, PROMPT, method=method, max_new_tokens=16, **tree)
    for W in (1, 4, 64):
        res = dflash.generate(target, draft, PROMPT, method=method, max_new_tokens=16, draft_window=W, **tree)
        assert torch.equal(res.output_ids, ref), W
    # a window past the whole sequence is no window: the same rounds
    assert res.acceptance_lengths == plain.acceptance_lengths


def test_dflash2_drafter_and_sampling(pair):
    """A DFlash2 drafter (its convolutions around the same attention) stays lossless with a window; sampled
    rounds (rejection against the drafter's q, DDTree's walk) run with it: every committed token is the
    target's own sample whatever the drafter saw, so the distribution is the target's."""
    target, draft = pair
    ref = greedy(target, 10, PROMPT)
    draft2 = tiny_dflash2_draft(target, block_size=4, target_layer_ids=[1, 2])
    for method in ("dflash", "ddtree"):
        res = dflash.generate(target, draft2, PROMPT, method=method, max_new_tokens=10, draft_window=2)
        assert torch.equal(res.output_ids, ref), method
        sampled = [dflash.generate(target, draft, PROMPT, method=method, max_new_tokens=10, do_sample=True,
                                   temperature=0.9, seed=5, draft_window=w).output_ids for w in (None, 2, 2)]
        assert torch.equal(sampled[1], sampled[2]) and sampled[1].shape == sampled[0].shape


def test_window_changes_the_drafts(pair):
    """A rigged-free random drafter: with a one-row window its trees differ from the unwindowed ones."""
    target, draft = pair
    kw = dict(method="ddtree", max_new_tokens=8, tree_budget=6, return_trees=True)
    plain = dflash.generate(target, draft, PROMPT, **kw)
    narrow = dflash.generate(target, draft, PROMPT, draft_window=1, **kw)
    assert [t["tokens"].tolist() for t in plain.trees] != [t["tokens"].tolist() for t in narrow.trees]


def test_left_padded_batch(pair):
    target, draft = pair
    short = PROMPT[:9]
    ids = torch.tensor([PROMPT, [0] * (len(PROMPT) - len(short)) + short])
    mask = (torch.arange(len(PROMPT))[None] >= torch.tensor([[0], [len(PROMPT) - len(short)]])).long()
    for method in ("dflash", "ddtree"):
        res = dflash.generate(target, draft, ids, attention_mask=mask, method=method, max_new_tokens=10,
                              draft_window=3)
        for row, prompt in zip(res.rows, (PROMPT, short)):
            assert torch.equal(row.output_ids, greedy(target, 10, prompt)), method


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_compiled_rounds_take_the_window(pair, method, monkeypatch):
    """The window is a static int: compiled rounds trace it (one fullgraph; dynamo alone, for speed), the same
    rounds as eager."""
    monkeypatch.setattr(compiled, "COMPILE_OPTIONS", dict(backend="eager"))
    target, draft = pair
    ref = greedy(target, 10, PROMPT)
    tree = dict(tree_budget=6) if method == "ddtree" else {}
    eager = dflash.generate(target, draft, PROMPT, method=method, max_new_tokens=10, draft_window=2, **tree)
    res = dflash.generate(target, draft, PROMPT, method=method, max_new_tokens=10, draft_window=2, compile=True,
                          **tree)
    assert torch.equal(res.output_ids, ref)
    assert res.acceptance_lengths == eager.acceptance_lengths
    # the same settings without the window are another compiled round, not the windowed one
    plain = dflash.generate(target, draft, PROMPT, method=method, max_new_tokens=10, compile=True, **tree)
    assert plain.acceptance_lengths == dflash.generate(target, draft, PROMPT, method=method, max_new_tokens=10,
                                                       **tree).acceptance_lengths
    windows = {key[0].draft_window for key in compiled._pool(target).keys() if key[0].method == method}
    assert {None, 2} <= windows


def test_triton_path_is_lossless(pair):
    if "triton" not in dflash_kernels.available_backends(torch.device("cpu")):
        pytest.skip("Triton cannot run here")
    target, draft = pair
    ref = greedy(target, 8, PROMPT)
    with dflash_kernels.force_backend("triton"):
        res = dflash.generate(target, draft, PROMPT, method="ddtree", max_new_tokens=8, tree_budget=6,
                              draft_window=3)
        chain = dflash.generate(target, draft, PROMPT, max_new_tokens=8, draft_window=3)
    assert torch.equal(res.output_ids, ref) and torch.equal(chain.output_ids, ref)


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize("bad", [0, -3, 2.0, "8", True])
def test_bad_values_are_refused(pair, bad):
    target, draft = pair
    with pytest.raises(ValueError, match=r"draft_window must be an int >= 1 .* or None"):
        dflash.generate(target, draft, PROMPT, max_new_tokens=4, draft_window=bad)
    with pytest.raises(ValueError, match=r"draft_window must be an int >= 1"):
        dflash.apply(target, draft, draft_window=bad)


def test_ar_refuses_the_window(pair):
    target, draft = pair
    with pytest.raises(UnsupportedGeneration, match="draft_window does not apply to method 'ar'"):
        dflash.generate(target, None, PROMPT, method="ar", max_new_tokens=4, draft_window=8)
    with pytest.raises(ValueError, match="draft_window applies to the drafter .* method 'ar' drafts nothing"):
        dflash.apply(target, draft, method="ar", draft_window=8)
    with pytest.raises(ValueError, match="method 'ar' drafts nothing"):  # the loop's own check of its options
        LoopOptions(max_new_tokens=4, draft_window=8).resolve("ar", None, target.config.vocab_size)


def test_dropin_passes_the_window(pair):
    target, draft = pair
    ref = greedy(target, 8, PROMPT)
    with dflash.apply(target, draft, method="dflash", draft_window=2) as handle:
        out = target.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)
        assert handle.last_result is not None  # our loop ran it
    assert torch.equal(out, ref)


def test_cli_flag(capsys):
    from dflash.cli import main

    assert main(["generate", "--prompt", "x", "--draft-window", "0"]) == 2
    assert "--draft-window must be an int >= 1" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--method", "ar", "--draft-window", "4"]) == 2
    assert "method 'ar' drafts nothing" in capsys.readouterr().err


def test_bench_script_runs_small(capsys):
    """bench/draft_window.py at a smoke size: its table, every window's output checked against no window."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import draft_window
    finally:
        sys.path.pop(0)
    report = draft_window.main(["--lengths", "48,80", "--windows", "none,8", "--max-new-tokens", "6",
                                "--prompts", "1"])
    assert [(r["length"], r["window"]) for r in report["rows"]] == [(48, "none"), (48, "8"), (80, "none"),
                                                                      (80, "8")]
    out = capsys.readouterr().out
    assert "| prompt tokens | draft_window | tau |" in out and "| 80 | 8 |" in out
