"""PNG plots of the end-to-end benchmark (matplotlib, Agg backend: no display needed).

Inputs are the summary rows of :mod:`dflash.benchmark.summary` (one per
configuration: ``method``, ``budget``, ``block_size``, ``temperature``,
``tau``, ``speedup``, ``acceptance_histogram`` = {committed tokens per round: count},
``position_acceptance`` = [a_1, ..., a_{B-1}], a_k the share of rounds whose accepted drafts reached k).

* ``acceptance_hist.png``: per drafting configuration (method, budget, block),
  the share of rounds that committed 1, 2, ... tokens, one bar colour per
  temperature, tau marked by a dashed line;
* ``budget_curves.png``: DDTree's tau and speedup over ``ar`` against the
  tree budget (log2 axis), one line per (temperature, block size), DFlash's
  chain at the same setting as a dotted horizontal line;
* ``position_acceptance.png``: a_k against the draft position k, one curve
  per drafting configuration (method, budget, block, temperature).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Methods whose rounds can commit more than one token (the others are all 1s).
DRAFTING_METHODS = ("dflash", "ddtree", "prompt-lookup")


def _group_key(row: dict) -> Tuple:
    return (DRAFTING_METHODS.index(row["method"]), row["block_size"] or 0, row["budget"] or 0)


def _group_title(row: dict) -> str:
    parts = [row["method"]]
    if row["budget"] is not None:
        parts.append(f"budget {row['budget']}")
    if row["block_size"] is not None:
        parts.append(f"block {row['block_size']}")
    return ", ".join(parts)


def acceptance_histograms(rows: Sequence[dict], path: Path):
    """Share of rounds per committed length; returns the path, or None when no drafting method ran."""
    drafting = [r for r in rows if r["method"] in DRAFTING_METHODS and r["acceptance_histogram"]]
    if not drafting:
        return None
    groups: Dict[Tuple, List[dict]] = {}
    for r in sorted(drafting, key=_group_key):
        groups.setdefault(_group_key(r), []).append(r)
    temps = sorted({r["temperature"] for r in drafting})
    colors = {t: plt.cm.tab10(i % 10) for i, t in enumerate(temps)}
    longest = max(int(k) for r in drafting for k in r["acceptance_histogram"])
    ncols = min(3, len(groups))
    nrows = math.ceil(len(groups) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.4 * nrows), squeeze=False, sharex=True)
    width = 0.8 / len(temps)
    for ax, members in zip(axes.flat, groups.values()):
        for r in members:
            t = r["temperature"]
            hist = {int(k): v for k, v in r["acceptance_histogram"].items()}
            rounds = sum(hist.values())
            xs = [x + (temps.index(t) - (len(temps) - 1) / 2) * width for x in range(1, longest + 1)]
            ax.bar(xs, [hist.get(x, 0) / rounds for x in range(1, longest + 1)], width=width, color=colors[t],
                   label=f"T={t:g} (tau {r['tau']:.2f}, {rounds} rounds)")
            ax.axvline(r["tau"], color=colors[t], linestyle="--", linewidth=1)
        ax.set_title(_group_title(members[0]), fontsize=10)
        ax.set_xlabel("tokens committed per round")
        ax.set_ylabel("share of rounds")
        ax.set_xticks(range(1, longest + 1))
        ax.tick_params(labelbottom=True)  # every panel keeps its numbers (shared x hides them otherwise)
        ax.set_ylim(0, 1.05)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(groups):]:
        ax.set_visible(False)
    fig.suptitle("Acceptance length per round (dashed: tau, the mean)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def budget_curves(rows: Sequence[dict], path: Path):
    """tau and speedup of DDTree against the tree budget; returns the path, or None without DDTree rows."""
    tree = [r for r in rows if r["method"] == "ddtree" and r["tau"] is not None]
    if not tree:
        return None
    lines: Dict[Tuple, List[dict]] = {}
    for r in sorted(tree, key=lambda r: (r["temperature"], r["block_size"] or 0, r["budget"])):
        lines.setdefault((r["temperature"], r["block_size"]), []).append(r)
    chains = {(r["temperature"], r["block_size"]): r for r in rows if r["method"] == "dflash"}
    budgets = sorted({r["budget"] for r in tree})
    several_blocks = len({block for _, block in lines}) > 1
    fig, (ax_tau, ax_speed) = plt.subplots(1, 2, figsize=(11, 4))
    for i, ((t, block), members) in enumerate(lines.items()):
        color = plt.cm.tab10(i % 10)
        name = f"T={t:g}" + (f", block {block}" if several_blocks else "")
        xs = [r["budget"] for r in members]
        ax_tau.plot(xs, [r["tau"] for r in members], "o-", color=color, label=f"ddtree {name}")
        if any(r["speedup"] is not None for r in members):
            ax_speed.plot(xs, [r["speedup"] if r["speedup"] is not None else float("nan") for r in members], "o-",
                          color=color, label=f"ddtree {name}")
        chain = chains.get((t, block))
        if chain is not None:
            ax_tau.axhline(chain["tau"], color=color, linestyle=":", label=f"dflash chain {name}")
            if chain["speedup"] is not None:
                ax_speed.axhline(chain["speedup"], color=color, linestyle=":", label=f"dflash chain {name}")
    ax_speed.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="ar (1x)")
    for ax, ylabel, title in ((ax_tau, "tau (tokens committed per round)", "Acceptance vs tree budget"),
                              (ax_speed, "speedup over ar (tokens/s ratio)", "Speedup vs tree budget")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets)
        ax.set_xticklabels([str(b) for b in budgets])
        ax.minorticks_off()
        ax.set_xlabel("tree budget (draft nodes per round)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=11)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_tau.set_ylim(bottom=0)
    ax_speed.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def position_acceptance_curves(rows: Sequence[dict], path: Path):
    """Share of rounds reaching each draft position, one curve per row; returns the path, or None when no
    row drafted."""
    drafting = [r for r in rows if r.get("position_acceptance")]
    if not drafting:
        return None
    longest = max(len(r["position_acceptance"]) for r in drafting)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, r in enumerate(drafting):
        shares = r["position_acceptance"]
        ax.plot(range(1, len(shares) + 1), shares, "o-", color=plt.cm.tab10(i % 10),
                linestyle="-" if i < 10 else "--", markersize=4, label=r["label"])
    ax.set_xlabel("draft position k")
    ax.set_ylabel("share of rounds accepting >= k drafts")
    ax.set_xticks(range(1, longest + 1))
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Acceptance per draft position (all rounds of all prompts)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save_plots(rows: Sequence[dict], out_dir) -> List[Path]:
    """Write the plots that apply to ``rows`` into ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    made = [acceptance_histograms(rows, out_dir / "acceptance_hist.png"),
            budget_curves(rows, out_dir / "budget_curves.png"),
            position_acceptance_curves(rows, out_dir / "position_acceptance.png")]
    return [p for p in made if p is not None]
