"""``python -m dflash train``: train a DFlash drafter for a frozen target (the command line).

The objective is in :mod:`.objective` (math and shapes), the loop in
:mod:`.loop`, torchrun and the parallel layouts in :mod:`.distributed`, the
resumable state in :mod:`.state`, tau in :mod:`.evaluation`; the names of
:mod:`.objective` and :func:`.evaluation.measure_tau` are re-exported here.

One process, or one per rank under torchrun (same arguments)::

    python -m dflash train --target DIR --data DATA.jsonl --out DRAFTER ...
    torchrun --nproc-per-node 8 -m dflash train --parallel fsdp --batch-size 64 ...

``--batch-size`` is the global batch; world N at the same batch trains the
same weights as world 1 (up to fp32 summation order). The out directory
receives the drafter in the published format (``config.json`` +
``model.safetensors``), ``train_log.json`` and ``train_log.jsonl``, and
in ``training_state/`` (or ``--state-dir``) the training state
(``training_state.json`` + a safetensors file: fp32 weights, AdamW moments,
step, elapsed time) for ``--resume``, on any world size.

The shipped tiny drafter (``dflash/assets/tiny/drafter``) comes from::

    python -m dflash.training.data --target dflash/assets/tiny/target --out /tmp/tiny_drafter_data.jsonl \
        --num 4096 --prompt-len 128 --new-tokens 256 --batch-size 64 --seed 0
    python -m dflash train --target dflash/assets/tiny/target --data /tmp/tiny_drafter_data.jsonl \
        --out dflash/assets/tiny/drafter --state-dir /tmp/tiny_drafter_state --layers 2 --block-size 8 \
        --target-layer-ids 1,3 --steps 2800 --batch-size 8 --blocks-per-seq 32 --lr 1e-3 --cache-target \
        --eval-every 500 --final-eval --seed 0 --threads 1

(one CPU thread; ``train_log.json`` next to the weights holds the measured
numbers).

Long sequences (2k-8k tokens and more): ``--max-length`` crops, the target's
pass runs in causal chunks (never a ``[T, T]`` score), ``--grad-checkpoint``
recomputes the drafter's layers in the backward, and memory grows linearly
with ``T`` (``bench/train_long_memory.py``). ``--pack`` fills sequences of
``--max-length`` tokens with several short samples without any block seeing
another sample. ``--sliding-window W`` (with ``--layer-types`` to mix
``full`` and ``sliding`` layers) trains a fresh drafter whose sliding layers
see what they will see at inference. With ``--steps`` alone the learning-rate schedule depends on the
step count only, so the run is reproducible step for step for a seed;
``--minutes`` makes it depend on the machine's speed.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence

from ..drafter.config import DraftConfigError
from .distributed import PARALLEL_CHOICES
from .evaluation import measure_tau
from .loop import SAVE_DTYPES as _SAVE_DTYPES
from .loop import train
from .objective import (BlockTrainingConfig, StepLoss, TargetCapture, block_attention_mask, block_visibility,
                        capture_target, default_gamma, drafter_block_losses, loss_weights, perturb_context,
                        resolve_logit_layer, sample_anchors, sequence_block_losses, sequence_weight_sum, step_loss,
                        target_labels)
from .records import DataError
from .state import STATE_JSON, StateError

__all__ = [
    "BlockTrainingConfig",
    "default_gamma",
    "loss_weights",
    "sample_anchors",
    "block_visibility",
    "block_attention_mask",
    "perturb_context",
    "resolve_logit_layer",
    "TargetCapture",
    "capture_target",
    "target_labels",
    "drafter_block_losses",
    "sequence_block_losses",
    "sequence_weight_sum",
    "StepLoss",
    "step_loss",
    "measure_tau",
    "build_parser",
    "train",
    "main",
]


def _int_list(text: str) -> List[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


LAYER_TYPE_NAMES = {"full_attention": "full_attention", "full": "full_attention",
                    "sliding_attention": "sliding_attention", "sliding": "sliding_attention"}


def _layer_types(text: str) -> List[str]:
    names = [x for x in text.replace(" ", "").split(",") if x]
    unknown = [x for x in names if x not in LAYER_TYPE_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown layer type(s) {unknown or [text]}; allowed: full_attention (or full), sliding_attention "
            "(or sliding), one per drafter layer, comma-separated")
    return [LAYER_TYPE_NAMES[x] for x in names]


def _add_file_arguments(p: argparse.ArgumentParser) -> None:
    """The data, output, initialisation, resume and checkpoint options."""
    io = p.add_argument_group("data and files")
    io.add_argument("--target", required=True, help="local target directory (HF causal LM)")
    io.add_argument("--target-adapter", default=None,
                    help="a local peft adapter directory (LoRA, DoRA, ...) put on the target: the drafter learns "
                         "the adapted target's choices (needs peft: pip install dflash-kernels[user-targets])")
    io.add_argument("--data", required=True, help="training JSONL: {'input_ids': [...], 'loss_mask': [...]} "
                                                  "or {'text': ...} per line")
    io.add_argument("--out", required=True, help="output drafter directory (published format)")
    io.add_argument("--tokenizer", default=None,
                    help="'byte', or a local tokenizer directory (default: the target directory)")
    io.add_argument("--init", default=None, help="start from this drafter directory instead of a fresh one")
    io.add_argument("--resume", action="store_true", help="continue from the training state in --state-dir")
    io.add_argument("--state-dir", default=None, help=f"where {STATE_JSON} and its tensors go (default: --out/training_state)")
    io.add_argument("--save-dtype", choices=sorted(_SAVE_DTYPES), default="bf16", help="stored weight dtype")
    io.add_argument("--save-every", type=int, default=200, help="checkpoint every N steps (and at the end)")
    io.add_argument("--max-length", type=int, default=None,
                    help="crop training sequences to this length (with --pack: the packed length)")
    io.add_argument("--pack", action="store_true",
                    help="pack several samples end to end into sequences of at most --max-length tokens: one "
                         "target pass per sample, one drafter pass over all blocks of the pack; no block sees "
                         "another sample (the same losses as the samples trained alone)")
    io.add_argument("--cache-target", action="store_true",
                    help="keep each sequence's target features and labels in memory after its first pass "
                         "(T*n*H floats per sequence; later epochs skip the target)")


def _add_architecture_arguments(p: argparse.ArgumentParser) -> None:
    """The fresh drafter's shape (ignored with --init / --resume)."""
    arch = p.add_argument_group("drafter architecture (ignored with --init / --resume)")
    arch.add_argument("--arch", choices=["dflash", "dflash2"], default="dflash",
                      help="dflash, or dflash2: dynamic convolutions around each sublayer and a candidate selector")
    arch.add_argument("--layers", type=int, default=2)
    arch.add_argument("--block-size", type=int, default=8)
    arch.add_argument("--target-layer-ids", type=_int_list, default=None,
                      help="comma-separated target layers read by the drafter (default: the published spread)")
    arch.add_argument("--heads", type=int, default=None, help="default: the target's")
    arch.add_argument("--kv-heads", type=int, default=None, help="default: the target's")
    arch.add_argument("--head-dim", type=int, default=None, help="default: the target's")
    arch.add_argument("--intermediate-size", type=int, default=None, help="default: the target's")
    arch.add_argument("--mask-token-id", type=int, default=None, help="default: the tokenizer's mask id")
    arch.add_argument("--sliding-window", type=int, default=None,
                      help="window W (tokens) of the drafter's sliding-window layers: a block row at position q "
                           "sees the context rows at positions > q - W (as at inference); without --layer-types "
                           "every layer slides")
    arch.add_argument("--layer-types", type=_layer_types, default=None,
                      help="comma-separated, one per drafter layer: full_attention (full) or sliding_attention "
                           "(sliding); sliding layers need --sliding-window")
    d2 = p.add_argument_group("DFlash2 (--arch dflash2; defaults as published)")
    d2.add_argument("--conv-kernel-size", type=int, default=None, help="taps of each dynamic convolution (2)")
    d2.add_argument("--conv-group-size", type=int, default=None, help="channels sharing a dynamic kernel (16)")
    d2.add_argument("--selector-rank", type=int, default=None, help="rank of the selector's codebooks (256)")
    d2.add_argument("--selector-top-k", type=int, default=None, help="candidates the selector re-scores (16)")
    d2.add_argument("--selector-loss-weight", type=float, default=1.0,
                    help="weight of the selector's cross-entropy beside the token loss (1)")


