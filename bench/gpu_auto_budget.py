"""``tree_budget="auto"`` against every fixed DDTree budget at Qwen3-8B shapes: tokens/s and tau side by side.

Run on a GPU machine: ``python bench/gpu_auto_budget.py [--layers 4] [--budgets 4,8,16,32,64]``.
On a CPU (tests): ``python bench/gpu_auto_budget.py --dry-run`` (tiny fp32 shapes: a check of the script,
not of speed).

The target is a ``Qwen3ForCausalLM`` with random weights at Qwen3-8B shapes cut to ``--layers``
decoder layers (``gpu_round_latency.build_target``), in fp32 by default (``--dtype``): random weights
give flat logits, and in bf16 a verify's other rounding flips a near-tie within a few tokens (seen on
an H200: every row left the greedy text early); the steered drafter follows the greedy text, so after
such a flip it is steered to the wrong text and acceptance collapses to about 1. In fp32 (our kernels'
fp32 dots are IEEE, not TF32) the rows stay on the greedy text and the acceptance is the steering's. Random weights accept nothing, so the drafter is
steered: a 2-layer drafter at the target's shapes whose block states are replaced, on the device, by
states whose logits rank the target's own greedy continuation first with probability ``--p-right`` per
position (else a random wrong token first and the right one a close second, so wider trees do catch
it). Acceptance then falls along the block as a real drafter's does, the costs are those of real shapes,
and nothing is read on the host besides the round's payload.

Rows: each fixed budget of ``--budgets`` and ``auto`` (buckets = those budgets). One warm-up generation
per row (Triton's first launches and auto's cost measurement happen there), then ``--repeats`` passes
over the rows, interleaved. tokens/s = new tokens / ``result.total_time`` (set-up excluded), pooled; tau
= committed tokens per round. Printed and in the JSON: the table, the best and median fixed budgets, and
auto's tokens/s over each; whether each row's tokens equal the plain greedy ones (in bf16 a verify may
flip a near-tie: reported, not hidden; in fp32 a difference fails the run).

JSON goes to ``--json``, else ``$OUT/gpu_auto_budget.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import add_dry_run, apply_dry_run, default_json, fail_without_cuda, write_json  # noqa: E402
from gpu_round_latency import QWEN3_8B, TINY, build_target  # noqa: E402

import dflash  # noqa: E402
from dflash.drafter.model import DFlashDraftModel  # noqa: E402

PROG = "gpu_auto_budget"


class SteeredDraft(DFlashDraftModel):
    """A drafter whose block states rank a known continuation first with probability ``p_right`` per position.

    ``reference [R]``: the target's greedy output (prompt + continuation). Block row ``j`` of a round at
    committed length ``L`` (device tensors) stands at position ``L + count + j``: its state ``h`` is the
    minimum-norm solution of ``W[first] h = top``, ``W[second] h = top - gap``, with ``(first, second)`` =
    (right, wrong) or, with probability ``1 - p_right``, (wrong, right). Device ops only.
    """

    def __init__(self, config, lm_head_weight: torch.Tensor, reference: torch.Tensor, p_right: float,
                 top: float = 8.0, gap: float = 0.7, seed: int = 0):
        super().__init__(config)
        self.W = lm_head_weight.detach()
        self.reference = reference.flatten().to(self.W.device)
        self.p_right, self.top, self.gap = float(p_right), float(top), float(gap)
        self.noise = torch.Generator(device=self.W.device).manual_seed(seed)

    def draft_block(self, block_embeds, context_features, context_count, cache, block_size=None):
        """``[b, B, H]`` block states; every sequence steered to the one reference text."""
        b, B = block_embeds.shape[:2]
        rows = torch.arange(B, device=block_embeds.device)
        position = ((cache.length_t + context_count)[:, None] + rows).clamp(max=self.reference.numel() - 1)
        cache.advance(context_count)
        right = self.reference.index_select(0, position.reshape(-1))  # [b * B]
        V = self.W.shape[0]
        n = right.numel()
        wrong = (right + 1 + torch.randint(0, V - 2, (n,), generator=self.noise, device=right.device)) % V
        ok = torch.rand(n, generator=self.noise, device=right.device) < self.p_right
        ranked = torch.stack([torch.where(ok, right, wrong), torch.where(ok, wrong, right)], 1)  # [b * B, 2]
        A = self.W.float().index_select(0, ranked.flatten()).view(n, 2, -1)  # [b * B, 2, H]
        y = torch.tensor([self.top, self.top - self.gap], device=A.device).expand(n, 2)
        coeff = torch.linalg.solve(A @ A.transpose(1, 2), y.unsqueeze(-1))  # [b * B, 2, 1]
        return (A.transpose(1, 2) @ coeff).squeeze(-1).view(b, B, -1).to(block_embeds.dtype)


def steered_pair(args, device):
    """``(target, draft, prompt [P], reference [1, P + n], dtype, layers)``: the Qwen3-8B-shaped target cut to
    ``args.layers`` (default 4) in ``args.dtype`` (tiny, fp32 and 2 layers with ``args.tiny``), a random prompt of
    ``args.prompt_len``, the target's greedy text of ``args.new_tokens`` after it, and a 2-layer
    :class:`SteeredDraft` of block ``args.block`` steered to that text with ``args.p_right``."""
    shape = TINY if args.tiny else QWEN3_8B
    dtype = torch.float32 if args.tiny else getattr(torch, args.dtype)
    layers = args.layers or (2 if args.tiny else 4)
    target = build_target(shape, layers, dtype, device)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, shape["vocab_size"], (args.prompt_len,), generator=gen).to(device)
    with torch.inference_mode():
        ref = target.generate(prompt[None], max_new_tokens=args.new_tokens, do_sample=False)
    cfg = dflash.make_draft_config(
        hidden_size=shape["hidden_size"], num_hidden_layers=2, num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"], intermediate_size=shape["intermediate_size"],
        vocab_size=shape["vocab_size"], num_target_layers=layers, block_size=args.block,
        mask_token_id=shape["vocab_size"] - 1, target_layer_ids=[0, layers - 1], head_dim=shape["head_dim"],
        max_position_embeddings=32768)
    torch.manual_seed(1)
    draft = SteeredDraft(cfg, target.lm_head.weight, ref, args.p_right).to(device=device, dtype=dtype).eval()
    return target, draft, prompt, ref, dtype, layers


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small fp32 model (CPU test of this script)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers of the cut target (default 4; tiny 2)")
    p.add_argument("--budgets", default="4,8,16,32,64")
    p.add_argument("--block", type=int, default=16, help="drafter block size")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--p-right", type=float, default=0.8)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the target's dtype (default float32: see the module docstring)")
    p.add_argument("--json", default=None)
    add_dry_run(p)
    args = p.parse_args(argv)
    apply_dry_run(args, PROG, layers=2, block=6, prompt_len=24, new_tokens=16, repeats=1)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if fail_without_cuda(torch, device, PROG):
        return 2
    budgets = [int(x) for x in args.budgets.split(",") if x.strip()]
    target, draft, prompt, ref, dtype, layers = steered_pair(args, device)
    rows = [(f"ddtree {b}", b) for b in budgets] + [("ddtree auto", list(budgets))]
    stats = {name: dict(tokens=0, seconds=0.0, rounds=0, committed=0, equal=True, nodes=[]) for name, _ in rows}
    kw = dict(method="ddtree", max_new_tokens=args.new_tokens)
    for name, budget in rows:
        dflash.generate(target, draft, prompt, tree_budget=budget, **kw)
    for _ in range(args.repeats):
        for name, budget in rows:
            res = dflash.generate(target, draft, prompt, tree_budget=budget, **kw)
            s = stats[name]
            s["tokens"] += res.num_new_tokens
            s["seconds"] += res.total_time
            s["rounds"] += res.num_rounds
            s["committed"] += sum(res.acceptance_lengths)
            s["nodes"] += res.tree_sizes
            s["equal"] &= bool(torch.equal(res.output_ids, ref))
    table = {name: dict(tokens_per_second=s["tokens"] / s["seconds"], tau=s["committed"] / s["rounds"],
                        mean_tree_nodes=statistics.fmean(s["nodes"]), equal_to_greedy=s["equal"])
             for name, s in stats.items()}
    fixed = {b: table[f"ddtree {b}"]["tokens_per_second"] for b in budgets}
    best = max(fixed, key=fixed.get)
    auto = table["ddtree auto"]["tokens_per_second"]
    report = dict(prog=PROG, device=str(device), dtype=str(dtype), layers=layers, block=args.block,
                  p_right=args.p_right, prompt_len=args.prompt_len, new_tokens=args.new_tokens, table=table,
                  best_fixed=best, auto_over_best=auto / fixed[best],
                  auto_over_median=auto / statistics.median(fixed.values()))
    print("| row | tokens/s | tau | mean tree nodes | equal to greedy |\n|---|---|---|---|---|")
    for name, r in table.items():
        print(f"| {name} | {r['tokens_per_second']:.1f} | {r['tau']:.2f} | {r['mean_tree_nodes']:.1f} | "
              f"{r['equal_to_greedy']} |")
    print(f"best fixed budget {best}; auto / best = {report['auto_over_best']:.3f}, auto / median fixed = "
          f"{report['auto_over_median']:.3f}")
    write_json(default_json(args.json, "gpu_auto_budget.json"), report)
    if dtype == torch.float32 and not all(r["equal_to_greedy"] for r in table.values()):
        print(f"{PROG}: FAIL: an fp32 row differs from greedy decoding", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
