"""``generate(..., compile=True)``: the rounds' fixed-shape steps compiled as whole graphs (CUDA graphs on a GPU).

At batch 1 an eager round is launch- and Python-bound: every layer is tens of
small ops. Here the draft and verify steps of :class:`~dflash.decoding.static_round.StaticRound`
(functions of fixed-shape device tensors only) are traced once by
``torch.compile(fullgraph=True, dynamic=False)``; on CUDA each compiled step
is then captured in a ``torch.cuda.CUDAGraph`` and a round is two graph
replays plus the one host read of its payload.

Set-up, all before the generation's clock starts (its seconds go to
``result.compile_time``, never into ``total_time`` or tokens/s):

1. a :class:`StaticRound` for the settings (method, block size, budget,
   sampling mode, cache rows rounded up to :data:`~dflash.decoding.static_round.ROW_BUCKET`)
   comes from a pool on the target model, so a later generation with the
   same settings reuses its buffers, its compiled code and its graphs;
2. a new entry is warmed up: its caches are frozen at length 0, each step
   runs twice (the first call compiles), on CUDA the steps are captured, then
   the state is put back and the caches thawed for the eager prefill.

A target that cannot be traced as one graph raises :class:`CompileUnsupported`
naming the cause (run it with ``compile=False``, the default and the
reference). Hybrid (linear-attention) targets are refused up front.
"""

from __future__ import annotations

import itertools
import time
import types
import warnings
from typing import Optional

import torch

from ..target import TargetAdapter
from .result import GenerationResult
from .ddtree import _check_budget
from .speculation import (HostReader, SeedSource, StageClock, _check_common, _Output, _prepare_prompt, as_sampling,
                          block_size_of, check_pair, choose_tokens, mask_token_id_of)
from .static_round import StaticRound, bucket_rows

__all__ = ["CompileUnsupported", "compiled_generate", "COMPILE_MODES"]

#: ``compile=`` values: True / "compile" (torch.compile; CUDA graphs on CUDA), "static" (the same fixed-shape
#: steps run eagerly: what the compiled graphs compute, for tests and comparisons)
COMPILE_MODES = (True, "compile", "static")


class CompileUnsupported(RuntimeError):
    """The target (or a setting) cannot be run as compiled fixed-shape rounds; run with ``compile=False``."""


def _draft_step(rnd: StaticRound) -> None:
    rnd.draft()


def _verify_step(rnd: StaticRound) -> torch.Tensor:
    return rnd.verify()


#: ``torch.compile`` keywords of the steps (tests trace with ``backend="eager"`` to count graph breaks cheaply).
#: On the CPU inductor's C++ wrapper replaces the Python one: a round's graph is ~100 kernel and GEMM calls, and
#: calling them from Python costs as much as the tiny pair's arithmetic.
COMPILE_OPTIONS = dict(backend="inductor")

def _compile_kwargs(device: torch.device) -> dict:
    kw = dict(COMPILE_OPTIONS)
    if kw.get("backend") == "inductor" and device.type == "cpu":
        kw["options"] = {"cpp_wrapper": True, **kw.get("options", {})}
    return kw


_copies = itertools.count()


def _compiled(fn, device: torch.device):
    """``torch.compile`` of a private copy of step ``fn``: its own code object, so its own dynamo cache.

    Dynamo keeps compiled graphs per code object, at most ``recompile_limit``
    (8) of them, and checks their guards in turn on every call: one shared
    step function would fail (fullgraph) once a process has compiled rounds
    for 8 models or settings, and pay every entry's guards. Each pooled
    :class:`CompiledSteps` compiles its own copy: one graph, one guard set.
    """
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_copies)}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name)
    return torch.compile(copy, fullgraph=True, dynamic=False, **_compile_kwargs(device))


class CompiledSteps:
    """A pooled :class:`StaticRound` and its runnable steps (compiled, captured on CUDA, or eager-static)."""

    def __init__(self, rnd: StaticRound, mode):
        self.rnd, self.mode = rnd, mode
        self.cuda = rnd.device.type == "cuda" and mode != "static"
        self.graphs = None
        self.payload = None
        self.ready = False
        if mode == "static":
            self._draft, self._verify = _draft_step, _verify_step
        else:
            self._draft, self._verify = _compiled(_draft_step, rnd.device), _compiled(_verify_step, rnd.device)

    def _run_draft(self):
        return self._draft(self.rnd)

    def _run_verify(self):
        return self._verify(self.rnd)

    def _round(self) -> torch.Tensor:
        if self.rnd.method != "ar":
            self._run_draft()
        return self._run_verify()

    def _capture(self) -> None:
        """Warm up on a side stream (the first calls compile), then capture each step in a CUDA graph."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.rnd.restore()
                self._round()
        torch.cuda.current_stream().wait_stream(side)
        self.rnd.restore()
        draft_graph = None
        if self.rnd.method != "ar":
            draft_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(draft_graph):
                self._run_draft()
        verify_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(verify_graph, pool=draft_graph.pool() if draft_graph is not None else None):
            self.payload = self._run_verify()
        self.graphs = (draft_graph, verify_graph)

    def prepare(self) -> float:
        """Compile (and capture) the steps once; returns the seconds it took (0 when already done).

        Runs on the frozen, empty caches; the rounds it runs write only scratch rows past the committed
        length, and the small state they change is put back (:meth:`StaticRound.snapshot`)."""
        if self.ready:
            return 0.0
        t0 = time.perf_counter()
        rnd = self.rnd
        rnd.freeze()
        rnd.snapshot()
        try:
            with warnings.catch_warnings():
                # the device tree build caches its index tables with functools.lru_cache (keyed by shapes
                # only): tracing through the cache is exactly right here, dynamo's generic warning is noise
                warnings.filterwarnings("ignore", message=".*functools.lru_cache.*")
                if self.cuda:
                    self._capture()
                elif self.mode != "static":
                    for _ in range(2):
                        rnd.restore()
                        self._round()
        except Exception as exc:  # dynamo / inductor / capture failures: say what and what to do
            raise CompileUnsupported(
                f"{type(rnd.adapter.model).__name__} cannot be run as compiled rounds ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); run it with compile=False") from exc
        finally:
            rnd.restore()
            rnd.thaw()
        self.ready = True
        return time.perf_counter() - t0

    def draft(self) -> None:
        """The round's draft step (nothing for AR)."""
        if self.rnd.method == "ar":
            return
        if self.graphs is not None:
            self.graphs[0].replay()
        else:
            self._run_draft()

    def verify(self) -> torch.Tensor:
        if self.graphs is not None:
            self.graphs[1].replay()
            return self.payload
        return self._run_verify()