def _add_optimization_arguments(p: argparse.ArgumentParser) -> None:
    """The schedule, batch, objective and AdamW options."""
    opt = p.add_argument_group("optimization")
    opt.add_argument("--steps", type=int, default=None, help="number of optimizer steps")
    opt.add_argument("--minutes", type=float, default=None, help="wall-clock budget (default 20 without --steps)")
    opt.add_argument("--batch-size", type=int, default=8,
                     help="the global batch: sequences per optimizer step over all ranks (a multiple of the world size)")
    opt.add_argument("--micro-batch-size", type=int, default=None,
                     help="sequences per forward/backward on a rank (default: its whole share); smaller accumulates "
                          "gradients over several passes, same step")
    opt.add_argument("--stop-at", type=int, default=None,
                     help="end this run after this step (checkpoint written; the schedule still follows --steps), "
                          "as a preempted job would; continue with --resume")
    opt.add_argument("--blocks-per-seq", type=int, default=16)
    opt.add_argument("--lr", type=float, default=1e-3)
    opt.add_argument("--warmup-steps", type=int, default=50)
    opt.add_argument("--weight-decay", type=float, default=0.01)
    opt.add_argument("--grad-clip", type=float, default=1.0)
    opt.add_argument("--gamma", type=float, default=None, help="loss decay (default from B: 4 for 8, 7 for 16)")
    opt.add_argument("--logit-layer", default="last", help="'last' (exact target choice), 'last-mapped' or an id")
    opt.add_argument("--context-noise", type=float, default=0.0, help="noise std on context features, x RMS")
    opt.add_argument("--seed", type=int, default=0)
    opt.add_argument("--threads", type=int, default=1,
                     help="torch threads (default 1: on a shared or small CPU more threads often run slower)")


