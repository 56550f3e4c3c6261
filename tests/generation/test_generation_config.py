"""transformers' generate keywords in dflash.generate: resolved as target.generate() resolves them.

One test per keyword: eos from the target's generation_config stops exactly where target.generate() stops, a
list of eos ids, max_length, stopping_criteria, do_sample=False with a temperature is greedy, and every refused
keyword names itself. Top-k / top-p / min-p sampling is tested with the sampler (tests/ops/test_sampling.py, tests/generation/test_sampling_loop.py).
"""

import pytest
import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

import dflash
import dflash_kernels
from dflash.decoding.generation_config import SamplingSettings, resolve_generation
from prompts import PROMPT
from tiny_models import tiny_draft, tiny_target

METHODS = ["ar", "dflash", "ddtree"]


@pytest.fixture(autouse=True)
def reference_ops():
    with dflash_kernels.force_backend("reference"):
        yield


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("qwen3", layers=3, hidden=32)
    return target, tiny_draft(target, block_size=4, target_layer_ids=[0, 1])


def hf(target, n=None, **kw):
    with torch.no_grad():
        return target.generate(torch.tensor([PROMPT]), max_new_tokens=n, **kw) if n else \
            target.generate(torch.tensor([PROMPT]), **kw)


def ours(target, draft, method, **kw):
    extra = dict(tree_budget=6) if method == "ddtree" else {}
    return dflash.generate(target, None if method == "ar" else draft, PROMPT, method=method, **extra, **kw)


@pytest.fixture
def eos_target(pair):
    """The pair's target with a generation_config eos that its greedy continuation hits."""
    target, draft = pair
    new = hf(target, 30, do_sample=False)[0, len(PROMPT):].tolist()
    saved = target.generation_config.eos_token_id
    yield target, draft, new
    target.generation_config.eos_token_id = saved


@pytest.mark.parametrize("method", METHODS)
def test_eos_from_generation_config_stops_where_target_generate_stops(eos_target, method):
    target, draft, new = eos_target
    target.generation_config.eos_token_id = new[6]
    ref = hf(target, 30, do_sample=False)
    assert ref.shape[1] < len(PROMPT) + 30, "the reference must stop early"
    assert torch.equal(ours(target, draft, method, max_new_tokens=30).output_ids, ref)


@pytest.mark.parametrize("method", METHODS)
def test_a_list_of_eos_ids(eos_target, method):
    target, draft, new = eos_target
    eos = [new[9], new[4]]
    ref = hf(target, 30, do_sample=False, eos_token_id=eos)
    assert ref.shape[1] == len(PROMPT) + new.index(new[4]) + 1
    assert torch.equal(ours(target, draft, method, max_new_tokens=30, eos_token_id=eos).output_ids, ref)


@pytest.mark.parametrize("method", METHODS)
def test_max_length_and_the_default_of_20_new_tokens(pair, method):
    target, draft = pair
    ref = hf(target, None, do_sample=False, max_length=len(PROMPT) + 7)
    assert ref.shape[1] == len(PROMPT) + 7
    assert torch.equal(ours(target, draft, method, max_length=len(PROMPT) + 7).output_ids, ref)
    default = hf(target, None, do_sample=False)
    assert default.shape[1] == len(PROMPT) + 20
    assert torch.equal(ours(target, draft, method).output_ids, default)
    # max_new_tokens wins over max_length
    assert ours(target, draft, method, max_new_tokens=5, max_length=100).num_new_tokens == 5


class StopAfter(StoppingCriteria):
    """Stops once the sequence holds ``n`` tokens (a user criterion of transformers' type)."""

    def __init__(self, n):
        self.n = n
        self.calls = 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.n, dtype=torch.bool)


@pytest.mark.parametrize("method", METHODS)
def test_stopping_criteria(pair, method):
    target, draft = pair
    ref = hf(target, 30, do_sample=False, stopping_criteria=StoppingCriteriaList([StopAfter(len(PROMPT) + 9)]))
    assert ref.shape[1] == len(PROMPT) + 9
    crit = StopAfter(len(PROMPT) + 9)
    res = ours(target, draft, method, max_new_tokens=30, stopping_criteria=StoppingCriteriaList([crit]))
    assert torch.equal(res.output_ids, ref) and crit.calls == 9


@pytest.mark.parametrize("method", METHODS)
def test_do_sample_false_with_a_temperature_is_greedy(pair, method):
    target, draft = pair
    ref = hf(target, 16, do_sample=False)
    res = ours(target, draft, method, max_new_tokens=16, do_sample=False, temperature=1.5, seed=1)
    assert torch.equal(res.output_ids, ref)
    # the same through a GenerationConfig
    res = ours(target, draft, method, generation_config=GenerationConfig(do_sample=False, temperature=1.5,
                                                                         max_new_tokens=16))
    assert torch.equal(res.output_ids, ref)


