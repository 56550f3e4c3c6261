"""tau of the shipped tiny pair against the prompt length: greedy DFlash and DDTree, 256 B to 8k tokens.

Run::

    python bench/tau_vs_prompt_length.py [--lengths 256,1024,2048,4096,8192] [--prompts 8] [--new-tokens 64]
        [--budgets 32] [--drafter DIR] [--window W] [--json out.json]

The tiny target with the shipped DFlash drafter (``dflash/assets/tiny``; another drafter directory with
``--drafter``), CPU, fp32, one thread, greedy (T = 0), no stop token. Prompts: ``--prompts`` per length,
``heldout_prompts(n, length, seed=0)`` (line starts in the held-out standard-library packages json, email,
asyncio and xml that neither model trained on; byte tokenizer, so a token is a byte). tau = committed
tokens / rounds pooled over the prompts (:func:`dflash.training.evaluation.measure_tau`), for the DFlash
chain (the drafter's block size) and DDTree at each ``--budgets`` node budget.

Beside tau, ``target bits/byte``: the target's own cross-entropy on the last 256 bytes of each prompt,
pooled. The tiny target was pretrained on 256-byte windows (``max_position_embeddings`` 2048) and the
drafter on 384-token sequences, so this column says whether a drop in tau comes with the target itself
leaving its trained range (the drafter is asked to predict a target that behaves differently) or with
the drafter alone (a context longer than any it saw in training).

``--window W`` runs the same weights with every drafter layer a sliding-window layer of ``W`` tokens
(z-lab's rule: block row ``j`` at position ``a + j`` sees context positions ``> a + j - W``; the
drafter's own non-causal block attention kept), so the drafter attends to about as much context as it
trained on, whatever the prompt length. That is what a drafter config with sliding-window layers does
at inference; a run-time window on the committed context does the same up to the block's ``B - 1`` rows.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dflash.benchmark.arguments import int_list  # noqa: E402

DEFAULT_LENGTHS = [256, 1024, 2048, 4096, 8192]


@torch.no_grad()
def target_bits_per_byte(target, prompts, tail: int = 256) -> float:
    """The target's mean cross-entropy (bits) predicting each of the last ``tail`` tokens of every prompt."""
    total, count = 0.0, 0
    for p in prompts:
        ids = torch.tensor(p, dtype=torch.long)[None]
        k = min(tail, ids.shape[1] - 1)
        logits = target(ids, logits_to_keep=k + 1).logits[0, :-1].float()
        total += float(torch.nn.functional.cross_entropy(logits, ids[0, -k:], reduction="sum"))
        count += k
    return total / max(count, 1) / math.log(2)


def with_window(draft, window: int):
    """``draft``'s weights in a drafter whose every layer is a (non-causal) sliding-window layer of ``window``."""
    import copy

    config = copy.deepcopy(draft.config)
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    config.sliding_window = int(window)
    config.use_sliding_window = True
    config.is_causal = False
    windowed = type(draft)(config)
    windowed.load_state_dict(draft.state_dict())
    return windowed.to(next(draft.parameters()).dtype).eval()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int_list, default=DEFAULT_LENGTHS, help="prompt lengths in tokens (bytes)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per length")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--budgets", type=int_list, default=[32], help="DDTree node budgets")
    p.add_argument("--drafter", default=None, help="a drafter directory (default: the shipped tiny drafter)")
    p.add_argument("--window", type=int, default=None,
                   help="run the drafter with every layer a sliding-window layer of W tokens (same weights)")
    p.add_argument("--no-target-bpb", action="store_true", help="skip the target bits/byte column")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.prompts < 1 or args.new_tokens < 1:
        p.error("--prompts and --new-tokens must be >= 1")
    if args.window is not None and args.window < 1:
        p.error(f"--window must be >= 1 (tokens of context the drafter sees), got {args.window}")

    import dflash_kernels
    from dflash.drafter.model import DFlashDraftModel
    from dflash.tiny.corpus import heldout_prompts
    from dflash.tiny.pair import DRAFT_DIR, load_default_pair
    from dflash.training.evaluation import measure_tau

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target, draft, _ = load_default_pair()
        drafter_dir = Path(args.drafter) if args.drafter else DRAFT_DIR
        if args.drafter:
            draft = DFlashDraftModel.from_pretrained(args.drafter, dtype=torch.float32)
        if args.window is not None:
            draft = with_window(draft, args.window)
        methods = [("dflash", None)] + [("ddtree", b) for b in args.budgets]
        rows = []
        with dflash_kernels.force_backend("reference"):
            for length in args.lengths:
                prompts = heldout_prompts(args.prompts, length, seed=0)
                row = dict(prompt_tokens=length, prompts=len(prompts))
                t0 = time.perf_counter()
                for method, budget in methods:
                    m = measure_tau(target, draft, prompts, method=method, max_new_tokens=args.new_tokens,
                                    tree_budget=budget)
                    row[method if budget is None else f"ddtree_{budget}"] = round(m["tau"], 3)
                if not args.no_target_bpb:
                    row["target_bits_per_byte"] = round(target_bits_per_byte(target, prompts), 3)
                row["seconds"] = round(time.perf_counter() - t0, 1)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        torch.set_num_threads(threads)
    log_path = drafter_dir / "train_log.json"
    trained_on = None
    if log_path.is_file():
        log = json.loads(log_path.read_text())
        data = log.get("data", {})
        if data.get("sequences"):
            trained_on = round(data.get("tokens", 0) / data["sequences"])
    report = dict(drafter=str(drafter_dir), window=args.window, block_size=draft.block_size,
                  new_tokens=args.new_tokens,
                  budgets=args.budgets, drafter_trained_on_tokens_per_sequence=trained_on,
                  target_max_position_embeddings=target.config.max_position_embeddings, rows=rows)
    heads = ["prompt tokens", "DFlash tau"] + [f"DDTree-{b} tau" for b in args.budgets]
    if not args.no_target_bpb:
        heads.append("target bits/byte (last 256)")
    print(f"\ntiny pair, greedy, {args.prompts} held-out prompts per length x {args.new_tokens} new tokens, "
          f"CPU fp32, block {draft.block_size}" + (f", drafter trained on {trained_on}-token sequences"
                                                   if trained_on else "")
          + (f", every drafter layer a {args.window}-token window" if args.window else "") + "\n")
    print("| " + " | ".join(heads) + " |")
    print("|" + "---:|" * len(heads))
    for r in rows:
        cells = [r["prompt_tokens"], r["dflash"]] + [r[f"ddtree_{b}"] for b in args.budgets]
        if not args.no_target_bpb:
            cells.append(r["target_bits_per_byte"])
        print("| " + " | ".join(str(c) for c in cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
