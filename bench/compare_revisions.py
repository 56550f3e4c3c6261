"""Before/after: ``python -m dflash bench`` of two checkouts of this repository, interleaved in one run.

    python bench/compare_revisions.py --before /path/to/old/checkout [--after .] [--repeats 3] \
        [-- <python -m dflash bench arguments>]

Each checkout must have its C++ extension built in place (``python setup.py build_ext --inplace``
there). The script alternates ``before, after, before, after, ...`` (each a fresh process with
that checkout first on ``PYTHONPATH``, so machine noise hits both alike), reads each run's
``results.json`` and prints, per configuration, the median tokens/s of each side and the ratio
after / before, plus each side's speedup over its own ``ar`` baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run_bench(checkout: str, bench_args, out_dir: str) -> list:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "dflash", "bench", "--no-progress", "--out", out_dir, *bench_args]
    subprocess.run(cmd, env=env, check=True, cwd=os.path.abspath(checkout), stdout=subprocess.DEVNULL)
    with open(os.path.join(out_dir, "results.json")) as f:
        return json.load(f)


def rows_of(results) -> dict:
    """{config label: tokens/s} from a results.json (summary rows)."""
    out = {}
    rows = results["rows"]
    for r in rows:
        label = " ".join(str(r.get(k, "-")) for k in ("method", "budget", "block_size", "temperature"))
        out[label] = float(r["tokens_per_second"])
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = []
    if "--" in argv:
        bench_args = argv[argv.index("--") + 1:]
        argv = argv[: argv.index("--")]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True)
    p.add_argument("--after", default=".")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    runs = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for side in ("before", "after"):
                out = os.path.join(tmp, f"{side}{i}")
                runs[side].append(rows_of(run_bench(getattr(args, side), bench_args, out)))
                print(f"[{i + 1}/{args.repeats}] {side} done", file=sys.stderr)
    labels = [k for k in runs["after"][0] if k in runs["before"][0]]
    med = {side: {k: statistics.median(r[k] for r in runs[side]) for k in labels} for side in runs}
    ar = {side: next((v for k, v in med[side].items() if k.startswith("ar ")), float("nan")) for side in runs}
    print(f"{'config (method budget block T)':<34}{'before tok/s':>14}{'after tok/s':>13}{'after/before':>14}"
          f"{'before vs ar':>14}{'after vs ar':>13}")
    for k in labels:
        b, a = med["before"][k], med["after"][k]
        print(f"{k:<34}{b:>14.1f}{a:>13.1f}{a / b:>13.2f}x{b / ar['before']:>13.2f}x{a / ar['after']:>12.2f}x")
    print(f"(medians of {args.repeats} interleaved runs per side)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
