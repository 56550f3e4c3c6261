"""Compiled rounds: cache sizing per side, a bounded round pool, tree tables owned by their round, distutils.

* the target's cache is sized from the rows a verify writes (``budget + 1``
  tree rows, ``B`` chain rows), the drafter's from the ``B`` block rows a
  draft writes; a round that could write past either cache is refused with a
  clear error before it runs (past the 256-row bucket a DDTree drafter with
  ``B > budget + 1`` used to index out of bounds);
* the pool of compiled rounds on a target is an LRU of
  :data:`~dflash.decoding.compiled.POOL_CAPACITY` entries: it never holds
  more, an evicted entry's caches, buffers and graphs are released (CUDA
  graphs reset), and one cache storage per side serves every bucket that fits
  in it; a call runs on the smallest pooled round of its settings whose
  caches hold it;
* the index tables of the device tree build belong to the round that reads
  them (no global cache of device tensors a captured graph could outlive);
* ``torch.compile`` failing because setuptools could not load its own
  distutils is refused as :class:`CompileUnsupported` with its cause and cure;
* a target once called with ``output_hidden_states=True`` (transformers then
  keeps output-capturing hooks on its layers, which look a ContextVar up)
  still compiles its rounds, and the hooks still capture in the user's own
  calls afterwards.
"""

import gc
import os
import subprocess
import sys
import textwrap
import weakref
from unittest import mock

import pytest
import torch

import dflash
import dflash_kernels
from dflash.decoding import compiled
from dflash.decoding.compiled import CompileUnsupported
from dflash.cache import CacheFullError
from dflash_kernels import tree_device
from prompts import SHORT_PROMPT as PROMPT, greedy
from test_compiled_rounds import trace_only  # noqa: F401  (the fixture: dynamo-only compile)
from tiny_models import tiny_draft, tiny_target

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)


@pytest.fixture
def reference_ops():
    with dflash_kernels.force_backend("reference"):
        yield


