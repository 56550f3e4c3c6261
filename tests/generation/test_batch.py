"""A padded batch of prompts: every row as ``generate()`` gives it alone, in one set of rounds.

* each row of a left-padded batch equals ``target.generate()`` on that row's unpadded prompt, token for token
  (fp32 greedy), for ar, dflash and ddtree, eagerly, as the pooled static round and traced (one graph per step),
  with rows of different prompt lengths, rows that stop early (eos) padded with ``pad_token_id`` as
  transformers pads, and a budget chosen per round;
* the shipped tiny pair, whose drafter is accepted often, so rows commit different counts each round;
* one host read per round at any batch size; per-row and pooled statistics; right padding and a streamer
  refused by name; the drop-in serves ``tokenizer(prompts, padding=True, padding_side="left")``;
* hybrid targets (Gated-DeltaNet layers: a conv window and a recurrent state per sequence, each prompt
  prefilled on its own) batch the same way: ar, dflash and ddtree rows equal generate() alone, eager, as the
  static round and traced (stopped sequences masked), rows stopping mid-batch, one host read per round, and
  the drop-in batches them.
"""

from __future__ import annotations

import pytest
import torch

import dflash
import dflash_kernels
from dflash.decoding.generation_config import UnsupportedGeneration
from tiny_models import RiggedDraft, tiny_draft, tiny_hybrid_target, tiny_target

PROMPTS = [[5, 17, 33, 2, 9, 41, 60, 7, 3, 11], [8, 1, 44], [21, 22, 23, 24, 25, 26, 27]]
PAD = 0


@pytest.fixture
def reference_ops():
    with dflash_kernels.force_backend("reference"):
        yield


def padded(prompts, pad=PAD):
    """``(input_ids [b, T], attention_mask [b, T])`` left-padded, as a tokenizer with padding_side='left'."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def alone(target, prompt, n, **kw):
    with torch.no_grad():
        return target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, **kw)[0]


def row_tokens(out_row, mask_row, pad):
    """A batch row with its left padding and its trailing pad ids (after the row ended) removed."""
    tokens = out_row[int((mask_row == 0).sum()):].tolist()
    while len(tokens) > 1 and tokens[-1] == pad:
        tokens.pop()
    return tokens


def pair(block_size=5):
    target = tiny_target("qwen3", layers=3, hidden=32)
    return target, tiny_draft(target, block_size=block_size, target_layer_ids=[0, 1])


@pytest.mark.parametrize("mode", [False, "static"])
@pytest.mark.parametrize("method,kw", [("ar", {}), ("dflash", {}), ("ddtree", dict(tree_budget=6)),
                                       ("ddtree", dict(tree_budget=[2, 5]))])
def test_each_row_equals_generate_alone(reference_ops, method, kw, mode):
    target, draft = pair()
    ids, mask = padded(PROMPTS)
    out = dflash.generate(target, None if method == "ar" else draft, ids, attention_mask=mask, method=method,
                          max_new_tokens=14, compile=mode, **kw)
    assert out.output_ids.shape == (3, ids.shape[1] + 14)
    assert torch.equal(out.output_ids[:, : ids.shape[1]], ids)  # the input as given, then the new tokens
    for r, prompt in enumerate(PROMPTS):
        assert out.rows[r].output_ids[0].tolist() == alone(target, prompt, 14).tolist(), r
    assert len(out.rows) == 3 and out.num_new_tokens == 3 * 14
    assert out.num_rounds == sum(row.num_rounds for row in out.rows)


def test_rows_that_stop_early_are_padded_like_transformers(reference_ops):
    """An eos ends its row (padded with pad_token_id after it) while the others go on: the whole output equals
    transformers' own batched generate()."""
    target, draft = pair()
    ids, mask = padded(PROMPTS)
    with torch.no_grad():
        ref = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    eos = ref[1, ids.shape[1] + 3].item()  # row 1's 4th new token ends it
    with torch.no_grad():
        ref = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=eos,
                              pad_token_id=PAD)
    for method in ("ar", "dflash", "ddtree"):
        out = dflash.generate(target, draft, ids, attention_mask=mask, method=method, max_new_tokens=16,
                              eos_token_id=eos, pad_token_id=PAD)
        assert torch.equal(out.output_ids, ref), method
        assert out.rows[1].output_ids[0, -1].item() == eos


