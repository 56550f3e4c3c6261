"""The drop-in's set-up is paid once: ``dflash.apply(target, draft, method="ddtree", tree_budget="auto")``
measures the budget's costs on the first call and reuses them at every later prompt length and at every batch
size of the same batch-size bucket, so a later call runs its prefill and its rounds and no other target pass;
``dflash.apply(..., compile=True)`` runs compiled rounds with the eager rounds' tokens, its set-up reported on
the handle (``last_setup_seconds``), never in the call; a chat whose prompt grows compiles one round when the
first call reserves its length (``max_cache_len``; by default on CUDA), else one per power of two of rows.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

import dflash
import dflash_kernels
from dflash.decoding import bucket_costs, compiled
from dflash.decoding import hf as dropin
from dflash.target import TargetAdapter
from dflash.target.prefill import BATCH_PREFILL_CHUNK
from tiny_models import tiny_draft, tiny_target


@pytest.fixture
def reference_ops():
    with dflash_kernels.force_backend("reference"):
        yield


def pair():
    target = tiny_target("qwen3", layers=3, hidden=32)
    return target, tiny_draft(target, block_size=5, target_layer_ids=[0, 1])


def prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 64, (n,), generator=g).tolist()


def left_padded(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


class Passes:
    """Counts the target's passes (calls of its layer 0) and keeps the result of each run of our loop."""

    def __init__(self, target, monkeypatch):
        self.count = 0
        self.results = []
        target.model.layers[0].register_forward_hook(lambda *a: self._tick())
        real = dropin.run_generation

        def run(*a, **k):
            result = real(*a, **k)
            self.results.append(result)
            return result

        monkeypatch.setattr(dropin, "run_generation", run)

    def _tick(self):
        self.count += 1

    def call(self, target, ids, mask, **kw):
        """``(target passes, prefill passes + rounds)`` of one ``target.generate`` call."""
        before, runs = self.count, len(self.results)
        with torch.no_grad():
            out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kw)
        assert len(self.results) == runs + 1, "the call did not run our loop"
        result = self.results[-1]
        rows = result.rows or [result]
        rounds = max(row.num_rounds for row in rows)
        # one sequence: its whole prompt in one pass; a padded batch: one pass per chunk
        prefill = 1 if ids.shape[0] == 1 else math.ceil(int(mask.sum(1).max()) / BATCH_PREFILL_CHUNK)
        return self.count - before, prefill + rounds, out


def test_auto_budget_set_up_once_across_prompt_lengths(reference_ops, monkeypatch):
    """After the first call, a call at a new prompt length (a new 256-row cache bucket) runs no target pass
    besides its prefill and its rounds, and reports no set-up."""
    target, draft = pair()
    passes = Passes(target, monkeypatch)
    handle = dflash.apply(target, draft, method="ddtree", tree_budget="auto")  # eager
    try:
        seen = []
        for n in (100, 100, 300, 700, 1200):
            ids = torch.tensor([prompt(n)])
            ran, needed, out = passes.call(target, ids, torch.ones_like(ids), max_new_tokens=24)
            assert out.shape == (1, n + 24)
            seen.append((n, ran, needed, passes.results[-1].compile_time))
        first = seen[0]
        assert first[1] > first[2] and first[3] > 0, seen  # the first call measures the costs
        for n, ran, needed, setup in seen[1:]:
            assert ran == needed and setup == 0.0, seen
        assert handle.last_result is passes.results[-1] and handle.last_setup_seconds == 0.0
        assert handle.setup_seconds == first[3]
    finally:
        dflash.unapply(target)


def test_auto_budget_set_up_once_per_batch_bucket(reference_ops, monkeypatch):
    """Batch sizes 3 and 4 share one measurement (the bucket of 4), at any prompt length; a batch of 2 (a new
    bucket) measures once, then not again."""
    target, draft = pair()
    passes = Passes(target, monkeypatch)
    handle = dflash.apply(target, draft, method="ddtree", tree_budget="auto")
    try:
        def run(lengths, seed):
            ids, mask = left_padded([prompt(n, seed + i) for i, n in enumerate(lengths)])
            ran, needed, out = passes.call(target, ids, mask, max_new_tokens=16)
            assert out.shape == (len(lengths), ids.shape[1] + 16)
            return ran, needed, passes.results[-1].compile_time

        ran, needed, setup = run([40, 60, 50], 0)
        assert ran > needed and setup > 0  # the bucket of 4 measured
        for lengths, seed in (([70, 300, 20, 90], 10), ([500, 30, 45], 20)):
            ran, needed, setup = run(lengths, seed)
            assert ran == needed and setup == 0.0, (lengths, ran, needed)
        ran, needed, setup = run([33, 80], 30)
        assert ran > needed and setup > 0  # a new bucket (2) measures once
        ran, needed, setup = run([333, 12], 40)
        assert ran == needed and setup == 0.0
    finally:
        dflash.unapply(target)


