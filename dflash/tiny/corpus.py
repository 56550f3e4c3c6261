"""The Python standard library sources as a byte-level training corpus.

The corpus is the ``.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``), read as raw bytes, in a deterministic
order (sorted relative POSIX path).

What is left out, and why:

* directories named ``site-packages`` (third-party code, differs per machine),
  ``__pycache__``, ``config-*`` (build files), ``pydoc_data`` (one 750 kB
  machine-generated string of documentation text, not code);
* test suites: any directory named ``test``, ``tests`` or ``idle_test``
  (``Lib/test`` alone is larger than the rest of the library and contains the
  tests of the held-out packages, e.g. ``test/test_json``; ``lib2to3/tests``
  holds deliberately broken files);
* machine-generated files: the ``encodings`` charmap tables written by
  ``gencodec.py`` (1.2 MB of hex tables) and ``_sysconfigdata_*.py``
  (build-machine specific).

Split: a file belongs to the *held-out* split when its top-level package or
module name (first path component, ``.py`` stripped) is in
:data:`HELDOUT_PACKAGES` (``json``, ``email``, ``asyncio``, ``xml``; note that
``xmlrpc`` is a different top-level package and stays in training); every other
file is *train*. The split is by whole package, so evaluation measures
generalization to code the model never saw.

In token space (see :class:`dflash.tiny.tokenizer.ByteTokenizer`) the files of a
split are concatenated with ``eos_token_id`` (257) after each file.
"""

from __future__ import annotations

import functools
import random
import sysconfig
from pathlib import Path
from typing import Optional, Union

import torch

from .tokenizer import ByteTokenizer

__all__ = [
    "HELDOUT_PACKAGES",
    "SPLITS",
    "stdlib_root",
    "top_level_name",
    "stdlib_files",
    "load_corpus",
    "encode_corpus",
    "heldout_prompts",
]

HELDOUT_PACKAGES = ("json", "email", "asyncio", "xml")
SPLITS = ("train", "heldout")

_EXCLUDED_DIR_NAMES = frozenset({"site-packages", "__pycache__", "pydoc_data", "test", "tests", "idle_test"})
_GENERATED_MARKER = b"gencodec.py"


def stdlib_root() -> Path:
    """Directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def top_level_name(relative_path: Union[str, Path]) -> str:
    """Top-level package or module of a path relative to the stdlib root.

    ``json/decoder.py`` -> ``json``; ``argparse.py`` -> ``argparse``.
    """
    first = Path(relative_path).parts[0]
    return first[:-3] if first.endswith(".py") else first


def _excluded_dir(name: str) -> bool:
    return name in _EXCLUDED_DIR_NAMES or name.startswith("config-")


def _generated_file(path: Path) -> bool:
    if path.name.startswith("_sysconfigdata"):
        return True
    if path.parent.name == "encodings":
        with open(path, "rb") as f:
            return _GENERATED_MARKER in f.read(300)
    return False


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


@functools.lru_cache(maxsize=None)
def _all_files(root: Path) -> tuple[Path, ...]:
    if not root.is_dir():
        raise FileNotFoundError(f"standard library directory {root} does not exist")
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(_excluded_dir(part) for part in rel.parts[:-1]):
            continue
        if not path.is_file() or _generated_file(path):
            continue
        found.append(path)
    found.sort(key=lambda p: p.relative_to(root).as_posix())
    return tuple(found)


def stdlib_files(split: str = "train", root: Optional[Union[str, Path]] = None) -> list[Path]:
    """The ``.py`` files of one split, sorted by path relative to ``root``.

    ``root`` defaults to :func:`stdlib_root`; tests pass a small fake tree.
    """
    _check_split(split)
    root = stdlib_root() if root is None else Path(root).resolve()
    want_heldout = split == "heldout"
    return [
        p for p in _all_files(root)
        if (top_level_name(p.relative_to(root)) in HELDOUT_PACKAGES) == want_heldout
    ]


def load_corpus(split: str = "train", root: Optional[Union[str, Path]] = None) -> list[bytes]:
    """Raw bytes of every file of the split, one entry per file, in file order.

    (A single ``bytes`` object cannot carry the EOS boundary, which is not a
    byte; :func:`encode_corpus` gives the joined token stream.)
    """
    return [p.read_bytes() for p in stdlib_files(split, root)]


def encode_corpus(split: str = "train", root: Optional[Union[str, Path]] = None) -> torch.Tensor:
    """Token ids of the split: each file's bytes followed by ``eos_token_id``.

    Returns a 1-D ``torch.long`` tensor of length ``sum(len(file) + 1)``.
    """
    eos = ByteTokenizer.eos_token_id
    parts = []
    for data in load_corpus(split, root):
        if data:
            parts.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).long())
        parts.append(torch.tensor([eos], dtype=torch.long))
    if not parts:
        raise ValueError(f"the {split!r} split has no files")
    return torch.cat(parts)


def line_start_prompts(
    split: str,
    n: int,
    prompt_len: int,
    seed: int = 0,
    following: int = 0,
    root: Optional[Union[str, Path]] = None,
) -> list[list[int]]:
    """``n`` deterministic prompts of ``prompt_len`` byte ids from the files of ``split``.

    Each prompt starts at the beginning of a non-blank line of one file and
    lies inside that file, with at least ``following`` more bytes of the same
    file after it (room for a reference continuation). Start points are drawn
    without replacement, uniformly over all eligible line starts, by
    ``random.Random(seed)``; the result depends only on (split, n, prompt_len,
    seed, following) and the interpreter's standard library.
    """
    if n < 0 or prompt_len <= 0 or following < 0:
        raise ValueError(f"need n >= 0, prompt_len > 0, following >= 0; got {n}, {prompt_len}, {following}")
    candidates: list[tuple[int, int]] = []
    sources = load_corpus(split, root)
    for file_index, data in enumerate(sources):
        last_start = len(data) - prompt_len - following
        start = 0
        while 0 <= start <= last_start:
            if data[start:start + 1] not in (b"\n", b"\r"):
                candidates.append((file_index, start))
            nl = data.find(b"\n", start)
            if nl < 0:
                break
            start = nl + 1
    if n > len(candidates):
        raise ValueError(
            f"asked for {n} prompts of {prompt_len}+{following} bytes but the {split} split "
            f"has only {len(candidates)} eligible line starts"
        )
    picks = random.Random(seed).sample(candidates, n)
    return [list(sources[f][s:s + prompt_len]) for f, s in picks]


def heldout_prompts(n: int, prompt_len: int, seed: int = 0, following: int = 0,
                    root: Optional[Union[str, Path]] = None) -> list[list[int]]:
    """Prompts from the held-out packages (json, email, asyncio, xml): see :func:`line_start_prompts`."""
    return line_start_prompts("heldout", n, prompt_len, seed, following, root)
