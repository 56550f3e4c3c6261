"""Every command of the README and of the assets' READMEs, run as a smoke version (few steps, tiny data).

Commands are read from the files themselves (fenced and indented code blocks, and inline code that
starts with ``python -m dflash`` or ``torchrun``), so a command edited or added there is run here. A
command runs with its own arguments plus :data:`SMOKE` overrides appended (argparse keeps the last
value; a default output directory is named there too), outputs redirected under a temporary directory (a path is renamed the same way everywhere, so
the data command's ``--out`` is the train command's ``--data``). Commands for a model that is not in
the repository (``path/to/...``) are parsed by their command's own parser instead. Commands that are not
the package's (installs, the test suite, the scripts under ``bench/``) are listed in :data:`NOT_RUN`
with the test that covers them.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

import dflash_kernels

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md"] + sorted((ROOT / "dflash" / "assets").rglob("README.md"))

# per entry point: arguments appended to make a smoke version
SMOKE = {
    "train": ["--steps", "2", "--batch-size", "2", "--blocks-per-seq", "2", "--eval-every", "1",
              "--eval-num-prompts", "1", "--eval-prompt-len", "32", "--eval-new-tokens", "8",
              "--final-eval-prompts", "1", "--final-eval-new-tokens", "8", "--ddtree-budgets", "4", "--quiet",
              "--no-tensorboard", "--threads", "1"],
    "dflash.training.data": ["--num", "6", "--prompt-len", "16", "--new-tokens", "32", "--batch-size", "6",
                             "--threads", "1"],
    "train-target": ["--steps", "2", "--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1",
                     "--head-dim", "16", "--intermediate", "64", "--seq-len", "32", "--batch", "2", "--eval-every", "0",
                     "--final-eval-windows", "2", "--loop-prompts", "1", "--loop-new-tokens", "128", "--quiet"],
    "demo": ["--max-new-tokens", "8"],
    "generate": ["--prompt", "def f(x):", "--max-new-tokens", "8"],
    "bench": ["--num-prompts", "1", "--max-new-tokens", "8", "--budgets", "4", "--temperatures", "0",
              "--block-sizes", "8", "--no-progress", "--warmup-tokens", "2", "--out", "runs/bench"],
}
SMOKE["dflash.tiny.pretrain"] = SMOKE["train-target"]
SMOKE["convert"] = []  # a conversion of the tiny drafter is already small
PATH_FLAGS = ("--out", "--state-dir", "--data")

NOT_RUN = {
    "python3 -m venv": "the installation (CI installs exactly this way)",
    "python -m pytest": "the test suite itself",
    "python bench/compare_revisions.py": "needs a second checkout; tests/tooling/test_benchmark_cli.py runs the benchmark",
    "python bench/reference_loops.py": "needs z-lab's package and the DDTree code in another venv; "
                                       "tests/tooling/test_reference_loops.py runs our side's dry run",
    "python bench/compile_speed.py": "torch.compile of every method; tests/generation/test_compiled_rounds.py compiles them",
    "bash bench/gpu_check.sh": "a GPU script; tests/tooling/test_gpu_check.py runs its CPU dry run",
    "python -m dflash generate --compile": "torch.compile of the rounds; tests/generation/test_compiled_rounds.py compiles them",
    "python bench/drafter_tau.py": "both shipped drafters on 16 prompts; tests/training/test_tiny_pair.py runs it at smoke size",
    "python bench/acceptance_rules.py": "four samplings of 8 prompts; tests/ops/test_rejection.py runs it at smoke size",
    "python bench/draft_window.py": "long prompts (2k to 8k tokens) with and without a drafter window; "
                                    "tests/generation/test_draft_window.py runs it at smoke size",
    "python bench/long_prompts.py": "2k to 32k-token prompts against transformers; tests/tooling/test_gpu_check.py runs its "
                                    "dry run (the GPU check's long step)",
    "python bench/auto_budget.py": "every fixed budget and auto on two prompt sets; tests/generation/test_auto_budget.py runs "
                                   "it at smoke size",
    "python bench/dropin_chat.py": "a 20-call chat, eager and compiled; tests/generation/test_dropin_setup.py runs it at "
                                   "smoke size",
    "python bench/train_world_parity.py": "three trainings of the tiny drafter; tests/training/test_train_distributed.py "
                                         "checks the same equality at test size",
    "python bench/tau_vs_prompt_length.py": "prompts up to 8k tokens; tests/training/test_train_long.py runs it at smoke size",
    "python bench/train_long_memory.py": "a fresh process per length up to 8k tokens; tests/training/test_train_long.py runs "
                                         "its step at smoke size",
    "python bench/sampled_acceptance.py": "both tiny drafters at six samplings, 20 seeds x 8 prompts; "
                                          "tests/generation/test_sampled_acceptance.py runs its --dry-run",
    "python bench/zlab_sampled_reference.py": "z-lab's package in its own environment (the fixture's script)",
}


def _code_spans(text: str):
    """Command lines of a Markdown text: code blocks (continuations joined) and inline code."""
    lines, block, fence = [], [], False
    for raw in text.splitlines():
        if raw.strip().startswith("```"):
            fence = not fence
            continue
        if fence or raw.startswith("    "):
            block.append(raw.strip())
        elif block:
            lines.extend(_join(block))
            block = []
    lines.extend(_join(block))
    lines += re.findall(r"`((?:python3? -m dflash|torchrun)[^`\n]*)`", text)
    return lines


def _join(block):
    out, cur = [], ""
    for line in block:
        if line.startswith("#") or not line:
            continue
        cur += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            out.append(cur.split("  #")[0].strip())
            cur = ""
    return out


def commands(doc: Path):
    """``(command, how)`` of a document (each once), ``how`` one of run / parse / not-run / placeholder."""
    out = []
    for line in _code_spans(doc.read_text()):
        for part in line.split("&&"):
            cmd = re.sub(r"^(\S*/)?\.venv/bin/", "", part.strip())
            cmd = re.sub(r"^(OUT|PYTHON|GPU_CHECK_DRY_RUN)=\S+ ", "", cmd)
            if not re.match(r"(python3? |torchrun |bash )", cmd):
                continue
            if any(cmd.startswith(k) for k in NOT_RUN):
                out.append((cmd, "not-run"))
            elif "..." in cmd or re.search(r"\bDIR\b|<", cmd):
                out.append((cmd, "placeholder"))  # syntax summaries such as `python -m dflash bench ...`
            elif "path/to/" in cmd or "HOST" in cmd:
                out.append((cmd, "parse"))
            elif "-m dflash" in cmd:
                out.append((cmd, "run"))
            else:
                out.append((cmd, "unknown"))
    return list(dict.fromkeys(out))


def _entry(argv):
    """``(entry point, arguments)`` of ``python -m MODULE ...`` or ``torchrun ... -m dflash train ...``."""
    i = argv.index("-m")
    module, rest = argv[i + 1], argv[i + 2:]
    if module == "dflash":
        return rest[0], rest[1:]
    return module, rest


def _main_of(entry):
    if entry == "dflash.training.data":
        from dflash.training.data import main
        return main
    if entry == "dflash.tiny.pretrain":
        from dflash.tiny.pretrain import main
        return main
    from dflash.cli import main as cli_main
    return lambda args: cli_main([entry] + list(args))


def _parser_of(entry):
    if entry == "dflash.training.data":
        from dflash.training.data import build_parser
    elif entry == "train":
        from dflash.training.train import build_parser
    else:
        raise AssertionError(f"no parser registered for {entry}")
    return build_parser()


def _redirect(args, tmp: Path, renamed: dict):
    """Output paths moved under ``tmp``: the values of :data:`PATH_FLAGS` and positional ``/tmp/`` paths
    (``convert IN OUT``)."""
    out = list(args)
    for k, a in enumerate(out[:-1]):
        if a in PATH_FLAGS:
            out[k + 1] = renamed.setdefault(out[k + 1], str(tmp / f"path{len(renamed)}"))
    for k, a in enumerate(out):
        if a.startswith("/tmp/") and (k == 0 or out[k - 1] not in PATH_FLAGS):
            out[k] = renamed.setdefault(a, str(tmp / f"path{len(renamed)}"))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_is_run_parsed_or_accounted_for(doc):
    found = commands(doc)
    unknown = [c for c, how in found if how == "unknown"]
    assert not unknown, f"commands in {doc.name} that no recipe test covers: {unknown}"
    for cmd, how in found:
        if how in ("run", "parse"):
            entry, _ = _entry(shlex.split(cmd))
            assert entry in SMOKE, f"{cmd!r}: no smoke version of {entry!r} (add it to SMOKE)"


def test_readme_runs_a_torchrun_training_and_the_data_tool():
    found = [c for c, how in commands(ROOT / "README.md") if how == "run"]
    assert any(c.startswith("torchrun ") for c in found)
    assert any("dflash.training.data" in c for c in found) and any(" train " in c for c in found)


def smoke_plan(doc: Path, tmp: Path):
    """The runnable commands of ``doc`` in order: ``(command, entry, smoke arguments, torchrun launcher or None)``.

    Parse-only commands come with ``None`` arguments. The torchrun ones are run by
    tests/training/test_train_distributed.py inside its one torchrun launch (a launch costs two interpreters'
    start-up), after the commands that write their inputs (:func:`inputs_of`).
    """
    renamed: dict = {}
    plan = []
    for cmd, how in commands(doc):
        if how not in ("run", "parse"):
            continue
        argv = shlex.split(cmd)
        entry, args = _entry(argv)
        args = _redirect(args + SMOKE[entry] if how == "run" else args, tmp, renamed)
        launcher = argv[1:argv.index("-m")] if argv[0] == "torchrun" else None
        plan.append((cmd, entry, args, launcher, how))
    return plan


def inputs_of(plan, step):
    """The earlier run commands whose ``--out`` is an argument of ``step``."""
    wanted = set(step[2])
    return [s for s in plan[:plan.index(step)]
            if s[4] == "run" and s[3] is None and any(a in PATH_FLAGS[:1] and s[2][k + 1] in wanted
                                                      for k, a in enumerate(s[2][:-1]))]


def run_step(step) -> None:
    import torch

    cmd, entry, args, launcher, how = step
    if how == "parse":
        _parser_of(entry).parse_args(args)
        return
    assert launcher is None, "torchrun commands run in tests/training/test_train_distributed.py"
    threads = torch.get_num_threads()
    with dflash_kernels.force_backend("reference"):
        rc = _main_of(entry)(args)
    torch.set_num_threads(threads)
    assert rc in (0, None), f"{cmd} exited {rc}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_recipes_run_as_smoke_versions(doc, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    for step in smoke_plan(doc, tmp_path):
        if step[3] is not None and step[4] == "run":
            assert step[3] == ["--nproc-per-node", "2"], f"{step[0]}: the CPU test runs 2 processes"
            continue
        run_step(step)


def _python_blocks(text: str):
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("doc", DOCS[1:], ids=lambda p: str(p.relative_to(ROOT)))
def test_asset_readme_python_snippets_run(doc, monkeypatch):
    """The assets' READMEs show offline loading code: it runs as written."""
    monkeypatch.chdir(ROOT)
    blocks = _python_blocks(doc.read_text())
    for code in blocks:
        namespace: dict = {}
        exec(compile(code, f"{doc.name} snippet", "exec"), namespace)  # noqa: S102 (our own documentation)
    if "from dflash.tiny import load_tiny_target" in doc.read_text():
        assert blocks
