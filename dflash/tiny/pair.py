"""The pair the demo and the benchmarks use by default, and loading a pair from local directories.

The embedded default is the tiny byte-level pair shipped in ``dflash/assets/tiny``
(a Qwen3 target trained on the standard library and its DFlash drafter). If the
drafter is not there (a checkout that has not trained it yet), the drafter is
built untrained, and if the target is missing too, a random small target is
built: the demo still runs, only without a speedup. The tiny DFlash2 drafter
(``drafter2``, trained with the same data and budget) is loaded on request,
and only when shipped.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Tuple

import torch

from ..drafter.model import DFlashDraftModel
from .tokenizer import ByteTokenizer

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "tiny"
TARGET_DIR = ASSETS / "target"
DRAFT_DIR = ASSETS / "drafter"
DRAFT2_DIR = ASSETS / "drafter2"
#: the embedded drafters by architecture
DRAFTERS = {"dflash": DRAFT_DIR, "dflash2": DRAFT2_DIR}


def load_tokenizer(directory):
    """The byte tokenizer if the directory says so, else a local transformers tokenizer."""
    cfg = Path(directory) / "tokenizer_config.json"
    if cfg.is_file() and json.loads(cfg.read_text()).get("type") == "byte":
        return ByteTokenizer.from_pretrained(directory)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def load_target(directory, dtype=torch.float32, device="cpu"):
    """A causal LM from a local directory (offline), SDPA attention."""
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(directory):
        raise FileNotFoundError(f"target directory {directory!r} does not exist (loading is local only)")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True,
                                                 attn_implementation="sdpa")
    return model.to(device).eval()


def load_pair(target_dir, draft_dir, dtype=torch.float32, device="cpu"):
    """(target, draft, tokenizer) from local directories; the tokenizer comes from the target's."""
    target = load_target(target_dir, dtype, device)
    draft = DFlashDraftModel.from_pretrained(str(draft_dir), dtype=dtype, device=device)
    return target, draft, load_tokenizer(target_dir)


def _untrained_drafter(target, dtype, device) -> DFlashDraftModel:
    from ..drafter.config import make_draft_config

    cfg = target.config
    config = make_draft_config(
        hidden_size=cfg.hidden_size, num_hidden_layers=2, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size, num_target_layers=cfg.num_hidden_layers, block_size=8,
        mask_token_id=ByteTokenizer.mask_token_id, head_dim=getattr(cfg, "head_dim", None),
        max_position_embeddings=cfg.max_position_embeddings,
    )
    torch.manual_seed(0)
    return DFlashDraftModel(config).to(device=device, dtype=dtype).eval()


def load_default_pair(dtype=torch.float32, device="cpu",
                      drafter: str = "dflash") -> Tuple[torch.nn.Module, DFlashDraftModel, ByteTokenizer]:
    """The embedded tiny pair (see the module docstring for the fallbacks).

    ``drafter``: ``"dflash"`` (the shipped DFlash drafter, or an untrained one)
    or ``"dflash2"`` (the shipped DFlash2 drafter; FileNotFoundError when this
    checkout does not ship it).
    """
    if drafter not in DRAFTERS:
        raise ValueError(f"unknown tiny drafter {drafter!r}; allowed: {', '.join(DRAFTERS)}")
    if drafter == "dflash2" and not (DRAFTERS[drafter] / "model.safetensors").is_file():
        raise FileNotFoundError(f"the tiny DFlash2 drafter is not shipped in this checkout ({DRAFTERS[drafter]} has "
                                "no model.safetensors); use the DFlash drafter (the default)")
    if (TARGET_DIR / "model.safetensors").is_file():
        target = load_target(TARGET_DIR, dtype, device)
    else:
        warnings.warn("the tiny target is not shipped in this checkout: using a random small target")
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(0)
        target = Qwen3ForCausalLM(Qwen3Config(
            vocab_size=ByteTokenizer.vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
            attn_implementation="sdpa")).to(device=device, dtype=dtype).eval()
    if (DRAFTERS[drafter] / "model.safetensors").is_file():
        draft = DFlashDraftModel.from_pretrained(str(DRAFTERS[drafter]), dtype=dtype, device=device)
    else:
        warnings.warn("the tiny drafter is not shipped in this checkout: using an untrained drafter (no speedup)")
        draft = _untrained_drafter(target, dtype, device)
    return target, draft, ByteTokenizer()
