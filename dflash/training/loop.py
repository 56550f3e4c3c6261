"""The trainer loop: global batches sharded over ranks, micro-batch accumulation, logs, checkpoints, resume.

Step ``s`` trains on the global batch ``I_s`` of ``G = --batch-size``
sequences (:func:`batch_indices`: epochs of a seeded permutation, the same
on every rank and for every world size). Rank ``r`` of ``N`` takes the
positions ``j = r, r+N, r+2N, ...`` of ``I_s`` (``G/N`` sequences), split
into micro-batches of ``--micro-batch-size`` sequences, one backward each
(gradients accumulate; they are reduced across ranks on the last one).
Sequence ``j`` of step ``s`` draws its anchors and noise from its own
generator seeded by ``(seed, s, j)``, so it gets the same blocks on any rank.
Every rank normalises by the global weight sum
``W_s = sum_{j in I_s} sequence_weight_sum(j)`` (known from the loss masks),
so the summed gradient is that of

    loss_s = sum_{j in I_s} sum_{b,k>=1} w_k CE_{j,b,k} / W_s

whatever ``N`` and the micro-batch size are: world 2 gives world 1's
weights up to the order of fp32 additions. The learning rate follows
``--steps`` (or rank 0's clock under ``--minutes``, broadcast so that every
rank agrees). Logged numbers are reduced over ranks; rank 0 alone writes
files (the drafter in the published format, :mod:`.state`, the logs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import List

import torch

import dflash_kernels

from ..drafter.config import default_target_layer_ids, make_draft_config, qwen3_config
from ..drafter.model import DFlashDraftModel
from ..target import TargetAdapter
from .checkpointing import enable_gradient_checkpointing
from .distributed import (World, full_parameters, full_tensor, gradient_scale, gradient_sync, init_world, is_sharded,
                          load_full_, shard_target_layers, wrap_drafter)
from .evaluation import distributed_tau, final_eval_table
from .objective import BlockTrainingConfig, default_gamma, resolve_logit_layer, sequence_weight_sum, step_loss
from .records import read_prompts_jsonl, read_training_jsonl
from .state import StateError, TrainingState, load_state, save_state

__all__ = ["LOG_NAME", "STATE_SUBDIR", "JSONL_LOG_NAME", "SAVE_DTYPES", "lr_at", "batch_indices", "rank_positions",
           "sequence_generator", "train"]

LOG_NAME = "train_log.json"
STATE_SUBDIR = "training_state"  # the default --state-dir inside --out (the drafter directory holds only its weights)
JSONL_LOG_NAME = "train_log.jsonl"
SAVE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# --------------------------------------------------------------------------- the schedule


def lr_at(progress: float, step: int, peak: float, warmup: int, final_fraction: float = 0.1) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from ``peak`` to ``final_fraction * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(max(progress, 0.0), 1.0)
    return peak * (final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * p)))


def batch_indices(step: int, batch_size: int, n: int, seed: int) -> List[int]:
    """The global batch of step ``step``: epochs of a seeded permutation, so a resumed run continues exactly."""
    out = []
    perms = {}
    for g in range(step * batch_size, (step + 1) * batch_size):
        epoch, i = divmod(g, n)
        if epoch not in perms:
            perms[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(perms[epoch][i]))
    return out


def rank_positions(batch_size: int, world: World) -> List[int]:
    """Positions in the global batch this rank trains on: ``rank, rank + N, ...``."""
    return list(range(world.rank, batch_size, world.world_size))


def sequence_generator(seed: int, step: int, position: int) -> torch.Generator:
    """The anchors-and-noise generator of the sequence at ``position`` of step ``step``'s global batch."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + step) * 65_537 + position) % (2 ** 63))


# --------------------------------------------------------------------------- building the run


def _load_tokenizer(args):
    from ..tiny.pair import load_tokenizer
    from ..tiny.tokenizer import ByteTokenizer

    if args.tokenizer == "byte":
        return ByteTokenizer()
    directory = args.tokenizer or args.target
    try:
        return load_tokenizer(directory)
    except Exception as e:  # no tokenizer there: token-id data still works
        if args.tokenizer is not None:
            raise SystemExit(f"cannot load the tokenizer from {directory}: {e}")
        return None


