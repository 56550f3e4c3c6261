"""Host syncs per decoding round at Qwen3-8B shapes, counted two ways, for ar / dflash / ddtree.

Run on a GPU machine: ``python bench/gpu_round_syncs.py [--layers 4]``; on a CPU (a test of
the script): ``python bench/gpu_round_syncs.py --device cpu --tiny``, or ``--dry-run`` (the same,
naming what it leaves out: ``set_sync_debug_mode`` needs CUDA, so only host reads are counted).

The target is a ``Qwen3ForCausalLM`` with random bf16 weights at Qwen3-8B shapes (hidden 4096,
32/8 heads x 128, MLP 12288, vocab 151936) cut to ``--layers`` decoder layers (default 4 of
36: syncs per round do not depend on the depth); the drafter is a random 1-layer DFlash drafter
reading 2 of them. Each method generates ``--new-tokens`` tokens after a warm-up, and every
round is delimited by the loop's own stage marks:

* ``cuda syncs``: ``torch.cuda.set_sync_debug_mode("warn")`` warnings per round (every
  synchronizing CUDA call torch makes: item, tolist of device tensors, nonzero, blocking copies);
  the round's one read is a non-blocking copy into pinned memory followed by a stream
  synchronize, which this mode does not flag, so 0 is the expected count;
* ``host reads``: tests/host_reads.py's counter (every torch call from Python that would wait
  for the device, whatever the device); 1 per round expected: the committed tokens.

Prints a table; JSON to ``--json`` (or ``$OUT/gpu_round_syncs.json``), rewritten after each
method. Exit 1 if any round of dflash or ddtree reads the host more than once.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from unittest import mock

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
from gpu_common import add_dry_run, apply_dry_run, default_json, fail_without_cuda, skipped, write_json  # noqa: E402

PROG = "gpu_round_syncs"

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=151936)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=512)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 512; tiny 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 64; tiny 16")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--json", default=None)
    add_dry_run(p)
    args = p.parse_args(argv)
    apply_dry_run(args, PROG, layers=4, prompt=16, new_tokens=16)
    args.prompt = args.prompt or (16 if args.tiny else 512)
    args.new_tokens = args.new_tokens or (16 if args.tiny else 64)
    if args.tiny:
        args.block, args.budget = min(args.block, 4), min(args.budget, 8)
    return args


def build_pair(shape, layers, block, dtype, device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash import DFlashDraftModel, make_draft_config

    torch.manual_seed(0)
    cfg = Qwen3Config(num_hidden_layers=layers, max_position_embeddings=32768, tie_word_embeddings=False,
                      attn_implementation="sdpa", **shape)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            target = Qwen3ForCausalLM(cfg)
            draft_cfg = make_draft_config(
                hidden_size=shape["hidden_size"], num_hidden_layers=1, num_attention_heads=shape["num_attention_heads"],
                num_key_value_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"],
                intermediate_size=shape["intermediate_size"], vocab_size=shape["vocab_size"], num_target_layers=layers,
                block_size=block, mask_token_id=shape["vocab_size"] - 1, target_layer_ids=[0, layers - 1],
                max_position_embeddings=32768)
            draft = DFlashDraftModel(draft_cfg)
    finally:
        torch.set_default_dtype(previous)
    target.generation_config.eos_token_id = None
    return target.to(device, dtype).eval(), draft.to(device, dtype).eval()


def count_per_round(run, device, round_end):
    from dflash.decoding.output import StageClock
    from host_reads import HostReadCounter

    counter, marks, cuda_warnings = HostReadCounter(), [], []
    real_mark = StageClock.mark

    def mark(self, stage):
        real_mark(self, stage)
        if stage == round_end:
            marks.append((counter.count, len(cuda_warnings)))

    with warnings.catch_warnings(record=True) as caught, mock.patch.object(StageClock, "mark", mark):
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with counter:
                # a view of the caught list, so that marks see the syncs so far
                cuda_warnings = caught
                run()
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
    reads = [b[0] - a[0] for a, b in zip(marks, marks[1:])]
    syncs = [b[1] - a[1] for a, b in zip(marks, marks[1:])]
    return reads, syncs


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if fail_without_cuda(torch, device, PROG):
        return 2
    import dflash

    if args.dry_run:
        skipped(PROG, 'torch.cuda.set_sync_debug_mode("warn")', "CUDA only: the cuda syncs column reads 0")
    shape = TINY if args.tiny else QWEN3_8B
    dtype = torch.float32 if args.tiny else torch.bfloat16
    target, draft = build_pair(shape, args.layers, args.block, dtype, device)
    prompt = torch.randint(0, shape["vocab_size"] - 1, (args.prompt,), generator=torch.Generator().manual_seed(1))
    rows = []
    report = dict(device=str(device), shape=shape, layers=args.layers, prompt=args.prompt, block=args.block,
                  budget=args.budget, note=f"target cut to {args.layers} decoder layers, random weights",
                  cuda_sync_debug_mode=device.type == "cuda", dry_run=args.dry_run, rows=rows, complete=False)
    path = default_json(args.json, "gpu_round_syncs.json")
    for method in ("ar", "dflash", "ddtree"):
        kw = dict(method=method, max_new_tokens=args.new_tokens)
        if method != "ar":
            kw["block_size"] = args.block
        if method == "ddtree":
            kw["tree_budget"] = args.budget
        with torch.inference_mode():
            dflash.warmup(target, None if method == "ar" else draft, method=method, block_size=args.block,
                          tree_budget=args.budget)
            reads, syncs = count_per_round(
                lambda: dflash.generate(target, None if method == "ar" else draft, prompt.to(device), **kw),
                device, "verify" if method == "ar" else "commit")
        rows.append(dict(method=method, rounds=len(reads) + 1, host_reads_max=max(reads), host_reads_mean=sum(reads) / len(reads),
                         cuda_syncs_max=max(syncs), cuda_syncs_mean=sum(syncs) / len(syncs)))
        write_json(path, report)  # what finished survives a kill
    report["complete"] = True
    print(f"== host syncs per round ({report['note']}; prompt {args.prompt}, B={args.block}, budget {args.budget})")
    print(f"{'method':<8}{'rounds':>8}{'host reads (max/mean)':>24}{'cuda syncs (max/mean)':>24}")
    for r in rows:
        print(f"{r['method']:<8}{r['rounds']:>8}{r['host_reads_max']:>14}/{r['host_reads_mean']:<9.2f}"
              f"{r['cuda_syncs_max']:>14}/{r['cuda_syncs_mean']:<9.2f}")
    write_json(path, report)
    bad = [r["method"] for r in rows if r["host_reads_max"] > 1]
    if bad:
        print("FAILED: more than one host read in a round of " + ", ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
