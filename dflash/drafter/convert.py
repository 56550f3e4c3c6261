"""``python -m dflash.drafter.convert IN OUT --format zlab|transformers``: rewrite a drafter checkpoint.

Reads ``IN`` in either format (z-lab or transformers' native DFlash
assistant, sharded or not; see :mod:`dflash.drafter.formats`) and writes it to
``OUT`` in ``--format``, weights bit-identical (same dtype unless ``--dtype``).
``--num-target-layers`` / ``--vocab-size`` fill the keys a published native
config lacks; ``--max-shard-mb`` writes shards.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import torch

from .config import DraftConfigError
from .formats import FORMATS

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dflash convert",
                                description="Convert a DFlash drafter checkpoint between the z-lab and the "
                                            "transformers (native assistant) formats.")
    p.add_argument("input", help="drafter directory (either format, sharded or not)")
    p.add_argument("output", help="directory to write")
    p.add_argument("--format", required=True, choices=FORMATS, help="format to write")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="cast the weights (default: keep)")
    p.add_argument("--max-shard-mb", type=float, default=None, help="write shards of at most this many MiB")
    p.add_argument("--num-target-layers", type=int, default=None,
                   help="target decoder-layer count (for a native config that lacks it)")
    p.add_argument("--vocab-size", type=int, default=None, help="target vocabulary size (same)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the conversion; returns the exit status (2 with a one-line message on a bad argument or checkpoint)."""
    from .model import DFlashDraftModel

    args = build_parser().parse_args(argv)
    target_config = None
    if args.num_target_layers is not None or args.vocab_size is not None:
        target_config = argparse.Namespace(num_hidden_layers=args.num_target_layers, vocab_size=args.vocab_size)
    try:
        if os.path.abspath(args.input) == os.path.abspath(args.output):
            raise DraftConfigError("output directory must differ from the input directory")
        model = DFlashDraftModel.from_pretrained(args.input, target_config=target_config)
        shard = None if args.max_shard_mb is None else int(args.max_shard_mb * (1 << 20))
        if shard is not None and shard < 1:
            raise DraftConfigError(f"--max-shard-mb must be > 0, got {args.max_shard_mb}")
        model.save_pretrained(args.output, dtype=_DTYPES.get(args.dtype), format=args.format, max_shard_bytes=shard)
    except DraftConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.format} drafter to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
