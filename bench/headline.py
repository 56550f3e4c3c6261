"""The headline table: tokens/s of every way to decode a Qwen3-8B-shaped target, and how close each comes to its limit.

Run on a GPU machine as ``bench/gpu_check.sh``'s ``headline`` step (the scaled-down default below), or
``python bench/headline.py --full --prompt-lens 512`` (then ``4096``) for the whole table, each on a lease of its
own. On a CPU (tests): ``python bench/headline.py --dry-run`` (tiny fp32 shapes: a check of the script, not of
speed).

**Pair.** The target is a ``Qwen3ForCausalLM`` with random weights built on the device
(``gpu_round_latency.build_target``) at Qwen3-8B shapes: 36 layers, hidden 4096, 32 query / 8 KV heads of
128, MLP 12288, vocab 151936, bf16; its ``eos_token_id`` is cleared so that every row makes exactly
``--new-tokens`` tokens. Random weights accept nothing, so the drafter (5 layers, block ``B = 16``, target
layers ``default_target_layer_ids(36, 5)``) is steered: it runs its real layers (their cost is in every
round) and its block states are then replaced by those of ``gpu_auto_budget.SteeredDraft`` (the minimum-norm
state whose lm_head logits rank the target's greedy token first with probability ``p`` per position, else a
wrong token first and the right one a close second), precomputed once per prompt for every position of the
greedy text and read by index (no host read, nothing to trace but an ``index_select``). A chain of ``B - 1``
drafts whose positions are each right with probability ``p`` commits on average
``tau(p) = 1 + p + p^2 + ... + p^(B-1)`` tokens per round; ``p`` is solved from each asked ``--taus`` value
(3, 6, 9: ``p`` = 0.667, 0.844, 0.916 at ``B = 16``). A tree also catches the right second choices, so
``ddtree``'s measured tau is higher than the chain's at the same ``p``. In bf16 a verify of 16 rows may
round a near-tie of the random target's flat logits differently from a 1-token decode step: the output
then leaves the greedy text (reported below with its margin, never hidden) and the steered drafter, still
steered to the greedy text, stops being accepted from there.

**Rows**, for each prompt length of ``--prompt-lens`` (a random prompt), ``--new-tokens`` new tokens, greedy:

* transformers AR: ``target.generate`` eager (DynamicCache), and with ``cache_implementation="static"``
  (transformers then compiles the forward with ``torch.compile``: its auto-compile of a static cache on
  CUDA); the eager row's tokens are the greedy text every other row is checked against;
* ours: ``dflash.generate(method="ar" | "dflash" | "ddtree", tree_budget="auto")``, eager and
  ``compile=True`` (torch.compile + CUDA graphs, compiled in an untimed warm-up call);
* the drop-in: ``with dflash.apply(target, draft, compile=...): target.generate(...)`` (DDTree, auto
  budget), eager and compiled;
* z-lab's ``dflash_generate`` and the DDTree reference's ``ddtree_generate`` (its fixed budget: the one our
  auto budget chose most often at that tau), run by ``bench/headline_refs.py`` (one process per reference and
  prompt length, every tau in it) from the carried sources ``--ref-src``/zlab (z-lab's ``dflash/`` package
  folder) and ``--ref-src``/ddtree (a checkout of the DDTree code), on the same target (rebuilt from its seed)
  and our drafter's weights in z-lab's format, steered to the same states: present when carried, else the row
  reads "not carried"; a reference that fails reads "failed: ..." (never a failed step; one of the other
  rows that raises is reported the same way, the other rows still run, and the exit status is then 1).

The AR rows do not depend on ``p``: they run once per prompt length; the speculative rows once per tau.
Every row first runs once untimed (a short eager call: Triton's first launches, the auto budget's cost
measurement; a compiled row's full call: its compile), then once timed: tokens/s = new tokens / wall
seconds of the call (``perf_counter``, synchronized; prefill included, a compiled row's set-up not).

**The limit.** A speculative round can at best cost its draft plus its verify: with ``t_AR`` the AR decode
step (ours eager ``ar``: (total - time to first token) / (new tokens - 1)) and ``t_round`` the draft + verify
seconds per round of our eager row of the same method (CUDA events of ``stage_timing``: the chain's for the
DFlash rows, the tree's for the DDTree rows), a loop that commits ``tau`` tokens per round runs at most at
``limit = tau / t_round`` tokens/s, a speedup of ``tau * t_AR / t_round`` over AR. Each row's ``of limit`` is
its tokens/s over the limit at its own measured tau (an AR row's limit is ``1 / t_AR``): how much of what its
acceptance allows it gets, the rest being the loop's own overhead (commit, host reads, Python).

**Memory.** ``torch.cuda.max_memory_allocated`` over each timed call (reset before it), in GiB, weights
included; beside it that peak less what was allocated before the call.

**Greedy.** Every row's tokens against the transformers AR eager row's; at a difference,
``dflash.decoding.parity.first_divergence`` runs the target on the common prefix and reports the fp32
margin between the two tokens and the top-2 gap. A difference fails the run in fp32 (the dry run); in bf16
it is reported (its row says where and with what margin) and the run still passes.

**Time.** ``--deadline-s`` (default ``$GPU_CHECK_GRANTED_S``, what ``gpu_check.sh`` grants the step, less 5 s
to write the report; counted from the script's start, its imports included): a row that would start with less than ``--min-row-s`` left is skipped, and each row
runs under a ``SIGALRM`` guard of the time left (and at most ``--row-timeout-s``): a row past it is
stopped and reported as "skipped (over its N s guard)", the step carries on and passes. The JSON is
rewritten after every row.

**Default vs full.** The GPU check's 540 s were all planned before this step; it takes 25 s from the steps
with the most room over their measured times and runs on what probe, build and kernels leave too (about 35 s
in all). That fits the 36-layer target's build, the first Triton launches and the eager rows of one small
case, so the default is one prompt of 512 tokens, 64 new tokens, tau 6, the eager rows (transformers AR, ours
ar / dflash / ddtree, the drop-in) and the references when carried; a row that does not fit is skipped by its
guard. ``--full`` is the whole table: prompts of 512 and 4096 tokens, 256 new tokens, tau 3, 6 and 9, every
row eager and compiled (each compiled row's first call compiles: tens of seconds at 36 layers). It does not
fit one 540 s run: run it one prompt length at a time, each alone (``GPU_CHECK_STEPS=headline
GPU_CHECK_HEADLINE_ARGS="--full --prompt-lens 512"``: about 530 s granted), the guards skipping what still
does not fit.

Output: ``--json`` (else ``$OUT/headline.json``) and ``--markdown`` (else ``$OUT/headline.md``): the table
ready for the README's "On an H200 / H100" section.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

STARTED = time.monotonic()  # run as a script, the deadline counts from here: the imports below take seconds

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_auto_budget import SteeredDraft  # noqa: E402
from gpu_common import (add_dry_run, apply_dry_run, cuda_name, default_json, fail_without_cuda, skipped,  # noqa: E402
                        write_json)
from gpu_round_latency import QWEN3_8B, TINY, build_target  # noqa: E402
from headline_refs import checksum  # noqa: E402

import dflash  # noqa: E402
from dflash.benchmark.arguments import int_list  # noqa: E402
from dflash.decoding.parity import first_divergence  # noqa: E402
from dflash.drafter.model import DFlashDraftModel  # noqa: E402

PROG = "headline"
HERE = Path(__file__).resolve().parent
GIB = 2.0 ** 30
REF_IMPLS = {"zlab": "z-lab dflash_generate", "ddtree": "DDTree reference"}


# ------------------------------------------------------------------ the steered drafter
def chain_tau(p: float, block: int) -> float:
    """Expected tokens per round of a chain of ``block - 1`` drafts, each right with probability ``p``."""
    return 1.0 + sum(p ** k for k in range(1, block))


def p_for_tau(tau: float, block: int) -> float:
    """The per-position probability ``p`` with ``chain_tau(p, block) == tau`` (bisection; 1 <= tau <= block)."""
    if not 1.0 <= tau <= block:
        raise ValueError(f"tau {tau} is outside [1, {block}] for block size {block}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chain_tau(mid, block) < tau else (lo, mid)
    return (lo + hi) / 2


class CostedSteeredDraft(SteeredDraft):
    """A :class:`SteeredDraft` that still runs its layers: each round pays the real drafter's cost.

    :meth:`steer` precomputes ``table [R, H]``, the steered state of every position ``0 .. R-1`` of the
    reference text (SteeredDraft's own draws and solve, over all positions at once); :meth:`draft_block`
    runs :meth:`DFlashDraftModel.draft_block` (the layers, the cache advance) and returns ``table[position]``
    (``+ 0 * real`` keeps the layers' output alive under torch.compile). Re-steering copies into the same
    table, so compiled rounds captured earlier read the new states.
    """

    def steer(self, reference: torch.Tensor, p_right: float) -> None:
        self.reference = reference.flatten().to(self.W.device)
        self.p_right = float(p_right)
        self.noise.manual_seed(0)
        R, H = self.reference.numel(), self.W.shape[1]
        fake_cache = SimpleNamespace(length_t=torch.zeros(1, dtype=torch.int64, device=self.W.device),
                                     advance=lambda count: None)
        blank = torch.empty(1, R, H, dtype=self.fc.weight.dtype, device=self.W.device)
        with torch.no_grad():
            states = SteeredDraft.draft_block(self, blank, None, torch.zeros(1, dtype=torch.int64,
                                                                               device=self.W.device), fake_cache)[0]
            if getattr(self, "table", None) is not None and self.table.shape == states.shape:
                self.table.copy_(states)
            else:
                self.table = states

    def draft_block(self, block_embeds, context_features, context_count, cache, block_size=None, draft_window=None):
        if block_embeds.dim() == 2:
            return self.draft_block(block_embeds[None], context_features[None], context_count, cache,
                                    block_size, draft_window)[0]
        B = block_embeds.shape[1]
        rows = torch.arange(B, device=block_embeds.device)
        position = ((cache.length_t + context_count)[:, None] + rows).clamp(max=self.table.shape[0] - 1)
        real = DFlashDraftModel.draft_block(self, block_embeds, context_features, context_count, cache,
                                            block_size, draft_window)
        return self.table[position].to(real.dtype) + real * 0


def build_drafter(target, shape: dict, layers: int, draft_layers: int, block: int, dtype, device):
    """A random ``draft_layers``-layer :class:`CostedSteeredDraft` at the target's shapes, built on the device."""
    cfg = dflash.make_draft_config(
        hidden_size=shape["hidden_size"], num_hidden_layers=draft_layers,
        num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_key_value_heads"],
        intermediate_size=shape["intermediate_size"], vocab_size=shape["vocab_size"], num_target_layers=layers,
        block_size=block, mask_token_id=shape["vocab_size"] - 1,
        target_layer_ids=dflash.default_target_layer_ids(layers, draft_layers), head_dim=shape["head_dim"],
        max_position_embeddings=32768)
    torch.manual_seed(1)
    with torch.device(device):  # fp32 on the device (a billion parameters: slow to draw on a CPU), then cast
        draft = CostedSteeredDraft(cfg, target.lm_head.weight, torch.zeros(1, dtype=torch.int64), 1.0)
    return draft.to(device=device, dtype=dtype).eval()


# ------------------------------------------------------------------ timing, memory, guards
class RowTimeout(Exception):
    pass


@contextlib.contextmanager
def guard(seconds: float):
    """Raise :class:`RowTimeout` in this thread after ``seconds`` (SIGALRM; between Python bytecodes); inf: none."""
    if seconds == float("inf"):
        yield
        return

    def ring(signum, frame):
        raise RowTimeout()

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(fn, device):
    """``(wall seconds, peak GiB or None, peak above the start GiB or None, fn())``, synchronized."""
    sync(device)
    base = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    wall = time.perf_counter() - t0
    if base is None:
        return wall, None, None, out
    peak = torch.cuda.max_memory_allocated(device)
    return wall, peak / GIB, (peak - base) / GIB, out


# ------------------------------------------------------------------ rows
class Row:
    """One row: how it runs (``warm()``, ``run() -> (new token ids, result or None)``) and what it measured."""

    def __init__(self, name, method, kind, run, warm=None, needs_cuda=False):
        self.name, self.method, self.kind = name, method, kind  # method: ar / dflash / ddtree
        self.run, self.warm, self.needs_cuda = run, warm, needs_cuda


def ours_row(name, target, draft, prompt, method, n, compile, stage_timing=True):
    kw = dict(method=method, max_new_tokens=n, compile=compile)
    if method != "ar":
        kw["stage_timing"] = stage_timing
    if method == "ddtree":
        kw["tree_budget"] = "auto"

    def call(tokens):
        res = dflash.generate(target, draft if method != "ar" else None, prompt, **dict(kw, max_new_tokens=tokens))
        return res.output_ids[0, prompt.numel():].tolist(), res

    return Row(name, method, "compiled" if compile else "eager", lambda: call(n),
               (lambda: call(n)) if compile else (lambda: call(min(n, 16))), needs_cuda=compile)


def dropin_row(name, target, draft, prompt, n, compile):
    def call(tokens):
        with dflash.apply(target, draft, compile=compile) as handle:
            out = target.generate(prompt[None], max_new_tokens=tokens, do_sample=False)
            return out[0, prompt.numel():].tolist(), handle.last_result

    return Row(name, "ddtree", "compiled" if compile else "eager", lambda: call(n),
               (lambda: call(n)) if compile else (lambda: call(min(n, 16))), needs_cuda=compile)


def hf_row(name, target, prompt, n, static):
    kw = dict(do_sample=False)
    if static:
        kw["cache_implementation"] = "static"

    def call(tokens):
        out = target.generate(prompt[None], max_new_tokens=tokens, **kw)
        return out[0, prompt.numel():].tolist(), None

    return Row(name, "ar", "compiled" if static else "eager", lambda: call(n),
               (lambda: call(n)) if static else (lambda: call(min(n, 8))), needs_cuda=static)


class Clock:
    """The run's deadline (``deadline_s`` after ``started``, default now) and the per-row cap."""

    def __init__(self, deadline_s, row_cap_s, min_row_s, started=None):
        start = time.monotonic() if started is None else started
        self.end = None if deadline_s is None else start + deadline_s
        self.row_cap_s, self.min_row_s = row_cap_s, min_row_s

    def row_budget(self):
        left = float("inf") if self.end is None else self.end - time.monotonic()
        return min(left, self.row_cap_s or float("inf"))


def measure(row: Row, device, clock: Clock, dry_run: bool) -> dict:
    """Warm up and time one row under its guard; a dict with its state and numbers."""
    out = dict(row=row.name, method=row.method, kind=row.kind, state="ok")
    if row.needs_cuda and device.type != "cuda":
        out["state"] = "skipped (CUDA only: torch.compile + CUDA graphs)"
        if dry_run:
            skipped(PROG, row.name, "torch.compile / CUDA graphs need CUDA")
        return out
    budget = clock.row_budget()
    if budget < clock.min_row_s:
        out["state"] = f"skipped (no time: {max(budget, 0):.0f} s left)"
        return out
    try:
        with guard(budget):
            t0 = time.perf_counter()
            if row.warm is not None:
                row.warm()
            out["warmup_s"] = time.perf_counter() - t0
            wall, peak, above, (tokens, res) = timed_call(row.run, device)
    except RowTimeout:
        out["state"] = f"skipped (over its {budget:.0f} s guard)"
        return out
    except Exception as e:  # reported in the table, never hidden, and the other rows still run
        out["state"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return out
    if res is not None:
        wall -= getattr(res, "compile_time", 0.0)  # a recompile inside the timed call is set-up, not decoding
    out.update(tokens=tokens, new_tokens=len(tokens), wall_s=wall, tokens_per_s=len(tokens) / wall,
               peak_gib=peak, peak_above_start_gib=above)
    if res is not None and row.method != "ar":
        rounds = max(len(res.acceptance_lengths), 1)
        out.update(tau=sum(res.acceptance_lengths) / rounds, rounds=len(res.acceptance_lengths))
        if res.tree_sizes:
            out["tree_sizes_mode"] = collections.Counter(res.tree_sizes).most_common(1)[0][0]
        if res.draft_time or res.verify_time:
            out["draft_verify_s_per_round"] = (res.draft_time + res.verify_time) / rounds
    elif row.method == "ar":
        out["tau"] = 1.0
        if res is not None and len(tokens) > 1:
            out["ar_step_s"] = (res.total_time - res.time_to_first_token) / (len(tokens) - 1)
    return out


# ------------------------------------------------------------------ the reference rows
def reference_sources(ref_src: str) -> dict:
    """impl -> its carried source folder, or None where it was not carried."""
    root = Path(ref_src)
    zlab, ddtree = root / "zlab", root / "ddtree"
    return {"zlab": zlab if (zlab / "dflash" / "model.py").is_file() else None,
            "ddtree": ddtree if (ddtree / "ddtree.py").is_file() else None}


def reference_rows(sources: dict, setup: dict, clock: Clock, workdir: Path) -> dict:
    """impl -> its rows, one per tau of ``setup["taus"]``: each implementation in one ``bench/headline_refs.py``
    process (its imports and its target's build paid once per prompt length), which rewrites its results after
    every tau; a process stopped by the guard keeps the taus it finished. ``setup``: what headline_refs.py reads
    (its docstring), written to ``workdir``."""
    taus = setup["taus"]
    out = {}
    for impl, src in sources.items():
        rows = [dict(row=REF_IMPLS[impl], method="dflash" if impl == "zlab" else "ddtree", kind="reference")
                for _ in taus]
        out[impl] = rows
        if src is None:
            for r in rows:
                r["state"] = "not carried"
            continue
        budget = clock.row_budget()
        if budget < clock.min_row_s:
            for r in rows:
                r["state"] = f"skipped (no time: {max(budget, 0):.0f} s left)"
            continue
        spec, result = workdir / "setup.pt", workdir / f"{impl}.json"
        result.unlink(missing_ok=True)
        torch.save(setup, spec)
        cmd = [sys.executable, str(HERE / "headline_refs.py"), impl, "--src", str(Path(src).resolve()),
               "--setup", str(spec), "--out", str(result)]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        why = None
        try:
            proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True,
                                  timeout=None if budget == float("inf") else budget)
            if proc.returncode != 0:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
                why = f"failed (exit {proc.returncode}): {tail[0][:200]}"
        except subprocess.TimeoutExpired:
            why = f"skipped (over its {budget:.0f} s guard)"
        done = json.loads(result.read_text()) if result.is_file() else []
        for r, res in zip(rows, done + [None] * (len(rows) - len(done))):
            if res is not None:
                r.update(res)
            else:
                r["state"] = why or "failed: no result"
    return out


def reference_setup(target, draft, prompt, reference_text, n, tables, tree_budgets, taus, args, device,
                    workdir: Path) -> dict:
    """What headline_refs.py needs for one prompt (every tau's steered table); the drafter in z-lab's format."""
    drafter = workdir / "drafter_zlab"
    if not drafter.is_dir():
        draft.save_pretrained(drafter, format="zlab")
    return dict(shape=TINY if args.tiny else QWEN3_8B, layers=args.layers, dtype=args.dtype, device=str(device),
                prompt=prompt.cpu(), new_tokens=n, tables=tables, drafter=str(drafter), taus=taus,
                tree_budgets=tree_budgets, checksum=checksum(target), reference=reference_text.cpu())


# ------------------------------------------------------------------ the greedy check and the limit
def greedy_check(target, prompt: torch.Tensor, reference: list, row: dict) -> None:
    """Set ``row["greedy"]`` ("equal", or the first difference and the target's margin there)."""
    if "tokens" not in row:
        return
    if row["tokens"] == reference:
        row["greedy"] = "equal"
        return
    head = prompt.tolist()
    div = first_divergence(target, head + reference, head + row["tokens"])
    row["greedy"] = "differs"
    row["divergence"] = dict(new_token=div.index - len(head), expected=div.expected, got=div.got,
                             logit_margin=div.logit_margin, top2_gap=div.top2_gap, describe=div.describe())


def add_limits(rows: list, t_ar) -> dict:
    """Per method the draft + verify seconds per round (ours eager), and each row's limit and share of it."""
    t_round = {r["method"]: r["draft_verify_s_per_round"] for r in rows
               if r.get("kind") == "eager" and r["row"].startswith("ours") and "draft_verify_s_per_round" in r}
    for r in rows:
        if "tokens_per_s" not in r or t_ar is None:
            continue
        if r["method"] == "ar":
            r["limit_tokens_per_s"], r["limit_speedup"] = 1.0 / t_ar, 1.0
        elif r["method"] in t_round and r.get("tau"):
            r["limit_tokens_per_s"] = r["tau"] / t_round[r["method"]]
            r["limit_speedup"] = r["tau"] * t_ar / t_round[r["method"]]
        if "limit_tokens_per_s" in r:
            r["of_limit"] = r["tokens_per_s"] / r["limit_tokens_per_s"]
    return t_round


# ------------------------------------------------------------------ main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small fp32 model (CPU test of this script)")
    p.add_argument("--full", action="store_true", help="the whole table (module docstring): a lease of its own")
    p.add_argument("--layers", type=int, default=None, help="target decoder layers (default 36; tiny 2)")
    p.add_argument("--draft-layers", type=int, default=None, help="drafter layers (default 5; tiny 1)")
    p.add_argument("--block", type=int, default=None, help="drafter block size B (default 16; tiny 8)")
    p.add_argument("--prompt-lens", type=int_list, default=None, help="default 512 (full: 512,4096)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 64 (full: 256)")
    p.add_argument("--taus", default=None, help="chain taus the drafter is steered to (default 6; full: 3,6,9)")
    p.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=None,
                   help="the compiled rows (default: only with --full)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="default bf16; tiny fp32")
    p.add_argument("--ref-src", default="runs/refsrc", help="carried reference sources: zlab/dflash/, ddtree/")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="seconds for the whole run (default: $GPU_CHECK_GRANTED_S - 5, else none)")
    p.add_argument("--row-timeout-s", type=float, default=None, help="at most this per row (default none)")
    p.add_argument("--min-row-s", type=float, default=None, help="skip a row with less than this left (default 4)")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    add_dry_run(p)
    args = p.parse_args(argv)
    apply_dry_run(args, PROG, layers=2, draft_layers=1, block=8, prompt_lens=[24], new_tokens=12, taus="6",
                  dtype="float32")
    tiny = args.tiny
    defaults = dict(layers=2 if tiny else 36, draft_layers=1 if tiny else 5, block=8 if tiny else 16,
                    prompt_lens=[512, 4096] if args.full else [512], new_tokens=256 if args.full else 64,
                    taus="3,6,9" if args.full else "6", compiled=args.full,
                    dtype="float32" if tiny else "bfloat16", min_row_s=1.0 if tiny else 4.0)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.taus = [float(t) for t in str(args.taus).split(",") if t.strip()]
    if args.deadline_s is None and os.environ.get("GPU_CHECK_GRANTED_S"):
        args.deadline_s = max(float(os.environ["GPU_CHECK_GRANTED_S"]) - 5.0, 1.0)
    return args


def main(argv=None, started=None) -> int:
    """``started``: the ``time.monotonic()`` the deadline counts from (the script passes its start, imports
    included); default: this call."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if fail_without_cuda(torch, device, PROG):
        return 2
    if args.dry_run:
        skipped(PROG, "the CUDA peak-memory column", "CUDA only (reads n/a)")
    clock = Clock(args.deadline_s, args.row_timeout_s, args.min_row_s, started)
    shape = TINY if args.tiny else QWEN3_8B
    dtype = getattr(torch, args.dtype)
    path = default_json(args.json, "headline.json")
    md_path = args.markdown or (os.path.join(os.environ["OUT"], "headline.md") if os.environ.get("OUT") else None)
    sources = reference_sources(args.ref_src)
    report = dict(prog=PROG, device=str(device), device_name=cuda_name(torch, device), dtype=args.dtype,
                  shape=shape, layers=args.layers, draft_layers=args.draft_layers, block=args.block,
                  new_tokens=args.new_tokens, prompt_lens=args.prompt_lens, taus=args.taus, full=args.full,
                  compiled_rows=args.compiled, torch=torch.__version__, dry_run=args.dry_run,
                  references={k: str(v) if v else "not carried" for k, v in sources.items()},
                  deadline_s=args.deadline_s, groups=[], complete=False)
    t_start = time.perf_counter()
    target = build_target(shape, args.layers, dtype, device)
    target.generation_config.eos_token_id = None  # every row makes exactly --new-tokens tokens
    report["target_build_s"] = time.perf_counter() - t_start
    if device.type == "cuda":
        report["weights_gib"] = torch.cuda.memory_allocated(device) / GIB
    failed = []
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="headline_") as tmp:
        for plen in args.prompt_lens:
            workdir = Path(tmp) / f"prompt{plen}"
            workdir.mkdir()
            prompt = torch.randint(0, shape["vocab_size"], (plen,), generator=gen).to(device)
            n = args.new_tokens
            ar_rows = [hf_row("transformers AR, eager", target, prompt, n, static=False)]
            if args.compiled:
                ar_rows.append(hf_row("transformers AR, static cache + torch.compile", target, prompt, n, static=True))
            ar_rows.append(ours_row("ours ar, eager", target, None, prompt, "ar", n, compile=False))
            if args.compiled:
                ar_rows.append(ours_row("ours ar, compiled", target, None, prompt, "ar", n, compile=True))
            ar_results = []
            for row in ar_rows:
                ar_results.append(measure(row, device, clock, args.dry_run))
                write_json(path, report)
            greedy = ar_results[0].get("tokens")
            if greedy is None:
                report["groups"].append(dict(prompt_len=plen, tau=None, rows=ar_results,
                                             note="the transformers AR eager row did not finish: no greedy text"))
                write_json(path, report)
                continue
            t_ar = next((r["ar_step_s"] for r in ar_results if "ar_step_s" in r), None)
            for r in ar_results:
                greedy_check(target, prompt, greedy, r)
            add_limits(ar_results, t_ar)
            report["groups"].append(dict(prompt_len=plen, tau=None, ar_step_s=t_ar, rows=ar_results))
            write_json(path, report)
            reference = torch.cat([prompt, torch.tensor(greedy, device=device)])
            draft = build_drafter(target, shape, args.layers, args.draft_layers, args.block, dtype, device)
            tables, tree_budgets = [], []
            for tau in args.taus:
                p = p_for_tau(tau, args.block)
                draft.steer(reference, p)
                group = dict(prompt_len=plen, tau=tau, p_right=p, ar_step_s=t_ar, rows=[])
                report["groups"].append(group)
                rows = [ours_row("ours dflash, eager", target, draft, prompt, "dflash", n, compile=False),
                        ours_row("ours ddtree (auto), eager", target, draft, prompt, "ddtree", n, compile=False),
                        dropin_row("drop-in (apply + generate), eager", target, draft, prompt, n, compile=False)]
                if args.compiled:
                    rows += [ours_row("ours dflash, compiled", target, draft, prompt, "dflash", n, compile=True),
                             ours_row("ours ddtree (auto), compiled", target, draft, prompt, "ddtree", n, compile=True),
                             dropin_row("drop-in (apply + generate), compiled", target, draft, prompt, n, compile=True)]
                for row in rows:
                    group["rows"].append(measure(row, device, clock, args.dry_run))
                    write_json(path, report)
                if any(sources.values()):
                    tables.append(draft.table.cpu().clone())
                    # the DDTree reference's fixed budget: the one our auto chose most often
                    sizes = [r.get("tree_sizes_mode") for r in group["rows"] if r["row"] == "ours ddtree (auto), eager"]
                    tree_budgets.append(next((b for b in sizes if b), 32))
            groups = [g for g in report["groups"] if g["prompt_len"] == plen and g["tau"] is not None]
            setup = (reference_setup(target, draft, prompt, reference, n, tables, tree_budgets, args.taus, args,
                                     device, workdir) if any(sources.values()) else dict(taus=args.taus))
            for impl, rows in reference_rows(sources, setup, clock, workdir).items():
                for group, r in zip(groups, rows):
                    group["rows"].append(r)
            for group in groups:
                for r in group["rows"]:
                    greedy_check(target, prompt, greedy, r)
                group["draft_verify_s_per_round"] = add_limits(group["rows"], t_ar)
            write_json(path, report)
            del draft
    broken = []
    for group in report["groups"]:
        for r in group["rows"]:
            if r.get("greedy") == "differs":
                failed.append(f"{r['row']} (prompt {group['prompt_len']}, tau {group['tau']}): "
                              f"{r['divergence']['describe']}")
            if r["state"].startswith("failed") and r["kind"] != "reference":
                broken.append(f"{r['row']} (prompt {group['prompt_len']}, tau {group['tau']}): {r['state']}")
    report["complete"] = True
    report["total_s"] = time.perf_counter() - t_start
    markdown = render(report)
    print(markdown)
    write_json(path, report)
    if md_path:
        Path(md_path).parent.mkdir(parents=True, exist_ok=True)
        Path(md_path).write_text(markdown + "\n")
    if path:
        print(f"wrote {path}" + (f" and {md_path}" if md_path else ""))
    status = 0
    if failed:
        print("!!! GREEDY MISMATCH: " + "; ".join(failed), file=sys.stderr)
        if dtype == torch.float32:
            print(f"{PROG}: FAIL: an fp32 row differs from greedy decoding", file=sys.stderr)
            status = 1
    if broken:  # ours or transformers raised: a bug to fix (a reference that fails is only reported)
        print(f"{PROG}: FAIL: rows raised: " + "; ".join(broken), file=sys.stderr)
        status = 1
    return status


def _num(x, fmt):
    return "n/a" if x is None else format(x, fmt)


def render(report: dict) -> str:
    s = report["shape"]
    lines = [f"Qwen3-8B-shaped target ({report['layers']} layers, hidden {s['hidden_size']}, "
             f"{s['num_attention_heads']}/{s['num_key_value_heads']} heads x {s['head_dim']}, vocab "
             f"{s['vocab_size']}, {report['dtype']}, random weights), drafter {report['draft_layers']} layers, "
             f"B = {report['block']}, steered; {report['new_tokens']} new tokens, greedy; "
             f"{report['device_name']}, torch {report['torch']}",
             "",
             "| prompt | tau asked | row | tokens/s | vs transformers eager | tau | limit tokens/s (x AR) "
             "| of limit | peak GiB | greedy |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for group in report["groups"]:
        base = next((r.get("tokens_per_s") for g in report["groups"] if g["prompt_len"] == group["prompt_len"]
                     for r in g["rows"] if r["row"] == "transformers AR, eager"), None)
        for r in group["rows"]:
            tau_asked = "-" if group["tau"] is None else f"{group['tau']:g} (p {group['p_right']:.3f})"
            if "tokens_per_s" not in r:
                lines.append(f"| {group['prompt_len']} | {tau_asked} | {r['row']} | {r['state']} | | | | | | |")
                continue
            vs = f"{r['tokens_per_s'] / base:.2f}x" if base else "n/a"
            limit = (f"{r['limit_tokens_per_s']:.1f} ({r['limit_speedup']:.2f}x)"
                     if "limit_tokens_per_s" in r else "n/a")
            of = f"{r['of_limit']:.0%}" if "of_limit" in r else "n/a"
            greedy = r.get("greedy", "n/a")
            if greedy == "differs":
                d = r["divergence"]
                greedy = (f"**differs** at new token {d['new_token']}: margin {_num(d['logit_margin'], '.3g')}, "
                          f"top-2 gap {_num(d['top2_gap'], '.3g')}")
            lines.append(f"| {group['prompt_len']} | {tau_asked} | {r['row']} | {r['tokens_per_s']:.1f} | {vs} | "
                         f"{_num(r.get('tau'), '.2f')} | {limit} | {of} | {_num(r.get('peak_gib'), '.2f')} | "
                         f"{greedy} |")
    lines += ["", "limit: tau / (draft + verify seconds per round of our eager row of the same method), x AR: "
              "tau * t_AR / t_round; of limit: tokens/s over the limit at the row's own tau; peak: "
              "torch.cuda.max_memory_allocated over the timed call, weights included"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(started=STARTED))
