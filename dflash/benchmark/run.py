"""End-to-end benchmark: ``python -m dflash bench``.

Every configuration (method x tree budget x block size x temperature) runs
on the same prompts. Per prompt, all configurations run one after another
(interleaved, the order rotated by one each prompt) after one warm-up
generation per configuration, so the plain autoregressive baseline ``ar`` is
measured under the same conditions as the methods it is compared with.

Methods
  ``ar``            plain decoding on our static cache and fused ops (the speedup baseline;
                    always run, at every temperature)
  ``dflash``        one drafted chain of B-1 tokens per round
  ``ddtree``        a best-first tree of ``budget`` drafted tokens per round
  ``hf``            transformers' ``target.generate(do_sample=False)`` (temperature 0 only)
  ``hf-sample``     transformers' ``target.generate(do_sample=True)`` (temperatures > 0 only)
  ``prompt-lookup`` transformers' prompt-lookup drafting,
                    ``target.generate(prompt_lookup_num_tokens=10)``. At T > 0 transformers
                    (5.17-5.24) samples the target at every drafted position and keeps
                    drafts while they equal the samples (no draft probabilities exist):
                    exact sampling, with acceptance against samples rather than argmax.

Statistics per configuration, pooled over prompts
  tau           committed tokens per round after the prefill (bonus included);
                1 for ``ar``, ``hf``, ``hf-sample`` by construction; for
                ``prompt-lookup`` the tokens of each target forward after the
                first, read from transformers' streamer (one ``put`` per forward)
  tokens/s      new tokens / wall time of the whole generation (prefill included)
  ms/token      decode time after the first emitted tokens / tokens emitted after them
  speedup       tokens/s over ``ar``'s tokens/s at the same temperature
  stage shares  draft / verify / commit time as a share of decode time (ours only)
  position acceptance
                per draft position k = 1 .. B - 1, the fraction of all rounds of all
                prompts whose accepted drafts reached k (``dflash`` / ``ddtree``: the
                drafts the verify accepted, a final round cut short by
                ``max_new_tokens`` included; ``prompt-lookup``: k = 1 .. 10, the tokens
                of each forward after the first, minus the bonus); empty without drafts
  peak memory   CUDA: ``torch.cuda.max_memory_allocated`` during the run (absolute, weights
                included); CPU: growth of the process's peak resident set during the run
                (``VmHWM`` of ``/proc/self/status`` after resetting it through
                ``/proc/self/clear_refs``; memory reused from earlier runs does not show)

At temperature 0 every method's output must equal ``ar``'s token for token;
a difference is reported as a FAILURE row and the command exits with 1.

This module composes the pieces: :mod:`~dflash.benchmark.arguments` (the
command line), :mod:`~dflash.benchmark.pair` (the pair, its stop ids),
:mod:`~dflash.benchmark.prompts`, :mod:`~dflash.benchmark.configs` (the
table's rows), :mod:`~dflash.benchmark.runners` (one timed generation per
method), :mod:`~dflash.benchmark.summary` (pooled statistics, the greedy
check), :mod:`~dflash.benchmark.report` (Markdown and JSON), and
:mod:`~dflash.benchmark.batch` for ``--batch-sizes``.
"""

from __future__ import annotations

import platform
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from .arguments import build_parser
from .configs import PROMPT_LOOKUP_TOKENS, BenchConfig, expand_configs
from .pair import describe_pair, load_pair_for, stop_ids_for
from .prompts import bench_prompts
from .report import memory_note, write_markdown, write_results_json
from .runners import PeakMemory, Run, RunSettings, run_config
from .summary import add_speedups, greedy_failures, summarize


def _progress(total: int, disable: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="run", desc="bench", disable=disable, file=sys.stderr, dynamic_ncols=True)


