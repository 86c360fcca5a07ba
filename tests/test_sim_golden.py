"""The simulator's records, bit for bit: a speed-up of the event loop must not move one.

A short HetRoute run on a generated 6-server topology under each physics; the
token-layer and request tables (every value, column order and dtype) are hashed and
compared with digests recorded from the simulator before it was optimised (issue 16,
item 2). Timings, decisions and records all feed the tables, so any change of event
order, of a kernel time or of a float operation's order shows up here.

The digests hold for this platform's floating point (x86-64, numpy 2.x); if a
deliberate change of the model moves them, print the new ones with
``python -m tests.test_sim_golden`` and say why in the commit.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pandas as pd
import pytest

from testbed.conformance import fresh
from testbed.records import RecordWriter
from testbed.setup import build_setup
from testbed.sim.backend import SimBackend
from testbed.spec import parse_spec

# Recorded at commit 44af190, before the simulator speed-up, then again when the request
# table gained its decode-timing columns (first_s, gen_done_s): with those two columns
# dropped the merged code still gives the 44af190 digests (fe0e6c6a... and d74be6f7...).
GOLDEN = {
    "hardware": "d9b6f0e726753e8ac9786b777f011e06ef7537b9c9c152276c1c2bfc6efd46df",
    "paper": "7a08912aa413d37912fe118b47d65d40b6a5dc5fee52fbaaf66d8129fad59a07",
}

SPEC = {"name": "golden", "topology": {"servers": 6, "seed": 1}, "engine": {"decision_s": 0},
        "workload": {"rate_per_s": 40, "duration_s": 0.25, "warmup_s": 0.0,
                     "calibration_tokens": 64}}


def digest(*frames: pd.DataFrame) -> str:
    """SHA-256 of tables' columns, dtypes and values in row order (floats exactly)."""
    h = hashlib.sha256()
    for frame in frames:
        for name in frame.columns:
            col = frame[name]
            h.update(f"{name}:{col.dtype}:{len(col)}".encode())
            for v in col.to_numpy():
                h.update(repr(v.tolist() if hasattr(v, "tolist") else v).encode())
    return h.hexdigest()


def run_digests() -> dict[str, str]:
    """Both physics on one placement (the world's physics does not enter the placement)."""
    base = build_setup(parse_spec({**SPEC, "physics": "hardware"}))
    out = {}
    for physics in ("hardware", "paper"):
        setup = fresh(dataclasses.replace(base, spec=base.spec.with_overrides({"physics": physics})))
        writer = RecordWriter(None, setup.shape.top_k)
        SimBackend(setup, writer).run()
        writer.close()
        tl, rq = writer.frames()
        assert len(tl) > 0 and len(rq) > 0
        out[physics] = digest(tl, rq)
    return out


def test_sim_records_match_the_recorded_digests():
    got = run_digests()
    assert got == GOLDEN, f"the simulator's records changed: {got}"


if __name__ == "__main__":  # pragma: no cover - prints the digests to record
    print(run_digests())