def _pool(target) -> dict:
    pool = getattr(target, "_dflash_compiled_rounds", None)
    if pool is None:
        pool = {}
        try:
            setattr(target, "_dflash_compiled_rounds", pool)
        except AttributeError:  # pragma: no cover - a target that refuses attributes: no pooling
            pass
    return pool


def _sampling_key(sampling):
    return (sampling.greedy, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)


def _check_compilable(adapter: TargetAdapter) -> None:
    if getattr(adapter.spec, "linear_layers", None):
        raise CompileUnsupported(
            f"{type(adapter.model).__name__} has linear-attention layers (a hybrid target): compiled rounds cover "
            "full-attention targets only; run it with compile=False")


@torch.inference_mode()
def compiled_generate(target, draft, input_ids, *, method: str, max_new_tokens, temperature=0.0,
                      stop_token_ids=None, block_size=None, seed=None, tree_budget=None, mask_token_id=None,
                      stage_timing=True, sampling=None, stopping_criteria=None, streamer=None,
                      compile=True) -> GenerationResult:
    """AR, DFlash or DDTree generation with compiled fixed-shape rounds (same tokens as the eager loops at T=0).

    ``compile``: True (compiled; CUDA graphs on CUDA) or ``"static"`` (the
    same steps run eagerly). Sampled output (T > 0) has the target's
    distribution; its noise is keyed by a device seed (``seed`` gives a
    reproducible run), so samples differ from the eager loops' draws.
    """
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES} or False, got {compile!r}")
    sampling = as_sampling(sampling, temperature)
    stop_ids = _check_common(max_new_tokens, sampling.temperature, stop_token_ids)
    capture = draft.target_layer_ids if method != "ar" else ()
    adapter = TargetAdapter(target, capture)
    out = None
    try:
        _check_compilable(adapter)
        device = adapter.device
        if method == "ar":
            B, budget, mask_id = 1, 0, 0
        else:
            check_pair(adapter, draft)
            B = block_size_of(draft, block_size)
            budget = 0
            if method == "ddtree":
                budget = _check_budget(2 * (B - 1) if tree_budget is None else tree_budget)
            mask_id = mask_token_id_of(draft, mask_token_id, adapter.vocab_size)
        prompt = _prepare_prompt(input_ids, adapter.vocab_size, device)
        seeds = SeedSource(seed)
        rows = budget + 1 if method == "ddtree" else B
        max_rows = prompt.numel() + max_new_tokens + rows + 1
        key = (method, id(draft) if draft is not None else None, B, budget, mask_id, _sampling_key(sampling),
               bucket_rows(max_rows), str(device), compile, repr(sorted(_compile_kwargs(device).items())))
        pool = _pool(target)
        steps = pool.get(key)
        if steps is None:
            rnd = StaticRound(adapter, draft, method=method, block_size=B, tree_budget=budget, max_rows=max_rows,
                              sampling=sampling, seed=0, mask_token_id=mask_id)
            steps = pool[key] = CompiledSteps(rnd, compile)
        rnd = steps.rnd
        rnd.adapter = adapter  # this call's adapter (hooks, attention switch); the same model
        compile_time = steps.prepare()
        rnd.reset(seeds.next())
        out = _Output(prompt, max_new_tokens, stop_ids, stopping_criteria=stopping_criteria, streamer=streamer)
        result = GenerationResult(output_ids=prompt[None], num_prompt_tokens=prompt.numel(), method=method)
        result.compile_time = compile_time
        reader = HostReader(device, max(B, rows) + 2)
        start = time.perf_counter()
        first = rnd.start(prompt, lambda h: choose_tokens(adapter, h, sampling, seeds.next()))
        out.extend(reader.read(first))
        result.time_to_first_token = time.perf_counter() - start
        clock = StageClock(device, stage_timing)
        D = B - 1
        while not out.done:
            if method != "ar":
                steps.draft()
                clock.mark("draft")
            host = reader.read(steps.verify())
            clock.mark("verify")
            before = out.committed
            if method == "ar":
                out.extend(host)
            elif method == "dflash":
                out.extend(host[: host[B] + 1])
            else:
                out.extend(host[: host[D + 1]])
                result.tree_sizes.append(rnd.N)
                result.accepted_depths.append(host[D + 1] - 1)
            result.acceptance_lengths.append(out.committed - before)
        result.total_time = time.perf_counter() - start
        stages = clock.totals()
        result.draft_time = stages.get("draft", 0.0)
        result.verify_time = stages.get("verify", 0.0)
        result.output_ids = torch.tensor([out.tokens], device=device)
        return result
    finally:
        try:
            if out is not None:
                out.close()
        finally:
            adapter.close()