@pytest.mark.slow
def test_traced_batch_one_graph_per_step_and_a_batch_bucket(reference_ops):
    """compile=True: three prompts run in the batch bucket of 4 (the fourth sequence stopped from the start), one
    graph per step, and two calls of 3 and 4 prompts share the bucket's compiled round."""
    from torch._dynamo.utils import counters

    from test_compiled_rounds import trace_only  # noqa: F401

    target, draft = pair()
    ids, mask = padded(PROMPTS)
    torch._dynamo.reset()
    counters.clear()
    out = dflash.generate(target, draft, ids, attention_mask=mask, method="ddtree", tree_budget=6, max_new_tokens=10,
                          compile=True)
    for r, prompt in enumerate(PROMPTS):
        assert out.rows[r].output_ids[0].tolist() == alone(target, prompt, 10).tolist(), r
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 2 and not counters["graph_break"]
    ids4, mask4 = padded(PROMPTS + [[3, 3, 3, 3]])
    out4 = dflash.generate(target, draft, ids4, attention_mask=mask4, method="ddtree", tree_budget=6,
                           max_new_tokens=10, compile=True)
    assert counters["stats"]["unique_graphs"] == graphs  # the same bucket: nothing compiled again
    assert out4.rows[3].output_ids[0].tolist() == alone(target, [3, 3, 3, 3], 10).tolist()


def test_shipped_pair_batch_commits_ragged_rounds(reference_ops):
    """The trained tiny pair: rows accept different counts round by round, each row is still its own greedy text,
    the per-row and pooled statistics add up."""
    from dflash.tiny.corpus import heldout_prompts
    from dflash.tiny.pair import load_default_pair

    target, draft, _ = load_default_pair()
    prompts = [p[:n] for p, n in zip(heldout_prompts(4, 64, seed=1), (64, 40, 57, 23))]
    ids, mask = padded(prompts)
    for method in ("dflash", "ddtree"):
        out = dflash.generate(target, draft, ids, attention_mask=mask, method=method, max_new_tokens=40,
                              stop_token_ids=[])
        for r, prompt in enumerate(prompts):
            want = dflash.generate(target, None, prompt, method="ar", max_new_tokens=40, stop_token_ids=[])
            assert out.rows[r].output_ids.tolist() == want.output_ids.tolist(), (method, r)
        lengths = [row.acceptance_lengths for row in out.rows]
        assert any(a != b for a, b in zip(*lengths[:2]))  # ragged: the rows commit their own counts
        assert out.tau == pytest.approx(sum(map(sum, lengths)) / sum(map(len, lengths)))
        assert all(row.tau > 1.5 for row in out.rows)
        assert len(out.position_acceptance) == draft.block_size - 1
        assert out.summary()["rows"][0]["tau"] == out.rows[0].tau


def test_one_host_read_per_round_at_batch_4(reference_ops):
    from host_reads import reads_per_round

    target, draft = pair()
    ids, mask = padded(PROMPTS + [[4, 4]])
    result = {}
    for method, kw in (("dflash", {}), ("ddtree", dict(tree_budget=6))):
        def run():
            result["r"] = dflash.generate(target, draft, ids, attention_mask=mask, method=method, max_new_tokens=12,
                                          stage_timing=True, **kw)

        per_round, reads, marks = reads_per_round(run, "commit")
        assert len(marks) >= 3
        assert max(per_round) == 1, (method, per_round, reads)


def test_sampled_rows_draw_apart_and_reproduce(reference_ops):
    """Two rows with the same prompt sample their own tokens; the same seed gives the same batch."""
    target, draft = pair()
    ids, mask = padded([PROMPTS[0], PROMPTS[0]])
    kw = dict(attention_mask=mask, method="dflash", max_new_tokens=16, temperature=1.5, seed=3)
    a = dflash.generate(target, draft, ids, **kw)
    b = dflash.generate(target, draft, ids, **kw)
    assert torch.equal(a.output_ids, b.output_ids)
    assert not torch.equal(a.output_ids[0], a.output_ids[1])


