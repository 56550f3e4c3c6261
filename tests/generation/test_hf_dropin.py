"""The transformers drop-in: after dflash.apply, an unchanged target.generate() runs our loop and returns what
transformers returns; calls our loop cannot serve fall back to transformers with one warning; unapply restores the
exact original method; assistant_model=<our drafter> runs our loop."""

import warnings

import pytest
import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

import dflash
import dflash_kernels
from dflash.decoding import hf as dropin
from dropin_runs import spy
from prompts import PROMPT
from tiny_models import RiggedDraft, tiny_draft, tiny_target


@pytest.fixture(autouse=True)
def reference_ops():
    with dflash_kernels.force_backend("reference"):
        yield


@pytest.fixture
def pair():
    target = tiny_target("qwen3", layers=3, hidden=32)
    return target, tiny_draft(target, block_size=4, target_layer_ids=[0, 1])


def inputs():
    ids = torch.tensor([PROMPT])
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids))



@pytest.mark.parametrize("method", ["ddtree", "dflash", "ar"])
def test_apply_round_trip_is_equal_at_t0(pair, monkeypatch, method):
    target, draft = pair
    with torch.no_grad():
        ref = target.generate(**inputs(), max_new_tokens=20, do_sample=False)
    calls = spy(monkeypatch)
    with dflash.apply(target, draft if method != "ar" else None, method=method, tree_budget=8):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback
            out = target.generate(**inputs(), max_new_tokens=20, do_sample=False)
            full = target.generate(**inputs(), max_new_tokens=20, return_dict_in_generate=True)
    assert calls == [method, method]
    assert isinstance(out, torch.Tensor) and out.dtype == torch.long and torch.equal(out, ref)
    assert isinstance(full, GenerateDecoderOnlyOutput) and torch.equal(full.sequences, ref)
    assert "generate" not in target.__dict__


def test_apply_sampling_is_reproducible_with_a_seed(pair, monkeypatch):
    target, draft = pair
    calls = spy(monkeypatch)
    dflash.apply(target, draft, method="ddtree", tree_budget="auto")
    kw = dict(max_new_tokens=16, do_sample=True, temperature=0.9, top_k=0)
    torch.manual_seed(7)
    a = target.generate(**inputs(), **kw)
    torch.manual_seed(7)
    b = target.generate(**inputs(), **kw)
    torch.manual_seed(8)
    c = target.generate(**inputs(), **kw)
    dflash.unapply(target)
    assert calls == ["ddtree"] * 3
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_unapply_restores_the_exact_original(pair):
    target, draft = pair
    before = target.generate
    assert "generate" not in target.__dict__
    handle = dflash.apply(target, draft, method="ddtree")
    assert target.generate != before and dflash.decoding.is_applied(target)
    dflash.apply(target, draft, method="dflash")  # applying again replaces the settings
    dflash.unapply(target)
    assert "generate" not in target.__dict__ and target.generate == before
    assert target.generate.__func__ is type(target).generate
    assert not dflash.decoding.is_applied(target) and handle.method == "ddtree"
    # an instance that had its own generate gets that very object back
    own = lambda *a, **k: "own"  # noqa: E731
    target.__dict__["generate"] = own
    dflash.apply(target, draft)
    dflash.unapply(target)
    assert target.__dict__["generate"] is own
    del target.__dict__["generate"]
    dflash.unapply(target)  # not applied: nothing to do


@pytest.mark.parametrize("case", ["right-padding", "beams", "scores"])
def test_unservable_calls_fall_back_to_transformers_with_one_warning(pair, monkeypatch, case):
    target, draft = pair
    ids = torch.tensor([PROMPT, PROMPT[::-1]]) if case == "right-padding" else torch.tensor([PROMPT])
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    if case == "beams":
        kw["num_beams"] = 2
    if case == "right-padding":  # a batch padded on the right: transformers' own generate (which warns)
        kw["attention_mask"] = torch.tensor([[1] * 10, [1] * 8 + [0, 0]])
    if case == "scores":
        kw.update(return_dict_in_generate=True, output_scores=True)
    torch.manual_seed(0)
    with torch.no_grad():
        ref = target.generate(**kw)
    calls = spy(monkeypatch)
    with dflash.apply(target, draft):
        with pytest.warns(UserWarning, match="transformers' own generate") as record:
            torch.manual_seed(0)
            out = target.generate(**kw)
        ours = [w for w in record if "dflash" in str(w.message)]
        assert len(ours) == 1
        with warnings.catch_warnings(record=True) as again:
            warnings.simplefilter("always")
            torch.manual_seed(0)
            target.generate(**kw)
        assert not [w for w in again if "dflash" in str(w.message)], "the warning is once per reason"
    assert calls == []
    if case == "scores":
        assert torch.equal(out.sequences, ref.sequences) and out.scores is not None
    else:
        assert torch.equal(out, ref)