def long_prompt(n, seed=0):
    # no pad id (0): transformers infers a mask hiding it, which a prompt of ours refuses
    return torch.randint(1, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def pool_of(target):
    return target._dflash_compiled_rounds


def only_entry(target):
    entries = list(pool_of(target).values())
    assert len(entries) == 1
    return entries[0]


def base_of(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


def pair(*, block_size=8, layers=2):
    target = tiny_target("qwen3", layers=2, hidden=32)
    draft = tiny_draft(target, block_size=block_size, layers=layers, target_layer_ids=[0, 1])
    return target, draft


# ---------------------------------------------------------------------------------------------------- sizing
@pytest.mark.parametrize("mode", ["static", True])
def test_ddtree_drafter_cache_holds_its_block_rows(reference_ops, trace_only, mode):
    """B = 8, budget = 2, prompt + new tokens = 252: the target writes 3 rows a verify (256 rows suffice),
    the drafter 8 context + 8 block rows a draft: its cache needs the next bucket. Lossless.

    Both sides take one bucket (compiled.compiled_rows of the larger need: a growing chat's step is one new
    round, not one per side), so the target's cache is 512 rows too: 512 only because the drafter's rows
    were counted (the target's alone fit 256)."""
    target, draft = pair(block_size=8)
    prompt = long_prompt(249)
    ref = greedy(target, 3, prompt)
    out = dflash.generate(target, draft, prompt, method="ddtree", max_new_tokens=3, block_size=8, tree_budget=2,
                          compile=mode)
    assert torch.equal(out.output_ids, ref)
    rnd = only_entry(target).rnd
    assert rnd.cache.max_len == 512 and rnd.dcache.max_len == 512


@pytest.mark.parametrize("side", ["target", "drafter"])
def test_round_that_could_overflow_is_refused_before_it_runs(reference_ops, monkeypatch, side):
    """Caches made too small on purpose: the host loop refuses the round before it writes past either cache.

    (Compiled rounds size both sides from one bucket, 512 rows here, so one side is made 256 rows at the
    round's construction.)"""
    real = compiled.Round

    def too_small(*args, target_rows, draft_rows, **kw):
        if side == "target":
            target_rows = 256
        else:
            draft_rows = 256
        return real(*args, target_rows=target_rows, draft_rows=draft_rows, **kw)

    monkeypatch.setattr(compiled, "Round", too_small)
    target, draft = pair(block_size=8)
    prompt = long_prompt(254 if side == "target" else 249)
    with pytest.raises(CacheFullError, match=f"the {side} cache of this round"):
        dflash.generate(target, draft, prompt, method="ddtree", max_new_tokens=2, block_size=8, tree_budget=2,
                        compile="static")


# ---------------------------------------------------------------------------------------------------- pool
def test_pool_is_a_bounded_lru(reference_ops, monkeypatch):
    monkeypatch.setattr(compiled, "POOL_CAPACITY", 3, raising=False)
    target, draft = pair(block_size=8)
    ref = greedy(target, 6, PROMPT)
    for block_size in range(2, 9):
        out = dflash.generate(target, draft, PROMPT, method="dflash", max_new_tokens=6, block_size=block_size,
                              compile="static")
        assert torch.equal(out.output_ids, ref), block_size
        assert len(pool_of(target)) <= 3
    assert [k[0].block_size for k in pool_of(target).keys()] == [6, 7, 8]
    # a hit moves its entry to the back: the least recently used one goes next
    again = dflash.generate(target, draft, PROMPT, method="dflash", max_new_tokens=6, block_size=6, compile="static")
    assert again.compile_time == 0.0
    dflash.generate(target, draft, PROMPT, method="dflash", max_new_tokens=6, block_size=3, compile="static")
    assert [k[0].block_size for k in pool_of(target).keys()] == [8, 6, 3]


def test_pool_capacity_from_the_environment():
    env = dict(os.environ, DFLASH_COMPILED_POOL_SIZE="2")
    code = "from dflash.decoding import compiled; print(compiled.POOL_CAPACITY)"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2"


@pytest.mark.parametrize("mode", ["static", True])
def test_evicted_entry_is_released(reference_ops, trace_only, monkeypatch, mode):
    monkeypatch.setattr(compiled, "POOL_CAPACITY", 2, raising=False)
    target = tiny_target("qwen3", layers=2, hidden=32)
    first = tiny_draft(target, block_size=4, layers=2, target_layer_ids=[0, 1])
    other = tiny_draft(target, block_size=4, layers=1, target_layer_ids=[0, 1])  # other drafter cache shapes
    ref = greedy(target, 8, PROMPT)
    kw = dict(method="ddtree", max_new_tokens=8, tree_budget=4, compile=mode)
    assert torch.equal(dflash.generate(target, first, PROMPT, **kw).output_ids, ref)
    steps = only_entry(target)
    rnd = steps.rnd
    held = [steps, rnd, rnd.ctx, rnd.cache.kv, rnd.dcache.kv, base_of(rnd.dcache.kv)]
    refs = [weakref.ref(x) for x in held]
    graphs = (mock.Mock(), [mock.Mock()])  # what a CUDA capture leaves (a verify graph per bucket); eviction
    steps.graphs = graphs                   # must reset them
    del steps, rnd, held
    for block_size in (4, 3):  # two entries of the other drafter evict the first one
        out = dflash.generate(target, other, PROMPT, block_size=block_size, **kw)
        assert torch.equal(out.output_ids, ref)
    assert len(pool_of(target)) == 2
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)
    assert graphs[0].reset.called and graphs[1][0].reset.called


def test_one_cache_storage_serves_smaller_buckets(reference_ops):
    """A short call with the long call's settings runs on the long call's round (it fits: no set-up, no new
    entry); a short call with other settings (budget 3) makes its own smaller round, whose caches view the
    long round's storage."""
    target, draft = pair(block_size=4)
    long, short = long_prompt(300), PROMPT
    kw = dict(method="ddtree", max_new_tokens=8, tree_budget=4, compile="static")
    ref_long, ref_short = greedy(target, 8, long), greedy(target, 8, short)
    assert torch.equal(dflash.generate(target, draft, long, **kw).output_ids, ref_long)
    fits = dflash.generate(target, draft, short, **kw)
    assert torch.equal(fits.output_ids, ref_short) and fits.compile_time == 0.0 and len(pool_of(target)) == 1
    other = dict(kw, tree_budget=3)
    assert torch.equal(dflash.generate(target, draft, short, **other).output_ids, ref_short)
    big, small = list(pool_of(target).values())
    assert (big.rnd.cache.max_len, small.rnd.cache.max_len) == (512, 256)
    ptr = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    assert ptr(small.rnd.cache.kv) == ptr(big.rnd.cache.kv)
    assert ptr(small.rnd.dcache.kv) == ptr(big.rnd.dcache.kv)
    assert ptr(big.rnd.cache.kv) != ptr(big.rnd.dcache.kv)  # the target's and the drafter's never overlap
    # the long setting again, after the short one wrote the shared rows: still the target's tokens, no set-up
    again = dflash.generate(target, draft, long, **kw)
    assert torch.equal(again.output_ids, ref_long) and again.compile_time == 0.0


# ---------------------------------------------------------------------------------------------------- tables
def test_tree_tables_live_as_long_as_their_round(reference_ops):
    target, draft = pair(block_size=4)
    ref = greedy(target, 12, PROMPT)
    kw = dict(method="ddtree", max_new_tokens=12, tree_budget=6, compile="static")
    assert torch.equal(dflash.generate(target, draft, PROMPT, **kw).output_ids, ref)
    tables = only_entry(target).rnd.tree_tables
    tensors = [t for t in tables if isinstance(t, torch.Tensor)]
    assert tensors
    refs = [weakref.ref(t) for t in tensors]
    ptrs = [t.data_ptr() for t in tensors]
    values = [t.clone() for t in tensors]
    del tables, tensors
    # empty every cache the tree module has, and build more than 64 distinct shapes
    for obj in list(vars(tree_device).values()):
        if hasattr(obj, "cache_clear"):
            obj.cache_clear()
    g = torch.Generator().manual_seed(0)
    for budget in range(1, 70):
        lp = torch.randn(3, 4, generator=g).sort(dim=1, descending=True).values.log_softmax(1)
        dflash_kernels.build_tree(lp, torch.arange(12).view(3, 4), budget, on_device=True)
    gc.collect()
    alive = [r() for r in refs]
    assert all(t is not None for t in alive)
    assert [t.data_ptr() for t in alive] == ptrs
    assert all(torch.equal(t, v) for t, v in zip(alive, values))
    again = dflash.generate(target, draft, PROMPT, **kw)
    assert torch.equal(again.output_ids, ref) and again.compile_time == 0.0
    # the tables go with their round, and with nothing else
    del alive
    pool_of(target).clear()
    gc.collect()
    assert all(r() is None for r in refs)


def test_no_global_cache_in_the_device_tree_build():
    cached = sorted(name for name, obj in vars(tree_device).items() if hasattr(obj, "cache_info"))
    assert cached == []


# ---------------------------------------------------------------------------------------------------- distutils
def _distutils_failure():
    from torch._inductor.exc import InductorError

    return InductorError(AssertionError("/usr/lib/python3.11/distutils/core.py"), None)


def _assert_distutils_message(message: str):
    assert "distutils" in message
    assert "pip" in message
    assert "import setuptools" in message
    assert "SETUPTOOLS_USE_DISTUTILS=stdlib" in message
    assert "compile=False" in message


def test_distutils_failure_is_explained(reference_ops, monkeypatch):
    def broken(fn, device):
        def run(*args):
            raise _distutils_failure()
        return run

    monkeypatch.setattr(compiled, "_compiled", broken)
    target, draft = pair(block_size=4)
    with pytest.raises(CompileUnsupported) as info:
        dflash.generate(target, draft, PROMPT, method="dflash", max_new_tokens=4, compile=True)
    _assert_distutils_message(str(info.value))


def _subprocess_env():
    env = {k: v for k, v in os.environ.items() if k != "SETUPTOOLS_USE_DISTUTILS"}
    env["PYTHONPATH"] = os.pathsep.join([TESTS, ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def test_distutils_failure_after_importing_pip():
    """The real failure, where this Python has it: importing pip first switches setuptools' distutils shim off
    (Python < 3.12), so inductor's import of setuptools fails; the compile is refused with the cause."""
    probe = subprocess.run([sys.executable, "-c", "import pip, setuptools"], env=_subprocess_env(),
                           capture_output=True, text=True, timeout=300)
    if probe.returncode == 0 or "distutils" not in probe.stderr:
        pytest.skip("importing pip before setuptools does not break setuptools' distutils here")
    script = textwrap.dedent("""
        import pip  # noqa: F401  (switches setuptools' distutils shim off)
        import torch
        import dflash, dflash_kernels
        from dflash.decoding.compiled import CompileUnsupported
        from tiny_models import tiny_draft, tiny_target
        target = tiny_target("qwen3", layers=2, hidden=32)
        draft = tiny_draft(target, block_size=4, target_layer_ids=[0, 1])
        with dflash_kernels.force_backend("reference"):
            try:
                dflash.generate(target, draft, [5, 17, 33], method="dflash", max_new_tokens=4, compile=True)
            except CompileUnsupported as exc:
                print("REFUSED:", str(exc).replace("\\n", " "))
            else:
                print("COMPILED")
    """)
    out = subprocess.run([sys.executable, "-c", script], env=_subprocess_env(), cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [ln for ln in out.stdout.splitlines() if ln.startswith(("REFUSED", "COMPILED"))]
    assert line and line[-1].startswith("REFUSED"), out.stdout[-3000:]
    _assert_distutils_message(line[-1])


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_a_target_with_output_capturing_hooks_compiles(reference_ops, trace_only, method):
    target, draft = pair(block_size=4)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        before = target(ids, output_hidden_states=True).hidden_states
    kw = dict(method=method, max_new_tokens=10, **(dict(tree_budget=4) if method == "ddtree" else {}))
    out = dflash.generate(target, draft, PROMPT, compile=True, **kw)
    assert torch.equal(out.output_ids, greedy(target, 10, PROMPT))
    assert dflash.generate(target, draft, PROMPT, compile=True, **kw).acceptance_lengths == out.acceptance_lengths
    with torch.no_grad():  # the hooks are untouched: they capture again in the user's own call
        after = target(ids, output_hidden_states=True).hidden_states
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
