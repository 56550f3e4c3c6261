"""``python -m dflash bench --batch-sizes 1,4,16``: throughput of padded batches, side by side.

For each batch size ``b`` the prompts are cut into batches of ``b`` (left-padded, with their attention mask,
as ``tokenizer(prompts, padding=True, padding_side="left")`` gives) and every row is generated three ways:

* **batched**: our method (``ar``, ``dflash``, ``ddtree`` at each budget) on the whole batch, one
  :func:`dflash.generate` call per batch;
* **row by row**: the same method on each prompt alone, one call per prompt (what a batch-1 library does
  with a list of prompts);
* **hf**: transformers' ``generate()`` on the same padded batch (plain greedy or sampled decoding).

Columns: tokens/s of each (every row's new tokens over the wall time of the calls, set-up excluded),
batched over row by row, batched over hf at the same ``b``, tau of the batched rows (pooled), the batched
rounds' milliseconds (a round runs every row, a stopped one masked: what a round of ``b`` costs against one
of 1 is what a stopped row keeps costing), and whether
every greedy batched row equals the same prompt generated alone (``ar`` alone for every method: the
target's own greedy text). The configurations take turns batch by batch after one warm-up each, so a slow
phase of a noisy machine falls on all of them alike.
"""

from __future__ import annotations

import time
from typing import Dict, List, Sequence

import torch

__all__ = ["batch_markdown", "run_batch_benchmark"]


