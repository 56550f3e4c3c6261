"""The benchmark's report: the result table and notes as Markdown (``results.md``), the results as JSON
(``results.json``).

Columns of the main table: method, budget, block, temperature, tau,
tokens/s, ms/token, speedup over ``ar``, the draft / verify / commit shares and
the peak memory; a greedy mismatch adds a FAILURE row. A second table holds the
acceptance per draft position of every drafting configuration.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from .configs import PROMPT_LOOKUP_TOKENS
from .summary import Failure

NOT_APPLICABLE = "–"


def _fmt(value, spec: str, suffix: str = "") -> str:
    if isinstance(value, str):  # a budget chosen per round: "auto"
        return value + suffix
    return NOT_APPLICABLE if value is None else format(value, spec) + suffix


def markdown_table(rows: Sequence[dict], failures: Sequence[Failure], memory_what: str) -> str:
    head = ["method", "budget", "block", "T", "tau", "tokens/s", "ms/token", "speedup vs ar",
            "draft %", "verify %", "commit %", f"{memory_what} (MiB)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            r["method"], _fmt(r["budget"], "d"), _fmt(r["block_size"], "d"), f"{r['temperature']:g}",
            _fmt(r["tau"], ".2f"), _fmt(r["tokens_per_second"], ".1f"),
            _fmt(None if r["time_per_output_token"] is None else r["time_per_output_token"] * 1e3, ".2f"),
            _fmt(r["speedup"], ".2f", "x"),
            *(_fmt(None if r[f"{s}_share"] is None else 100 * r[f"{s}_share"], ".1f") for s in
              ("draft", "verify", "commit")),
            _fmt(r["peak_memory_mib"], ".1f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    for f in failures:
        lines.append("| **FAILURE** | " + f.describe() + " |" + " |" * (len(head) - 2))
    return "\n".join(lines)


def position_acceptance_table(rows: Sequence[dict]) -> str:
    """One line per drafting row, one column per draft position k (``–`` past a row's block)."""
    drafting = [r for r in rows if r.get("position_acceptance")]
    if not drafting:
        return ""
    positions = max(len(r["position_acceptance"]) for r in drafting)
    head = ["method", "budget", "block", "T", *(f"k={k}" for k in range(1, positions + 1))]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in drafting:
        shares = r["position_acceptance"]
        cells = [r["method"], _fmt(r["budget"], "d"), _fmt(r["block_size"], "d"), f"{r['temperature']:g}",
                 *(_fmt(shares[k] if k < len(shares) else None, ".3f") for k in range(positions))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


POSITION_ACCEPTANCE_NOTE = (
    "**Acceptance per draft position**: the share of rounds whose accepted drafts reached draft position k, over "
    "all rounds of all prompts (a final round cut short by the token limit counts the drafts its verify accepted; "
    "prompt-lookup: the tokens of each forward after the first, minus the bonus token, as transformers' streamer "
    "shows them). Methods without drafts have no line.")


NOTES = """\
- tau: committed tokens per round after the prefill (bonus included); 1 for ar / hf / hf-sample by construction;
  for prompt-lookup, tokens per target forward after the first (one streamer `put` per forward in transformers'
  assisted-decoding loop).
- tokens/s: new tokens over the wall time of the whole generation, prefill included. ms/token: decode time after the
  first emitted tokens, per token emitted after them.
- speedup vs ar: tokens/s over `ar`'s tokens/s at the same temperature, measured in this run on the same prompts
  (configurations interleaved per prompt, one warm-up generation each first).
- draft / verify / commit %: share of decode time per stage (our methods only; ar's decode loop counts as verify).
- peak memory: {memory_note}
- hf / hf-sample: transformers' `target.generate` (greedy / multinomial sampling at the temperature, top-k and top-p
  off). prompt-lookup: `generate(prompt_lookup_num_tokens={lookup})`; at T > 0 transformers samples the target at
  every drafted position and keeps drafts while they equal the samples (exact sampling; no draft probabilities).
- At T = 0 every method's output is compared with ar's token for token; a difference is a FAILURE row.
- Kernel backend: {backend}{backend_note}.
"""


def memory_note(cuda: bool) -> str:
    if cuda:
        return "`torch.cuda.max_memory_allocated` during the run (weights included), max over prompts."
    return ("growth of the process's peak resident set during the run (`VmHWM` in /proc/self/status after a reset "
            "through /proc/self/clear_refs), max over prompts; memory reused from earlier runs does not show.")


def write_markdown(results: dict, path: Path, plots: Sequence[str]) -> str:
    meta = results["meta"]
    failures = results["_failure_objects"]
    backend_note = (" (CPU: the Triton interpreter is a correctness tool, not a speed path, so the ops run their "
                    "pure-torch references)" if meta["kernel_backend"] == "reference" else "")
    pair = meta["pair"]
    lines = [
        "# dflash end-to-end benchmark", "",
        f"`{meta['command']}`", "",
        f"- device: {meta['device']} ({meta['device_name']}), {meta['dtype']}, {meta['threads']} CPU threads; "
        f"torch {meta['torch']}, transformers {meta['transformers']}",
        f"- pair: {pair['target']} ({pair['target_layers']} layers, hidden {pair['hidden']}, vocab {pair['vocab']})"
        + (f", drafter {pair['draft_layers']} layers, block {pair['draft_block_size']}, target layers "
           f"{pair['target_layer_ids']}" if "draft_layers" in pair else ""),
        f"- prompts: {meta['prompts']['source']}; {meta['max_new_tokens']} new tokens max; stop ids "
        f"{meta['stop_token_ids'] or 'none'}",
        "",
        markdown_table(results["rows"], failures, "peak GPU mem" if meta["device"].startswith("cuda") else
                       "peak RSS growth"),
        "",
    ]
    if failures:
        lines += [f"**{len(failures)} FAILURE(S)**: greedy outputs differ from ar's:", ""]
        lines += [f"- FAILURE: {f.describe()}" for f in failures] + [""]
    else:
        lines += ["All greedy (T = 0) outputs equal ar's token for token.", ""]
    positions = position_acceptance_table(results["rows"])
    if positions:
        lines += [POSITION_ACCEPTANCE_NOTE, "", positions, ""]
    lines += ["Notes:", "", NOTES.format(memory_note=meta["memory_note"], lookup=PROMPT_LOOKUP_TOKENS,
                                         backend=meta["kernel_backend"], backend_note=backend_note)]
    if meta["dtype"] != "float32":
        lines.append(f"- {meta['dtype']}: verifying a block at once and decoding one token at a time round differently, "
                     "and transformers' peers use other kernels, so a near-tie can flip and show as a FAILURE; "
                     "`--dtype float32` gives the strict check.")
    lines += [f"- {n}" for n in results["notes"]]
    if plots:
        lines += [""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def write_results_json(results: dict, path: Path) -> None:
    """``results`` as indented JSON (the Failure objects kept for the Markdown report left out)."""
    public = {k: v for k, v in results.items() if k != "_failure_objects"}
    path.write_text(json.dumps(public, indent=2) + "\n")
