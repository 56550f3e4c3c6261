"""Our DFlash / DDTree loops against the reference loops, side by side on the tiny pair (CPU, one thread).

Implementations, each generating the same held-out prompts (``heldout_prompts(n, prompt_len, seed=0)``):

* ``z-lab dflash_generate``: z-lab's ``dflash==0.1.0`` DFlash loop;
* ``reference ddtree_generate``: the DDTree loop of Liran Ringel's DDTree code (``ddtree.py``), tree budget
  ``--tree-budget`` (draft nodes per round, the root apart, as ours);
* ours: ``dflash.generate(method="dflash")`` and ``generate(method="ddtree", tree_budget=...)``, eager and
  ``compile=True`` (compiled once before the clock: the compiled rounds are pooled, later calls reuse them).

The references run in worker processes under their own environment (bench/reference_worker.py: z-lab's package
and this one both import as ``dflash``), kept alive for the whole run and fed over a line protocol, so the
implementations take turns: in each of ``--repeats`` rounds every implementation generates all prompts once,
prompt by prompt (prompt i by every implementation, the order rotating, then prompt i + 1: a burst of other
load on a shared machine then slows all of them, not one). Each implementation first generates one prompt
untimed (warm-up; compilation for ours compiled). Reported per implementation:

* tokens/s: new tokens / the smallest total over the rounds of the per-call wall times (``perf_counter``
  around each call: prefill, rounds, output), and ours / the reference of the same method; beside it the
  median over the rounds of that ratio taken within each round (steadier where other processes share the
  cores: both sides of a round ran in the same minutes);
* tau: mean tokens per round as each loop reports them (accepted drafts + 1; ours before the last round's length
  cut, z-lab's last block shortened to the tokens left, the DDTree code's uncut);
* ops/round: device ops per round by ``dflash.benchmark.launches.LaunchCounter`` (eager only, inside
  ``torch.inference_mode()``, the same rules on both sides), from one extra pass:
  (ops of a call with ``--max-new-tokens``) - (ops of the same call with 1 new token), over the rounds
  between them; the per-op breakdown of a round, ours next to the reference's, follows the table. On a CPU our
  ops run their reference backend (plain torch: a tree's visibility or ancestor bits are a dozen ops where a GPU
  launches one Triton kernel);
* greedy: every implementation's tokens against ours eager DFlash, token for token (a mismatch is printed
  loudly and makes the exit status 1); at ``--temperature > 0`` nothing is compared.

Set up the reference environment once::

    python3 -m venv /tmp/venv-zlab
    /tmp/venv-zlab/bin/pip install torch==2.13.0 'dflash[local]==0.1.0' loguru numpy datasets
    git clone https://github.com/liranringel/ddtree /tmp/ddtree_src

then, from the repository root (our venv)::

    OMP_NUM_THREADS=1 python bench/reference_loops.py --zlab-python /tmp/venv-zlab/bin/python \\
        --ddtree-src /tmp/ddtree_src --json runs/reference_loops.json

On a GPU (``--device cuda``) everything runs there, each timed call bracketed by a synchronize; a machine
without network gets z-lab's package as files: copy its installed ``dflash/`` folder (``site-packages/dflash``
of the environment above) into a directory and pass that directory as ``--zlab-src`` (the workers then run under
this interpreter, with stand-ins for the DDTree code's unused ``loguru`` / ``datasets`` imports where missing)::

    python bench/reference_loops.py --device cuda --zlab-src runs/refsrc/zlab --ddtree-src runs/refsrc/ddtree

(``bench/gpu_check.sh``'s ``refloops`` step runs exactly that when the two directories are there.)

Without ``--zlab-python`` / ``--zlab-src`` (or when its worker cannot start) only our side runs, and the output
says so.
``--dry-run``: one prompt of 32 tokens, 8 new tokens, one round, eager only (seconds).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "reference_worker.py"
LAUNCHES = ROOT / "dflash" / "benchmark" / "launches.py"
TARGET_DIR = ROOT / "dflash" / "assets" / "tiny" / "target"
DRAFT_DIR = ROOT / "dflash" / "assets" / "tiny" / "drafter"
METHOD_NAMES = {"dflash": "DFlash", "ddtree": "DDTree"}
REF_NAMES = {"dflash": "z-lab dflash_generate", "ddtree": "reference ddtree_generate"}


@dataclass
class Impl:
    """One implementation's results: per repeat the wall seconds of all prompts, tokens, rounds, ops."""

    name: str
    method: str
    kind: str  # "reference", "eager", "compiled"
    seconds: list = field(default_factory=list)
    prompt_seconds: list = field(default_factory=list)  # per repeat, per prompt
    new_tokens: list = field(default_factory=list)  # per prompt, from the last timed repeat
    rounds: list = field(default_factory=list)  # per prompt: tokens per round
    ops_per_round: float | None = None
    by_op_per_round: dict | None = None
    greedy_equal: bool | None = None
    mismatches: list = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self.new_tokens)

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.best

    @property
    def tau(self) -> float:
        flat = [n for r in self.rounds for n in r]
        return sum(flat) / max(len(flat), 1)


