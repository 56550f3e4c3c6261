"""Streaming: streamer= gets the prompt, then each round's committed tokens, then end() once; dflash.stream yields
each round's tokens (or text). The concatenation is the generated output; a round still makes one host read."""

from unittest import mock

import pytest
import torch

import dflash
import dflash_kernels
from dflash.decoding.output import StageClock
from host_reads import HostReadCounter
from prompts import PROMPT, greedy
from tiny_models import RiggedDraft, tiny_draft, tiny_target

METHODS = ["ar", "dflash", "ddtree"]


@pytest.fixture(autouse=True)
def reference_ops():
    with dflash_kernels.force_backend("reference"):
        yield


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("qwen3", layers=3, hidden=32)
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
    ref = greedy(target, 40)
    return target, RiggedDraft(draft, target.lm_head.weight, ref, p_right=0.8), ref


class Recorder:
    """transformers' streamer protocol, recording every put and end (like TextIteratorStreamer, without text)."""

    def __init__(self):
        self.events = []

    def put(self, value):
        assert isinstance(value, torch.Tensor) and value.dtype == torch.long
        self.events.append(("put", value.clone()))

    def end(self):
        self.events.append(("end", None))


def kwargs_for(method):
    return dict(tree_budget=6) if method == "ddtree" else {}


@pytest.mark.parametrize("method", METHODS)
def test_streamer_gets_prompt_then_each_round_then_one_end(pair, method):
    target, draft, ref = pair
    rec = Recorder()
    res = dflash.generate(target, None if method == "ar" else draft, PROMPT, method=method, max_new_tokens=30,
                          streamer=rec, **kwargs_for(method))
    kinds = [k for k, _ in rec.events]
    assert kinds.count("end") == 1 and kinds[-1] == "end"
    puts = [v for k, v in rec.events if k == "put"]
    assert puts[0].tolist() == [PROMPT]  # the prompt first, [1, T], as transformers' generate puts it
    assert torch.cat(puts[1:]).tolist() == res.generated_ids[0].tolist() == ref[0, len(PROMPT):len(PROMPT) + 30].tolist()
    # the first token after the prefill, then one put per round with that round's committed tokens
    assert [p.numel() for p in puts[1:]] == [1] + res.acceptance_lengths
    if method != "ar":
        assert max(res.acceptance_lengths) > 1  # several tokens per put


def test_transformers_streamer_order_matches_target_generate(pair):
    """transformers' own generate feeds the same recorder: prompt first, then tokens, then end."""
    target, draft, ref = pair
    rec = Recorder()
    with torch.no_grad():
        target.generate(torch.tensor([PROMPT]), max_new_tokens=5, do_sample=False, streamer=rec)
    ours = Recorder()
    dflash.generate(target, draft, PROMPT, max_new_tokens=5, streamer=ours)
    assert rec.events[0][1].tolist() == ours.events[0][1].tolist()
    flat = lambda ev: torch.cat([v.flatten() for k, v in ev[1:] if k == "put"]).tolist()  # noqa: E731
    assert flat(rec.events) == flat(ours.events) and rec.events[-1][0] == ours.events[-1][0] == "end"


def test_text_iterator_streamer_works_unchanged(pair):
    from transformers import TextIteratorStreamer

    class Tok:  # the decode TextStreamer needs
        def decode(self, ids, **kw):
            return "".join(f"<{i}>" for i in ids)

    target, draft, ref = pair
    streamer = TextIteratorStreamer(Tok(), skip_prompt=True)
    res = dflash.generate(target, draft, PROMPT, max_new_tokens=12, streamer=streamer)
    text = "".join(streamer)
    assert text == Tok().decode(res.generated_ids[0].tolist())


@pytest.mark.parametrize("method", METHODS)
def test_stream_iterator_yields_rounds(pair, method):
    target, draft, ref = pair
    it = dflash.stream(target, None if method == "ar" else draft, PROMPT, method=method, max_new_tokens=25,
                       **kwargs_for(method))
    rounds = list(it)
    assert sum(rounds, []) == it.result.generated_ids[0].tolist() == ref[0, len(PROMPT):len(PROMPT) + 25].tolist()
    assert [len(r) for r in rounds] == [1] + it.result.acceptance_lengths
    # the streamed result knows its block size: per-position acceptance as the loop counted it
    res = it.result
    assert res.block_size == (1 if method == "ar" else 4)
    assert res.position_acceptance == ([] if method == "ar" else
                                       [sum(n >= k for n in res.accepted_depths) / res.num_rounds for k in (1, 2, 3)])


def test_stream_with_a_tokenizer_yields_text(pair):
    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(65 + i % 26) for i in ids)

    target, draft, ref = pair
    it = dflash.stream(target, draft, PROMPT, max_new_tokens=20, tokenizer=Tok())
    pieces = list(it)
    assert "".join(pieces) == Tok().decode(it.result.generated_ids[0].tolist()) and len(pieces) > 1


def test_stream_raises_bad_keywords_at_once_and_errors_from_the_loop(pair):
    target, draft, _ = pair
    with pytest.raises(ValueError, match="num_beams"):
        dflash.stream(target, draft, PROMPT, max_new_tokens=4, num_beams=2)
    bad = tiny_draft(tiny_target("qwen3", layers=4, hidden=32), block_size=4)
    it = dflash.stream(target, bad, PROMPT, max_new_tokens=4)
    with pytest.raises(Exception, match="4-layer target"):
        list(it)


def test_stream_closed_early_stops_the_generation(pair):
    target, draft, _ = pair
    it = dflash.stream(target, draft, PROMPT, max_new_tokens=40)
    first = next(it)
    it.close()
    assert len(first) == 1 and it.result is None


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_streaming_keeps_one_host_read_per_round(pair, method):
    target = pair[0]
    draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])  # the rigged drafter reads the host itself
    counter, marks, real_mark = HostReadCounter(), [], StageClock.mark

    def mark(self, stage):
        real_mark(self, stage)
        if stage == "commit":
            marks.append(counter.count)

    rec = Recorder()
    with mock.patch.object(StageClock, "mark", mark), counter:
        dflash.generate(target, draft, PROMPT, method=method, max_new_tokens=20, streamer=rec,
                        **kwargs_for(method))
    per_round = [b - a for a, b in zip(marks, marks[1:])]
    assert per_round and max(per_round) <= 1, per_round
