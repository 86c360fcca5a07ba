"""Reading a figure's results: one row per run (axis values, seed, flattened metrics)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from testbed.records import read_records
from testbed.runner import is_complete
from testbed.sweep import FigureSpec, Point, expand


@dataclass
class FigureData:
    """Everything a plotting script and the claims need."""

    spec: FigureSpec
    backend: str
    scale: str
    runs: pd.DataFrame  # one row per complete run
    points: list[Point]
    missing: int  # runs of the sweep that are not (yet) complete
    physics: str = "hardware"

    def requests(self, where: dict | None = None) -> pd.DataFrame:
        """Request records of the matching complete runs, with axis values and seed."""
        frames = []
        for p in self.points:
            if not is_complete(p.out_dir) or not _matches(p.values, where or {}):
                continue
            _, rq = read_records(p.out_dir)
            for k, v in p.values.items():
                rq[k] = v
            rq["seed"] = p.seed
            frames.append(rq)
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _matches(values: dict, where: dict) -> bool:
    for k, v in where.items():
        if k not in values:
            continue
        if isinstance(v, float) or isinstance(values[k], float):
            if abs(float(values[k]) - float(v)) > 1e-9:
                return False
        elif values[k] != v:
            return False
    return True


def load_figure_data(spec: FigureSpec, backend: str, scale: str, results: Path,
                     physics: str = "hardware") -> FigureData:
    points = expand(spec, backend, scale, results, physics)  # type: ignore[arg-type]
    rows = []
    missing = 0
    for p in points:
        mfile = p.out_dir / "metrics.json"
        if not is_complete(p.out_dir) or not mfile.exists():
            missing += 1
            continue
        m = flatten(json.loads(mfile.read_text()))
        rows.append({**p.values, "seed": p.seed, "run_dir": str(p.out_dir), **m})
    return FigureData(spec, backend, scale, pd.DataFrame(rows), points, missing, physics)


def select(df: pd.DataFrame, where: dict) -> pd.DataFrame:
    mask = pd.Series(True, index=df.index)
    for k, v in where.items():
        if k not in df.columns:
            continue
        col = df[k]
        if isinstance(v, (int, float)) and not isinstance(v, bool) and pd.api.types.is_numeric_dtype(col):
            mask &= (col.astype(float) - float(v)).abs() < 1e-9
        else:
            mask &= col == v
    return df[mask]