def left_padded(prompts: Sequence[Sequence[int]], pad: int, device) -> tuple:
    """``(input_ids [b, T], attention_mask [b, T])`` of ``prompts`` padded on the left with ``pad``."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ours(pair, method: str, ids, mask, settings, temperature: float, budget, seed: int):
    """``(rows' new tokens, seconds, committed, rows' rounds, the batch's rounds, tree nodes verified)`` of one
    batched call of our method (the nodes summed over every row's DDTree rounds, 0 for the other methods)."""
    from ..decoding import generate

    kw = dict(method=method, max_new_tokens=settings.max_new_tokens, temperature=temperature,
              stop_token_ids=settings.stop_token_ids or None, seed=seed, attention_mask=mask,
              pad_token_id=settings.pad_token_id)
    if method == "ddtree":
        kw["tree_budget"] = budget
    result = generate(pair.target, pair.draft if method != "ar" else None, ids, **kw)
    rows = result.rows or [result]
    # the batch's rounds: every row runs in each, so the longest row's count
    rounds = max(len(row.acceptance_lengths) for row in rows)
    return ([row.generated_ids[0].tolist() for row in rows], result.total_time, sum(result.acceptance_lengths),
            len(result.acceptance_lengths), rounds, sum(result.tree_sizes))


def _hf(pair, ids, mask, settings, temperature: float, seed: int):
    """``(rows' new tokens, seconds)`` of transformers' generate on the padded batch."""
    from transformers import GenerationConfig

    target = pair.target
    kw = dict(max_new_tokens=settings.max_new_tokens, eos_token_id=list(settings.stop_token_ids) or None,
              pad_token_id=settings.pad_token_id, do_sample=temperature > 0, num_beams=1)
    if temperature > 0:
        kw.update(temperature=temperature, top_k=0, top_p=1.0)
    saved = target.generation_config
    target.generation_config = GenerationConfig()
    try:
        torch.manual_seed(seed)
        _sync(pair.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(ids, attention_mask=mask, generation_config=GenerationConfig(**kw))
        _sync(pair.device)
        seconds = time.perf_counter() - start
    finally:
        target.generation_config = saved
    rows = []
    stops = set(settings.stop_token_ids)
    for row in out[:, ids.shape[1]:].tolist():
        tokens = []
        for t in row:  # up to and with the first stop id; the pad ids after it are not generated tokens
            tokens.append(t)
            if t in stops:
                break
        rows.append(tokens)
    return rows, seconds


def run_batch_benchmark(args, pair, prompts: List[List[int]], settings) -> dict:
    """Measure every (method, budget, temperature, batch size); returns ``{"rows": [...], "notes": [...]}``."""
    device = pair.device
    methods = [m for m in ("ar", "dflash", "ddtree") if m in args.methods]
    configs = []
    for t in args.temperatures:
        for m in methods:
            for budget in (args.budgets if m == "ddtree" else [None]):
                configs.append((m, budget, t))
    notes: List[str] = []
    rows: List[dict] = []
    for b in args.batch_sizes:
        n = len(prompts) // b * b
        if n == 0:
            notes.append(f"batch size {b} is larger than the {len(prompts)} prompts: skipped")
            continue
        batches = [prompts[i : i + b] for i in range(0, n, b)]
        padded = [left_padded(batch, settings.pad_token_id, device) for batch in batches]
        stats: Dict[tuple, dict] = {}
        for cfg in configs + [("hf", None, t) for t in args.temperatures if "hf" in args.methods]:
            stats[cfg] = dict(batched=[0, 0.0], alone=[0, 0.0], committed=0, rounds=0, batch_rounds=0, nodes=0,
                              equal=True)
        # warm-up of every configuration at this batch size (kernels, caches, allocator)
        warm = [prompts[0]] * b
        w_ids, w_mask = left_padded(warm, settings.pad_token_id, device)
        for (m, budget, t) in stats:
            if m == "hf":
                _hf(pair, w_ids, w_mask, settings, t, args.seed)
            else:
                _ours(pair, m, w_ids, w_mask, settings, t, budget, args.seed)
        reference: Dict[int, List[int]] = {}  # prompt index -> ar alone, greedy
        for k, (batch, (ids, mask)) in enumerate(zip(batches, padded)):
            order = list(stats)
            shift = k % len(order)
            for cfg in order[shift:] + order[:shift]:
                m, budget, t = cfg
                s = stats[cfg]
                seed = args.seed + k
                if m == "hf":
                    got, seconds = _hf(pair, ids, mask, settings, t, seed)
                else:
                    got, seconds, committed, rounds, batch_rounds, nodes = _ours(pair, m, ids, mask, settings, t,
                                                                                 budget, seed)
                    s["nodes"] += nodes
                    s["committed"] += committed
                    s["rounds"] += rounds
                    s["batch_rounds"] += batch_rounds
                    alone_tokens, alone_seconds = 0, 0.0
                    for j, prompt in enumerate(batch):
                        one_ids, one_mask = left_padded([prompt], settings.pad_token_id, device)
                        tokens, secs, *_ = _ours(pair, m, one_ids, None, settings, t, budget, seed)
                        alone_tokens += len(tokens[0])
                        alone_seconds += secs
                        if t == 0 and m == "ar":
                            reference[k * b + j] = tokens[0]
                    s["alone"][0] += alone_tokens
                    s["alone"][1] += alone_seconds
                s["batched"][0] += sum(len(r) for r in got)
                s["batched"][1] += seconds
                if t == 0:
                    s.setdefault("outputs", {}).update({k * b + j: r for j, r in enumerate(got)})
        for cfg, s in stats.items():
            m, budget, t = cfg
            if t == 0:
                s["equal"] = all(s["outputs"][i] == reference[i] for i in s["outputs"] if i in reference)
            tps = s["batched"][0] / s["batched"][1] if s["batched"][1] else float("nan")
            alone = s["alone"][0] / s["alone"][1] if s["alone"][1] else None
            rows.append(dict(batch_size=b, method=m, budget=budget, temperature=t, tokens_per_second=tps,
                             row_by_row_tokens_per_second=alone, tau=s["committed"] / s["rounds"] if s["rounds"]
                             else None, ms_per_round=1e3 * s["batched"][1] / s["batch_rounds"] if s["batch_rounds"]
                             else None, mean_tree_nodes=s["nodes"] / s["rounds"] if m == "ddtree" and s["rounds"]
                             else None, equal_to_alone=s["equal"] if t == 0 else None, prompts=n))
    for row in rows:
        hf = next((r for r in rows if r["method"] == "hf" and r["batch_size"] == row["batch_size"]
                   and r["temperature"] == row["temperature"]), None)
        row["over_row_by_row"] = (row["tokens_per_second"] / row["row_by_row_tokens_per_second"]
                                  if row["row_by_row_tokens_per_second"] else None)
        row["over_hf"] = row["tokens_per_second"] / hf["tokens_per_second"] if hf and row["method"] != "hf" else None
    return dict(rows=rows, notes=notes)


def _fmt(x, spec) -> str:
    return "–" if x is None else format(x, spec)


def batch_markdown(results: dict) -> str:
    """The batch table (one row per batch size and configuration)."""
    lines = ["| batch | method | budget | T | tokens/s | row by row tokens/s | batched / row by row | "
             "batched / hf | tau | mean tree nodes | ms per round | rows equal to ar alone |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        equal = "–" if r["equal_to_alone"] is None else ("yes" if r["equal_to_alone"] else "**NO**")
        lines.append(f"| {r['batch_size']} | {r['method']} | {r['budget'] or '–'} | {r['temperature']:g} | "
                     f"{r['tokens_per_second']:.1f} | {_fmt(r['row_by_row_tokens_per_second'], '.1f')} | "
                     f"{_fmt(r['over_row_by_row'], '.2f')}{'x' if r['over_row_by_row'] else ''} | "
                     f"{_fmt(r['over_hf'], '.2f')}{'x' if r['over_hf'] else ''} | {_fmt(r['tau'], '.2f')} | "
                     f"{_fmt(r.get('mean_tree_nodes'), '.1f')} | "
                     f"{_fmt(r.get('ms_per_round'), '.2f')} | {equal} |")
    return "\n".join(lines + [""] + [f"- {n}" for n in results["notes"]])
