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
from typing import List, NamedTuple, Optional

import torch

import dflash_kernels

from ..drafter.config import dflash2_config, default_target_layer_ids, make_draft_config, qwen3_config
from ..drafter.model import DFlash2DraftModel, DFlashDraftModel
from ..target import TargetAdapter
from .checkpointing import enable_gradient_checkpointing
from .distributed import (World, full_parameters, full_tensor, gradient_scale, gradient_sync, init_world, is_sharded,
                          load_full_, shard_target_layers, wrap_drafter)
from .evaluation import distributed_tau, final_eval_table
from .objective import BlockTrainingConfig, default_gamma, resolve_logit_layer, sequence_weight_sum, step_loss
from .records import pack_sequences, read_prompts_jsonl, read_training_jsonl
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


def _with_adapter(target, directory):
    """``target`` wearing the peft adapter saved in ``directory`` (a ``PeftModel``: the target side finds the
    decoder inside it and runs its adapter layers, :mod:`dflash.target.wrappers`)."""
    try:
        import peft
    except ImportError:
        raise SystemExit("--target-adapter needs peft: pip install dflash-kernels[user-targets]") from None
    return peft.PeftModel.from_pretrained(target, str(directory), is_trainable=False).eval()


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
    extra = {}
    if getattr(args, "arch", "dflash") == "dflash2":
        extra = dflash2_config(cfg.hidden_size, cfg.vocab_size, args.block_size,
                               conv_kernel_size=args.conv_kernel_size, conv_group_size=args.conv_group_size,
                               selector_rank=args.selector_rank, selector_top_k=args.selector_top_k)
    window, types = getattr(args, "sliding_window", None), getattr(args, "layer_types", None)
    if window is not None or types is not None:
        extra.update(layer_types=types or ["sliding_attention"] * args.layers, sliding_window=window)
    config = make_draft_config(
        hidden_size=cfg.hidden_size, num_hidden_layers=args.layers,
        num_attention_heads=args.heads or cfg.num_attention_heads,
        num_key_value_heads=args.kv_heads or getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=args.head_dim or getattr(cfg, "head_dim", None),
        intermediate_size=args.intermediate_size or cfg.intermediate_size, vocab_size=cfg.vocab_size,
        num_target_layers=L, block_size=args.block_size, mask_token_id=mask_id, target_layer_ids=ids,
        rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6),
        max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096), **extra,
    )
    torch.manual_seed(args.seed)
    return DFlashDraftModel.class_for(config)(config)


def _drafter_from_state(state: TrainingState, state_file: Path) -> DFlashDraftModel:
    raw = dict(state.config)
    raw.pop("architectures", None)
    try:
        config = qwen3_config(raw)
        draft = DFlashDraftModel.class_for(config)(config)
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


_DFLASH2_OPTIONS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def _check_args(args, world: World) -> None:
    given = [f"--{k.replace('_', '-')}" for k in _DFLASH2_OPTIONS if getattr(args, k, None) is not None]
    if given and getattr(args, "arch", "dflash") != "dflash2":
        raise ValueError(f"{', '.join(given)} set the DFlash2 architecture: add --arch dflash2")
    if args.batch_size < 1 or args.batch_size % world.world_size:
        raise ValueError(f"--batch-size {args.batch_size} (the global batch) must be a positive multiple of the "
                         f"world size {world.world_size}: each rank takes an equal share")
    if args.micro_batch_size is not None and args.micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be >= 1, got {args.micro_batch_size}")
    if args.shard_target and args.parallel != "fsdp":
        raise ValueError("--shard-target needs --parallel fsdp")
    if args.max_length is not None and args.max_length < 1:
        raise ValueError(f"--max-length must be a positive number of tokens, got {args.max_length}")
    if getattr(args, "pack", False) and args.max_length is None:
        raise ValueError("--pack needs --max-length: the length of a packed sequence (e.g. --max-length 4096)")
    _check_window_args(args)


