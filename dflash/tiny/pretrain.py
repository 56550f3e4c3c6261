"""Pretrain the tiny byte-level Qwen3 target on the standard library sources.

The model is a ``transformers.Qwen3ForCausalLM`` trained from scratch, with
the byte tokenizer of :mod:`dflash.tiny.tokenizer` (vocabulary 258) on the *train*
split of :mod:`dflash.tiny.corpus`; the held-out packages (json, email,
asyncio, xml) measure it.

Training: each step draws ``batch`` random contiguous windows of
``seq_len + 1`` tokens from the train token stream (files separated by EOS),
and minimizes the next-token cross-entropy

    loss = mean_{b, t} -log softmax(logits[b, t])[x[b, t + 1]]

with AdamW (betas 0.9 / 0.95, weight decay on matrices only, gradient norm
clipped to 1), a linear warmup then cosine decay to 10% of the peak learning
rate. The schedule runs on the *progress* fraction
``max(step / steps, elapsed / (minutes * 60))``, so a time-budgeted run still
anneals fully; ``--steps`` alone gives a run that is reproducible step for step.

Measures (also written to ``train_log.json``):

* held-out bits per byte: over fixed, evenly spaced windows of the held-out
  token stream, ``sum CE / (ln 2 * number of byte targets)``, skipping the
  positions whose target is the EOS id (not a byte);
* loop rate: greedy continuations of held-out prompts (see
  :func:`dflash.tiny.corpus.heldout_prompts`) and the fraction that end in a
  repetition loop (:func:`ends_in_loop`). A looping target inflates
  speculative-decoding acceptance, so this is reported next to it.

The shipped weights come from::

    python -m dflash.tiny.pretrain --out dflash/assets/tiny/target --seed 0 --minutes 25

and are stored in bf16 (``config.json``, ``model.safetensors``,
``tokenizer_config.json``, ``train_log.json``). Final numbers are measured on
the saved weights reloaded in fp32, i.e. what a user of the files gets.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

from .corpus import encode_corpus, heldout_prompts
from .tokenizer import ByteTokenizer

__all__ = [
    "build_target_config",
    "sample_windows",
    "eval_windows",
    "heldout_bits_per_byte",
    "ends_in_loop",
    "greedy_continuations",
    "greedy_loop_rates",
    "greedy_loop_rate",
    "train_target",
    "TrainResult",
    "parse_args",
    "main",
]

_LN2 = math.log(2.0)
_STORAGE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# --------------------------------------------------------------------------- model


def build_target_config(
    layers: int = 6,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    intermediate: int = 768,
    max_positions: int = 2048,
    rope_theta: float = 10000.0,
) -> Qwen3Config:
    """Qwen3 config of a byte-level target (vocab 258, tied embeddings, sdpa)."""
    if heads % kv_heads != 0:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    tok = ByteTokenizer()
    config = Qwen3Config(
        vocab_size=tok.vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rope_theta=rope_theta,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
        bos_token_id=None,
        attn_implementation="sdpa",
    )
    # Some transformers versions keep rope settings only in rope_parameters.
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("rope_theta") != rope_theta:
        rope["rope_theta"] = rope_theta
    return config


# --------------------------------------------------------------------------- data


def sample_windows(tokens: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """``batch`` random contiguous windows of ``length`` tokens: ``[batch, length]`` long."""
    if tokens.dim() != 1 or tokens.numel() <= length:
        raise ValueError(f"need a 1-D token stream longer than {length}, got shape {tuple(tokens.shape)}")
    starts = torch.randint(0, tokens.numel() - length + 1, (batch,), generator=generator)
    return tokens[starts[:, None] + torch.arange(length)]


def eval_windows(tokens: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """``count`` evenly spaced windows of ``length`` tokens (deterministic): ``[count, length]``."""
    if tokens.dim() != 1 or tokens.numel() < length:
        raise ValueError(f"need a 1-D token stream of at least {length} tokens, got shape {tuple(tokens.shape)}")
    starts = torch.linspace(0, tokens.numel() - length, count).long()
    return tokens[starts[:, None] + torch.arange(length)]


# --------------------------------------------------------------------------- measures


@torch.no_grad()
def heldout_bits_per_byte(
    model: torch.nn.Module, windows: torch.Tensor, batch: int = 16, autocast_dtype: Optional[torch.dtype] = None
) -> float:
    """Bits per byte of ``model`` on ``windows`` (``[n, T + 1]`` token ids).

    Position t of a window predicts token t + 1; targets equal to a special id
    (EOS, MASK) are not bytes and are skipped. Returns
    ``sum(CE) / (ln 2 * number of byte targets)``.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total_nll, total_count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        chunk = windows[i:i + batch].to(device)
        inputs, targets = chunk[:, :-1], chunk[:, 1:]
        with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            logits = model(input_ids=inputs).logits
        nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
        is_byte = targets.reshape(-1) < ByteTokenizer.num_byte_ids
        total_nll += nll[is_byte].sum().item()
        total_count += int(is_byte.sum().item())
    model.train(was_training)
    return total_nll / (_LN2 * max(total_count, 1))


