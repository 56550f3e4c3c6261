"""Split the test suite into shards by file, balanced by a table of per-file costs.

The pytest hooks at the end add two options (``conftest.py`` imports them):

* ``--shard I/N`` keeps the I-th of N shards, split by file; every file is in exactly
  one shard, so the N runs together are the whole (selected) suite. ``--shard-preload
  S1,...,SN`` books seconds of other work on each shard before packing.
* ``--only-listed FILE`` keeps the tests a list file names (see ``read_list``); an entry
  that selects nothing is an error, so a renamed test cannot silently leave the list,
  and files no entry names are not imported. With ``--only-listed-lenient`` that error
  comes at the end instead (exit status 1, the entries named in the summary) and the
  tests that were found still run: the GPU check's one lease is not lost to one id
  whose parametrization differs on the GPU machine.

The table is written by ``.ci/shard_costs.py``. This module imports no torch.

Packing (deterministic): every test file gets a cost, its seconds in
``shard_costs.json`` when the file is listed there, else the table's mean seconds
per test times its number of collected tests (a new file is never dropped, only
guessed). Files are taken largest cost first (ties by path) and each goes to the
shard whose ``load + preload`` is lowest (ties to the lowest index), where
``preload[i]`` is the seconds of other work the same core does besides this run.
A file is never split, so module-scoped fixtures are built once, in one process.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import pytest

COSTS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shard_costs.json")

# Seconds per test for a file the table does not list, when the table records no mean of its own.
DEFAULT_SECONDS_PER_TEST = 1.0


def parse_shard(text: str) -> Tuple[int, int]:
    """``"i/n"`` -> ``(i, n)`` with ``1 <= i <= n``; anything else is a ``ValueError``."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard wants I/N with integers, e.g. 1/2; got {text!r}") from None
    if count < 1 or not 1 <= index <= count:
        raise ValueError(f"--shard {text}: need 1 <= I <= N and N >= 1")
    return index, count


def parse_floats(text: Optional[str], count: int, name: str, default: float) -> List[float]:
    """A comma-separated list of ``count`` non-negative numbers (``None``: all ``default``)."""
    if text is None:
        return [default] * count
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{name} wants {count} comma-separated numbers; got {text!r}") from None
    if len(values) != count or any(value < 0 for value in values):
        raise ValueError(f"{name} wants {count} non-negative numbers (one per shard); got {text!r}")
    return values


def load_costs(path: str = COSTS_PATH) -> Tuple[Dict[str, float], float]:
    """The table's per-file seconds, and the seconds per test to guess a file it lacks.

    The table (JSON) holds ``files`` (``{"tests/ops/test_x.py": seconds}``) and ``tests`` (the
    same files' test counts); the guess is their ratio, the measured suite's mean. A
    missing table is an empty one: every file is guessed, ``DEFAULT_SECONDS_PER_TEST``.
    """
    if not os.path.exists(path):
        return {}, DEFAULT_SECONDS_PER_TEST
    with open(path) as handle:
        table = json.load(handle)
    files = {key: float(value) for key, value in table["files"].items()}
    tests = sum(int(n) for n in table.get("tests", {}).values())
    per_test = sum(files.values()) / tests if tests else DEFAULT_SECONDS_PER_TEST
    return files, per_test


def load_counts(path: str = COSTS_PATH) -> Dict[str, int]:
    """The table's ``tests`` (each measured file's test count; empty without a table)."""
    if not os.path.exists(path):
        return {}
    with open(path) as handle:
        return {key: int(n) for key, n in json.load(handle).get("tests", {}).items()}


def file_costs(counts: Dict[str, int], table: Dict[str, float],
               per_test: float = DEFAULT_SECONDS_PER_TEST) -> Dict[str, float]:
    """The cost of each collected file (``counts``: path -> number of tests collected).

    Its table entry, else ``per_test`` times its test count.
    """
    return {path: table[path] if path in table else per_test * n for path, n in counts.items()}


def pack(costs: Dict[str, float], count: int, preload: Sequence[float] = ()) -> List[List[str]]:
    """Greedy bin-packing of ``costs`` (path -> seconds) into ``count`` shards (lists of paths).

    Largest first, ties by path, each onto the shard of least ``load + preload`` (ties to
    the lowest index); the result depends only on its arguments.
    """
    loads = [float(x) for x in preload] or [0.0] * count
    if len(loads) != count:
        raise ValueError(f"pack: {count} shards need {count} preloads, got {len(loads)}")
    shards: List[List[str]] = [[] for _ in range(count)]
    for path in sorted(costs, key=lambda p: (-costs[p], p)):
        target = min(range(count), key=lambda i: (loads[i], i))
        shards[target].append(path)
        loads[target] += costs[path]
    return shards


def read_list(path: str) -> List[str]:
    """The entries of a list file: one test path or node id prefix a line, ``#`` comments."""
    entries = []
    with open(path) as handle:
        for line in handle:
            line = line.split("#", 1)[0].strip()
            if line:
                entries.append(line)
    if not entries:
        raise ValueError(f"{path} lists no tests")
    return entries


def matches(nodeid: str, entry: str) -> bool:
    """Whether ``entry`` (a file, ``file::test`` or ``file::test[param]``) selects ``nodeid``.

    A prefix selects the ids it is a whole part of: ``f.py::test_a`` selects ``f.py::test_a``
    and ``f.py::test_a[1]`` but not ``f.py::test_ab``.
    """
    if nodeid == entry:
        return True
    if not nodeid.startswith(entry):
        return False
    return nodeid[len(entry)] in ":[" or entry.endswith("::")