def test_costs_measured_once_for_compiled_rounds_too(reference_ops, monkeypatch):
    """compiled rounds (dynamo only here, to keep it quick): a new cache bucket compiles its own round (its
    set-up reported), but the costs are not measured again."""
    monkeypatch.setattr(compiled, "COMPILE_OPTIONS", dict(backend="eager"))
    torch._dynamo.reset()
    measured = []
    real = bucket_costs.measure_round_costs

    def counted(*a, **k):
        measured.append(1)
        return real(*a, **k)

    monkeypatch.setattr(bucket_costs, "measure_round_costs", counted)
    target, draft = pair()
    handle = dflash.apply(target, draft, method="ddtree", tree_budget=[2, 5], compile=True)
    try:
        for n in (20, 300):
            ids = torch.tensor([prompt(n)])
            with torch.no_grad():
                out = target.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
                ref = dflash.generate(target, draft, ids, method="ddtree", tree_budget=5, max_new_tokens=8)
            assert torch.equal(out, ref.output_ids)
            assert handle.last_setup_seconds > 0  # a new cache bucket: its own compiled round
        assert len(measured) == 1
    finally:
        dflash.unapply(target)
        torch._dynamo.reset()


class Compiles:
    """Counts the compiled rounds made (pool entries created) and keeps their cache rows."""

    def __init__(self, monkeypatch):
        self.rows = []
        real = compiled.RoundSteps.__init__

        def init(steps, rnd, mode, blocks=()):
            real(steps, rnd, mode, blocks)
            if mode is not False:  # not the eager references' fresh rounds
                self.rows.append((rnd.cache.max_len, rnd.dcache.max_len))

        monkeypatch.setattr(compiled.RoundSteps, "__init__", init)


def growing_chat(target, draft, lengths, **apply_kw):
    """Greedy drop-in calls at the prompt ``lengths``, each checked against the eager ``dflash.generate``."""
    handle = dflash.apply(target, draft, method="ddtree", tree_budget=4, compile=True, **apply_kw)
    try:
        for n in lengths:
            ids = torch.tensor([prompt(n, seed=n)])
            with torch.no_grad():
                out = target.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
                ref = dflash.generate(target, draft, ids, method="ddtree", tree_budget=4, max_new_tokens=8)
            assert torch.equal(out, ref.output_ids), n
    finally:
        dflash.unapply(target)
    return handle


@pytest.fixture
def traced_only(monkeypatch):
    monkeypatch.setattr(compiled, "COMPILE_OPTIONS", dict(backend="eager"))  # dynamo alone: quick
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_growing_prompts_compile_once_with_a_reservation(reference_ops, traced_only, monkeypatch):
    """A chat whose prompt grows across 256-row boundaries (40 -> 460 tokens: rows in 256, 512) runs on one
    compiled round: ``max_cache_len`` sizes the first call's round for the longest, and every later call fits
    it (it used to compile a round per new 256-row bucket of either cache); the tokens are the eager ones."""
    counted = Compiles(monkeypatch)
    target, draft = pair()
    handle = growing_chat(target, draft, (40, 200, 270, 460), max_cache_len=500)
    assert counted.rows == [(512, 512)]  # one round; both caches from one bucket (500 tokens need 506 rows)
    assert len(compiled._pool(target)) == 1
    assert handle.last_setup_seconds == 0.0 and handle.setup_seconds > 0


def test_growing_prompts_default_reservation(reference_ops, traced_only, monkeypatch):
    """The drop-in's default (``max_cache_len="auto"``) on a device that reserves (CUDA; here the free memory
    is faked on the CPU): the target's max_position_embeddings (512) in rows, once. Capped by the memory:
    with room for 300 rows only, the reservation is the largest power of two that fits (256) and a longer
    call compiles its own round."""
    counted = Compiles(monkeypatch)
    target, draft = pair()
    monkeypatch.setattr(compiled, "_free_bytes", lambda device: 1 << 40)
    growing_chat(target, draft, (40, 200, 270, 460))
    assert counted.rows == [(768, 768)]  # 512 tokens need 512 + 5 + 1 rows, rounded up to 256
    per_row = compiled._row_bytes(TargetAdapter(target, draft.target_layer_ids), draft,
                                  dflash.decoding.options.RoundShape("ddtree", 5, 4, 0), 1)
    monkeypatch.setattr(compiled, "_free_bytes", lambda device: int(300 * per_row / compiled.RESERVE_MEMORY_FRACTION))
    target, draft = pair()
    counted.rows.clear()
    growing_chat(target, draft, (40, 200, 270))
    assert counted.rows == [(256, 256), (512, 512)]


