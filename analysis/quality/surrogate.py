"""Surrogate check: does a request's accumulated Lambda (eq. 8) track its measured degradation?

Inputs are per-request tables with ``lam_mean`` (Lambda per token, averaged
over the request's tokens) and ``degradation`` (measured: mean KL from the
full-precision output over the request's tokens, divided by the proxy's CE_ref,
the same unit as Lambda):

- a run folder replayed by ``python -m testbed quality-replay RUN`` (reads its
  ``quality_replay.csv``; only requests after warm-up);
- a profile folder of ``python -m workloads.proxy profile`` (reads its
  ``surrogate.csv``, the random-plan check).

``python -m analysis.quality.surrogate RUN_OR_PROFILE... --out surrogate.png``
prints Spearman's rho and its p-value per input and over all, and writes a
scatter plot (log-log; requests with Lambda = 0 are counted in the title but
cannot be drawn on a log axis).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402


def load(path: Path) -> pd.DataFrame:
    """Per-request rows of a replayed run or a profile folder, labelled by source."""
    path = Path(path)
    if (path / "quality_replay.csv").exists():
        df = pd.read_csv(path / "quality_replay.csv")
        df = df[df.measured] if "measured" in df else df
        label = f"{path.parent.name}/{path.name}"
        return df.assign(source=label, group=label)
    if (path / "surrogate.csv").exists():
        df = pd.read_csv(path / "surrogate.csv")
        return df.assign(source=path.name, group=path.name + ":" + df.family)
    raise FileNotFoundError(f"{path}: neither quality_replay.csv (python -m testbed quality-replay) "
                            "nor surrogate.csv (a profile folder)")


def spearman(df: pd.DataFrame) -> tuple[float, float]:
    x, y = df.lam_mean.to_numpy(), df.degradation.to_numpy()
    if len(df) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return math.nan, math.nan
    r = spearmanr(x, y)
    return float(r.statistic), float(r.pvalue)


def _p(p: float) -> str:
    """A p-value for a title; below double precision it prints as a bound, not as 0."""
    return "p<1e-300" if p == 0 else f"p={p:.2g}"


def plot(df: pd.DataFrame, out: Path, title: str = "Lambda vs measured degradation") -> dict:
    """Scatter of measured degradation against lam_mean, one colour per group; returns the stats."""
    stats = {g: dict(zip(("rho", "p"), spearman(part)), n=len(part)) for g, part in df.groupby("group")}
    rho, p = spearman(df)
    stats["all"] = {"rho": rho, "p": p, "n": len(df)}
    nonzero = df[df.lam_mean > 0]  # exact-only requests tie at (0, 0) and inflate rho
    stats["all, Lambda > 0"] = dict(zip(("rho", "p"), spearman(nonzero)), n=len(nonzero))
    sns.set_theme(style="whitegrid", context="paper")
    fig, ax = plt.subplots(figsize=(5.2, 4.2))
    pos = df[(df.lam_mean > 0) & (df.degradation > 0)]
    labels = {g: f"{g} (rho={s['rho']:.2f}, n={s['n']})" for g, s in stats.items()
              if not g.startswith("all")}
    sns.scatterplot(data=pos.assign(label=pos.group.map(labels)), x="lam_mean", y="degradation",
                    hue="label", s=14, alpha=0.7, ax=ax, edgecolor="none")
    if len(pos):
        lo = min(pos.lam_mean.min(), pos.degradation.min())
        hi = max(pos.lam_mean.max(), pos.degradation.max())
        ax.plot([lo, hi], [lo, hi], ":", color="grey", label="measured = Lambda")
        ax.set(xscale="log", yscale="log")
    ax.set(xlabel="Lambda per token, request mean (surrogate, eq. 8)",
           ylabel="measured KL / CE_ref per token, request mean")
    ax.set_title(f"{title}\nSpearman rho={rho:.3f} ({_p(p)}), n={len(df)}, "
                 f"{len(df) - len(pos)} at zero not drawn", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.quality.surrogate",
                                     description="Spearman of Lambda vs measured degradation, with a plot.")
    parser.add_argument("inputs", nargs="+", type=Path, help="replayed run folders or profile folders")
    parser.add_argument("--out", type=Path, default=Path("figures/quality_surrogate.png"))
    parser.add_argument("--title", default="Lambda vs measured degradation")
    args = parser.parse_args(argv)
    try:
        df = pd.concat([load(p) for p in args.inputs], ignore_index=True)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    stats = plot(df, args.out, args.title)
    for g, s in stats.items():
        print(f"{g:40s} n={s['n']:5d}  Spearman rho={s['rho']:.3f}  {_p(s['p'])}")
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