def test_a_left_padded_single_prompt_is_its_tokens(reference_ops):
    target, draft = pair()
    ids, mask = padded([PROMPTS[1]], pad=0)
    ids = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 2, dtype=torch.long), mask], 1)
    out = dflash.generate(target, draft, ids, attention_mask=mask, method="dflash", max_new_tokens=8)
    assert out.output_ids[0, :2].tolist() == [0, 0]
    assert out.rows[0].output_ids[0].tolist() == alone(target, PROMPTS[1], 8).tolist()


def test_right_padding_and_other_bad_batches_are_refused_by_name(reference_ops):
    target, draft = pair()
    ids, mask = padded(PROMPTS)
    right = mask.flip(1)
    with pytest.raises(UnsupportedGeneration, match="row 1 of attention_mask has a 0 after a 1 .*padding_side='left'"):
        dflash.generate(target, draft, ids, attention_mask=right, max_new_tokens=4)
    with pytest.raises(UnsupportedGeneration, match="row 0 of attention_mask is all padding"):
        dflash.generate(target, draft, ids, attention_mask=torch.cat([torch.zeros(1, mask.shape[1],
                                                                                 dtype=torch.long), mask[1:]]),
                        max_new_tokens=4)
    with pytest.raises(UnsupportedGeneration, match=r"does not match input_ids \[3, 10\]"):
        dflash.generate(target, draft, ids, attention_mask=mask[:2], max_new_tokens=4)
    with pytest.raises(UnsupportedGeneration, match="streamer takes one sequence"):
        dflash.generate(target, draft, ids, attention_mask=mask, max_new_tokens=4,
                        streamer=type("S", (), {"put": lambda s, v: None, "end": lambda s: None})())
    with pytest.raises(UnsupportedGeneration, match="different lengths"):
        dflash.generate(target, draft, [[1, 2, 3], [4, 5]], max_new_tokens=4)


# ----------------------------------------------------------------------------- hybrid targets


def hybrid_pair(family="qwen3_5"):
    target = tiny_hybrid_target(family)
    return target, tiny_draft(target, block_size=4, target_layer_ids=[0, 1])


@pytest.mark.parametrize("mode", [False, "static"])
@pytest.mark.parametrize("method,kw", [("ar", {}), ("dflash", {}), ("ddtree", dict(tree_budget=6))])
def test_hybrid_batch_rows_equal_generate_alone(reference_ops, method, kw, mode):
    """A hybrid target (Gated-DeltaNet layers) runs a left-padded batch: each sequence its own conv windows and
    recurrent states, prefilled on its own, verified and committed with the others; every row equals
    generate() on its prompt alone. The drafter is steered to row 0's text (right 70% of the time, the right
    token ranked second otherwise: trees branch), so row 0 accepts long paths and the others short ones: the
    rows commit different counts in the same rounds."""
    target, draft = hybrid_pair()
    ids, mask = padded(PROMPTS)
    want = [alone(target, prompt, 12).tolist() for prompt in PROMPTS]
    if method != "ar":
        draft = RiggedDraft(draft, target.lm_head.weight, torch.tensor(want[0]), p_right=0.7, second_right=True)
    out = dflash.generate(target, None if method == "ar" else draft, ids, attention_mask=mask, method=method,
                          max_new_tokens=12, compile=mode, **kw)
    for r in range(3):
        assert out.rows[r].output_ids[0].tolist() == want[r], r
    if method != "ar":
        lengths = [row.acceptance_lengths for row in out.rows]
        assert max(lengths[0]) >= 3 and any(len(set(a)) > 1 for a in zip(*lengths)), lengths  # ragged rounds