class Worker:
    """A reference worker process (bench/reference_worker.py) and its line protocol."""

    def __init__(self, impl: str, python: str, extra: list, workdir: Path, threads: int):
        self.impl = impl
        self.log = workdir / f"{impl}.stderr"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["OMP_NUM_THREADS"] = str(threads)
        with self.log.open("w") as err:
            self.proc = subprocess.Popen([python, str(WORKER), impl, *extra], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True, cwd=workdir, env=env)

    def ask(self, **msg) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.impl} worker exited ({self.proc.wait()}); its stderr ends:\n"
                               + self.log.read_text()[-3000:])
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the {self.impl} worker failed:\n{reply['error']}")
        return reply

    def close(self):
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(Exception):
                pipe.close()


class Ours:
    """Our ``generate`` on the tiny pair, the same call shape as the worker's."""

    def __init__(self, method: str, compile: bool, tree_budget: int, device: torch.device):
        from dflash.tiny.pair import load_default_pair

        self.target, self.draft, _ = load_default_pair(device=device)
        self.method, self.compile, self.tree_budget, self.device = method, compile, tree_budget, device

    def call(self, ids, max_new_tokens, temperature, seed):
        import dflash

        kw = dict(method=self.method, max_new_tokens=max_new_tokens, seed=seed, compile=self.compile)
        if temperature > 0:  # plain temperature sampling as the references do (top_k=0: no global top_k=50)
            kw.update(do_sample=True, temperature=temperature, top_k=0)
        if self.method == "ddtree":
            kw["tree_budget"] = self.tree_budget
        return dflash.generate(self.target, self.draft, torch.tensor(ids, dtype=torch.long), **kw)

    def generate(self, prompts, max_new_tokens, temperature, seed, count=False):
        from dflash.benchmark.launches import LaunchCounter

        reply = {"seconds": [], "new_tokens": [], "rounds": [], "ops": [], "by_op": []}
        for i, ids in enumerate(prompts):
            if count:
                counter = LaunchCounter()
                with torch.inference_mode(), counter:
                    r = self.call(ids, max_new_tokens, temperature, seed + i)
                reply["ops"].append(counter.total)
                reply["by_op"].append(dict(counter.by_op))
            else:
                synchronize(self.device)
                t0 = time.perf_counter()
                r = self.call(ids, max_new_tokens, temperature, seed + i)
                synchronize(self.device)
                reply["seconds"].append(time.perf_counter() - t0 - r.compile_time)  # a recompile is not timed
            reply["new_tokens"].append(r.output_ids[0, len(ids):].tolist())
            reply["rounds"].append([d + 1 for d in r.accepted_depths])
        return reply


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def convert_drafter(out: Path, num_target_layers: int) -> Path:
    """Our tiny drafter in z-lab's format (what z-lab's and the DDTree code's ``from_pretrained`` load)."""
    from dflash.drafter.convert import main as convert

    with contextlib.redirect_stdout(io.StringIO()):
        rc = convert([str(DRAFT_DIR), str(out), "--format", "zlab", "--num-target-layers", str(num_target_layers)])
    if rc:
        raise RuntimeError(f"converting {DRAFT_DIR} to z-lab's format failed ({rc})")
    return out


