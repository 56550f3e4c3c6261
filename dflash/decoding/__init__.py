"""The decoding loops: AR baseline, DFlash chain, DDTree tree, and the state they share; the generate-keyword
resolution, streaming, the transformers drop-in, and the public drafter class (the network plus
``spec_generate``)."""

from .ar import ar_generate
from .chain import dflash_generate
from .ddtree import ddtree_generate, ddtree_generate_result
from .drafter import DFlashDraftModel
from .generate import METHODS, generate, prepare_generation, run_generation
from .generation_config import GenerationPlan, SamplingSettings, UnsupportedGeneration, resolve_generation
from .hf import DropIn, apply, is_applied, unapply
from .result import GenerationResult
from .speculation import Speculation, check_pair, choose_tokens
from .streaming import TokenStream, stream
from .warmup import warmup

__all__ = ["DFlashDraftModel", "DropIn", "GenerationPlan", "GenerationResult", "METHODS", "SamplingSettings", "Speculation",
           "TokenStream", "UnsupportedGeneration", "apply", "ar_generate", "check_pair", "choose_tokens",
           "ddtree_generate", "ddtree_generate_result", "dflash_generate", "generate", "is_applied",
           "prepare_generation", "resolve_generation", "run_generation", "stream", "unapply",
           "warmup"]