def _check_window_args(args) -> None:
    """``--sliding-window`` / ``--layer-types``: a fresh drafter's attention layout, checked before any loading."""
    window, types = getattr(args, "sliding_window", None), getattr(args, "layer_types", None)
    if window is None and types is None:
        return
    if args.init or args.resume:
        raise ValueError("--sliding-window / --layer-types shape a fresh drafter; with --init or --resume the "
                         "checkpoint's config sets its layers (drop these flags)")
    if window is not None and window < 1:
        raise ValueError(f"--sliding-window must be >= 1 (tokens of context a block row sees), got {window}")
    if types is not None:
        if len(types) != args.layers:
            raise ValueError(f"--layer-types lists {len(types)} layer type(s) for --layers {args.layers}: give one "
                             "per drafter layer")
        sliding = "sliding_attention" in types
        if sliding and window is None:
            raise ValueError("--layer-types has sliding_attention layers: give their window with --sliding-window W")
        if window is not None and not sliding:
            raise ValueError(f"--sliding-window {window} but --layer-types has no sliding_attention layer")


def _train(args, world: World) -> dict:
    """Set the run up on this rank, take its optimizer steps, save, and return the train log."""
    run = _TrainRun(args, world)
    run.run_steps()
    return run.finish()


class _StepResult(NamedTuple):
    """One optimizer step's numbers, reduced over ranks (``seconds`` is this rank's wall time for the step)."""

    lr: float
    loss: float  # loss_sum / weight: the step's normalised loss
    loss_sum: float  # sum of weighted per-token cross-entropies over the global batch
    weight: float  # W_s, the global batch's weight sum
    tau_sum: float  # sum over blocks of (1 + leading correct predictions)
    blocks: float
    tokens: float  # supervised tokens
    seconds: float
    selector_loss_sum: float = 0.0  # DFlash2: the weighted selector cross-entropies alone