def _add_device_arguments(p: argparse.ArgumentParser) -> None:
    """The device, dtype and parallel-layout options."""
    run = p.add_argument_group("devices and parallelism (torchrun --nproc-per-node N -m dflash train ...)")
    run.add_argument("--parallel", choices=PARALLEL_CHOICES, default="ddp",
                     help="under torchrun: ddp (replicated drafter) or fsdp (FSDP2 fully_shard per layer)")
    run.add_argument("--shard-target", action="store_true",
                     help="with --parallel fsdp: shard the frozen target's decoder layers too (a target that does "
                          "not fit one device)")
    run.add_argument("--device", choices=["cpu", "cuda"], default=None,
                     help="default: cuda:LOCAL_RANK when CUDA is available (NCCL), else the CPU (gloo)")
    run.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                     help="bf16 autocast of the drafter pass (default: on for CUDA, off on the CPU)")
    run.add_argument("--target-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                     help="the frozen target's dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    run.add_argument("--grad-checkpoint", action="store_true",
                     help="recompute drafter layer activations in the backward (long sequences, less memory)")


def _add_evaluation_arguments(p: argparse.ArgumentParser) -> None:
    """The periodic and final tau evaluation and the log options."""
    ev = p.add_argument_group("evaluation and logs")
    ev.add_argument("--log-every", type=int, default=50, help="a log entry (JSONL, TensorBoard) every N steps")
    ev.add_argument("--no-tensorboard", action="store_true",
                    help="no TensorBoard event files (written to --out/tensorboard when tensorboard is installed)")
    ev.add_argument("--eval-every", type=int, default=0, help="measure tau every N steps (0: off)")
    ev.add_argument("--eval-prompts", default=None, help="prompt JSONL (default for byte targets: held-out stdlib)")
    ev.add_argument("--eval-num-prompts", type=int, default=8)
    ev.add_argument("--eval-prompt-len", type=int, default=128)
    ev.add_argument("--eval-new-tokens", type=int, default=96)
    ev.add_argument("--final-eval", action="store_true",
                    help="after training: tau table (T=0 and 0.7; DFlash and DDTree budgets; untrained alongside)")
    ev.add_argument("--final-eval-prompts", type=int, default=16)
    ev.add_argument("--final-eval-new-tokens", type=int, default=128)
    ev.add_argument("--ddtree-budgets", type=_int_list, default=[8, 32])
    ev.add_argument("--quiet", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m dflash train`` parser: files, architecture, optimization, devices, evaluation."""
    p = argparse.ArgumentParser(prog="python -m dflash train",
                                description="Train a DFlash drafter for a frozen target.")
    _add_file_arguments(p)
    _add_architecture_arguments(p)
    _add_optimization_arguments(p)
    _add_device_arguments(p)
    _add_evaluation_arguments(p)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m dflash train ...``; bad data, state or arguments exit 2 with one line naming what is wrong."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    for flag in ("steps", "stop_at", "log_every"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    try:
        train(args)
    except (DataError, DraftConfigError, StateError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
