"""The decoding loops: AR baseline, DFlash chain, DDTree tree, and the state they share."""

from .ar import ar_generate
from .chain import dflash_generate
from .ddtree import ddtree_generate, ddtree_generate_result
from .generate import METHODS, generate, spec_generate
from .result import GenerationResult
from .speculation import Speculation, check_pair
from .warmup import warmup

__all__ = ["GenerationResult", "METHODS", "Speculation", "ar_generate", "check_pair", "ddtree_generate",
           "ddtree_generate_result", "dflash_generate", "generate", "spec_generate", "warmup"]
