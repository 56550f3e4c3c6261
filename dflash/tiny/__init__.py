"""The shipped tiny byte-level pair: tokenizer (:mod:`.tokenizer`), stdlib corpus (:mod:`.corpus`),
target pretraining (:mod:`.pretrain`), loaders of the shipped weights (:mod:`.models`, :mod:`.pair`).

``from dflash.tiny import load_tiny_target, load_tiny_tokenizer, load_tiny_drafter`` loads them offline.
"""

from .models import load_tiny_drafter, load_tiny_target, load_tiny_tokenizer

__all__ = ["load_tiny_drafter", "load_tiny_target", "load_tiny_tokenizer"]