def select_listed(nodeids: Iterable[str], entries: Sequence[str]) -> Tuple[List[bool], List[str]]:
    """For each node id whether some entry selects it, and the entries that selected nothing."""
    used = set()
    keep = []
    for nodeid in nodeids:
        hit = [entry for entry in entries if matches(nodeid, entry)]
        used.update(hit)
        keep.append(bool(hit))
    return keep, [entry for entry in entries if entry not in used]


# ---------------------------------------------------------------- pytest hooks

def pytest_addoption(parser):
    group = parser.getgroup("dflash sharding")
    group.addoption("--shard", default=None, metavar="I/N",
                    help="run the I-th of N shards of the test files, balanced by tests/shard_costs.json")
    group.addoption("--shard-preload", default=None, metavar="S1,...,SN",
                    help="seconds of other work each shard's machine does besides this run "
                         "(the packing balances load + preload); default all 0")
    group.addoption("--shard-costs", default=COSTS_PATH, metavar="JSON",
                    help="the per-file cost table for --shard (default tests/shard_costs.json)")
    group.addoption("--only-listed", default=None, metavar="FILE",
                    help="run only the tests FILE lists (one path or node id prefix a line, # comments)")
    group.addoption("--only-listed-lenient", action="store_true", default=False,
                    help="with --only-listed: run what the entries select even when some select nothing; "
                         "those are named at the end and fail the session")


def _listed_entries(config):
    path = config.getoption("--only-listed")
    if path is None:
        return None
    entries = config.stash.get(_LISTED, None)
    if entries is None:
        entries = read_list(path)
        config.stash[_LISTED] = entries
    return entries


_LISTED = pytest.StashKey()
_SHARD_SUMMARY = pytest.StashKey()
_UNUSED = pytest.StashKey()


def pytest_ignore_collect(collection_path, config):
    """With ``--only-listed``, test files that no entry names are not even imported."""
    entries = _listed_entries(config)
    if entries is None or not collection_path.is_file():
        return None
    rel = collection_path.relative_to(config.rootpath).as_posix() if collection_path.is_relative_to(
        config.rootpath) else str(collection_path)
    if rel.startswith("tests/") and collection_path.name.startswith("test_") and not any(entry.split("::", 1)[0] == rel for entry in entries):
        return True
    return None


def _counts(items) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        counts[path] = counts.get(path, 0) + 1
    return counts


def listed_cost(selected: Dict[str, int], table: Dict[str, float], tests: Dict[str, int],
                per_test: float) -> float:
    """Estimated seconds of a selection (path -> tests selected): each file's table cost times
    the fraction of its tests selected, else ``per_test`` per test (a file-wide fixture is
    counted pro rata, so a slice of a file with a costly fixture is underestimated)."""
    total = 0.0
    for path, n in selected.items():
        if path in table and tests.get(path):
            total += table[path] * min(1.0, n / tests[path])
        else:
            total += per_test * n
    return total


def pytest_collection_modifyitems(config, items):
    entries = _listed_entries(config)
    shard = config.getoption("--shard")
    if entries is None and shard is None:
        return
    table_path = config.getoption("--shard-costs")
    table, per_test = load_costs(table_path)
    lines = []
    kept = list(items)
    if entries is not None:
        keep, unused = select_listed([item.nodeid for item in kept], entries)
        if unused:
            message = (f"--only-listed {config.getoption('--only-listed')}: these entries select no collected "
                       f"test: {', '.join(unused)}")
            if not config.getoption("--only-listed-lenient"):
                raise pytest.UsageError(message)
            config.stash[_UNUSED] = message
        kept = [item for item, k in zip(kept, keep) if k]
        selected = _counts(kept)
        tests = load_counts(table_path)
        lines.append(f"only-listed {config.getoption('--only-listed')}: {len(kept)} tests in {len(selected)} "
                     f"files, ~{listed_cost(selected, table, tests, per_test):.0f} s by the cost table")
    if shard is not None:
        try:
            index, count = parse_shard(shard)
            preload = parse_floats(config.getoption("--shard-preload"), count, "--shard-preload", 0.0)
        except ValueError as error:
            raise pytest.UsageError(str(error)) from None
        counts = _counts(kept)
        costs = file_costs(counts, table, per_test)
        mine = set(pack(costs, count, preload)[index - 1])
        kept = [item for item in kept if item.nodeid.split("::", 1)[0] in mine]
        guessed = sorted(path for path in mine if path not in table)
        lines.append(
            f"shard {index}/{count}: {len(mine)} of {len(counts)} files, {len(kept)} tests, "
            f"~{sum(costs[p] for p in mine):.0f} s of ~{sum(costs.values()):.0f} s by the cost table"
            + (f" (not in the table, guessed from test counts: {', '.join(guessed[:6])}"
               + (f" and {len(guessed) - 6} more" if len(guessed) > 6 else "") + ")" if guessed else ""))
    config.stash[_SHARD_SUMMARY] = lines
    kept_ids = {id(item) for item in kept}
    dropped = [item for item in items if id(item) not in kept_ids]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def pytest_terminal_summary(terminalreporter, config):
    for line in config.stash.get(_SHARD_SUMMARY, []):
        terminalreporter.write_line(line)
    unused = config.stash.get(_UNUSED, None)
    if unused:
        terminalreporter.write_line(f"FAILED (lenient) {unused}", red=True)


def pytest_sessionfinish(session, exitstatus):
    """``--only-listed-lenient``: entries that selected nothing fail the session once the rest has run."""
    if session.config.stash.get(_UNUSED, None) and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
