"""Records every backend writes: one row per token-layer and one per request.

Rows are appended column-wise (plain lists; the per-row loop runs in C, see
``RecordWriter.token_layer``) and
flushed to numbered Parquet parts, so a killed run keeps what it had flushed.
Per-target fields of a token-layer (target, executed expert, replica, server,
precision, tier, execution type) are stored as fixed-size list columns of
length k.
"""

from __future__ import annotations

from collections import deque
from operator import call
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from hetroute.state import TokenLayerRecord


TOKEN_LAYER_SCALARS = (
    ("request", pa.int64()), ("token", pa.int32()), ("layer", pa.int16()),
    ("t_start", pa.float64()), ("server", pa.int16()), ("next_server", pa.int16()),
    ("participants", pa.int8()), ("fanout_s", pa.float64()), ("compute_s", pa.float64()),
    ("fanin_s", pa.float64()), ("total_s", pa.float64()), ("bytes", pa.int64()),
    ("dq", pa.float64()), ("est_delay_s", pa.float64()), ("view_age_s", pa.float64()),
    ("backlog_err_s", pa.float64()), ("dense_s", pa.float64()), ("decision_s", pa.float64()),
)
TOKEN_LAYER_LISTS = (
    ("target", pa.int32()), ("exec_expert", pa.int32()), ("replica", pa.int32()),
    ("exec_server", pa.int16()), ("precision", pa.int8()), ("gpu", pa.bool_()),
    ("exec_type", pa.int8()),
)
REQUEST_COLUMNS = (
    ("request", pa.int64()), ("user", pa.int32()), ("home", pa.int16()),
    ("arrival_s", pa.float64()), ("done_s", pa.float64()), ("latency_s", pa.float64()),
    ("tokens", pa.int32()), ("lam_mean", pa.float64()), ("lam_max", pa.float64()),
    ("status", pa.string()), ("reason", pa.string()),
    # decode timing (testbed/progress.py): the prompt's last token home, each generated token home
    ("first_s", pa.float64()), ("gen_done_s", pa.list_(pa.float64())),
)
#: One row per step of a server's stream (``run --trace-steps``, either backend): what the
#: step rule charged and what it was made of, so ``hardware replay-steps`` can run the same
#: step as real kernels and ``python -m analysis compare-steps`` can line two runs up.
#: Replicas in order of first appearance, with their precision code
#: (``hetroute.system.Precision``), token count and tier (True: GPU-resident); the dense
#: part as one (request, position) pair per token.
STEP_COLUMNS = (
    ("server", pa.int16()), ("layer", pa.int16()), ("t_start", pa.float64()),
    ("model_s", pa.float64()), ("rep_precision", pa.list_(pa.int8())),
    ("rep_tokens", pa.list_(pa.int32())), ("rep_gpu", pa.list_(pa.bool_())),
    ("dense_request", pa.list_(pa.int64())), ("dense_position", pa.list_(pa.int32())),
)


# The record type lives with the method (``hetroute.state``): routers read it in
# ``on_layer_done``. Its scalar fields come first, in the table's column order.
assert TokenLayerRecord._fields[:len(TOKEN_LAYER_SCALARS)] == tuple(n for n, _ in TOKEN_LAYER_SCALARS)


N_SCALARS = len(TOKEN_LAYER_SCALARS)
N_WRITTEN = N_SCALARS + len(TOKEN_LAYER_LISTS)  # fields of a record that the table stores
_drain = deque(maxlen=0).extend  # runs an iterator to its end, keeping nothing


