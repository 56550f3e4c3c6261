"""The decoding loops: AR baseline, DFlash chain, DDTree tree, and the state they share; the generate-keyword
resolution, streaming, and the transformers drop-in."""

from .ar import ar_generate
from .chain import dflash_generate
from .ddtree import ddtree_generate, ddtree_generate_result
from .generate import METHODS, generate, prepare_generation, run_generation, spec_generate
from .generation_config import GenerationPlan, SamplingSettings, UnsupportedGeneration, resolve_generation
from .hf import DropIn, apply, is_applied, unapply
from .result import GenerationResult
from .speculation import Speculation, check_pair, choose_tokens
from .streaming import TokenStream, stream
from .warmup import warmup

__all__ = ["DropIn", "GenerationPlan", "GenerationResult", "METHODS", "SamplingSettings", "Speculation",
           "TokenStream", "UnsupportedGeneration", "apply", "ar_generate", "check_pair", "choose_tokens",
           "ddtree_generate", "ddtree_generate_result", "dflash_generate", "generate", "is_applied",
           "prepare_generation", "resolve_generation", "run_generation", "spec_generate", "stream", "unapply",
           "warmup"]