def run_benchmark(args, argv: Sequence[str] = ()) -> dict:
    """Load, warm up, measure interleaved, check greedy outputs; returns the results dict."""
    import dflash_kernels

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    torch.set_num_threads(args.threads)
    notes: List[str] = []
    if args.compile:
        notes.append("ar / dflash / ddtree ran as compiled rounds (generate(compile=True): torch.compile, CUDA graphs "
                     "on a GPU); their set-up happened in the warm-up and is in no timed run.")
    pair = load_pair_for(args, device, dtype, notes)
    prompt_tensors, prompts, source = bench_prompts(args, pair, device)

    block_sizes = args.block_sizes or [int(pair.draft.block_size)]
    configs = expand_configs(args.methods, args.budgets, args.temperatures, block_sizes)
    for method, why in (("hf", "runs at temperature 0 only"), ("hf-sample", "runs at temperatures > 0 only")):
        if method in args.methods and not any(c.method == method for c in configs):
            notes.append(f"{method} was asked for but {why}: not run.")
    eos = stop_ids_for(pair, args.ignore_eos)
    pad = eos[0] if eos else 0
    settings = RunSettings(args.max_new_tokens, eos, pad, args.seed, compile=args.compile)
    memory = PeakMemory(device)

    bar = _progress(len(configs) * (len(prompts) + 1), disable=args.no_progress)
    for cfg in configs:  # warm-up: kernels compiled, caches allocated, allocator warm
        bar.set_postfix_str(f"warm-up {cfg.label}")
        run_config(cfg, pair, prompt_tensors[0], settings, args.seed, memory,
                   max_new_tokens=min(args.warmup_tokens, args.max_new_tokens))
        bar.update()
    runs: Dict[BenchConfig, List[Run]] = {c: [] for c in configs}
    for i, prompt in enumerate(prompt_tensors):
        shift = i % len(configs)
        for cfg in configs[shift:] + configs[:shift]:
            bar.set_postfix_str(f"prompt {i} {cfg.label}")
            run = run_config(cfg, pair, prompt, settings, args.seed + i, memory)
            run.prompt_index = i
            runs[cfg].append(run)
            bar.update()
    bar.close()

    failures = greedy_failures(configs, runs, pair, prompt_tensors)
    rows = [summarize(c, runs[c]) for c in configs]
    add_speedups(rows)
    for f in failures:
        next(r for r in rows if r["label"] == f.label)["failures"] += 1

    backend = dflash_kernels.get_backend(device)
    meta = dict(
        command=" ".join(["python -m dflash bench", *argv]),
        device=str(device), device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
        dtype=str(dtype).replace("torch.", ""), threads=args.threads, kernel_backend=backend,
        torch=torch.__version__, transformers=__import__("transformers").__version__,
        pair=describe_pair(pair), prompts=dict(source=source, count=len(prompts), lengths=[len(p) for p in prompts]),
        max_new_tokens=args.max_new_tokens, stop_token_ids=eos, seed=args.seed,
        methods=list(args.methods), budgets=list(args.budgets), temperatures=list(args.temperatures),
        block_sizes=block_sizes, memory=memory.what, memory_note=memory_note(device.type == "cuda"),
        prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS, compiled_rounds=bool(args.compile),
    )
    return dict(meta=meta, rows=rows, failures=[asdict(f) | {"message": f.describe()} for f in failures],
                runs=[asdict(r) | {"new_tokens": r.new_tokens} for c in configs for r in runs[c]], notes=notes,
                _failure_objects=failures)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    for name in ("num_prompts", "max_new_tokens", "prompt_len", "threads", "warmup_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.batch_sizes:
        return _main_batch(args, argv)
    results = run_benchmark(args, argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        from .plots import save_plots
    except ImportError as e:  # matplotlib is in the "bench" extra
        results["notes"].append(f"no plots: {e} (pip install 'dflash-kernels[bench]')")
        plots = []
    else:
        plots = save_plots(results["rows"], out)
    failures = results["_failure_objects"]
    results["plots"] = [str(p) for p in plots]
    write_results_json(results, out / "results.json")
    text = write_markdown(results, out / "results.md", plots)
    print(text)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}" + "".join(f", {p}" for p in plots))
    if failures:
        print(f"FAILURE: {len(failures)} greedy output(s) differ from ar's (see above)", file=sys.stderr)
        return 1
    return 0


def _main_batch(args, argv: Sequence[str]) -> int:
    """``--batch-sizes``: the batch table (:mod:`dflash.benchmark.batch`), to stdout, results.json and results.md."""
    from .batch import batch_markdown, run_batch_benchmark

    if any(b < 1 for b in args.batch_sizes):
        raise SystemExit("--batch-sizes must be ints >= 1")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    torch.set_num_threads(args.threads)
    notes: List[str] = []
    pair = load_pair_for(args, device, dtype, notes)
    _, prompts, source = bench_prompts(args, pair, device)
    eos = stop_ids_for(pair, args.ignore_eos)
    settings = RunSettings(args.max_new_tokens, eos, eos[0] if eos else 0, args.seed)
    results = run_batch_benchmark(args, pair, prompts, settings)
    results["notes"] = notes + results["notes"]
    results["meta"] = dict(command=" ".join(["python -m dflash bench", *argv]), device=str(device),
                           dtype=str(dtype).replace("torch.", ""), threads=args.threads, prompts=source,
                           max_new_tokens=args.max_new_tokens, batch_sizes=list(args.batch_sizes),
                           torch=torch.__version__, pair=describe_pair(pair))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_results_json(results, out / "results.json")
    text = (f"# dflash batch benchmark\n\n`{results['meta']['command']}`\n\n- device: {device}, "
            f"{results['meta']['dtype']}, {args.threads} CPU threads; prompts: {source}; up to {args.max_new_tokens} "
            f"new tokens\n\n" + batch_markdown(results))
    (out / "results.md").write_text(text + "\n")
    print(text)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}")
    if any(r["equal_to_alone"] is False for r in results["rows"]):
        print("FAILURE: a greedy batched row differs from its prompt generated alone (see the table)", file=sys.stderr)
        return 1
    return 0