def per_round(full: dict, one: dict) -> tuple[float, dict]:
    """Ops per round from a counted pass at the full length and one at 1 new token (every prompt)."""
    rounds = sum(len(r) for r in full["rounds"]) - sum(len(r) for r in one["rounds"])
    ops = sum(full["ops"]) - sum(one["ops"])
    by_op = collections.Counter()
    for b in full["by_op"]:
        by_op.update(b)
    for b in one["by_op"]:
        by_op.subtract(b)
    return ops / max(rounds, 1), {k: v / max(rounds, 1) for k, v in by_op.items() if v}


def first_difference(a: list, b: list):
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--zlab-python", default=None, help="python of an environment with z-lab's dflash==0.1.0")
    p.add_argument("--ddtree-src", default=None, help="a checkout of the DDTree code (ddtree.py, dflash.py, model/)")
    p.add_argument("--zlab-src", default=None, help="a directory holding z-lab's dflash/ package folder, run by "
                                                     "--zlab-python (default: this interpreter)")
    p.add_argument("--ddtree-python", default=None,
                   help="python for the DDTree worker (default: --zlab-python, else this interpreter)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (every implementation runs there)")
    p.add_argument("--methods", nargs="+", default=["dflash", "ddtree"], choices=["dflash", "ddtree"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=4, help="rounds; the minimum total time of each is reported")
    p.add_argument("--tree-budget", type=int, default=7)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="prompt i draws with seed + i (T > 0)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-compiled", action="store_true", help="leave out ours with compile=True")
    p.add_argument("--no-ops", action="store_true", help="skip the counted pass (ops per round)")
    p.add_argument("--require-references", action="store_true",
                   help="exit 2 when a reference of --methods was not run (a missing source or environment)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--dry-run", action="store_true", help="1 prompt of 32 tokens, 8 new tokens, 1 round, eager")
    args = p.parse_args(argv)
    if args.dry_run:
        args.prompts, args.prompt_len, args.max_new_tokens, args.repeats, args.no_compiled = 1, 32, 8, 1, True
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available here")
    if device.type not in ("cpu", "cuda"):
        p.error(f"--device {args.device}: cpu or cuda[:N]")
    zlab_python = args.zlab_python or (sys.executable if args.zlab_src else None)
    zlab_extra = ["--zlab-src", str(Path(args.zlab_src).resolve())] if args.zlab_src else []

    from dflash.tiny.corpus import heldout_prompts

    prompts = heldout_prompts(args.prompts, args.prompt_len, seed=0)
    settings = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    notes = []
    impls: dict[str, Impl] = {}
    runners = {}
    workers = []
    with tempfile.TemporaryDirectory(prefix="reference_loops_") as tmp:
        tmp = Path(tmp)
        # ---- the references
        refs = {}
        if zlab_python is None:
            notes.append("no --zlab-python / --zlab-src: the references were not run (ours only)")
        else:
            from transformers import AutoConfig

            layers = AutoConfig.from_pretrained(TARGET_DIR).num_hidden_layers
            drafter = convert_drafter(tmp / "drafter_zlab", layers)
            wanted = []
            if "dflash" in args.methods:
                wanted.append(("dflash", "zlab", zlab_python, zlab_extra))
            if "ddtree" in args.methods:
                if args.ddtree_src and (Path(args.ddtree_src) / "ddtree.py").is_file():
                    wanted.append(("ddtree", "ddtree", args.ddtree_python or args.zlab_python or sys.executable,
                                   ["--ddtree-src", str(Path(args.ddtree_src).resolve())]))
                else:
                    notes.append(f"no DDTree code at --ddtree-src {args.ddtree_src!r}: the DDTree reference was "
                                 "not run")
            for method, impl, python, extra in wanted:
                worker = None
                try:
                    worker = Worker(impl, python, extra, tmp, args.threads)
                    workers.append(worker)
                    info = worker.ask(cmd="setup", target=str(TARGET_DIR), drafter=str(drafter),
                                      threads=args.threads, launches=str(LAUNCHES), device=str(device))
                except (RuntimeError, OSError) as e:
                    notes.append(f"the {impl} worker could not start, its reference was not run: {e}")
                    if worker is not None:
                        worker.close()
                    continue
                refs[method] = (worker, info)
        try:
            for method in args.methods:
                if method in refs:
                    worker, info = refs[method]
                    name = REF_NAMES[method]
                    impls[name] = Impl(name, method, "reference")
                    runners[name] = (lambda w, m: lambda ps, count=False, **kw: w.ask(
                        cmd="count" if count else "generate", prompts=ps, tree_budget=args.tree_budget, **kw)
                    )(worker, method)
                for compiled in (False, True) if not args.no_compiled else (False,):
                    name = f"ours {method}, {'compiled' if compiled else 'eager'}"
                    impls[name] = Impl(name, method, "compiled" if compiled else "eager")
                    runners[name] = Ours(method, compiled, args.tree_budget, device).generate

            # ---- warm-up (ours compiled: compiles and pools its rounds), then the timed rounds, taking turns
            names = list(impls)
            compile_s = {}
            for name in names:
                t0 = time.perf_counter()
                runners[name](prompts[:1], **settings)
                compile_s[name] = time.perf_counter() - t0
            for rep in range(args.repeats):
                for impl in impls.values():
                    impl.prompt_seconds.append([])
                    impl.new_tokens, impl.rounds = [], []
                for i, prompt in enumerate(prompts):  # turns per prompt: a burst of other load hits every one
                    k = (rep + i) % len(names)
                    for name in names[k:] + names[:k]:
                        reply = runners[name]([prompt], **dict(settings, seed=args.seed + i))
                        impl = impls[name]
                        impl.prompt_seconds[-1] += reply["seconds"]
                        impl.new_tokens += reply["new_tokens"]
                        impl.rounds += reply["rounds"]
                for impl in impls.values():
                    impl.seconds.append(sum(impl.prompt_seconds[-1]))

            # ---- the counted pass (eager implementations)
            if not args.no_ops:
                for name, impl in impls.items():
                    if impl.kind == "compiled":
                        continue
                    full = runners[name](prompts, count=True, **settings)
                    one = runners[name](prompts, count=True, **dict(settings, max_new_tokens=1))
                    impl.ops_per_round, impl.by_op_per_round = per_round(full, one)
        finally:
            for worker in workers:
                worker.close()

    # ---- greedy equality against ours eager DFlash (else the first eager of ours)
    base = impls.get("ours dflash, eager") or next(i for i in impls.values() if i.kind == "eager")
    mismatch = False
    if args.temperature == 0:
        for impl in impls.values():
            impl.mismatches = [(i, first_difference(a, b)) for i, (a, b) in
                               enumerate(zip(impl.new_tokens, base.new_tokens)) if a != b]
            impl.greedy_equal = not impl.mismatches
            mismatch |= bool(impl.mismatches)

    report = render(impls, args, notes, base, compile_s, device)
    print(report)
    if mismatch:
        print("\n!!! GREEDY MISMATCH: " + "; ".join(
            f"{i.name}: prompt {k} differs from {base.name} at new token {pos}" for i in impls.values()
            for k, pos in i.mismatches))
    missing = [REF_NAMES[m] for m in args.methods if REF_NAMES[m] not in impls]
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(to_json(impls, args, notes, argv, compile_s, device), indent=1) + "\n")
    if missing and args.require_references:
        print(f"\n!!! --require-references: not run: {', '.join(missing)} (see the notes above)")
        return 2
    return 1 if mismatch else 0