def test_assistant_model_with_our_drafter_runs_our_loop(pair, monkeypatch):
    target, draft = pair
    with torch.no_grad():
        ref = target.generate(**inputs(), max_new_tokens=12, do_sample=False)
    rigged = RiggedDraft(draft, target.lm_head.weight, ref, p_right=1.0)
    calls = spy(monkeypatch)
    with dflash.apply(target) as handle:  # no default drafter: plain calls go to transformers
        plain = target.generate(**inputs(), max_new_tokens=12, do_sample=False)
        assert handle.last_result is None  # transformers ran it
        out = target.generate(**inputs(), max_new_tokens=12, do_sample=False, assistant_model=rigged)
        assert handle.last_result.num_new_tokens == 12  # ours: the handle holds its result
        target.generate(**inputs(), max_new_tokens=12, do_sample=False)
        assert handle.last_result is None and handle.last_setup_seconds == 0.0
    assert calls == ["dflash"] and torch.equal(out, ref) and torch.equal(plain, ref)
    with dflash.apply(target, draft, method="ddtree", tree_budget=6):
        out = target.generate(**inputs(), max_new_tokens=12, assistant_model=rigged)
    assert calls == ["dflash", "ddtree"] and torch.equal(out, ref)


def test_other_assistant_models_go_to_transformers(pair, monkeypatch):
    target, draft = pair
    assistant = tiny_target("qwen3", layers=1, hidden=32, seed=3)
    with torch.no_grad():
        ref = target.generate(**inputs(), max_new_tokens=10, do_sample=False)
    calls = spy(monkeypatch)
    with dflash.apply(target, draft):
        out = target.generate(**inputs(), max_new_tokens=10, do_sample=False, assistant_model=assistant)
    assert calls == [] and torch.equal(out, ref)


def test_streamer_through_the_drop_in(pair):
    target, draft = pair
    events = []

    class Rec:
        def put(self, v):
            events.append(v.flatten().tolist())

        def end(self):
            events.append("end")

    with dflash.apply(target, draft, method="ddtree", tree_budget=6):
        out = target.generate(**inputs(), max_new_tokens=15, streamer=Rec())
    assert events[0] == PROMPT and events[-1] == "end" and events.count("end") == 1
    assert sum(events[1:-1], []) == out[0, len(PROMPT):].tolist()


def test_apply_checks_the_pair_and_the_method(pair):
    target, _ = pair
    other = tiny_draft(tiny_target("qwen3", layers=4, hidden=32), block_size=4, target_layer_ids=[0, 1])
    with pytest.raises(dflash.DraftConfigError, match="4-layer target"):
        dflash.apply(target, other)
    with pytest.raises(ValueError, match="unknown method 'beam'"):
        dflash.apply(target, None, method="beam")
    with pytest.raises(ValueError, match="tree_budget must be an int >= 1"):
        dflash.apply(target, pair[1], method="ddtree", tree_budget=0)
    assert "generate" not in target.__dict__


def test_apply_checks_the_acceptance_rule(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="acceptance must be one of 'rejection', 'match'"):
        dflash.apply(target, draft, acceptance="greedy")
    with pytest.raises(ValueError, match="not to method 'ddtree'"):
        dflash.apply(target, draft, method="ddtree", acceptance="rejection")
    assert "generate" not in target.__dict__


def test_top_k_top_p_sampling_runs_our_loop(pair):
    """Processed sampling (top-k / top-p / min-p) is served by our loop: no fallback, tokens inside the top-k set."""
    target, draft = pair
    kw = dict(input_ids=torch.tensor([PROMPT]), max_new_tokens=8, do_sample=True, temperature=0.8, top_k=3,
              top_p=0.9)
    with dflash.apply(target, draft):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            torch.manual_seed(0)
            out = target.generate(**kw)
    assert not [w for w in record if "dflash" in str(w.message)]
    with torch.no_grad():
        logits = target(out[:, :-1]).logits[0, len(PROMPT) - 1:]
    top3 = logits.topk(3, dim=-1).indices
    new = out[0, len(PROMPT):]
    assert all(int(t) in top3[i].tolist() for i, t in enumerate(new))


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_dropin_results_know_the_block_size_apply_set(pair, monkeypatch, method):
    """The drop-in returns only sequences, but the result its loop built carries apply's block size, so
    its per-position acceptance has one entry per draft position."""
    target, draft = pair
    results = []
    real = dropin.run_generation
    monkeypatch.setattr(dropin, "run_generation", lambda *a, **k: results.append(real(*a, **k)) or results[-1])
    with dflash.apply(target, draft, method=method, block_size=3, tree_budget=4):
        target.generate(**inputs(), max_new_tokens=8, do_sample=False)
    (res,) = results
    assert res.method == method and res.block_size == 3 and len(res.position_acceptance) == 2
