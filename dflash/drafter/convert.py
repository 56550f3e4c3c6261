"""``python -m dflash convert IN OUT --format zlab|transformers|speculators``: rewrite a drafter checkpoint.

Reads ``IN`` in any format (z-lab, transformers' native DFlash assistant or
vLLM speculators, DFlash or DFlash2, sharded or not; see
:mod:`dflash.drafter.formats`) and writes it to ``OUT`` in ``--format``,
weights bit-identical (same dtype unless ``--dtype``). A DFlash2 drafter
cannot be written in the transformers format. ``--num-target-layers`` /
``--vocab-size`` fill the keys a format does not carry (a native config has
neither, a speculators one no layer count; the z-lab format needs both);
``--max-shard-mb`` writes shards.
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
                                description="Convert a DFlash / DFlash2 drafter checkpoint between the z-lab, the "
                                            "transformers (native assistant) and the speculators formats.")
    p.add_argument("input", help="drafter directory (any format, sharded or not)")
    p.add_argument("output", help="directory to write")
    p.add_argument("--format", required=True, choices=FORMATS, help="format to write")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="cast the weights (default: keep)")
    p.add_argument("--max-shard-mb", type=float, default=None, help="write shards of at most this many MiB")
    p.add_argument("--num-target-layers", type=int, default=None,
                   help="target decoder-layer count (for a native or speculators config, which lack it)")
    p.add_argument("--vocab-size", type=int, default=None, help="target vocabulary size (for a native config, which lacks it)")
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