class RecordWriter:
    """Column buffers with periodic flushes to ``<dir>/<table>/part-NNNNN.parquet``."""

    def __init__(self, out_dir: Path | None, k: int, flush_rows: int = 400_000,
                 part_prefix: str = "", trace_steps: bool = False) -> None:
        self.out_dir = out_dir
        self.k = k
        self.part_prefix = part_prefix  # e.g. "w3-": emulated workers write side by side
        self.flush_rows = flush_rows
        self.tl = {name: [] for name, _ in TOKEN_LAYER_SCALARS}
        self.tl_lists = {name: [] for name, _ in TOKEN_LAYER_LISTS}  # flat, k per row
        self._bind()
        self.rq = {name: [] for name, _ in REQUEST_COLUMNS}
        #: the step table, or None where steps are not traced (the backend asks this)
        self.st = {name: [] for name, _ in STEP_COLUMNS} if trace_steps else None
        self._parts = {"token_layers": 0, "requests": 0, "steps": 0}
        self._frames: dict[str, list[pa.Table]] = {"token_layers": [], "requests": [], "steps": []}
        self.rows = 0

    # hot path ---------------------------------------------------------------
    def token_layer(self, rec: TokenLayerRecord) -> None:
        # each stored field goes to its column: the scalars are appended, the per-target
        # lists extended; ``map`` stops after the stored fields and the loop runs in C
        _drain(map(call, self._adds, rec))
        self.rows += 1
        if self.rows % self.flush_rows == 0:
            self._flush("token_layers")

    def _bind(self) -> None:
        self._adds = (tuple(self.tl[n].append for n, _ in TOKEN_LAYER_SCALARS)
                      + tuple(self.tl_lists[n].extend for n, _ in TOKEN_LAYER_LISTS))
        assert len(self._adds) == N_WRITTEN

    def request(self, row: tuple) -> None:
        for (name, _), v in zip(REQUEST_COLUMNS, row):
            self.rq[name].append(v)

    def step(self, row: tuple) -> None:
        """One traced step, fields in ``STEP_COLUMNS`` order (only when tracing)."""
        st = self.st
        for (name, _), v in zip(STEP_COLUMNS, row):
            st[name].append(v)
        if len(st["server"]) >= self.flush_rows:
            self._flush("steps")

    # tables -----------------------------------------------------------------
    def _table(self, which: str) -> pa.Table:
        if which == "steps":
            cols = {n: pa.array(self.st[n], type=t) for n, t in STEP_COLUMNS}
            self.st = {name: [] for name, _ in STEP_COLUMNS}
            return pa.table(cols)
        if which == "requests":
            cols = {n: pa.array(self.rq[n], type=t) for n, t in REQUEST_COLUMNS}
            for n in self.rq:
                self.rq[n] = []
            return pa.table(cols)
        cols = {n: pa.array(self.tl[n], type=t) for n, t in TOKEN_LAYER_SCALARS}
        for n, t in TOKEN_LAYER_LISTS:
            cols[n] = pa.FixedSizeListArray.from_arrays(pa.array(self.tl_lists[n], type=t), self.k)
        self.tl = {name: [] for name, _ in TOKEN_LAYER_SCALARS}
        self.tl_lists = {name: [] for name, _ in TOKEN_LAYER_LISTS}
        self._bind()
        return pa.table(cols)

    def _flush(self, which: str) -> None:
        table = self._table(which)
        if table.num_rows == 0:
            return
        if self.out_dir is None:
            self._frames[which].append(table)
            return
        d = self.out_dir / which
        d.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, d / f"part-{self.part_prefix}{self._parts[which]:05d}.parquet")
        self._parts[which] += 1

    def close(self) -> None:
        self._flush("token_layers")
        self._flush("requests")
        if self.st is not None:
            self._flush("steps")

    def frames(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """In-memory results (when ``out_dir`` is None)."""
        return (_concat(self._frames["token_layers"]), _concat(self._frames["requests"]))


def _concat(tables: list[pa.Table]) -> pd.DataFrame:
    if not tables:
        return pd.DataFrame()
    return pa.concat_tables(tables).to_pandas()


def read_records(run_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Token-layer and request tables of a finished (or partial) run folder."""
    out = []
    for which in ("token_layers", "requests"):
        d = Path(run_dir) / which
        parts = sorted(d.glob("part-*.parquet")) if d.exists() else []
        out.append(pd.concat([pq.read_table(p).to_pandas() for p in parts], ignore_index=True)
                   if parts else pd.DataFrame())
    return out[0], out[1]


def read_steps(run_dir: Path) -> pd.DataFrame:
    """The step table of a run traced with ``--trace-steps`` (empty if it was not)."""
    d = Path(run_dir) / "steps"
    parts = sorted(d.glob("part-*.parquet")) if d.exists() else []
    return pd.concat([pq.read_table(p).to_pandas() for p in parts], ignore_index=True) if parts \
        else pd.DataFrame()


def flat(series: pd.Series) -> np.ndarray:
    """A fixed-size list column as a (rows, k) array."""
    if len(series) == 0:
        return np.zeros((0, 0))
    return np.stack(series.to_numpy())
