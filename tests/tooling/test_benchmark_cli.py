"""``python -m dflash bench`` on a tiny random pair, and the coverage of the microbenchmark suite.

The pair is saved to temporary directories and loaded back through
``--target`` / ``--draft`` (the path a user takes with real checkpoints).
"""

import ast
import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dflash_kernels
from dflash.benchmark import run as benchmark
from dflash.benchmark import runners
from dflash.benchmark.configs import PROMPT_LOOKUP_TOKENS, BenchConfig, expand_configs
from dflash.benchmark.prompts import read_prompts_jsonl
from dflash.benchmark.runners import Run, RunSettings, hf_generation_config
from dflash.benchmark.summary import compare_greedy
from dflash.cli import main as cli_main
from dflash.tiny.tokenizer import ByteTokenizer
from tiny_models import tiny_draft, tiny_target

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny shapes run fastest on one thread (and the CI machine's cores are shared); restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def reference_ops():
    """The end-to-end runs use the pure-torch ops: the Triton interpreter would only make them slow
    (the loops on the kernels are tested in test_generate_triton.py)."""
    with dflash_kernels.force_backend("reference"):
        yield


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    """A tiny Qwen3 target over the byte vocabulary and a 2-layer drafter, saved like checkpoints."""
    root = tmp_path_factory.mktemp("pair")
    target = tiny_target("qwen3", layers=4, hidden=32, vocab=ByteTokenizer.vocab_size)
    draft = tiny_draft(target, block_size=4, target_layer_ids=[1, 2])
    target.save_pretrained(root / "target")
    ByteTokenizer().save_pretrained(root / "target")
    draft.save_pretrained(str(root / "draft"))
    return root / "target", root / "draft"


def bench_args(pair_dirs, out, *extra):
    target, draft = pair_dirs
    return ["bench", "--target", str(target), "--draft", str(draft), "--out", str(out), "--threads", "1",
            "--no-progress", "--max-new-tokens", "10", "--warmup-tokens", "2", *extra]


def test_all_methods_write_results_table_and_plots(pair_dirs, tmp_path, capsys):
    out = tmp_path / "run"
    rc = cli_main(bench_args(pair_dirs, out, "--num-prompts", "2", "--prompt-len", "16", "--budgets", "2,4",
                             "--temperatures", "0,0.8"))
    stdout = capsys.readouterr().out
    assert rc == 0, stdout
    results = json.loads((out / "results.json").read_text())
    labels = [r["label"] for r in results["rows"]]
    assert labels == [
        "ar, T=0", "dflash, block 4, T=0", "ddtree, budget 2, block 4, T=0", "ddtree, budget 4, block 4, T=0",
        "hf, T=0", "prompt-lookup, T=0",
        "ar, T=0.8", "dflash, block 4, T=0.8", "ddtree, budget 2, block 4, T=0.8", "ddtree, budget 4, block 4, T=0.8",
        "hf-sample, T=0.8", "prompt-lookup, T=0.8",
    ]
    assert results["failures"] == []
    assert results["meta"]["prompts"]["count"] == 2 and results["meta"]["prompts"]["lengths"] == [16, 16]
    assert results["meta"]["stop_token_ids"] == [ByteTokenizer.eos_token_id]
    assert results["meta"]["command"].startswith("python -m dflash bench --target ")
    assert results["meta"]["kernel_backend"] == "reference"
    assert len(results["runs"]) == 2 * len(labels)
    for row in results["rows"]:
        assert row["prompts"] == 2 and row["new_tokens"] >= 2
        assert row["tokens_per_second"] > 0 and row["time_per_output_token"] > 0
        assert sum(row["acceptance_histogram"].values()) == row["rounds"]
        assert row["tau"] >= 1.0
        if row["method"] in ("ar", "hf", "hf-sample"):
            assert row["tau"] == 1.0
        if row["method"] in ("dflash", "ddtree"):
            shares = row["draft_share"] + row["verify_share"] + row["commit_share"]
            assert 0.5 < shares <= 1.0 + 1e-6  # the stages cover the decode loop
        assert row["speedup"] > 0
    assert all(r["speedup"] == pytest.approx(1.0) for r in results["rows"] if r["method"] == "ar")
    # greedy outputs really are identical to ar's on every prompt
    greedy = {}
    for run in results["runs"]:
        if run["label"].endswith("T=0"):
            greedy.setdefault(run["prompt_index"], set()).add(tuple(run["generated"]))
    assert all(len(outputs) == 1 for outputs in greedy.values())

    md = (out / "results.md").read_text()
    assert "| method | budget | block | T | tau | tokens/s | ms/token | speedup vs ar |" in md
    assert "All greedy (T = 0) outputs equal ar's token for token." in md and "| **FAILURE** |" not in md
    assert "| ddtree | 4 | 4 | 0.8 |" in md
    assert md in stdout
    # per-position acceptance: pooled over the prompts' rounds in the JSON, a Markdown table, a plot
    runs_of = {label: [r for r in results["runs"] if r["label"] == label] for label in labels}
    for row in results["rows"]:
        shares = row["position_acceptance"]
        if row["method"] in ("ar", "hf", "hf-sample"):
            assert shares == []
            continue
        positions = 3 if row["method"] in ("dflash", "ddtree") else PROMPT_LOOKUP_TOKENS
        pooled = [n for r in runs_of[row["label"]] for n in r["accepted_drafts"]]
        assert len(pooled) == row["rounds"] and len(shares) == positions
        assert shares == [sum(n >= k for n in pooled) / len(pooled) for k in range(1, positions + 1)]
        assert all(0 <= v <= 1 for v in shares) and shares == sorted(shares, reverse=True)
    assert "**Acceptance per draft position**" in md
    assert "| method | budget | block | T | k=1 | k=2 | k=3 | k=4 |" in md
    table = md[md.index("| method | budget | block | T | k=1"):].split("\n\n")[0].splitlines()
    assert len(table) == 2 + 8  # dflash, two ddtree budgets and prompt-lookup at each temperature
    ddtree = next(r for r in results["rows"] if r["label"] == "ddtree, budget 4, block 4, T=0.8")
    assert "| ddtree | 4 | 4 | 0.8 | " + " | ".join(f"{v:.3f}" for v in ddtree["position_acceptance"]) + " | – |" in md
    for name in ("acceptance_hist.png", "budget_curves.png", "position_acceptance.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC and (out / name).stat().st_size > 10_000
        assert f"]({name})" in md


@pytest.mark.parametrize("method,runner", [("dflash", "run_ours"), ("prompt-lookup", "run_peer")])
def test_a_greedy_mismatch_is_a_failure_and_exits_nonzero(pair_dirs, tmp_path, monkeypatch, capsys, method, runner):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [100, 101, 102, 40, 41, 100, 101]}) + "\n\n"
                       + json.dumps({"prompt": "def f(x):\n    return"}) + "\n")
    real = getattr(runners, runner)

    def corrupted(cfg, *args, **kwargs):
        run = real(cfg, *args, **kwargs)
        if cfg.method == method and len(run.generated) > 3:
            run.generated[3] = (run.generated[3] + 1) % 256
        return run

    monkeypatch.setattr(runners, runner, corrupted)
    out = tmp_path / "run"
    rc = cli_main(bench_args(pair_dirs, out, "--prompts", str(prompts), "--methods", f"ar,{method}",
                             "--temperatures", "0", "--ignore-eos"))
    captured = capsys.readouterr()
    assert rc == 1
    assert "FAILURE" in captured.err
    results = json.loads((out / "results.json").read_text())
    assert {f["prompt_index"] for f in results["failures"]} == {0, 1}
    assert all(f["position"] == 3 and f["label"].startswith(method) for f in results["failures"])
    row = next(r for r in results["rows"] if r["method"] == method)
    assert row["failures"] == 2
    md = (out / "results.md").read_text()
    label = row["label"]
    assert md.count("| **FAILURE** |") == 2 and f"| **FAILURE** | {label} differs from ar on prompt 1 at new token 3" in md


