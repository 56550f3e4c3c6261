"""A pytest plugin for the GPU check's pytest steps: a JSON report rewritten after every test, and SIGTERM as Ctrl-C.

Load it with ``-p gpu_pytest_report`` (``bench/`` on ``PYTHONPATH``) and name the report in
``GPU_CHECK_PYTEST_JSON``; ``bench/gpu_check.sh`` does both for its ``tests`` and ``micro`` steps.

* The report (``{"collected": [...], "tests": [{"nodeid", "outcome", "seconds"}], "counts": {...},
  "collect_only", "exitstatus", "finished"}``) is written when collection ends, after each test, and
  when the session ends, each time by an atomic rename: a run killed by its time limit keeps the
  outcome of every test that finished.
* ``timeout`` ends a step with SIGTERM first; this plugin turns it into ``KeyboardInterrupt``, so
  pytest stops at the current test and still runs its session-finish hooks (pytest-benchmark
  writes ``--benchmark-json`` there: the benchmarks that finished are saved).
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

_REPORT = {"collected": [], "tests": [], "counts": {}, "collect_only": False, "exitstatus": None, "finished": False}
_STARTED = {}


def _path():
    return os.environ.get("GPU_CHECK_PYTEST_JSON")


def _write():
    path = _path()
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    counts = {}
    for t in _REPORT["tests"]:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    _REPORT["counts"] = counts
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(_REPORT, f, indent=1)
    os.replace(tmp, path)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}: the step's time limit")


def pytest_configure(config):
    _REPORT["collect_only"] = bool(config.getoption("collectonly", False))
    signal.signal(signal.SIGTERM, _interrupt)


def pytest_collection_finish(session):
    _REPORT["collected"] = [item.nodeid for item in session.items]
    _write()


def pytest_runtest_logstart(nodeid, location):
    _STARTED[nodeid] = time.perf_counter()


def pytest_runtest_logreport(report):
    # one entry per test: the call phase, or the setup phase when it failed or skipped the test
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        seconds = time.perf_counter() - _STARTED.get(report.nodeid, time.perf_counter())
        _REPORT["tests"].append(dict(nodeid=report.nodeid, outcome=report.outcome, seconds=round(seconds, 3)))
        _write()
    elif report.when == "teardown" and report.outcome == "failed":
        _REPORT["tests"].append(dict(nodeid=report.nodeid, outcome="error in teardown", seconds=0.0))
        _write()


@pytest.hookimpl(trylast=True)  # after the hooks that may still change the session's status
def pytest_sessionfinish(session, exitstatus):
    _REPORT["exitstatus"] = int(session.exitstatus)
    _REPORT["finished"] = True
    _write()
