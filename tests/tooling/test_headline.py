"""bench/headline.py (the GPU headline table) at tiny shapes on the CPU: its rows, the limit and memory columns,
the greedy check, the reference rows from carried sources (stand-ins with the references' call shapes) and
without them, and the time guards."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
import torch

import dflash_kernels

ROOT = Path(__file__).resolve().parents[2]

EAGER_ROWS = ["transformers AR, eager", "ours ar, eager", "ours dflash, eager", "ours ddtree (auto), eager",
              "drop-in (apply + generate), eager"]
REFS = ["z-lab dflash_generate", "DDTree reference"]


def load_headline():
    spec = importlib.util.spec_from_file_location("bench_headline", ROOT / "bench" / "headline.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def headline():
    return load_headline()


def run(headline, tmp_path, *extra):
    out, md = tmp_path / "headline.json", tmp_path / "headline.md"
    with dflash_kernels.force_backend("reference"):  # not the Triton interpreter conftest.py switches on
        rc = headline.main(["--dry-run", "--json", str(out), "--markdown", str(md), *extra])
    return rc, json.loads(out.read_text()), md.read_text()


def rows_of(report):
    return {r["row"]: r for group in report["groups"] for r in group["rows"]}


FAKE_ZLAB = '''
"""A stand-in for z-lab's package with its call shapes: the drafter's forward once, greedy through generate()."""
import json
import types

import torch


class DFlashDraftModel(torch.nn.Module):
    @classmethod
    def from_pretrained(cls, path, **kwargs):
        model = cls()
        cfg = json.load(open(f"{path}/config.json"))
        model.hidden, model.block_size = cfg["hidden_size"], cfg["block_size"]
        model.mask_token_id = cfg.get("dflash_config", {}).get("mask_token_id", 0)
        return model

    def forward(self, position_ids=None, **kwargs):
        return torch.zeros(1, position_ids.shape[1], self.hidden)


def dflash_generate(draft, target, x, max_new_tokens, stop_token_ids, temperature=0.0, return_stats=False, **kw):
    assert temperature == 0.0 and return_stats and stop_token_ids is None
    states = draft(position_ids=torch.arange(x.shape[1] + draft.block_size)[None])
    assert states.shape == (1, x.shape[1] + draft.block_size, draft.hidden)  # the steered table's rows
    out = target.generate(x, max_new_tokens=max_new_tokens, do_sample=False)
    return types.SimpleNamespace(output_ids=out, acceptance_lengths=[2] * (max_new_tokens // 2))
'''

FAKE_DDTREE = '''
from loguru import logger  # the DDTree code's module-level imports (stand-ins where not installed)
from model import DFlashDraftModel
import dflash


def ddtree_generate(draft, target, x, mask_token_id, max_new_tokens, block_size, stop_token_ids, temperature,
                    tree_budget):
    assert tree_budget >= 1 and stop_token_ids is None
    logger.info("fake ddtree")
    return dflash.dflash_generate(draft, target, x, max_new_tokens, stop_token_ids, temperature=temperature,
                                  return_stats=True)
'''


def fake_references(root: Path) -> Path:
    """``root/zlab/dflash/`` and ``root/ddtree/`` as gpu_check.sh's carried sources lie."""
    (root / "zlab" / "dflash").mkdir(parents=True)
    (root / "zlab" / "dflash" / "__init__.py").write_text("")
    (root / "zlab" / "dflash" / "model.py").write_text(FAKE_ZLAB)
    (root / "ddtree" / "model").mkdir(parents=True)
    (root / "ddtree" / "model" / "__init__.py").write_text("from dflash import DFlashDraftModel\n")
    (root / "ddtree" / "dflash.py").write_text(FAKE_ZLAB)
    (root / "ddtree" / "ddtree.py").write_text(FAKE_DDTREE)
    return root


def test_dry_run_table_with_carried_references(headline, tmp_path):
    """Every eager row runs, its tokens equal transformers' greedy ones, the limit and of-limit columns are filled
    from our eager stage times, memory reads n/a on the CPU, the compiled rows say why they did not run, and the
    references run from their carried sources in their own processes."""
    rc, report, md = run(headline, tmp_path, "--compiled", "--ref-src", str(fake_references(tmp_path / "refsrc")))
    assert rc == 0 and report["complete"]
    rows = rows_of(report)
    assert [g["tau"] for g in report["groups"]] == [None, 6.0]
    for name in EAGER_ROWS + REFS:
        r = rows[name]
        assert r["state"] == "ok" and r["greedy"] == "equal" and r["new_tokens"] == 12, r
        assert r["tokens_per_s"] > 0 and r["peak_gib"] is None
        assert r["limit_tokens_per_s"] > 0 and r["of_limit"] == pytest.approx(r["tokens_per_s"] /
                                                                             r["limit_tokens_per_s"])
    assert rows["ours ar, eager"]["of_limit"] == pytest.approx(rows["ours ar, eager"]["tokens_per_s"]
                                                               * report["groups"][0]["ar_step_s"])
    spec = report["groups"][1]
    assert set(spec["draft_verify_s_per_round"]) == {"dflash", "ddtree"}
    assert spec["p_right"] == pytest.approx(headline.p_for_tau(6, 8))
    for name in ("ours dflash, eager", "ours ddtree (auto), eager"):
        t_round = spec["draft_verify_s_per_round"][rows[name]["method"]]
        assert rows[name]["limit_tokens_per_s"] == pytest.approx(rows[name]["tau"] / t_round)
        assert rows[name]["tau"] > 1  # the steered drafter is accepted
    assert rows["DDTree reference"]["tree_budget"] >= 1 and rows["z-lab dflash_generate"]["tau"] == 2
    for name in ("transformers AR, static cache + torch.compile", "ours ar, compiled", "ours dflash, compiled",
                 "drop-in (apply + generate), compiled"):
        assert rows[name]["state"].startswith("skipped (CUDA only")
    assert "| 24 | 6 (p " in md
    assert "| of limit | peak GiB | greedy |" in md and "| DDTree reference |" in md


