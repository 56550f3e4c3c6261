"""The tiny byte-level models shipped with the package (the demo's default).

``dflash/assets/tiny/target`` holds a 6-layer Qwen3 target trained on the
Python standard library by :mod:`dflash.tiny.pretrain` (bf16 weights, byte
tokenizer config, ``train_log.json`` with its measured numbers). Loading is
fully offline.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3ForCausalLM

from .tokenizer import ByteTokenizer

__all__ = ["TINY_DIR", "TINY_TARGET_DIR", "load_tiny_target", "load_tiny_tokenizer"]

TINY_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny"
TINY_TARGET_DIR = TINY_DIR / "target"


def _check_dir(directory: Path) -> Path:
    if not (directory / "config.json").is_file() or not (directory / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"{directory} lacks config.json / model.safetensors; train it with "
            f"`python -m dflash.tiny.pretrain --out {directory} --seed 0 --minutes 25`"
        )
    return directory


def load_tiny_target(
    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", path: str | Path | None = None
) -> Qwen3ForCausalLM:
    """The shipped tiny target as a ``Qwen3ForCausalLM`` in eval mode.

    ``dtype`` is the compute dtype (the file stores bf16; fp32 is exact for
    it); ``path`` overrides the directory (default :data:`TINY_TARGET_DIR`).
    """
    directory = _check_dir(Path(path) if path is not None else TINY_TARGET_DIR)
    model = Qwen3ForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def load_tiny_tokenizer(path: str | Path | None = None) -> ByteTokenizer:
    """The byte tokenizer stored next to the tiny target."""
    return ByteTokenizer.from_pretrained(Path(path) if path is not None else TINY_TARGET_DIR)


TINY_DRAFTER_DIR = TINY_DIR / "drafter"
__all__ += ["TINY_DRAFTER_DIR", "load_tiny_drafter"]


def load_tiny_drafter(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                      path: str | Path | None = None):
    """The shipped DFlash drafter of the tiny target (2 layers reading target layers [1, 3], B=8).

    Trained by :mod:`dflash.training.train` on the target's own greedy continuations;
    ``dflash/assets/tiny/drafter/train_log.json`` holds the command and its
    measured tau. ``dtype`` is the compute dtype (the file stores bf16).
    """
    from ..drafter.model import DFlashDraftModel

    directory = Path(path) if path is not None else TINY_DRAFTER_DIR
    if not (directory / "config.json").is_file() or not (directory / "model.safetensors").is_file():
        raise FileNotFoundError(f"{directory} lacks config.json / model.safetensors; train it with the command in "
                                "dflash.training.train module docstring (python -m dflash train ...)")
    return DFlashDraftModel.from_pretrained(str(directory), dtype=dtype, device=device)