def test_hybrid_rows_that_stop_early(reference_ops):
    """An eos ends row 1 mid-batch (an eager round then drops it: the last sequence's states take its place)
    while the others go on: every row equals generate() on its prompt alone with that eos."""
    target, draft = hybrid_pair()
    ids, mask = padded(PROMPTS)
    eos = alone(target, PROMPTS[1], 16)[len(PROMPTS[1]) + 3].item()  # row 1's 4th new token ends it
    want = [alone(target, p, 16, eos_token_id=eos, pad_token_id=PAD).tolist() for p in PROMPTS]
    assert len(want[1]) == len(PROMPTS[1]) + 4 and len(want[2]) > len(want[1]) - len(PROMPTS[1]) + len(PROMPTS[2])
    for method in ("ar", "dflash", "ddtree"):
        out = dflash.generate(target, None if method == "ar" else draft, ids, attention_mask=mask, method=method,
                              max_new_tokens=16, eos_token_id=eos, pad_token_id=PAD)
        for r in range(3):
            assert out.rows[r].output_ids[0].tolist() == want[r], (method, r)


def test_hybrid_traced_batch_masks_stopped_rows(reference_ops):
    """compile=True on a hybrid target: three prompts in the batch bucket of 4 (the fourth sequence stopped from
    the start) and row 1 stopped by an eos mid-way; stopped sequences are computed but commit nothing (a
    replay of 0 rows), so the others' states are untouched and every row equals generate() alone."""
    from dflash.decoding import compiled

    target, draft = hybrid_pair()
    ids, mask = padded(PROMPTS)
    eos = alone(target, PROMPTS[1], 10)[len(PROMPTS[1]) + 2].item()
    want = [alone(target, p, 10, eos_token_id=eos, pad_token_id=PAD).tolist() for p in PROMPTS]
    saved = compiled.COMPILE_OPTIONS
    compiled.COMPILE_OPTIONS = dict(backend="eager")  # dynamo alone: the traced steps, in seconds
    torch._dynamo.reset()
    try:
        out = dflash.generate(target, draft, ids, attention_mask=mask, method="ddtree", tree_budget=6,
                              max_new_tokens=10, eos_token_id=eos, pad_token_id=PAD, compile=True)
    finally:
        compiled.COMPILE_OPTIONS = saved
        torch._dynamo.reset()
    for r in range(3):
        assert out.rows[r].output_ids[0].tolist() == want[r], r


def test_hybrid_one_host_read_per_round_at_batch_3(reference_ops):
    from host_reads import reads_per_round

    target, draft = hybrid_pair()
    ids, mask = padded(PROMPTS)
    for method, kw in (("dflash", {}), ("ddtree", dict(tree_budget=6))):
        def run():
            dflash.generate(target, draft, ids, attention_mask=mask, method=method, max_new_tokens=12,
                            stage_timing=True, **kw)

        per_round, reads, marks = reads_per_round(run, "commit")
        assert len(marks) >= 3
        assert max(per_round) == 1, (method, per_round, reads)


def test_dropin_batches_a_hybrid_target(reference_ops, monkeypatch):
    """target.generate() on a left-padded batch of a hybrid target runs our rounds (no fallback to transformers'
    generate), each row its own greedy text."""
    import warnings

    from dflash.decoding import hf

    target, draft = hybrid_pair()
    ids, mask = padded(PROMPTS)
    ran = []
    run_generation = hf.run_generation
    monkeypatch.setattr(hf, "run_generation", lambda *a, **k: ran.append(1) or run_generation(*a, **k))
    for method in ("dflash", "ddtree"):
        with dflash.apply(target, draft, method=method), warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # a fallback warns
            with torch.no_grad():
                out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        for r, prompt in enumerate(PROMPTS):
            assert out[r, ids.shape[1] - len(prompt):].tolist() == alone(target, prompt, 10).tolist(), (method, r)
    assert len(ran) == 2


def test_dropin_serves_a_left_padded_batch(reference_ops):
    target, draft = pair()
    ids, mask = padded(PROMPTS)
    with torch.no_grad():
        ref = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    for method in ("dflash", "ddtree"):
        with dflash.apply(target, draft, method=method):
            with torch.no_grad():
                out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        assert torch.equal(out, ref), method
