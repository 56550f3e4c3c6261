"""The decoding layer: the one round (draft + verify over device state), the host loop, its entry points;
the generate-keyword resolution, streaming, warm-up, the transformers drop-in, and the public drafter
class (the network plus ``spec_generate``)."""

from .entry import ar_generate, ddtree_generate, ddtree_generate_result, dflash_generate
from .drafter import DFlash2DraftModel, DFlashDraftModel
from .generate import METHODS, generate, prepare_generation, run_generation
from .generation_config import GenerationPlan, SamplingSettings, UnsupportedGeneration, resolve_generation
from .hf import DropIn, apply, is_applied, unapply
from .options import LoopOptions, check_pair
from .result import GenerationResult
from .round import Round
from .streaming import TokenStream, stream
from .warmup import warmup

__all__ = ["DFlash2DraftModel", "DFlashDraftModel", "DropIn", "GenerationPlan", "GenerationResult", "LoopOptions", "METHODS", "Round",
           "SamplingSettings", "TokenStream", "UnsupportedGeneration", "apply", "ar_generate", "check_pair",
           "ddtree_generate", "ddtree_generate_result", "dflash_generate", "generate", "is_applied",
           "prepare_generation", "resolve_generation", "run_generation", "stream", "unapply", "warmup"]