def test_references_not_carried(headline, tmp_path):
    """Without the sources the reference rows read "not carried" and the run passes."""
    rc, report, md = run(headline, tmp_path, "--ref-src", str(tmp_path / "nothing"))
    assert rc == 0
    rows = rows_of(report)
    assert all(rows[name]["state"] == "not carried" for name in REFS)
    assert report["references"] == {"zlab": "not carried", "ddtree": "not carried"}
    assert "| z-lab dflash_generate | not carried |" in md
    assert all(rows[name]["state"] == "ok" for name in EAGER_ROWS)


def test_greedy_mismatch_is_reported_with_its_margin(headline, tmp_path, monkeypatch):
    """A row whose tokens differ: where, the target's margin there, in the table; an fp32 run then fails."""
    real = headline.ours_row

    def broken(name, target, draft, prompt, method, n, compile, **kw):
        row = real(name, target, draft, prompt, method, n, compile, **kw)
        if name == "ours dflash, eager":
            run_ = row.run
            row.run = lambda: (lambda out: (out[0][:5] + [(out[0][5] + 1) % 512] + out[0][6:], out[1]))(run_())
        return row

    monkeypatch.setattr(headline, "ours_row", broken)
    rc, report, md = run(headline, tmp_path)
    assert rc == 1
    r = rows_of(report)["ours dflash, eager"]
    assert r["greedy"] == "differs" and r["divergence"]["new_token"] == 5
    assert r["divergence"]["logit_margin"] > 0 and r["divergence"]["top2_gap"] >= 0
    assert "**differs** at new token 5: margin" in md
    assert rows_of(report)["ours ddtree (auto), eager"]["greedy"] == "equal"


def test_a_row_that_raises_is_reported_and_fails_the_run(headline, tmp_path, monkeypatch):
    """One of our rows raising: its state names the error, the rows after it still run, the exit status is 1."""
    real = headline.dropin_row

    def raising(*args, **kwargs):
        row = real(*args, **kwargs)
        row.warm = lambda: (_ for _ in ()).throw(RuntimeError("simulated drop-in failure"))
        return row

    monkeypatch.setattr(headline, "dropin_row", raising)
    rc, report, md = run(headline, tmp_path, "--ref-src", str(tmp_path / "nothing"))
    assert rc == 1
    rows = rows_of(report)
    assert rows["drop-in (apply + generate), eager"]["state"] == "failed: RuntimeError: simulated drop-in failure"
    assert rows["ours ddtree (auto), eager"]["state"] == "ok" and rows["DDTree reference"]["state"] == "not carried"
    assert "| drop-in (apply + generate), eager | failed: RuntimeError: simulated drop-in failure |" in md


def test_tau_is_steered_by_the_chain_formula(headline):
    for block, tau in [(16, 3.0), (16, 6.0), (16, 9.0), (8, 6.0)]:
        p = headline.p_for_tau(tau, block)
        assert headline.chain_tau(p, block) == pytest.approx(tau, abs=1e-9) and 0 < p < 1
    with pytest.raises(ValueError):
        headline.p_for_tau(17, 16)


def test_rows_past_the_time_guard_are_skipped_not_failed(headline, tmp_path):
    """Out of time: rows read "skipped (no time ...)", and a row that overruns its guard is stopped and skipped."""
    rc, report, md = run(headline, tmp_path, "--deadline-s", "0.5", "--ref-src", str(tmp_path / "nothing"))
    assert rc == 0 and report["complete"]
    states = {r["row"]: r["state"] for g in report["groups"] for r in g["rows"]}
    assert states["transformers AR, eager"].startswith("skipped (no time")
    late = headline.Clock(5.0, None, 1.0, started=time.monotonic() - 10)  # the script's imports count too
    assert late.row_budget() < 0
    assert headline.measure(headline.Row("late", "ar", "eager", run=lambda: ([], None)), torch.device("cpu"), late,
                            dry_run=True)["state"] == "skipped (no time: 0 s left)"
    clock = headline.Clock(None, 0.2, 0.05)
    slow = headline.Row("slow", "ar", "eager", run=lambda: time.sleep(5) or ([], None))
    t0 = time.perf_counter()
    out = headline.measure(slow, torch.device("cpu"), clock, dry_run=True)
    assert out["state"] == "skipped (over its 0 s guard)" and time.perf_counter() - t0 < 2
