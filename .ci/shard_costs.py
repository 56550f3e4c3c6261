"""Measure the seconds each test file takes and write them to tests/shard_costs.json.

The table balances ``pytest --shard I/N`` (see tests/sharding.py); run this on a quiet
machine (nothing else running: times are wall clock) from the repository root:

    .venv/bin/python .ci/shard_costs.py                       # the whole suite, one core
    .venv/bin/python .ci/shard_costs.py --merge tests/ops/test_x.py   # re-measure some files only

Like a CI job it runs on one thread (``OMP_NUM_THREADS=1``) with empty inductor and Triton
caches, in one pytest process. A file's cost is its module's import plus the setup, call
and teardown of each of its tests (``--durations=0``'s numbers, summed by file). Extra
arguments go to pytest; with ``--merge`` the files measured replace their entries and
the others stay. The exit status is pytest's: a table is written only after a run with
no failures.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = os.path.join(ROOT, "tests", "shard_costs.json")


class Recorder:
    """Sums, per test file, the wall seconds of its import and of every test phase."""

    def __init__(self):
        self.seconds = {}
        self.tests = {}

    def add(self, path, seconds):
        self.seconds[path] = self.seconds.get(path, 0.0) + seconds

    def pytest_make_collect_report(self, collector):
        start = time.perf_counter()
        yield
        if type(collector).__name__ == "Module":
            self.add(collector.nodeid, time.perf_counter() - start)

    pytest_make_collect_report.hookwrapper = True

    def pytest_runtest_logreport(self, report):
        path = report.nodeid.split("::", 1)[0]
        self.add(path, report.duration)
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self.tests[path] = self.tests.get(path, 0) + 1


def main(argv):
    merge = "--merge" in argv
    args = [arg for arg in argv if arg != "--merge"]
    os.environ["OMP_NUM_THREADS"] = "1"
    caches = tempfile.mkdtemp(prefix="shard-costs-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(caches, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(caches, "triton")
    os.chdir(ROOT)
    import pytest

    recorder = Recorder()
    status = pytest.main(["-q", "-p", "no:cacheprovider", *args], plugins=[recorder])
    if status != 0:
        print(f"shard_costs: pytest exit {status}; the table is left as it was", file=sys.stderr)
        return int(status)
    files, tests = {}, {}
    if merge and os.path.exists(TABLE):
        with open(TABLE) as handle:
            old = json.load(handle)
        files, tests = old["files"], old["tests"]
    for path, count in recorder.tests.items():
        files[path] = round(recorder.seconds[path], 1)
        tests[path] = count
    measured = sum(recorder.seconds[p] for p in recorder.tests)
    import torch

    table = {
        "_note": "seconds per test file on one core, fresh caches, and each file's test count; "
                 "written by .ci/shard_costs.py (see there to regenerate); read by pytest --shard "
                 "(tests/sharding.py)",
        "measured": f"{datetime.date.today()} Python {sys.version.split()[0]}, torch {torch.__version__}"
                    + (" (some files merged into an earlier table)" if merge else ""),
        "files": dict(sorted(files.items())),
        "tests": dict(sorted(tests.items())),
    }
    with open(TABLE, "w") as handle:
        json.dump(table, handle, indent=1)
        handle.write("\n")
    print(f"shard_costs: {len(recorder.tests)} files, {measured:.0f} s measured; "
          f"wrote {os.path.relpath(TABLE, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