def test_growing_prompts_without_reservation_grow_in_powers_of_two(reference_ops, traced_only, monkeypatch):
    """No reservation (the CPU's default, or ``max_cache_len=None``): a new round only when the call does not
    fit, sized to the next power of two for both sides, so 40 -> 800 tokens compile 3 rounds (256, 512, 1024
    rows), not one per 256 rows (4: 768 was one); a shorter call after a longer one reuses the larger round."""
    counted = Compiles(monkeypatch)
    target, draft = pair()
    handle = growing_chat(target, draft, (40, 270, 600, 800, 100))
    assert counted.rows == [(256, 256), (512, 512), (1024, 1024)]
    assert handle.last_setup_seconds == 0.0


def test_apply_refuses_a_bad_max_cache_len():
    target, draft = pair()
    for bad in (0, -3, "big", 1.5, True):
        with pytest.raises(ValueError, match="max_cache_len"):
            dflash.apply(target, draft, compile=True, max_cache_len=bad)


def test_apply_compile_equals_eager(reference_ops):
    """``apply(compile=True)``: inductor's compiled rounds give the eager drop-in's tokens (greedy); the set-up
    is on the handle (the first call's), not in the call; a second call reuses it."""
    torch._dynamo.reset()
    target, draft = pair()
    ids = torch.tensor([prompt(12)])
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    with torch.no_grad():
        ref = target.generate(**kw)
        with dflash.apply(target, draft, method="ddtree", tree_budget=4) as handle:
            eager = target.generate(**kw)
        assert handle.compile is False and handle.last_result.compile_time == 0
        with dflash.apply(target, draft, method="ddtree", tree_budget=4, compile=True) as handle:
            fast = target.generate(**kw)
            first = handle.last_setup_seconds
            again = target.generate(**kw)
            second = handle.last_setup_seconds
    assert torch.equal(eager, ref) and torch.equal(fast, eager) and torch.equal(again, eager)
    assert first > 0 and second == 0.0 and handle.setup_seconds == first
    assert handle.last_result.compile_time == 0.0 and handle.last_result.total_time > 0
    torch._dynamo.reset()


def test_apply_refuses_a_bad_compile_value():
    target, draft = pair()
    with pytest.raises(ValueError, match="compile"):
        dflash.apply(target, draft, compile="fast")
    assert not dflash.decoding.is_applied(target)


def test_chat_benchmark_runs_at_smoke_size(capsys, tmp_path, monkeypatch, reference_ops):
    """``python bench/dropin_chat.py`` (the README's chat table) at smoke size: every row, the compiled one
    traced by dynamo alone (the script's own concern is its table; inductor is tested above)."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "dropin_chat.py"
    spec = importlib.util.spec_from_file_location("dropin_chat", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "dropin_chat", module)  # dynamo looks its pass-counting hook's module up
    spec.loader.exec_module(module)
    monkeypatch.setattr(compiled, "COMPILE_OPTIONS", dict(backend="eager"))
    torch._dynamo.reset()
    threads = torch.get_num_threads()
    out = tmp_path / "chat.json"
    try:
        code = module.main(["--calls", "2", "--max-new-tokens", "6", "--first-prompt-len", "24", "--line-len", "8",
                            "--tree-budget", "2,4", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
        torch._dynamo.reset()
    assert code == 0
    report = json.loads(out.read_text())
    assert set(report["summary"]) == {"plain", "eager", "compiled"}
    assert all(row["same_tokens"] for row in report["summary"].values())
    for row in ("eager", "compiled"):
        first, later = report["calls"][row]
        assert first["setup"] > 0 and later["setup"] == 0.0  # measured (and compiled) once; the same bucket
        assert first["passes"] > later["passes"]
    assert report["calls"]["plain"][1]["passes"] == 6  # transformers: a pass per new token
    assert compiled.RoundSteps._run_verify.__name__ == "_run_verify"  # the script's pass counter is undone
    text = capsys.readouterr().out
    assert "| drop-in, `compile=True` |" in text and "/ plain:" in text