def _new_drafter(args, target, tokenizer) -> DFlashDraftModel:
    cfg = target.config
    L = cfg.num_hidden_layers
    mask_id = args.mask_token_id
    if mask_id is None:
        mask_id = getattr(tokenizer, "mask_token_id", None)
    if mask_id is None:
        raise SystemExit("the tokenizer has no mask token: give --mask-token-id (an id the drafter uses as MASK)")
    ids = args.target_layer_ids or default_target_layer_ids(L, args.layers)
    config = make_draft_config(
        hidden_size=cfg.hidden_size, num_hidden_layers=args.layers,
        num_attention_heads=args.heads or cfg.num_attention_heads,
        num_key_value_heads=args.kv_heads or getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=args.head_dim or getattr(cfg, "head_dim", None),
        intermediate_size=args.intermediate_size or cfg.intermediate_size, vocab_size=cfg.vocab_size,
        num_target_layers=L, block_size=args.block_size, mask_token_id=mask_id, target_layer_ids=ids,
        rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6),
        max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096),
    )
    torch.manual_seed(args.seed)
    return DFlashDraftModel(config)


def _drafter_from_state(state: TrainingState, state_file: Path) -> DFlashDraftModel:
    raw = dict(state.config)
    raw.pop("architectures", None)
    try:
        draft = DFlashDraftModel(qwen3_config(raw))
    except Exception as e:
        raise StateError(f"{state_file}: the drafter config does not build a drafter ({e})") from None
    weights = state.model_tensors()
    params = dict(draft.named_parameters())
    missing, extra = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if missing or extra:
        raise StateError(f"{state_file}: the tensors do not match the drafter config (missing {missing[:4]}, "
                         f"unexpected {extra[:4]})")
    with torch.no_grad():
        for name, p in params.items():
            if tuple(weights[name].shape) != tuple(p.shape):
                raise StateError(f"{state_file}: {name} has shape {tuple(weights[name].shape)}, the config "
                                 f"gives {tuple(p.shape)}")
            p.copy_(weights[name])
    return draft


def _param_groups(model: torch.nn.Module, weight_decay: float) -> List[dict]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [(n, p) for n, p in named if p.dim() >= 2]
    other = [(n, p) for n, p in named if p.dim() < 2]
    return [dict(params=[p for _, p in decay], names=[n for n, _ in decay], weight_decay=weight_decay),
            dict(params=[p for _, p in other], names=[n for n, _ in other], weight_decay=0.0)]


_GROUP_KEYS = ("weight_decay", "betas", "eps")


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict:
    """``{"optim.<name>.<moment>": whole fp32 tensor}`` (collective under FSDP)."""
    out = {}
    for group in optimizer.param_groups:
        for name, p in zip(group["names"], group["params"]):
            for key, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value):
                    out[f"optim.{name}.{key}"] = full_tensor(value.detach()).float().cpu().reshape(value.shape)
    return out


def _optimizer_meta(optimizer: torch.optim.Optimizer) -> dict:
    return {"param_groups": [{**{k: (list(g[k]) if isinstance(g[k], tuple) else g[k]) for k in _GROUP_KEYS},
                              "params": list(g["names"])} for g in optimizer.param_groups]}


def _restore_optimizer(optimizer: torch.optim.Optimizer, state: TrainingState, state_file: Path) -> None:
    saved = state.optimizer.get("param_groups")
    if not isinstance(saved, list) or len(saved) != len(optimizer.param_groups):
        raise StateError(f"{state_file}: optimizer.param_groups must list {len(optimizer.param_groups)} groups")
    for group, meta in zip(optimizer.param_groups, saved):
        if not isinstance(meta, dict) or meta.get("params") != group["names"]:
            raise StateError(f"{state_file}: the optimizer's parameter names do not match the drafter's")
        for key in _GROUP_KEYS:
            value = meta.get(key)
            ok = isinstance(value, (int, float)) or (isinstance(value, list) and all(
                isinstance(v, (int, float)) for v in value))
            if not ok or isinstance(value, bool):
                raise StateError(f"{state_file}: optimizer field {key!r} must be a number (or list of numbers)")
            group[key] = tuple(value) if isinstance(value, list) else value
        for name, p in zip(group["names"], group["params"]):
            saved_t = state.optimizer_tensors(name)
            if not saved_t:
                continue  # a state saved before the first step
            entry = {}
            for key, full in saved_t.items():
                if key == "step":
                    entry[key] = full.reshape(()).clone()
                    continue
                if tuple(full.shape) != tuple(p.shape):
                    raise StateError(f"{state_file}: optim.{name}.{key} has shape {tuple(full.shape)}, "
                                     f"the parameter {tuple(p.shape)}")
                t = torch.zeros_like(p, memory_format=torch.preserve_format)
                load_full_(t, full)
                entry[key] = t
            optimizer.state[p] = entry