class _TrainRun:
    """One training run on this rank: target, drafter, data, optimizer, log sinks and the step counter.

    Construction does the whole set-up (a resumed run restores the drafter, the optimizer, the step, the
    elapsed time and the history); :meth:`run_steps` trains until the step limit or the schedule's end;
    :meth:`finish` writes the last checkpoint and returns the train log.
    """

    def __init__(self, args, world: World):
        _check_args(args, world)
        torch.set_num_threads(args.threads)
        torch.manual_seed(args.seed)
        self.args, self.world = args, world
        self._resolve_options()
        state = self._load_models()
        self._prepare_data()
        self._build_optimizer(state)
        self._plan_batches()
        self.window = dict(loss=0.0, weight=0.0, tau=0.0, blocks=0.0, tokens=0.0, seconds=0.0, steps=0, selector=0.0)
        self.last_eval = float("nan")
        self.start = time.perf_counter()

    # ----------------------------------------------------------------------- set-up

    def _resolve_options(self) -> None:
        """Device, directories, the time budget and the dtypes the arguments select."""
        args = self.args
        self.device = device = self.world.device
        self.out_dir = Path(args.out)
        self.state_dir = Path(args.state_dir) if args.state_dir else self.out_dir / STATE_SUBDIR
        self.minutes = args.minutes if (args.minutes is not None or args.steps is not None) else 20.0
        self.bf16 = (device.type == "cuda") if args.bf16 is None else args.bf16
        if self.bf16 and device.type != "cuda":
            raise ValueError("--bf16 (autocast) is for CUDA devices; on the CPU train in fp32")
        self.target_dtype = getattr(torch, args.target_dtype) if args.target_dtype else (
            torch.bfloat16 if device.type == "cuda" else torch.float32)

    def _load_models(self) -> Optional[TrainingState]:
        """The frozen target, the tokenizer and the fp32 drafter (fresh, ``--init`` or resumed); returns the
        resumed training state, or None."""
        from ..tiny.pair import load_target

        args = self.args
        self.target = load_target(args.target, dtype=self.target_dtype, device=self.device)
        if getattr(args, "target_adapter", None):
            self.target = _with_adapter(self.target, args.target_adapter)
        self.target.requires_grad_(False)
        self.tokenizer = _load_tokenizer(args)
        self.vocab = self.target.config.vocab_size
        state = None
        if args.resume:
            state = load_state(self.state_dir)
            draft = _drafter_from_state(state, self.state_dir)
        elif args.init:
            draft = DFlashDraftModel.from_pretrained(args.init, dtype=torch.float32)
        else:
            draft = _new_drafter(args, self.target, self.tokenizer)
        self.draft = draft.float().to(self.device).train()
        self.block_size = self.draft.block_size
        self.dflash2 = isinstance(self.draft, DFlash2DraftModel)
        if args.grad_checkpoint:
            enable_gradient_checkpointing(self.draft)
        return state

    def _prepare_data(self) -> None:
        """The training sequences, the target adapter (checked against the drafter; sharded on request), the
        objective's config, the capture cache and each sequence's weight sum."""
        from ..decoding import check_pair as _check_pair

        args, draft, target = self.args, self.draft, self.target
        self.sequences = read_training_jsonl(args.data, self.vocab, self.block_size, tokenizer=self.tokenizer,
                                             max_length=args.max_length)
        self.samples = len(self.sequences)
        if getattr(args, "pack", False):
            self.sequences = pack_sequences(self.sequences, args.max_length, self.block_size)
        self.adapter = TargetAdapter(target, list(draft.target_layer_ids) + [
            resolve_logit_layer(args.logit_layer, draft.target_layer_ids, target.config.num_hidden_layers)])
        _check_pair(self.adapter, draft)
        if args.shard_target:
            shard_target_layers(self.adapter.layers, self.world)
        self.cfg = BlockTrainingConfig(block_size=self.block_size, blocks_per_seq=args.blocks_per_seq,
                                       gamma=args.gamma, logit_layer=self.adapter.capture_layer_ids[-1],
                                       context_noise=args.context_noise,
                                       selector_loss_weight=getattr(args, "selector_loss_weight", 1.0))
        self.cache = self.adapter.new_cache(max(s.input_ids.numel() for s in self.sequences))
        self.store = {} if args.cache_target else None
        self.weight_sums = [sequence_weight_sum(s, self.cfg) for s in self.sequences]

    def _build_optimizer(self, state: Optional[TrainingState]) -> None:
        """The parallel forward, AdamW over the drafter, and the step, elapsed time and history (restored from
        ``state`` when resuming)."""
        self.forward = wrap_drafter(self.draft, self.world, self.args.parallel)
        groups = _param_groups(self.draft, self.args.weight_decay)
        self.optimizer = torch.optim.AdamW(groups, lr=self.args.lr, betas=(0.9, 0.95))
        self.step, self.elapsed_before, self.history = 0, 0.0, []
        if state is not None:
            _restore_optimizer(self.optimizer, state, self.state_dir)
            self.step, self.elapsed_before, self.history = state.step, state.elapsed, list(state.history)

    def _plan_batches(self) -> None:
        """The periodic evaluation prompts, this rank's micro-batches of global-batch positions, the gradient
        scale, the autocast context and the log sinks."""
        args, world = self.args, self.world
        self.eval_prompts = None
        if args.eval_every:
            self.eval_prompts = _eval_prompts(args, self.tokenizer, self.vocab, args.eval_num_prompts, seed=1)
            if self.eval_prompts is None and world.is_main:
                warnings.warn("no evaluation prompts (give --eval-prompts): periodic tau evaluation is off")
        share = args.batch_size // world.world_size
        self.micro = min(args.micro_batch_size or share, share)
        mine = rank_positions(args.batch_size, world)
        self.chunks = [mine[i:i + self.micro] for i in range(0, share, self.micro)]
        self.scale = gradient_scale(world)
        self.autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if self.bf16 \
            else contextlib.nullcontext
        self.log = _RunLog(self.out_dir, world.is_main, not args.no_tensorboard, resume=args.resume)
        self.sharded = is_sharded(self.draft.fc.weight)

    # ----------------------------------------------------------------------- clock and schedule

    def elapsed(self) -> float:
        """Training seconds so far, including those of the runs this one resumes."""
        return self.elapsed_before + time.perf_counter() - self.start

    def progress(self) -> float:
        """The schedule's fraction done: the larger of steps / ``--steps`` and rank 0's time / ``--minutes``."""
        fr = []
        if self.args.steps is not None:
            fr.append(self.step / self.args.steps)
        if self.minutes is not None:
            fr.append(self.world.broadcast_float(self.elapsed()) / (self.minutes * 60))
        return max(fr)

    # ----------------------------------------------------------------------- training

    def run_steps(self) -> None:
        """Optimizer steps until ``--stop-at`` or the schedule's end: logs, evaluations, checkpoints, the bar."""
        from tqdm import tqdm

        args, world = self.args, self.world
        bar = tqdm(total=args.steps, initial=self.step, desc="drafter", unit="step",
                   disable=args.quiet or not world.is_main, mininterval=1.0 if sys.stderr.isatty() else 30.0,
                   dynamic_ncols=True)
        stop_at = args.stop_at if args.stop_at is not None else math.inf
        while self.step < stop_at and self.progress() < 1.0:
            done = self._optimizer_step()
            self._log_step(done)
            if args.save_every and self.step % args.save_every == 0:
                self.save(self.elapsed())
            bar.update(1)
            bar.set_postfix(loss=f"{done.loss:.3f}", block_tau=f"{done.tau_sum / max(done.blocks, 1.0):.2f}",
                            tok_s=f"{done.tokens / max(done.seconds, 1e-9):.0f}",
                            eval_tau=f"{self.last_eval:.2f}", refresh=False)
        bar.close()

    def _optimizer_step(self) -> _StepResult:
        """One step on the global batch ``I_step``: set the learning rate, accumulate the micro-batch gradients,
        check the loss, clip, step AdamW and advance the step counter."""
        args = self.args
        t_step = time.perf_counter()
        lr = lr_at(self.progress(), self.step, args.lr, args.warmup_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        idx = batch_indices(self.step, args.batch_size, len(self.sequences), args.seed)
        W = sum(self.weight_sums[i] for i in idx)
        loss_sum, tau_sum, blocks, tokens, selector_sum = self._accumulate_gradients(idx, W)
        loss = loss_sum / W
        if not math.isfinite(loss):
            raise FloatingPointError(f"training loss became {loss} at step {self.step}; lower --lr")
        torch.nn.utils.clip_grad_norm_(self.draft.parameters(), args.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return _StepResult(lr=lr, loss=loss, loss_sum=loss_sum, weight=W, tau_sum=tau_sum, blocks=blocks,
                           tokens=tokens, seconds=time.perf_counter() - t_step, selector_loss_sum=selector_sum)

    def _accumulate_gradients(self, idx: List[int], W: float) -> List[float]:
        """Backward over this rank's micro-batches of ``idx`` (normalised by the global weight sum ``W``;
        gradients sync on the last); returns the loss, tau, block and token sums over all ranks."""
        sums = [0.0] * 5  # weighted loss, sum of (1 + leading correct), blocks, supervised tokens, selector loss
        for c, chunk in enumerate(self.chunks):
            gens = [sequence_generator(self.args.seed, self.step, j) for j in chunk]
            with gradient_sync(self.forward, self.draft, enabled=c == len(self.chunks) - 1), self.autocast():
                out = step_loss(self.draft, self.adapter, [self.sequences[idx[j]] for j in chunk], self.cfg,
                                cache=self.cache, store=self.store, generators=gens, normalizer=W,
                                forward=self.forward)
                (out.loss * self.scale).backward()
            sums = [a + b for a, b in zip(sums, (out.loss_sum, out.tau_sum, out.num_blocks, out.supervised_tokens,
                                                  out.selector_loss_sum))]
        return self.world.all_reduce_sum(sums)

    def _log_step(self, done: _StepResult) -> None:
        """Add the step to the log window; on an evaluation step measure tau; on a log or evaluation step
        write the window's entry (history, JSONL, TensorBoard, stderr when not a terminal) and reset it."""
        args, world, window = self.args, self.world, self.window
        for key, value in (("loss", done.loss_sum), ("weight", done.weight), ("tau", done.tau_sum),
                           ("blocks", done.blocks), ("tokens", done.tokens), ("seconds", done.seconds),
                           ("steps", 1), ("selector", done.selector_loss_sum)):
            window[key] += value
        eval_due = self.eval_prompts and self.step % args.eval_every == 0
        if eval_due:
            self.last_eval = distributed_tau(world, self.target, self.eval_drafter(), self.eval_prompts,
                                             args.eval_new_tokens)
        if not (eval_due or self.step % args.log_every == 0):
            return
        entry = dict(step=self.step, minutes=round(self.elapsed() / 60, 2), lr=done.lr,
                     loss=round(window["loss"] / window["weight"], 4),
                     block_tau=round(window["tau"] / max(window["blocks"], 1.0), 3),
                     tokens_per_s=round(window["tokens"] / max(window["seconds"], 1e-9), 1))
        if self.dflash2:
            entry["selector_loss"] = round(window["selector"] / window["weight"], 4)
        if eval_due:
            entry["eval_tau_T0"] = round(self.last_eval, 3)
        self.window = dict.fromkeys(window, 0.0)
        self.history.append(entry)
        self.log.write(entry)
        if world.is_main and not sys.stderr.isatty() and not args.quiet:
            print(json.dumps(entry), file=sys.stderr, flush=True)

    def eval_drafter(self) -> DFlashDraftModel:
        """A whole drafter in the target's dtype on this rank: the drafter itself when it already is one."""
        if not self.sharded and self.target_dtype == torch.float32:
            return self.draft
        copy = type(self.draft)(self.draft.config)
        copy.load_state_dict(full_parameters(self.draft), strict=False)
        return copy.to(device=self.device, dtype=self.target_dtype)

    # ----------------------------------------------------------------------- saving and the summary

    def save(self, elapsed_s: float) -> None:
        """Rank 0 writes the drafter and the state; under FSDP every rank first helps gather them."""
        draft, optimizer = self.draft, self.optimizer
        if self.sharded or self.world.is_main:
            params = full_parameters(draft)
            tensors = {f"model.{k}": v for k, v in params.items()}
            tensors.update(_optimizer_tensors(optimizer))
        if self.world.is_main:
            publish = draft if not self.sharded else type(draft)(draft.config)
            if publish is not draft:
                publish.load_state_dict(params, strict=False)
            publish.save_pretrained(str(self.out_dir), dtype=SAVE_DTYPES[self.args.save_dtype])
            save_state(self.state_dir, TrainingState(step=self.step, elapsed=elapsed_s, history=self.history,
                                                     config=draft.config.to_dict(),
                                                     optimizer=_optimizer_meta(optimizer), tensors=tensors))
        self.world.barrier()

    def finish(self) -> dict:
        """The last checkpoint, then the train log; rank 0 adds the weights' size and the final evaluation
        (on request) and writes ``train_log.json``."""
        train_seconds = self.elapsed()
        self.save(train_seconds)
        self.log.close()
        result = self.summary(train_seconds)
        if self.world.is_main:
            result["drafter"]["weights_bytes"] = (self.out_dir / "model.safetensors").stat().st_size
            if self.args.final_eval:
                _final_eval(self.args, result, self.target, self.tokenizer, self.vocab, self.draft, self.out_dir)
            (self.out_dir / LOG_NAME).write_text(json.dumps(result, indent=2) + "\n")
        self.adapter.close()
        return result

    def summary(self, train_seconds: float) -> dict:
        """The train log: the command, the run's size and time, the last logged loss and tau, the data, the
        drafter, the hyperparameters, the versions and the history."""
        args, world = self.args, self.world
        last = [h for h in self.history if "loss" in h][-1:] or [dict(loss=float("nan"), block_tau=float("nan"))]
        return {
            "command": ("torchrun --nproc-per-node %d -m dflash train " % world.world_size if world.distributed
                        else "python -m dflash train ") + " ".join(getattr(args, "argv", [])),
            "seed": args.seed,
            "steps": self.step,
            "world_size": world.world_size,
            "parallel": args.parallel if world.distributed else None,
            "train_minutes": round(train_seconds / 60, 2),
            "train_loss_last_log": last[0]["loss"],
            "block_tau_last_log": last[0]["block_tau"],
            "data": {"file": str(args.data), "sequences": len(self.sequences), "samples": self.samples,
                     "packed": bool(getattr(args, "pack", False)), "max_length": args.max_length,
                     "tokens": int(sum(s.input_ids.numel() for s in self.sequences)),
                     "supervised_tokens": int(sum(int(s.loss_mask.sum()) for s in self.sequences))},
            "drafter": {"layers": self.draft.config.num_hidden_layers, "block_size": self.block_size,
                        "target_layer_ids": list(self.draft.target_layer_ids), "logit_layer": self.cfg.logit_layer,
                        "layer_types": list(getattr(self.draft.config, "layer_types", None) or []),
                        "sliding_window": getattr(self.draft.config, "sliding_window", None),
                        "parameters": sum(p.numel() for p in self.draft.parameters()),
                        "storage_dtype": args.save_dtype, **self._dflash2_summary()},
            "hyperparameters": self._hyperparameters(),
            "threads": args.threads,
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": __import__("transformers").__version__},
            "history": self.history,
        }

    def _dflash2_summary(self) -> dict:
        """The train log's drafter entries of a DFlash2 drafter (its arch and DFlash2 keys); empty for DFlash."""
        if not self.dflash2:
            return {}
        from ..drafter.config import dflash_value
        from ..drafter.dflash2 import DFLASH2_KEYS

        return {"arch": "dflash2", **{k: int(dflash_value(self.draft.config, k)) for k in DFLASH2_KEYS}}

    def _hyperparameters(self) -> dict:
        """The train log's ``hyperparameters``: the batch, schedule and objective settings the run used."""
        args = self.args
        return {"batch_size": args.batch_size, "micro_batch_size": self.micro, "blocks_per_seq": args.blocks_per_seq,
                "lr": args.lr, "warmup_steps": args.warmup_steps, "weight_decay": args.weight_decay,
                "grad_clip": args.grad_clip,
                "gamma": default_gamma(self.block_size) if args.gamma is None else args.gamma,
                "context_noise": args.context_noise, "minutes": self.minutes, "max_steps": args.steps,
                "bf16_autocast": self.bf16, "gradient_checkpointing": bool(args.grad_checkpoint),
                **({"selector_loss_weight": self.cfg.selector_loss_weight} if self.dflash2 else {})}


def _final_eval(args, result: dict, target, tokenizer, vocab: int, draft, out_dir: Path) -> None:
    prompts = _eval_prompts(args, tokenizer, vocab, args.final_eval_prompts, seed=0)
    if prompts is None:
        warnings.warn("no evaluation prompts (give --eval-prompts): final evaluation skipped")
        return
    torch.manual_seed(args.seed)
    param = next(target.parameters())
    device, dtype = param.device, param.dtype
    untrained = type(draft)(draft.config).eval().to(device=device, dtype=dtype)
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
