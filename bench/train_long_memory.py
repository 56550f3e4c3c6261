"""Peak memory of one drafter training step on long sequences (2k-8k tokens), with and without
``--grad-checkpoint``, packed or not.

Run (CPU or CUDA; a table, then one JSON line per setting)::

    python bench/train_long_memory.py [--lengths 2048,4096,8192] [--blocks 32] [--layers 2]
        [--target dflash/assets/tiny/target] [--sliding-window 0] [--pack 0]

Each setting runs in a fresh Python process: the shipped tiny target (6 layers, hidden 256; any local
target with ``--target``) frozen in fp32, a fresh drafter of the shipped drafter's shape (``--layers``
layers, block 8, target layers 1,3), one sequence of ``T`` tokens of held-in standard-library bytes,
``--blocks`` blocks, one :func:`dflash.training.objective.step_loss` forward and backward with the
trainer's capture cache, exactly what one micro-batch of ``python -m dflash train`` does. Right
before the step the process resets its peak resident set (``/proc/self/clear_refs``) and reads
``VmRSS``; ``VmHWM - VmRSS_before`` after the step is the step's peak extra memory (fallback:
``ru_maxrss``; on CUDA ``torch.cuda.max_memory_allocated`` minus the bytes allocated before). The
target's KV cache (allocated once per run, before the step) is reported beside it. The child runs
with ``MALLOC_MMAP_THRESHOLD_=65536``: every buffer over 64 KiB is its own mapping, returned to the
system when freed, so the resident peak is the peak of live tensors, not of what glibc kept from an
earlier pass.

``--pack N`` splits the ``T`` tokens into ``N`` samples packed into one sequence (one target pass per
sample, one drafter pass over all blocks). ``--sliding-window W``: every drafter layer a sliding-window
layer of ``W`` tokens.

What grows with ``T`` (per drafter layer, ``R = blocks * B`` block rows, ``C <= T`` context rows): the
context keys/values ``[Hkv, C, D]``, the additive mask ``[R, C + R]`` fp32 (at 8k and 32 blocks of 8:
256 x 8448 x 4 B = 8.3 MiB) and the attention weights ``[Hq, R, C + R]``; on the target side the
captured features ``[T, (n+1) H]`` and the KV cache. Nothing is ``[T, T]``: the target's capture runs
in causal chunks of :data:`dflash.target.adapter.PREFILL_CHUNK` rows.
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
sys.path.insert(0, str(ROOT))

from dflash.benchmark.memory import PeakGrowth  # noqa: E402

DEFAULT_TARGET = ROOT / "dflash" / "assets" / "tiny" / "target"


def child(cfg: dict) -> dict:
    """One step at ``cfg['seq_len']`` tokens in this process; returns its peak extra memory (MiB)."""
    import torch

    torch.set_num_threads(1)
    import dflash_kernels
    from dflash import TargetAdapter, make_draft_config
    from dflash.drafter.model import DFlashDraftModel
    from dflash.tiny.corpus import encode_corpus
    from dflash.tiny.pair import load_target
    from dflash.training.checkpointing import enable_gradient_checkpointing
    from dflash.training.objective import BlockTrainingConfig, step_loss
    from dflash.training.records import TrainingSequence, pack_sequences

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    T, B, nb = cfg["seq_len"], 8, cfg["blocks"]
    target = load_target(cfg["target"], dtype=torch.float32, device=device)
    target.requires_grad_(False)
    tc = target.config
    L = tc.num_hidden_layers
    ids = [1, 3] if cfg["layers"] == 2 else None
    window = cfg["sliding_window"] or None
    torch.manual_seed(0)
    draft = DFlashDraftModel(make_draft_config(
        hidden_size=tc.hidden_size, num_hidden_layers=cfg["layers"], num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, head_dim=getattr(tc, "head_dim", None),
        intermediate_size=tc.intermediate_size, vocab_size=tc.vocab_size, num_target_layers=L, block_size=B,
        mask_token_id=256, target_layer_ids=ids, max_position_embeddings=tc.max_position_embeddings,
        layer_types=["sliding_attention"] * cfg["layers"] if window else None, sliding_window=window,
    )).to(device).train()
    if cfg["grad_checkpoint"]:
        enable_gradient_checkpointing(draft)
    adapter = TargetAdapter(target, list(draft.target_layer_ids) + [L - 1])
    tokens = encode_corpus("train")[:T].clamp_max(255)
    pieces = max(1, cfg["pack"])
    cut = [round(i * T / pieces) for i in range(pieces + 1)]
    seqs = [TrainingSequence(tokens[a:b].clone(), torch.ones(b - a, dtype=torch.bool), line=i + 1)
            for i, (a, b) in enumerate(zip(cut, cut[1:]))]
    seq = pack_sequences(seqs, T, B)[0] if pieces > 1 else seqs[0]
    step_cfg = BlockTrainingConfig(block_size=B, blocks_per_seq=nb, logit_layer=L - 1)
    cache = adapter.new_cache(T)
    kv_mib = cache.kv.numel() * cache.kv.element_size() / 2**20 if hasattr(cache, "kv") else float("nan")
    with dflash_kernels.force_backend("reference") if device.type == "cpu" else _null():
        # warm-up on a short slice (allocator pools, lazy imports), then the measured step
        short = TrainingSequence(tokens[:64].clone(), torch.ones(64, dtype=torch.bool), line=0)
        step_loss(draft, adapter, [short], BlockTrainingConfig(block_size=B, blocks_per_seq=2, logit_layer=L - 1),
                  generator=torch.Generator().manual_seed(0), cache=cache).loss.backward()
        draft.zero_grad(set_to_none=False)
        with PeakGrowth(device) as growth:
            t0 = time.perf_counter()
            out = step_loss(draft, adapter, [seq], step_cfg, generator=torch.Generator().manual_seed(0), cache=cache)
            out.loss.backward()
            seconds = time.perf_counter() - t0
    peak, how = growth.bytes, growth.how
    R = out.num_blocks * B
    return dict(seq_len=T, grad_checkpoint=bool(cfg["grad_checkpoint"]), pack=pieces,
                sliding_window=window or 0, blocks=out.num_blocks, peak_extra_mib=round(peak / 2**20, 1),
                target_kv_cache_mib=round(kv_mib, 1), seconds=round(seconds, 2), loss=round(out.loss.item(), 4),
                drafter_mask_mib_per_layer=round(R * (T + R) * 4 / 2**20, 2), device=device.type, measured_as=how)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run_setting(cfg: dict) -> dict:
    """:func:`child` in a fresh interpreter; its JSON line."""
    args = [sys.executable, str(Path(__file__).resolve()), "--child"]
    for k, v in cfg.items():
        args += [f"--{k.replace('_', '-')}", str(int(v) if isinstance(v, bool) else v)]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=str(ROOT))
    if proc.returncode != 0:
        raise RuntimeError(f"setting {cfg} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ints(text: str):
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, default=2048, help=argparse.SUPPRESS)
    p.add_argument("--grad-checkpoint", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--lengths", type=_ints, default=[2048, 4096, 8192])
    p.add_argument("--blocks", type=int, default=32, help="blocks per sequence (the trainer's --blocks-per-seq)")
    p.add_argument("--layers", type=int, default=2, help="drafter layers")
    p.add_argument("--target", default=str(DEFAULT_TARGET))
    p.add_argument("--sliding-window", type=int, default=0)
    p.add_argument("--pack", type=int, default=0, help="split each sequence into this many packed samples")
    args = p.parse_args(argv)
    base = dict(blocks=args.blocks, layers=args.layers, target=args.target, sliding_window=args.sliding_window,
                pack=args.pack)
    if args.child:
        print(json.dumps(child(dict(base, seq_len=args.seq_len, grad_checkpoint=args.grad_checkpoint))))
        return 0
    rows = [run_setting(dict(base, seq_len=T, grad_checkpoint=gc)) for T in args.lengths for gc in (0, 1)]
    print(f"one training step (forward + backward), {rows[0]['blocks']} blocks of 8, {args.layers} drafter layers, "
          f"{rows[0]['device']}" + (f", packed {args.pack} samples" if args.pack > 1 else "")
          + (f", sliding window {args.sliding_window}" if args.sliding_window else ""))
    print("| tokens | grad checkpoint | peak extra MiB | MiB per 1k tokens | target KV cache MiB | "
          "drafter mask MiB/layer | step s |")
    print("|---:|:---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['seq_len']} | {'yes' if r['grad_checkpoint'] else 'no'} | {r['peak_extra_mib']} | "
              f"{r['peak_extra_mib'] / (r['seq_len'] / 1024):.1f} | {r['target_kv_cache_mib']} | "
              f"{r['drafter_mask_mib_per_layer']} | {r['seconds']} |")
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