def test_batch_sizes_table_ours_row_by_row_and_hf(pair_dirs, tmp_path, capsys):
    """``--batch-sizes``: per batch size every method batched, row by row and transformers' batched generate; greedy
    batched rows equal their prompts alone; a batch size above the prompt count is skipped with a note."""
    out = tmp_path / "batch"
    rc = cli_main(bench_args(pair_dirs, out, "--num-prompts", "4", "--prompt-len", "12", "--budgets", "3",
                             "--temperatures", "0", "--methods", "ar,dflash,ddtree,hf", "--batch-sizes", "1,2,8"))
    stdout = capsys.readouterr().out
    assert rc == 0, stdout
    results = json.loads((out / "results.json").read_text())
    rows = results["rows"]
    assert {(r["batch_size"], r["method"]) for r in rows} == {
        (b, m) for b in (1, 2) for m in ("ar", "dflash", "ddtree", "hf")}
    assert all(r["equal_to_alone"] for r in rows if r["method"] != "hf")
    ours = [r for r in rows if r["method"] != "hf"]
    assert all(r["tokens_per_second"] > 0 and r["row_by_row_tokens_per_second"] > 0 and r["over_hf"] > 0
               for r in ours)
    assert any("batch size 8 is larger than the 4 prompts" in n for n in results["notes"])
    trees = [r for r in rows if r["method"] == "ddtree"]
    assert all(r["mean_tree_nodes"] == 3 for r in trees)  # the verified nodes per round: the fixed budget
    assert all(r["mean_tree_nodes"] is None for r in rows if r["method"] != "ddtree")
    assert "| 2 | dflash | – | 0 |" in stdout and (out / "results.md").is_file()


def test_configs_put_ar_first_and_peers_at_their_temperatures():
    configs = expand_configs(["dflash", "hf", "hf-sample", "prompt-lookup"], [8], [0.0, 1.0], [16])
    assert [c.label for c in configs] == [
        "ar, T=0", "dflash, block 16, T=0", "hf, T=0", "prompt-lookup, T=0",
        "ar, T=1", "dflash, block 16, T=1", "hf-sample, T=1", "prompt-lookup, T=1",
    ]