def backend(device: torch.device) -> str:
    import dflash_kernels

    name = dflash_kernels.get_backend(device)
    interpreted = name == "triton" and device.type == "cpu"
    return name + (" (the Triton interpreter: not a speed path)" if interpreted else "")


def round_ratios(impls: dict, impl: Impl) -> list | None:
    """Ours / reference tokens/s within each round (the same minutes of machine load), or None."""
    ref = impls.get(REF_NAMES[impl.method])
    if ref is None:
        return None
    return [(impl.tokens / s) / (ref.tokens / r) for s, r in zip(impl.seconds, ref.seconds)]


def ratio_to_ref(impls: dict, impl: Impl) -> str:
    ref = impls.get(REF_NAMES[impl.method])
    if ref is None:
        return "-", "-"
    if impl is ref:
        return "1.00x", "1.00x"
    return f"{impl.tokens_per_s / ref.tokens_per_s:.2f}x", f"{statistics.median(round_ratios(impls, impl)):.2f}x"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} thread(s)"


def render(impls, args, notes, base, compile_s, device) -> str:
    lines = [f"{args.prompts} held-out prompts x {args.prompt_len} tokens, {args.max_new_tokens} new tokens, "
             f"T={args.temperature}, tree budget {args.tree_budget}, {args.repeats} rounds (min), "
             f"{device_name(device)}, torch {torch.__version__}, our kernels' backend {backend(device)}"]
    lines += [f"NOTE: {n}" for n in notes]
    lines += ["", "| method | implementation | tokens/s | ours / reference | per-round ratio, median | tau | ops/round "
              f"| greedy = {base.name} |", "|---|---|---|---|---|---|---|---|"]
    for impl in impls.values():
        ops = f"{impl.ops_per_round:.0f}" if impl.ops_per_round is not None else "-"
        eq = "-" if impl.greedy_equal is None else ("yes" if impl.greedy_equal else "**NO**")
        ratio, median = ratio_to_ref(impls, impl)
        method = METHOD_NAMES[impl.method] + (f" (budget {args.tree_budget})" if impl.method == "ddtree" else "")
        lines.append(f"| {method} | {impl.name} | {impl.tokens_per_s:.1f} | {ratio} | {median} | {impl.tau:.2f} | {ops} | {eq} |")
    compiled = {n: s for n, s in compile_s.items() if impls[n].kind == "compiled"}
    if compiled:
        lines.append("")
        lines.append("first (compiling) call, not timed: " + ", ".join(f"{n} {s:.1f} s" for n, s in compiled.items()))
    for method in args.methods:
        ref, ours = impls.get(REF_NAMES[method]), impls.get(f"ours {method}, eager")
        if ref is None or ours is None or ref.by_op_per_round is None or ours.by_op_per_round is None:
            continue
        lines += ["", f"{METHOD_NAMES[method]}: ops per round by aten op, {ref.name} vs {ours.name}", "",
                  "| op | reference | ours | ours - reference |", "|---|---|---|---|"]
        ops = sorted(set(ref.by_op_per_round) | set(ours.by_op_per_round),
                     key=lambda o: (-max(ref.by_op_per_round.get(o, 0), ours.by_op_per_round.get(o, 0)), o))
        for o in ops:
            a, b = ref.by_op_per_round.get(o, 0.0), ours.by_op_per_round.get(o, 0.0)
            lines.append(f"| {o} | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
        lines.append(f"| **total** | {ref.ops_per_round:.1f} | {ours.ops_per_round:.1f} | "
                     f"{ours.ops_per_round - ref.ops_per_round:+.1f} |")
    return "\n".join(lines)


def to_json(impls, args, notes, argv, compile_s, device) -> dict:
    rows = []
    for impl in impls.values():
        rows.append(dict(name=impl.name, method=impl.method, kind=impl.kind, tokens=impl.tokens,
                         seconds=impl.seconds, best_seconds=impl.best, tokens_per_s=impl.tokens_per_s,
                         # less sensitive to another process's bursts than the best total (not the headline)
                         sum_of_prompt_minima_s=sum(map(min, zip(*impl.prompt_seconds))),
                         ratio_to_reference=(impl.tokens_per_s / impls[REF_NAMES[impl.method]].tokens_per_s
                                             if REF_NAMES[impl.method] in impls else None),
                         round_ratios=round_ratios(impls, impl),
                         tau=impl.tau, ops_per_round=impl.ops_per_round, by_op_per_round=impl.by_op_per_round,
                         greedy_equal=impl.greedy_equal, mismatches=impl.mismatches,
                         first_call_s=compile_s.get(impl.name)))
    command = "python bench/reference_loops.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    return dict(command=command, settings=vars(args), torch=torch.__version__, device=device_name(device),
                backend=backend(device), notes=notes, rows=rows)


if __name__ == "__main__":
    sys.exit(main())