def ends_in_loop(ids: Sequence[int], tail: int = 64, max_period: int = 16) -> bool:
    """True when the last ``tail`` ids repeat with some period ``p <= max_period``.

    That is: for some p in 1..max_period, ``ids[i] == ids[i - p]`` for every i
    in the last ``tail`` positions. Needs ``len(ids) >= tail + p``.
    """
    ids = list(ids)
    n = len(ids)
    for period in range(1, max_period + 1):
        if n < tail + period:
            break
        if all(ids[i] == ids[i - period] for i in range(n - tail, n)):
            return True
    return False


@torch.no_grad()
def greedy_continuations(model: torch.nn.Module, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
    """Greedy (argmax) continuations of ``new_tokens`` ids for equal-length prompts.

    One batched prefill, then one token per step with the model's KV cache;
    generation does not stop at EOS (the measure wants fixed lengths).
    """
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("greedy_continuations needs prompts of equal length")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids = torch.tensor([list(p) for p in prompts], dtype=torch.long, device=device)
    # transformers >= 5.24 renamed the forward argument `past_key_values` to `cache`.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, use_cache=True, **{cache_arg: cache})
    next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
    generated = [next_ids]
    for _ in range(new_tokens - 1):
        out = model(input_ids=next_ids, use_cache=True, **{cache_arg: cache})
        next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        generated.append(next_ids)
    model.train(was_training)
    return torch.cat(generated, dim=1).tolist()


def greedy_loop_rates(
    model: torch.nn.Module,
    n_prompts: int = 16,
    prompt_len: int = 128,
    new_tokens: int = 128,
    seed: int = 0,
    tail: int = 64,
    max_periods: Sequence[int] = (16, 64),
) -> dict[int, float]:
    """Fraction of greedy continuations of held-out prompts that end in a loop.

    The prompts are ``heldout_prompts(n_prompts, prompt_len, seed)``; each gets
    ``new_tokens`` greedy ids, tested with :func:`ends_in_loop` (last ``tail``
    ids) once per entry of ``max_periods``. Returns ``{max_period: rate}``.
    """
    prompts = heldout_prompts(n_prompts, prompt_len, seed=seed)
    continuations = greedy_continuations(model, prompts, new_tokens)
    count = max(len(continuations), 1)
    return {
        period: sum(ends_in_loop(c, tail=tail, max_period=period) for c in continuations) / count
        for period in max_periods
    }


def greedy_loop_rate(
    model: torch.nn.Module,
    n_prompts: int = 16,
    prompt_len: int = 128,
    new_tokens: int = 128,
    seed: int = 0,
    tail: int = 64,
    max_period: int = 16,
) -> float:
    """:func:`greedy_loop_rates` for one ``max_period`` (default: the brief's period <= 16)."""
    return greedy_loop_rates(model, n_prompts, prompt_len, new_tokens, seed, tail, (max_period,))[max_period]


# --------------------------------------------------------------------------- training


def _cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _autocast_dtype(choice: str, device: torch.device) -> Optional[torch.dtype]:
    """bf16 autocast when asked, or on ``auto`` where it is fast (CUDA, CPUs with bf16 instructions)."""
    if choice == "fp32":
        return None
    if choice == "bf16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16
    # bf16 autocast on a CPU with bf16 instructions (README: the tiny pair's training numbers); without them
    # autocast is slower, so keep fp32.
    return torch.bfloat16 if device.type == "cpu" and _cpu_has_bf16() else None


def _lr_at(progress: float, step: int, peak: float, warmup_steps: int, final_fraction: float = 0.1) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from ``peak`` to ``final_fraction * peak``."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = min(max(progress, 0.0), 1.0)
    return peak * (final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@dataclass
class TrainResult:
    """What :func:`train_target` returns: the saved model (as reloaded, fp32) and the log."""

    model: Qwen3ForCausalLM
    log: dict = field(default_factory=dict)
    out_dir: Optional[Path] = None


def _file_size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def train_target(args: argparse.Namespace) -> TrainResult:
    """Train, save, reload and measure; see the module docstring.

    Runs with ``args.threads`` torch threads and restores the caller's count.
    """
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _train_target(args)
    finally:
        torch.set_num_threads(threads_before)


@dataclass
class _Fit:
    """What the training loop leaves: steps and tokens done, wall seconds, the mean of the last 50 losses, the
    held-out curve."""

    steps: int
    tokens_seen: int
    seconds: float
    train_loss: float
    history: list


def _fit(model, args: argparse.Namespace, device, autocast_dtype, budget_s: Optional[float], train_tokens,
         windows_eval) -> _Fit:
    """AdamW on random ``seq_len + 1`` windows of ``train_tokens`` until ``args.steps`` or ``budget_s`` (whichever
    comes first), warm-up then cosine learning rate, held-out bits/byte every ``args.eval_every`` steps."""
    optimizer = torch.optim.AdamW(
        _param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8
    )
    generator = torch.Generator().manual_seed(args.seed)
    history: list[dict] = []
    recent_losses: list[float] = []
    step, tokens_seen = 0, 0
    start = time.perf_counter()
    interactive = sys.stderr.isatty()
    bar = tqdm(total=args.steps, desc="target", unit="step", mininterval=1.0 if interactive else 30.0,
               dynamic_ncols=True, disable=args.quiet)

    def progress() -> float:
        fractions = []
        if args.steps is not None:
            fractions.append(step / args.steps)
        if budget_s is not None:
            fractions.append((time.perf_counter() - start) / budget_s)
        return max(fractions)

    last_bpb = float("nan")
    while progress() < 1.0:
        lr = _lr_at(progress(), step, args.lr, args.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = sample_windows(train_tokens, args.batch, args.seq_len + 1, generator).to(device)
        with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        if not torch.isfinite(loss):
            raise FloatingPointError(f"training loss became {loss.item()} at step {step}; lower --lr")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += batch.shape[0] * args.seq_len
        recent_losses = (recent_losses + [loss.item()])[-50:]
        if args.eval_every and step % args.eval_every == 0:
            last_bpb = heldout_bits_per_byte(model, windows_eval, batch=args.batch, autocast_dtype=autocast_dtype)
            elapsed = time.perf_counter() - start
            history.append({
                "step": step, "minutes": round(elapsed / 60, 3), "lr": lr,
                "train_loss": round(sum(recent_losses) / len(recent_losses), 4),
                "heldout_bits_per_byte": round(last_bpb, 4),
            })
            if not interactive and not args.quiet:
                print(json.dumps(history[-1]), flush=True)
        bar.update(1)
        elapsed = time.perf_counter() - start
        bar.set_postfix(loss=f"{loss.item():.3f}", bpb=f"{last_bpb:.3f}",
                        tok_s=f"{tokens_seen / max(elapsed, 1e-9):.0f}", min=f"{elapsed / 60:.1f}", refresh=False)
    bar.close()
    return _Fit(step, tokens_seen, time.perf_counter() - start, sum(recent_losses) / max(len(recent_losses), 1),
                history)


def _train_target(args: argparse.Namespace) -> TrainResult:
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    minutes = args.minutes
    if minutes is None and args.steps is None:
        minutes = 25.0
    budget_s = minutes * 60.0 if minutes is not None else None
    autocast_dtype = _autocast_dtype(args.autocast, device)

    train_tokens = encode_corpus("train")
    heldout_tokens = encode_corpus("heldout")
    windows_eval = eval_windows(heldout_tokens, args.eval_windows, args.seq_len + 1)
    windows_final = eval_windows(heldout_tokens, args.final_eval_windows, args.seq_len + 1)

    config = build_target_config(
        layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
        head_dim=args.head_dim, intermediate=args.intermediate, max_positions=args.max_positions,
        rope_theta=args.rope_theta,
    )
    model = Qwen3ForCausalLM(config).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    fit = _fit(model, args, device, autocast_dtype, budget_s, train_tokens, windows_eval)

    # Save in the storage dtype, then measure what was saved, reloaded in fp32.
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    storage_dtype = _STORAGE_DTYPES[args.save_dtype]
    model.eval()
    model.to(storage_dtype)
    model.config.dtype = storage_dtype
    model.save_pretrained(out_dir)
    ByteTokenizer().save_pretrained(out_dir)
    reloaded = Qwen3ForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="sdpa").to(device)
    reloaded.eval()
    del model

    measure_start = time.perf_counter()
    final_bpb = heldout_bits_per_byte(reloaded, windows_final, batch=args.batch)
    loop_rates = greedy_loop_rates(reloaded, n_prompts=args.loop_prompts, prompt_len=args.loop_prompt_len,
                                   new_tokens=args.loop_new_tokens, seed=args.loop_seed, max_periods=(16, 64))
    measured = dict(final_bpb=final_bpb, loop_rates=loop_rates, seconds=time.perf_counter() - measure_start,
                    parameters=n_params, weights_bytes=_file_size(out_dir / "model.safetensors"))
    log = _train_log(args, fit, measured, minutes, autocast_dtype, device, train_tokens, heldout_tokens)
    (out_dir / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    return TrainResult(model=reloaded, log=log, out_dir=out_dir)


def _train_log(args: argparse.Namespace, fit: _Fit, measured: dict, minutes, autocast_dtype, device, train_tokens,
               heldout_tokens) -> dict:
    """The ``train_log.json`` of a run: the command, the training numbers, what was measured on the saved
    weights, the hyperparameters, the corpus sizes and the library versions."""
    loop_rates = measured["loop_rates"]
    return {
        "command": "python -m dflash.tiny.pretrain " + " ".join(args.argv),
        "seed": args.seed,
        "steps": fit.steps,
        "tokens_seen": fit.tokens_seen,
        "epochs": round(fit.tokens_seen / train_tokens.numel(), 3),
        "train_minutes": round(fit.seconds / 60, 2),
        "tokens_per_s": round(fit.tokens_seen / fit.seconds, 1),
        "train_loss_last50": round(fit.train_loss, 4),
        "heldout_bits_per_byte": round(measured["final_bpb"], 4),
        "heldout_eval": {
            "windows": args.final_eval_windows, "window_tokens": args.seq_len + 1,
            "weights": "saved file reloaded in fp32",
        },
        "loop_rate": loop_rates[16],
        "loop_rate_period64": loop_rates[64],
        "loop_eval": {
            "prompts": args.loop_prompts, "prompt_bytes": args.loop_prompt_len,
            "new_tokens": args.loop_new_tokens, "prompt_seed": args.loop_seed,
            "loop_rate": "share of greedy continuations (fp32) whose last 64 ids repeat with a period <= 16",
            "loop_rate_period64": "the same with any period <= 64 (catches repeated whole lines)",
        },
        "measure_seconds": round(measured["seconds"], 1),
        "parameters": measured["parameters"],
        "weights_bytes": measured["weights_bytes"],
        "storage_dtype": args.save_dtype,
        "train_precision": "bf16 autocast" if autocast_dtype is not None else "fp32",
        "threads": args.threads,
        "device": str(device),
        "hyperparameters": {
            "layers": args.layers, "hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "intermediate": args.intermediate, "seq_len": args.seq_len,
            "batch": args.batch, "lr": args.lr, "warmup_steps": args.warmup_steps,
            "weight_decay": args.weight_decay, "grad_clip": args.grad_clip,
            "minutes": minutes, "max_steps": args.steps,
        },
        "corpus": {"train_tokens": train_tokens.numel(), "heldout_tokens": heldout_tokens.numel()},
        "versions": {
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
        },
        "history": fit.history,
    }


# --------------------------------------------------------------------------- CLI


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command-line options of ``python -m dflash.tiny.pretrain``."""
    p = argparse.ArgumentParser(
        prog="python -m dflash.tiny.pretrain",
        description="Pretrain the tiny byte-level Qwen3 target on the Python standard library.",
    )
    p.add_argument("--out", required=True, help="output directory (config.json, model.safetensors, ...)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=None,
                   help="wall-clock training budget (default 25 unless --steps is given)")
    p.add_argument("--steps", type=int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--device", default="cpu")
    p.add_argument("--autocast", choices=("auto", "bf16", "fp32"), default="auto",
                   help="bf16 autocast: auto uses it on CUDA and on CPUs with bf16 instructions")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--max-positions", type=int, default=2048)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=200, help="steps between held-out evaluations (0: never)")
    p.add_argument("--eval-windows", type=int, default=64, help="held-out windows per periodic evaluation")
    p.add_argument("--final-eval-windows", type=int, default=512, help="held-out windows of the final evaluation")
    p.add_argument("--loop-prompts", type=int, default=16)
    p.add_argument("--loop-prompt-len", type=int, default=128)
    p.add_argument("--loop-new-tokens", type=int, default=128)
    p.add_argument("--loop-seed", type=int, default=0, help="seed of the loop-rate prompts (fixed across runs)")
    p.add_argument("--save-dtype", choices=tuple(_STORAGE_DTYPES), default="bf16")
    p.add_argument("--quiet", action="store_true", help="no progress bar or evaluation lines")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    for name in ("steps", "threads", "batch", "seq_len", "layers", "hidden", "heads", "kv_heads", "head_dim",
                 "intermediate", "final_eval_windows", "loop_prompts", "loop_new_tokens"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.minutes is not None and args.minutes <= 0:
        p.error(f"--minutes must be positive, got {args.minutes}")
    if args.loop_new_tokens < 64 + 64:
        p.error("--loop-new-tokens must be at least 128 (the loop test looks at the last 64 ids, period <= 64)")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: parse ``argv``, train, save, print the summary line."""
    args = parse_args(argv)
    result = train_target(args)
    log = result.log
    summary = {k: log[k] for k in ("steps", "train_minutes", "tokens_per_s", "train_loss_last50",
                                   "heldout_bits_per_byte", "loop_rate", "loop_rate_period64", "parameters",
                                   "weights_bytes")}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
