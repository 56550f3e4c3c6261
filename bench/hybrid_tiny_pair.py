"""A tiny hybrid pair on this CPU: a byte-level Qwen3.5 target, a DFlash drafter trained on it, and tau / tokens/s.

    python bench/hybrid_tiny_pair.py --out bench/results/hybrid_tiny_pair   (about 15 minutes on one core)

1. target: transformers' ``Qwen3_5ForCausalLM`` (hidden ``--hidden``, 4 layers: Gated-DeltaNet, Gated-DeltaNet,
   Gated-DeltaNet, full attention; byte vocabulary 258, tied embeddings) pretrained for ``--target-steps`` on
   random windows of the stdlib *train* stream (:mod:`dflash.tiny.corpus`), AdamW, cosine schedule;
2. data: its greedy continuations of ``--prompts`` train-split prompts (:func:`dflash.training.data.heldin_prompts`);
3. drafter: a 2-layer DFlash drafter (block 8) trained for ``--draft-steps`` with our trainer's step
   (:func:`dflash.training.train.step_loss`: the fused CE through the frozen lm_head);
4. benchmark, one thread, reference ops: ``ar``, ``dflash`` and ``ddtree`` (budget ``--budget``) interleaved
   per prompt (prompt i runs ar, dflash, ddtree in turn, so drifts of the machine hit all three) on held-out
   prompts, ``--new`` tokens each, greedy; every output is checked equal to ``ar`` (lossless). Reported: tau
   (committed tokens per round) and tokens/s, pooled; the greedy loop rate of the target (a looping target
   inflates acceptance).

Writes ``pair.json`` (numbers) and the two models (``target/``, ``drafter/``) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/hybrid_tiny_pair")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--target-steps", type=int, default=1500)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--continuation", type=int, default=96)
    p.add_argument("--draft-steps", type=int, default=1500)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--eval-prompts", type=int, default=16)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def target_config(hidden: int):
    import transformers

    from dflash.tiny.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    return transformers.Qwen3_5TextConfig(
        vocab_size=tok.vocab_size, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=hidden // 4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=hidden // 4,
        linear_value_head_dim=hidden // 4, linear_conv_kernel_dim=4, max_position_embeddings=1024,
        tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id, bos_token_id=None)


def pretrain_target(args):
    import transformers

    from dflash.tiny.corpus import encode_corpus
    from dflash.tiny.pretrain import sample_windows

    torch.manual_seed(args.seed)
    model = transformers.Qwen3_5ForCausalLM(target_config(args.hidden)).train()
    tokens = encode_corpus("train")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    g = torch.Generator().manual_seed(args.seed)
    t0, losses = time.perf_counter(), []
    for step in range(args.target_steps):
        lr = 3e-3 * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.target_steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        x = sample_windows(tokens, args.batch, args.seq_len + 1, g)
        loss = model(x[:, :-1], labels=x[:, :-1].clone()).loss  # HF shifts the labels itself
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if step % 100 == 0 or step == args.target_steps - 1:
            print(f"  target step {step}: loss {sum(losses[-50:]) / len(losses[-50:]):.3f} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
    model.eval()
    model.generation_config.eos_token_id = None
    return model, dict(target_final_loss=sum(losses[-50:]) / len(losses[-50:]),
                       target_seconds=time.perf_counter() - t0)


def train_drafter(args, target):
    from dflash import DFlashDraftModel, make_draft_config
    from dflash.target import TargetAdapter
    from dflash.tiny.tokenizer import ByteTokenizer
    from dflash.training.data import TrainingSequence, build_greedy_records, heldin_prompts
    from dflash.training.train import BlockTrainingConfig, step_loss

    prompts = heldin_prompts(args.prompts, args.prompt_len, seed=args.seed)
    t0 = time.perf_counter()
    records = build_greedy_records(target, prompts, args.continuation, batch_size=64)
    data_s = time.perf_counter() - t0
    cfg = target.config
    tok = ByteTokenizer()
    config = make_draft_config(hidden_size=cfg.hidden_size, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=cfg.hidden_size // 4,
                               intermediate_size=3 * cfg.hidden_size, vocab_size=cfg.vocab_size,
                               num_target_layers=4, block_size=args.block, mask_token_id=tok.mask_token_id,
                               target_layer_ids=[1, 2], max_position_embeddings=1024)
    torch.manual_seed(args.seed)
    draft = DFlashDraftModel(config).train()
    seqs = [TrainingSequence(torch.tensor(r["input_ids"]), torch.tensor(r["loss_mask"], dtype=torch.bool), i)
            for i, r in enumerate(records)]
    adapter = TargetAdapter(target, [1, 2, 3])
    bcfg = BlockTrainingConfig(block_size=args.block, blocks_per_seq=8, logit_layer=3)
    opt = torch.optim.AdamW(draft.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.01)
    g = torch.Generator().manual_seed(args.seed)
    store, cache = {}, adapter.new_cache(max(s.input_ids.numel() for s in seqs))
    t0, taus = time.perf_counter(), []
    try:
        for step in range(args.draft_steps):
            decay = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.draft_steps))
            lr = 2e-3 * min(1.0, (step + 1) / 50) * decay
            for group in opt.param_groups:
                group["lr"] = lr
            idx = torch.randint(0, len(seqs), (8,), generator=g).tolist()
            out = step_loss(draft, adapter, [seqs[i] for i in idx], bcfg, generator=g, cache=cache, store=store)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            opt.step()
            taus.append(out.block_tau)
            if step % 100 == 0 or step == args.draft_steps - 1:
                print(f"  drafter step {step}: loss {float(out.loss):.3f}, block tau "
                      f"{sum(taus[-50:]) / len(taus[-50:]):.2f} ({time.perf_counter() - t0:.0f}s)", flush=True)
    finally:
        adapter.close()
    return draft.eval(), dict(records=len(records), data_seconds=data_s, drafter_seconds=time.perf_counter() - t0,
                              drafter_block_tau=sum(taus[-50:]) / len(taus[-50:]))


def benchmark(args, target, draft):
    import dflash
    import dflash_kernels
    from dflash.tiny.corpus import heldout_prompts
    from dflash.tiny.pretrain import ends_in_loop

    prompts = heldout_prompts(args.eval_prompts, args.prompt_len, seed=args.seed + 1)
    totals = {m: dict(tokens=0, rounds=0, seconds=0.0) for m in ("ar", "dflash", "ddtree")}
    loops = 0
    with dflash_kernels.force_backend("reference"):
        dflash.generate(target, draft, prompts[0], max_new_tokens=16)  # warm-up
        for p in prompts:
            outs = {}
            for method in ("ar", "dflash", "ddtree"):  # interleaved per prompt
                kw = dict(tree_budget=args.budget) if method == "ddtree" else {}
                r = dflash.generate(target, None if method == "ar" else draft, p, method=method,
                                    max_new_tokens=args.new, **kw)
                outs[method] = r.output_ids
                t = totals[method]
                t["tokens"] += r.num_new_tokens
                t["rounds"] += len(r.acceptance_lengths)
                t["seconds"] += r.total_time
            for method in ("dflash", "ddtree"):
                if not torch.equal(outs[method], outs["ar"]):
                    raise SystemExit(f"hybrid_tiny_pair: {method} differs from ar on a prompt (not lossless)")
            loops += ends_in_loop(outs["ar"][0, len(p):].tolist())
    ar_tps = totals["ar"]["tokens"] / totals["ar"]["seconds"]
    rows = {}
    for m, t in totals.items():
        tps = t["tokens"] / t["seconds"]
        # the prefill's first token is not a round: tau = tokens committed by rounds / rounds
        rows[m] = dict(tau=(t["tokens"] - len(prompts)) / t["rounds"], tokens_per_second=tps, speedup=tps / ar_tps)
    return rows, dict(loop_rate=loops / len(prompts), eval_prompts=len(prompts), new_tokens=args.new)


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("hybrid_tiny_pair: pretraining the Qwen3.5 byte target", flush=True)
    target, info = pretrain_target(args)
    target.save_pretrained(out / "target")
    print("hybrid_tiny_pair: training the drafter", flush=True)
    draft, dinfo = train_drafter(args, target)
    draft.save_pretrained(str(out / "drafter"))
    info.update(dinfo)
    print("hybrid_tiny_pair: benchmark (one thread, interleaved)", flush=True)
    rows, binfo = benchmark(args, target, draft)
    info.update(binfo)
    print(f"{'method':<8} {'tau':>6} {'tokens/s':>10} {'vs ar':>7}")
    for m, r in rows.items():
        print(f"{m:<8} {r['tau']:>6.2f} {r['tokens_per_second']:>10.1f} {r['speedup']:>7.2f}")
    print(f"target greedy loop rate on the eval prompts: {info['loop_rate']:.2f}")
    (out / "pair.json").write_text(json.dumps(dict(args=vars(args), info=info, methods=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
