"""What the GPU check's scripts share: the ``--dry-run`` switch, its printed skips, and JSON written at once.

Each ``bench/gpu_*.py`` script run by ``bench/gpu_check.sh`` takes ``--dry-run``: tiny shapes on the
CPU (``--device cpu --tiny``, and small sizes in place of the size arguments, which are still
parsed), every CUDA-only part (CUDA events, CUDA graphs, ``torch.compile``
of the rounds, ``torch.cuda.set_sync_debug_mode``, compiled Triton, CUDA memory statistics)
skipped with its reason printed, and the rest of the script's logic executed, so that an API
error or a version incompatibility in a script fails on a CPU machine before a GPU lease is spent.

:func:`write_json` replaces its file atomically (a temporary file, then a rename): a script
that writes its report after each part keeps what finished when the check's time limit kills it.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

DRY_RUN_HELP = ("CPU dry run of this script: tiny shapes, device cpu, the CUDA-only parts skipped with their "
                "reason printed (what bench/gpu_check.sh runs with GPU_CHECK_DRY_RUN=1)")


def add_dry_run(parser) -> None:
    parser.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)


def apply_dry_run(args, prog: str, **sizes) -> None:
    """``--dry-run`` implies ``--device cpu --tiny`` and sets each of ``sizes`` (overriding the command line's
    size arguments, which are still parsed: the GPU check passes the same arguments in both modes); says so."""
    if not getattr(args, "dry_run", False):
        return
    args.device = "cpu"
    if hasattr(args, "tiny"):
        args.tiny = True
    for key, value in sizes.items():
        setattr(args, key, value)
    given = ", ".join(f"{k.replace('_', '-')} {'its tiny default' if v is None else v}" for k, v in sizes.items())
    print(f"{prog}: dry run: tiny shapes on the CPU" + (f" ({given})" if given else "")
          + "; CUDA-only parts are skipped and named")


def skipped(prog: str, what: str, reason: str) -> None:
    """One line naming a part left out of this run and why."""
    print(f"{prog}: dry run: skipped {what}: {reason}")


def default_json(path: Optional[str], name: str) -> Optional[str]:
    """``path`` when given, else ``$OUT/name`` when ``OUT`` is set, else None."""
    if path:
        return path
    out = os.environ.get("OUT")
    return os.path.join(out, name) if out else None


def write_json(path: Optional[str], report: dict) -> None:
    """Write ``report`` to ``path`` (no-op for None), replacing the file in one rename."""
    if not path:
        return
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(tmp, path)


def cuda_name(torch, device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def fail_without_cuda(torch, device, prog: str) -> bool:
    """True (after a message on stderr) when ``device`` is CUDA and torch sees none."""
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"{prog}: CUDA is not available (use --dry-run, or --device cpu --tiny, to test this script)",
              file=sys.stderr)
        return True
    return False
