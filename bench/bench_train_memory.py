"""Benchmark: peak memory of one drafter training step, fused lm_head ops vs the naive path.

Run as a script (prints a table and JSON)::

    python bench/bench_train_memory.py [--vocab 151936] [--seq-len 1024] [--blocks 32]

or with pytest-benchmark (one round per variant; the memory is in
``extra_info``)::

    python -m pytest bench/bench_train_memory.py --benchmark-columns=median,rounds

One step of :func:`dflash.training.train.step_loss` (forward and backward) on one
sequence of ``T`` tokens with ``nb`` blocks of ``B = 16`` at a 151936-token
vocabulary (Qwen3's), a small hidden size so that it runs on a CPU:

* ``fused``: what training runs. Labels from
  :func:`dflash_kernels.lm_head_argmax` at the ``nb*(B-1)`` supervised rows
  (no logits stored), loss from :func:`dflash_kernels.lm_head_cross_entropy`
  (logits one row chunk at a time; at most ``2**25`` fp32 values per chunk).
* ``unfused``: the naive recipe (``BlockTrainingConfig(fused=False)``): the
  target's logits over the whole sequence ``[T, V]`` then argmax, the
  drafter's logits ``[nb*B, V]`` then ``F.cross_entropy``.

Memory: each variant runs in a fresh Python process (nothing freed by the
other variant is reused). Right before the step the process resets its
peak resident set (``/proc/self/clear_refs``) and reads ``VmRSS``; after the
step, ``VmHWM - VmRSS_before`` is the step's peak extra memory (fallback
without ``clear_refs``: ``ru_maxrss`` of ``resource.getrusage`` minus the
RSS before). On a CUDA machine the step runs on the GPU and the number is
``torch.cuda.max_memory_allocated`` minus the allocated bytes before.

Without CUDA the fused ops run under Triton's CPU interpreter (set in the
child process): their memory is what the kernels allocate, their time means
nothing (the interpreter is a correctness tool).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DEFAULTS = dict(vocab=151936, hidden=64, seq_len=1024, blocks=32, block_size=16, target_layers=3)


from dflash.benchmark.memory import PeakGrowth  # noqa: E402


def child(variant: str, cfg: dict) -> dict:
    """Build a random target/drafter pair, run one step, report peak extra memory (MiB)."""
    import torch

    torch.set_num_threads(1)
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import dflash_kernels
    from dflash import TargetAdapter, make_draft_config
    from dflash.training.data import TrainingSequence
    from dflash.drafter.model import DFlashDraftModel
    from dflash.training.train import BlockTrainingConfig, step_loss

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    V, H, T, B, L = cfg["vocab"], cfg["hidden"], cfg["seq_len"], cfg["block_size"], cfg["target_layers"]
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=L, num_attention_heads=4,
        num_key_value_heads=2, head_dim=H // 4, max_position_embeddings=4 * T, tie_word_embeddings=True,
        attn_implementation="sdpa")).to(device).eval()
    target.requires_grad_(False)
    draft = DFlashDraftModel(make_draft_config(
        hidden_size=H, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=H // 4,
        intermediate_size=2 * H, vocab_size=V, num_target_layers=L, block_size=B, mask_token_id=V - 1,
        target_layer_ids=[1], max_position_embeddings=4 * T)).to(device).train()
    adapter = TargetAdapter(target, [1, L - 1])
    seq = TrainingSequence(torch.randint(0, V - 1, (T,)), torch.ones(T, dtype=torch.bool), line=1)
    step_cfg = BlockTrainingConfig(block_size=B, blocks_per_seq=cfg["blocks"], logit_layer=L - 1,
                                   fused=variant == "fused")
    cache = adapter.new_cache(T)
    # warm the kernels up on one row (imports, interpreter set-up) so the step measures the step
    W = adapter.lm_head.weight
    h = torch.randn(1, H, device=device, requires_grad=True)
    dflash_kernels.lm_head_argmax(h.detach(), W)
    dflash_kernels.lm_head_cross_entropy(h, W, torch.zeros(1, dtype=torch.long, device=device)).sum().backward()
    del h

    gen = torch.Generator().manual_seed(0)
    with PeakGrowth(device) as growth:
        t0 = time.perf_counter()
        out = step_loss(draft, adapter, [seq], step_cfg, generator=gen, cache=cache)
        out.loss.backward()
        seconds = time.perf_counter() - t0
    peak, how = growth.bytes, growth.how
    n_sup = out.num_blocks * (B - 1)
    return dict(variant=variant, device=device.type, peak_extra_mib=round(peak / 2**20, 1), seconds=round(seconds, 2),
                loss=round(out.loss.item(), 4), num_blocks=out.num_blocks, supervised_rows=n_sup,
                full_target_logits_mib=round(T * V * 4 / 2**20, 1),
                full_draft_logits_mib=round(out.num_blocks * B * V * 4 / 2**20, 1),
                backend=dflash_kernels.get_backend(device), measured_as=how, **cfg)


def run_variant(variant: str, cfg: dict) -> dict:
    """Run :func:`child` in a fresh interpreter and return its JSON line."""
    args = [sys.executable, str(Path(__file__).resolve()), "--child", variant]
    for k, v in cfg.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=str(ROOT))
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} step failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ pytest-benchmark


def _bench(benchmark, variant):
    result = {}

    def once():
        result.update(run_variant(variant, DEFAULTS))

    benchmark.pedantic(once, rounds=1, iterations=1)
    benchmark.group = f"train step memory V={DEFAULTS['vocab']} T={DEFAULTS['seq_len']}"
    benchmark.extra_info.update(result)


def test_train_step_memory_fused(benchmark):
    _bench(benchmark, "fused")


def test_train_step_memory_unfused(benchmark):
    _bench(benchmark, "unfused")


# ------------------------------------------------------------------ script


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", choices=["fused", "unfused"], help=argparse.SUPPRESS)
    for k, v in DEFAULTS.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    args = p.parse_args(argv)
    cfg = {k: getattr(args, k) for k in DEFAULTS}
    if args.child:
        print(json.dumps(child(args.child, cfg)))
        return 0
    rows = [run_variant(v, cfg) for v in ("fused", "unfused")]
    print(f"one training step, V={cfg['vocab']}, H={cfg['hidden']}, T={cfg['seq_len']}, "
          f"{rows[0]['num_blocks']} blocks of {cfg['block_size']} ({rows[0]['supervised_rows']} supervised rows), "
          f"{rows[0]['device']}")
    print(f"  full target logits [T, V] fp32 would be {rows[0]['full_target_logits_mib']} MiB, "
          f"drafter logits [nb*B, V] {rows[0]['full_draft_logits_mib']} MiB")
    for r in rows:
        print(f"  {r['variant']:8s} peak extra {r['peak_extra_mib']:8.1f} MiB   loss {r['loss']:.4f}   "
              f"{r['seconds']:.1f} s ({r['backend']})")
    print(f"  unfused / fused peak: {rows[1]['peak_extra_mib'] / max(rows[0]['peak_extra_mib'], 1e-9):.1f}x")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