def test_hf_generation_config_leaves_nothing_to_checkpoint_defaults():
    settings = RunSettings(max_new_tokens=5, stop_token_ids=[7], pad_token_id=7, seed=0)
    sampled = hf_generation_config(BenchConfig("prompt-lookup", 0.7), settings, 5)
    assert (sampled.do_sample, sampled.temperature, sampled.top_k, sampled.top_p) == (True, 0.7, 0, 1.0)
    assert sampled.prompt_lookup_num_tokens == PROMPT_LOOKUP_TOKENS and sampled.eos_token_id == [7]
    greedy = hf_generation_config(BenchConfig("hf", 0.0), settings, 5)
    assert greedy.do_sample is False and greedy.prompt_lookup_num_tokens is None


def test_prompts_jsonl_reader(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "ab"}\n{"input_ids": [1, 2, 3]}\n')
    assert read_prompts_jsonl(good, ByteTokenizer()) == [[97, 98], [1, 2, 3]]
    for text, match in (('{"input_ids": []}\n', "non-empty list of ints"), ('{"text": "x"}\n', "expected"),
                        ("{oops\n", "not valid JSON"), ("\n", "no prompts")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(ValueError, match=match):
            read_prompts_jsonl(bad, ByteTokenizer())


def test_bad_arguments_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as e:
        benchmark.main(["--methods", "ar,beam"])
    assert e.value.code == 2 and "unknown method" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        benchmark.main(["--budgets", "0"])
    assert e.value.code == 2


def test_compare_greedy_reports_first_difference_and_length():
    ref = Run("ar, T=0", 0, [1, 2, 3], 1.0, 0.1, 1, [1, 1])
    same = Run("dflash, T=0", 0, [1, 2, 3], 1.0, 0.1, 1, [2])
    shorter = Run("dflash, T=0", 0, [1, 2], 1.0, 0.1, 1, [1])
    assert compare_greedy(ref, same) is None
    failure = compare_greedy(ref, shorter)
    assert (failure.position, failure.expected, failure.got) == (2, 3, None)
    assert "end of output" in failure.describe()


PEAK_PROBE = """
import torch
from dflash.benchmark.runners import PeakMemory
probe = PeakMemory(torch.device("cpu"))
probe.start()
if probe._rss_base is None:
    print("n/a")
else:
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    del big
    print(probe.peak_mib())
"""


def test_peak_memory_on_cpu_sees_a_large_allocation():
    # in a fresh process: in this one, after other tests, the allocator may serve the 64 MiB from pages it
    # already holds, and the resident set would not grow at all
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", PEAK_PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    reading = out.stdout.split()[-1]
    if reading == "n/a":
        pytest.skip("no /proc/self/clear_refs here: peak RSS growth is reported as n/a")
    assert float(reading) > 48


# ------------------------------------------------- microbenchmark coverage
def public_ops():
    """Every name in the ``__all__`` of dflash_kernels' public op modules."""
    ops = []
    for info in pkgutil.iter_modules(dflash_kernels.__path__):
        if info.name.startswith("_") or info.name == "reference":
            continue
        module = importlib.import_module(f"dflash_kernels.{info.name}")
        ops += list(getattr(module, "__all__", []))
    return sorted(ops)


def bench_references():
    """Identifiers used in bench/bench_*.py: names, attributes and imported names."""
    names = set()
    for path in sorted((ROOT / "bench").glob("bench_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.ImportFrom):
                names.update(alias.name for alias in node.names)
    return names


# Public ops that no bench file measures yet; strict: once one gets a benchmark, its entry must go.
NOT_BENCHMARKED = {
    "lm_head_logits": "bench_lm_head.py times the argmax / top-K / sample / CE consumers, not the bare logits op",
    "walk_tree": "host-side C++ walk of a few hundred nodes: no bench file times it",
    "tree_positions": "one torch.cat + add: no bench file times it",
}


def test_public_op_list_is_what_the_package_exports():
    ops = public_ops()
    assert {"gather_concat", "lm_head_argmax", "tree_attention", "compact_kv_", "build_tree"} <= set(ops)
    assert all(callable(getattr(dflash_kernels, op)) for op in ops)
    assert set(NOT_BENCHMARKED) <= set(ops), "NOT_BENCHMARKED names an op that is not public"


@pytest.mark.parametrize("op", [
    pytest.param(op, marks=pytest.mark.xfail(strict=True, reason=NOT_BENCHMARKED[op] + " (once a bench file covers "
                                             "it, delete its NOT_BENCHMARKED entry)")) if op in NOT_BENCHMARKED
    else op for op in public_ops()])
def test_every_public_op_has_a_benchmark(op):
    """A bench file calls the op itself, or its Triton launcher ``<op>_triton`` against the reference."""
    names = bench_references()
    assert op in names or op.rstrip("_") + "_triton" in names, f"no bench/bench_*.py benchmarks {op}"