def _eval_prompts(args, tokenizer, vocab_size: int, n: int, seed: int):
    if args.eval_prompts:
        return read_prompts_jsonl(args.eval_prompts, vocab_size, tokenizer)[:n]
    if getattr(tokenizer, "num_byte_ids", None) == 256:
        from ..tiny.corpus import heldout_prompts

        return heldout_prompts(n, args.eval_prompt_len, seed=seed)
    return None


class _RunLog:
    """Rank 0's log sinks: one JSON line per entry in ``train_log.jsonl``, TensorBoard scalars when installed."""

    def __init__(self, out_dir: Path, enabled: bool, tensorboard: bool, resume: bool):
        self.enabled = enabled
        self.file = None
        self.tb = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(out_dir / JSONL_LOG_NAME, "a" if resume else "w", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                return
            self.tb = SummaryWriter(str(out_dir / "tensorboard"))

    def write(self, entry: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(entry) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in entry.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(f"train/{key}", value, entry["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


# --------------------------------------------------------------------------- the run


def train(args: argparse.Namespace) -> dict:
    """Train (or resume) on this rank; returns the train log (rank 0 also writes it to ``--out``)."""
    world = init_world(args.device)
    try:
        return _train(args, world)
    finally:
        world.close()


def _check_args(args, world: World) -> None:
    if args.batch_size < 1 or args.batch_size % world.world_size:
        raise ValueError(f"--batch-size {args.batch_size} (the global batch) must be a positive multiple of the "
                         f"world size {world.world_size}: each rank takes an equal share")
    if args.micro_batch_size is not None and args.micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be >= 1, got {args.micro_batch_size}")
    if args.shard_target and args.parallel != "fsdp":
        raise ValueError("--shard-target needs --parallel fsdp")


def _train(args, world: World) -> dict:
    from tqdm import tqdm

    from ..tiny.pair import load_target

    _check_args(args, world)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = world.device
    out_dir = Path(args.out)
    state_dir = Path(args.state_dir) if args.state_dir else out_dir / STATE_SUBDIR
    minutes = args.minutes if (args.minutes is not None or args.steps is not None) else 20.0
    bf16 = (device.type == "cuda") if args.bf16 is None else args.bf16
    if bf16 and device.type != "cuda":
        raise ValueError("--bf16 (autocast) is for CUDA devices; on the CPU train in fp32")
    target_dtype = getattr(torch, args.target_dtype) if args.target_dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)

    target = load_target(args.target, dtype=target_dtype, device=device)
    target.requires_grad_(False)
    tokenizer = _load_tokenizer(args)
    vocab = target.config.vocab_size

    state = None
    if args.resume:
        state = load_state(state_dir)
        draft = _drafter_from_state(state, state_dir)
    elif args.init:
        draft = DFlashDraftModel.from_pretrained(args.init, dtype=torch.float32)
    else:
        draft = _new_drafter(args, target, tokenizer)
    draft = draft.float().to(device).train()
    B = draft.block_size
    if args.grad_checkpoint:
        enable_gradient_checkpointing(draft)

    sequences = read_training_jsonl(args.data, vocab, B, tokenizer=tokenizer, max_length=args.max_length)
    adapter = TargetAdapter(target, list(draft.target_layer_ids) + [
        resolve_logit_layer(args.logit_layer, draft.target_layer_ids, target.config.num_hidden_layers)])
    from ..decoding import check_pair as _check_pair

    _check_pair(adapter, draft)
    if args.shard_target:
        shard_target_layers(adapter.layers, world)
    cfg = BlockTrainingConfig(block_size=B, blocks_per_seq=args.blocks_per_seq, gamma=args.gamma,
                              logit_layer=adapter.capture_layer_ids[-1], context_noise=args.context_noise)
    cache = adapter.new_cache(max(s.input_ids.numel() for s in sequences))
    store = {} if args.cache_target else None
    weight_sums = [sequence_weight_sum(s, cfg) for s in sequences]

    forward = wrap_drafter(draft, world, args.parallel)
    groups = _param_groups(draft, args.weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    step, elapsed_before, history = 0, 0.0, []
    if state is not None:
        _restore_optimizer(optimizer, state, state_dir)
        step, elapsed_before, history = state.step, state.elapsed, list(state.history)

    eval_prompts = None
    if args.eval_every:
        eval_prompts = _eval_prompts(args, tokenizer, vocab, args.eval_num_prompts, seed=1)
        if eval_prompts is None and world.is_main:
            warnings.warn("no evaluation prompts (give --eval-prompts): periodic tau evaluation is off")

    share = args.batch_size // world.world_size
    micro = min(args.micro_batch_size or share, share)
    mine = rank_positions(args.batch_size, world)
    chunks = [mine[i:i + micro] for i in range(0, share, micro)]
    scale = gradient_scale(world)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    log = _RunLog(out_dir, world.is_main, not args.no_tensorboard, resume=args.resume)

    sharded = is_sharded(draft.fc.weight)

    def eval_drafter() -> DFlashDraftModel:
        """A whole drafter in the target's dtype on this rank: the drafter itself when it already is one."""
        if not sharded and target_dtype == torch.float32:
            return draft
        copy = DFlashDraftModel(draft.config)
        copy.load_state_dict(full_parameters(draft), strict=False)
        return copy.to(device=device, dtype=target_dtype)

    def save(elapsed_s: float) -> None:
        """Rank 0 writes the drafter and the state; under FSDP every rank first helps gather them."""
        if sharded or world.is_main:
            params = full_parameters(draft)
            tensors = {f"model.{k}": v for k, v in params.items()}
            tensors.update(_optimizer_tensors(optimizer))
        if world.is_main:
            publish = draft if not sharded else DFlashDraftModel(draft.config)
            if publish is not draft:
                publish.load_state_dict(params, strict=False)
            publish.save_pretrained(str(out_dir), dtype=SAVE_DTYPES[args.save_dtype])
            save_state(state_dir, TrainingState(step=step, elapsed=elapsed_s, history=history,
                                                config=draft.config.to_dict(), optimizer=_optimizer_meta(optimizer),
                                                tensors=tensors))
        world.barrier()

    start = time.perf_counter()

    def elapsed() -> float:
        return elapsed_before + time.perf_counter() - start

    def progress() -> float:
        fr = []
        if args.steps is not None:
            fr.append(step / args.steps)
        if minutes is not None:
            fr.append(world.broadcast_float(elapsed()) / (minutes * 60))
        return max(fr)

    bar = tqdm(total=args.steps, initial=step, desc="drafter", unit="step", disable=args.quiet or not world.is_main,
               mininterval=1.0 if sys.stderr.isatty() else 30.0, dynamic_ncols=True)
    window = dict(loss=0.0, weight=0.0, tau=0.0, blocks=0.0, tokens=0.0, seconds=0.0, steps=0)
    last_eval = float("nan")
    stop_at = args.stop_at if args.stop_at is not None else math.inf
    while step < stop_at and progress() < 1.0:
        t_step = time.perf_counter()
        lr = lr_at(progress(), step, args.lr, args.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        idx = batch_indices(step, args.batch_size, len(sequences), args.seed)
        W = sum(weight_sums[i] for i in idx)
        sums = [0.0, 0.0, 0.0, 0.0]  # weighted loss, sum of (1 + leading correct), blocks, supervised tokens
        for c, chunk in enumerate(chunks):
            gens = [sequence_generator(args.seed, step, j) for j in chunk]
            with gradient_sync(forward, draft, enabled=c == len(chunks) - 1), autocast():
                out = step_loss(draft, adapter, [sequences[idx[j]] for j in chunk], cfg, cache=cache, store=store,
                                generators=gens, normalizer=W, forward=forward)
                (out.loss * scale).backward()
            sums = [a + b for a, b in zip(sums, (out.loss_sum, out.tau_sum, out.num_blocks, out.supervised_tokens))]
        loss_sum, tau_sum, blocks, tokens = world.all_reduce_sum(sums)
        loss = loss_sum / W
        if not math.isfinite(loss):
            raise FloatingPointError(f"training loss became {loss} at step {step}; lower --lr")
        torch.nn.utils.clip_grad_norm_(draft.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        seconds = time.perf_counter() - t_step
        for key, value in (("loss", loss_sum), ("weight", W), ("tau", tau_sum), ("blocks", blocks),
                           ("tokens", tokens), ("seconds", seconds), ("steps", 1)):
            window[key] += value
        block_tau = tau_sum / max(blocks, 1.0)
        entry = None
        if eval_prompts and step % args.eval_every == 0:
            last_eval = distributed_tau(world, target, eval_drafter(), eval_prompts, args.eval_new_tokens)
        if (eval_prompts and step % args.eval_every == 0) or step % args.log_every == 0:
            entry = dict(step=step, minutes=round(elapsed() / 60, 2), lr=lr,
                         loss=round(window["loss"] / window["weight"], 4),
                         block_tau=round(window["tau"] / max(window["blocks"], 1.0), 3),
                         tokens_per_s=round(window["tokens"] / max(window["seconds"], 1e-9), 1))
            if eval_prompts and step % args.eval_every == 0:
                entry["eval_tau_T0"] = round(last_eval, 3)
            window = dict.fromkeys(window, 0.0)
            history.append(entry)
            log.write(entry)
            if world.is_main and not sys.stderr.isatty() and not args.quiet:
                print(json.dumps(entry), file=sys.stderr, flush=True)
        if args.save_every and step % args.save_every == 0:
            save(elapsed())
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", block_tau=f"{block_tau:.2f}", tok_s=f"{tokens / max(seconds, 1e-9):.0f}",
                        eval_tau=f"{last_eval:.2f}", refresh=False)
    bar.close()
    train_seconds = elapsed()
    save(train_seconds)
    log.close()
    last = [h for h in history if "loss" in h][-1:] or [dict(loss=float("nan"), block_tau=float("nan"))]

    result = {
        "command": ("torchrun --nproc-per-node %d -m dflash train " % world.world_size if world.distributed
                    else "python -m dflash train ") + " ".join(getattr(args, "argv", [])),
        "seed": args.seed,
        "steps": step,
        "world_size": world.world_size,
        "parallel": args.parallel if world.distributed else None,
        "train_minutes": round(train_seconds / 60, 2),
        "train_loss_last_log": last[0]["loss"],
        "block_tau_last_log": last[0]["block_tau"],
        "data": {"file": str(args.data), "sequences": len(sequences),
                 "tokens": int(sum(s.input_ids.numel() for s in sequences)),
                 "supervised_tokens": int(sum(int(s.loss_mask.sum()) for s in sequences))},
        "drafter": {"layers": draft.config.num_hidden_layers, "block_size": B,
                    "target_layer_ids": list(draft.target_layer_ids), "logit_layer": cfg.logit_layer,
                    "parameters": sum(p.numel() for p in draft.parameters()),
                    "storage_dtype": args.save_dtype},
        "hyperparameters": {"batch_size": args.batch_size, "micro_batch_size": micro, "blocks_per_seq": args.blocks_per_seq,
                            "lr": args.lr, "warmup_steps": args.warmup_steps, "weight_decay": args.weight_decay,
                            "grad_clip": args.grad_clip, "gamma": default_gamma(B) if args.gamma is None else args.gamma,
                            "context_noise": args.context_noise, "minutes": minutes, "max_steps": args.steps,
                            "bf16_autocast": bf16, "gradient_checkpointing": bool(args.grad_checkpoint)},
        "threads": args.threads,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__},
        "history": history,
    }
    if world.is_main:
        result["drafter"]["weights_bytes"] = (out_dir / "model.safetensors").stat().st_size
        if args.final_eval:
            _final_eval(args, result, target, tokenizer, vocab, draft, out_dir)
        (out_dir / LOG_NAME).write_text(json.dumps(result, indent=2) + "\n")
    adapter.close()
    return result


def _final_eval(args, result: dict, target, tokenizer, vocab: int, draft, out_dir: Path) -> None:
    prompts = _eval_prompts(args, tokenizer, vocab, args.final_eval_prompts, seed=0)
    if prompts is None:
        warnings.warn("no evaluation prompts (give --eval-prompts): final evaluation skipped")
        return
    torch.manual_seed(args.seed)
    param = next(target.parameters())
    device, dtype = param.device, param.dtype
    untrained = DFlashDraftModel(draft.config).eval().to(device=device, dtype=dtype)
    trained = DFlashDraftModel.from_pretrained(str(out_dir), dtype=dtype, device=device)
    t0 = time.perf_counter()
    with dflash_kernels.force_backend("reference") if device.type == "cpu" else contextlib.nullcontext():
        result["final_eval"] = {
            "prompts": len(prompts), "prompt_tokens": len(prompts[0]) if prompts else 0,
            "new_tokens": args.final_eval_new_tokens,
            "set": "held-out stdlib packages (json, email, asyncio, xml), heldout_prompts(seed=0)"
            if not args.eval_prompts else args.eval_prompts,
            "weights": f"saved file reloaded in {str(dtype).replace('torch.', '')}; untrained = fresh init, "
                       "same config and seed",
            "tau": final_eval_table(target, trained, untrained, prompts, args.ddtree_budgets,
                                    args.final_eval_new_tokens, args.seed),
        }
    result["final_eval"]["seconds"] = round(time.perf_counter() - t0, 1)
