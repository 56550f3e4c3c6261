"""bench/reference_loops.py (ours against z-lab's DFlash loop and the DDTree reference loop) at smoke size.

The references need their own environment (bench/reference_worker.py runs there), so here only our side
runs, plus the path where a reference environment cannot serve: the benchmark says so and goes on. The
worker is checked statically: it must not import this repository's ``dflash`` (z-lab's package has the
same import name).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import dflash_kernels

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "reference_loops.py"
WORKER = ROOT / "bench" / "reference_worker.py"


def _run(argv, monkeypatch):
    spec = importlib.util.spec_from_file_location("reference_loops", BENCH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        with dflash_kernels.force_backend("reference"):  # not the Triton interpreter conftest.py switches on
            return module.main(argv)
    finally:
        torch.set_num_threads(threads)


def test_dry_run_of_our_side(tmp_path, capsys, monkeypatch):
    """Ours eager DFlash and DDTree: timed, tau, ops per round from the counted pass, greedy tokens equal."""
    out = tmp_path / "r.json"
    assert _run(["--dry-run", "--json", str(out)], monkeypatch) == 0
    report = json.loads(out.read_text())
    rows = {r["name"]: r for r in report["rows"]}
    assert set(rows) == {"ours dflash, eager", "ours ddtree, eager"}
    for row in rows.values():
        assert row["tokens"] == 8 and row["tokens_per_s"] > 0 and row["tau"] >= 1
        assert row["ops_per_round"] > 0
        assert sum(row["by_op_per_round"].values()) == pytest.approx(row["ops_per_round"])
        assert row["greedy_equal"] is True and row["ratio_to_reference"] is None
    assert any("ours only" in n for n in report["notes"])
    printed = capsys.readouterr().out
    assert "| DFlash | ours dflash, eager |" in printed and "NOTE: no --zlab-python" in printed


def test_a_reference_environment_that_cannot_serve_is_reported(tmp_path, monkeypatch):
    """A python without z-lab's package (ours): the worker refuses, the note says why, our side still runs."""
    out = tmp_path / "r.json"
    assert _run(["--dry-run", "--methods", "dflash", "--no-ops", "--zlab-python", sys.executable,
                 "--json", str(out)], monkeypatch) == 0
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["rows"]] == ["ours dflash, eager"]
    assert any("zlab worker could not start" in n for n in report["notes"]), report["notes"]


def _imports(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import in the worker"
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)


def test_the_worker_imports_nothing_of_this_repository():
    """Its only ``dflash`` imports are z-lab's ``dflash`` / ``dflash.model`` (a module this package does not
    have); nothing of ``dflash_kernels``; it loads the launch counter by path."""
    tree = ast.parse(WORKER.read_text())
    names = set(_imports(tree))
    ours = {n for n in names if n.split(".")[0] in ("dflash", "dflash_kernels")}
    assert ours <= {"dflash", "dflash.model"}, ours
    assert not (ROOT / "dflash" / "model.py").exists() and not (ROOT / "dflash" / "model").exists()
    tops = {n.split(".")[0] for n in names}
    allowed = set(sys.stdlib_module_names) | {"torch", "transformers", "dflash", "ddtree", "model"}
    assert tops <= allowed, tops - allowed
    assert "spec_from_file_location" in WORKER.read_text()