def test_generation_config_sampling_defaults_resolve_as_transformers(pair):
    target, _ = pair
    saved = target.generation_config
    try:
        target.generation_config = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95, top_k=20,
                                                    eos_token_id=[3, 4])
        plan = resolve_generation(target, PROMPT)
        assert plan.sampling == SamplingSettings(0.6, 20, 0.95, None)
        assert plan.stop_token_ids == (3, 4) and plan.max_new_tokens == 20
        assert resolve_generation(target, PROMPT, do_sample=False).sampling.greedy
        assert resolve_generation(target, PROMPT, temperature=0).sampling.greedy
        # top_k >= vocab, top_p = 1, min_p = 0 change nothing and are dropped
        assert resolve_generation(target, PROMPT, top_k=500, top_p=1.0, min_p=0.0).sampling.active() == {}
        # served: sampled from the processed distribution (tests/ops/test_sampling.py checks the distribution)
        out = dflash.generate(target, None, PROMPT, method="ar", max_new_tokens=4, seed=0)
        assert out.num_new_tokens == 4
    finally:
        target.generation_config = saved
    # transformers' global top_k=50 applies with do_sample=True (vocab 96), not to a temperature-only call
    assert resolve_generation(target, PROMPT, do_sample=True).sampling == SamplingSettings(1.0, 50, None, None)
    assert resolve_generation(target, PROMPT, temperature=0.8).sampling == SamplingSettings(0.8)


def test_sampling_with_do_sample_is_reproducible_under_a_seed(pair):
    target, draft = pair
    kw = dict(max_new_tokens=16, do_sample=True, temperature=0.9, top_k=0)
    a = ours(target, draft, "dflash", seed=3, **kw)
    assert torch.equal(a.output_ids, ours(target, draft, "dflash", seed=3, **kw).output_ids)
    assert not torch.equal(a.output_ids, ours(target, draft, "dflash", seed=4, **kw).output_ids)


@pytest.mark.parametrize("kw,name", [
    (dict(num_beams=2), "num_beams"), (dict(repetition_penalty=1.2), "repetition_penalty"),
    (dict(no_repeat_ngram_size=3), "no_repeat_ngram_size"), (dict(output_scores=True), "output_scores"),
    (dict(output_logits=True), "output_logits"), (dict(typical_p=0.5), "typical_p"),
    (dict(num_return_sequences=2, do_sample=True), "num_return_sequences"), (dict(max_time=1.0), "max_time"),
    (dict(bad_words_ids=[[3]]), "bad_words_ids"), (dict(suppress_tokens=[3]), "suppress_tokens"),
    (dict(min_new_tokens=3, eos_token_id=5), "min_new_tokens"), (dict(stop_strings=["x"]), "stop_strings"),
    (dict(logits_processor=[lambda i, s: s]), "logits_processor"), (dict(frobnicate=1), "frobnicate"),
    (dict(attention_mask=torch.tensor([[1] * 9 + [0]])), "attention_mask"),  # right padding
    (dict(tree_budget=4), "tree_budget"),
])
def test_refused_keywords_name_themselves(pair, kw, name):
    target, draft = pair
    with pytest.raises(ValueError, match=name):
        dflash.generate(target, draft, PROMPT, method="dflash", max_new_tokens=4, **kw)


def test_neutral_values_are_accepted(pair):
    target, draft = pair
    ref = hf(target, 6, do_sample=False)
    res = dflash.generate(target, draft, PROMPT, max_new_tokens=6, num_beams=1, repetition_penalty=1.0,
                          pad_token_id=0, use_cache=True, output_scores=False, attention_mask=torch.ones(1, 10),
                          stopping_criteria=StoppingCriteriaList())
    assert torch.equal(res.output_ids, ref) and torch.equal(res.sequences, ref)


def test_pad_ids_in_a_prompt_without_a_mask_are_masked_as_transformers_infers(pair):
    """No attention_mask and the prompt holds pad_token_id (not an eos id): transformers' generate() infers
    ``input_ids != pad_token_id``. Leading pad ids are left padding (the same tokens); a pad id after the first
    other token is refused by name (before: attended, a different text silently)."""
    target, draft = pair
    assert target.generation_config.pad_token_id == 0 and target.generation_config.eos_token_id is None
    padded = [0, 0, 0] + PROMPT
    with torch.inference_mode():
        want = target.generate(torch.tensor([padded]), max_new_tokens=8, do_sample=False)
    for method in METHODS:
        res = dflash.generate(target, None if method == "ar" else draft, padded, method=method, max_new_tokens=8)
        assert torch.equal(res.output_ids, want), method
    inside = PROMPT[:4] + [0] + PROMPT[4:]
    with pytest.raises(ValueError, match="holds pad_token_id=0 at position 4 and no attention_mask"):
        dflash.generate(target, draft, inside, max_new_tokens=8)
    ones = torch.ones(1, len(inside), dtype=torch.long)  # given explicitly: every token attended, as transformers
    with torch.inference_mode():
        want = target.generate(torch.tensor([inside]), attention_mask=ones, max_new_tokens=8, do_sample=False)
    res = dflash.generate(target, draft, inside, attention_mask=ones, max_new_tokens=8)
    assert torch.equal(res.output_ids, want)


def test_a_pad_id_that_is_an_eos_id_infers_no_mask(pair):
    """pad_token_id equal to an eos id: transformers infers nothing (every token attended); so do we."""
    target, draft = pair
    inside = PROMPT[:4] + [0] + PROMPT[4:]
    with torch.inference_mode():
        want = target.generate(torch.tensor([inside]), max_new_tokens=8, do_sample=False, eos_token_id=0)
    res = dflash.generate(target, draft, inside, max_new_tokens=8, eos_token_id=0)
    assert torch.equal(res.output_ids, want)
