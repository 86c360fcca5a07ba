"""Recorded request traces: when requests arrived and how long their prompts and outputs were.

Poisson arrivals of fixed-length requests are the paper's workload (Sec. VI-A gives a
rate and nothing else), not what a serving system sees. Public traces of production
LLM serving record, per request, its arrival and its input and output token counts:

- the Azure LLM inference traces (Azure/AzurePublicDataset, ``AzureLLMInferenceTrace_*``;
  Patel et al., Splitwise, ISCA 2024): ``TIMESTAMP,ContextTokens,GeneratedTokens``, the
  timestamp a wall-clock date with up to 7 fractional digits;
- BurstGPT (Wang et al., arXiv:2401.17644): ``Timestamp,Model,Request tokens,Response
  tokens,Total tokens,Log Type`` (some releases add ``Session ID`` and ``Elapsed time``),
  the timestamp in seconds from the trace's start;
- this project's own: ``arrival_s,prompt_tokens,gen_tokens``.

The format is told by the header (the column names, case and spacing ignored). A row
that does not parse (missing or non-numeric fields, a negative or non-integer count, a
timestamp that is not a date or a number) is skipped and counted with its line number; a
request with no prompt token (BurstGPT logs failed requests with 0 tokens) is dropped
and counted. Arrivals are sorted and start at 0. What a run does with a trace (its
arrivals, its lengths, or both; rescaled to a rate or as recorded) is
``workloads.requests``' business; this module only reads.
"""

from __future__ import annotations

import csv
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: format -> (arrival column, prompt column, output column), normalised header names
FORMATS = {
    "azure": ("timestamp", "contexttokens", "generatedtokens"),
    "burstgpt": ("timestamp", "requesttokens", "responsetokens"),
    "native": ("arrival_s", "prompt_tokens", "gen_tokens"),
}
#: skipped lines listed in a report, at most
MAX_LISTED = 10


class RequestTraceError(ValueError):
    """A request trace that cannot be used; the message is one line naming the file."""


@dataclass(frozen=True)
class RequestTrace:
    """A trace's requests in arrival order: seconds from the first, and token counts."""

    path: str
    format: str
    arrival_s: np.ndarray  # float64, sorted, starting at 0
    prompt_tokens: np.ndarray  # int64 >= 1
    gen_tokens: np.ndarray  # int64 >= 0
    skipped_lines: tuple[int, ...] = ()  # line numbers of rows that did not parse
    dropped_empty: int = 0  # rows without a prompt token
    sha256: str = ""  # of the file's bytes: a run's provenance names the trace it read

    @property
    def n(self) -> int:
        return int(self.arrival_s.size)

    @property
    def span_s(self) -> float:
        return float(self.arrival_s[-1]) if self.n else 0.0

    @property
    def mean_rate_per_s(self) -> float:
        """Requests per second over the recorded span (n - 1 gaps), or 0 for one request."""
        return (self.n - 1) / self.span_s if self.n > 1 and self.span_s > 0 else 0.0

    def report(self) -> dict:
        """What was read, for ``run.json``: counts, span, rate, lengths and what was skipped."""
        def q(a: np.ndarray) -> dict:
            return {"mean": round(float(a.mean()), 1), "p50": float(np.median(a)),
                    "p99": float(np.quantile(a, 0.99)), "max": int(a.max())}
        cv = gap_cv(self.arrival_s)
        return {"file": self.path, "format": self.format, "requests": self.n,
                "span_s": round(self.span_s, 3), "mean_rate_per_s": round(self.mean_rate_per_s, 3),
                "interarrival_cv": cv, "prompt_tokens": q(self.prompt_tokens),
                "gen_tokens": q(self.gen_tokens), "skipped_lines": len(self.skipped_lines),
                "skipped_first": list(self.skipped_lines[:MAX_LISTED]),
                "dropped_no_prompt": self.dropped_empty, "sha256": self.sha256}


def gap_cv(times) -> float | None:
    """Coefficient of variation of the gaps between sorted arrival times (1 for a Poisson
    process, above 1 bursty), to three decimals; None with fewer than two gaps."""
    gaps = np.diff(np.asarray(times, dtype=np.float64))
    if gaps.size < 2 or not gaps.mean() > 0:
        return None
    return round(float(gaps.std() / gaps.mean()), 3)


def _norm(name: str) -> str:
    return "".join(name.split()).lower()


def _stamp(text: str, fmt: str) -> float | int:
    """A timestamp: seconds as a number, or (Azure) a date as integer nanoseconds (a date's
    epoch seconds in a float would keep only ~0.2 us; the differences are taken exactly)."""
    text = text.strip()
    try:
        v = float(text)
    except ValueError:
        if fmt != "azure":
            raise
        # numpy reads 'YYYY-MM-DD HH:MM:SS.fffffff' (any fraction) exactly to the ns
        return int(np.datetime64(text.replace(" ", "T"), "ns").astype(np.int64))
    if not math.isfinite(v):
        raise ValueError("not finite")
    return v


def _count(text: str) -> int:
    v = float(text)
    if not (math.isfinite(v) and v >= 0 and v == int(v)):
        raise ValueError("not a count")
    return int(v)


def read_request_trace(path: str | Path) -> RequestTrace:
    """Read a request trace (format from its header); raises ``RequestTraceError``."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as err:
        raise RequestTraceError(f"{p}: cannot read ({err.strerror or err})") from None
    if b"\0" in raw[:4096]:
        raise RequestTraceError(f"{p}: a binary file, not a CSV request trace")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise RequestTraceError(f"{p}: not UTF-8 text (byte {err.start})") from None
    rows = csv.reader(text.splitlines())
    header = next(rows, None)
    if header is None:
        raise RequestTraceError(f"{p}: empty file")
    cols = [_norm(h) for h in header]
    fmt = next((name for name, want in FORMATS.items() if all(c in cols for c in want)), None)
    if fmt is None:
        known = "; ".join(f"{k}: {', '.join(v)}" for k, v in FORMATS.items())
        raise RequestTraceError(f"{p}: header {header!r} names no known format ({known})")
    ia, ip, ig = (cols.index(c) for c in FORMATS[fmt])
    need = max(ia, ip, ig) + 1
    times, prompts, gens, skipped, empty = [], [], [], [], 0
    for lineno, row in enumerate(rows, start=2):
        if not row or all(not c.strip() for c in row):
            continue
        try:
            if len(row) < need:
                raise ValueError("short row")
            t, pr, g = _stamp(row[ia], fmt), _count(row[ip]), _count(row[ig])
        except (ValueError, OverflowError):
            skipped.append(lineno)
            continue
        if pr < 1:
            empty += 1
            continue
        times.append(t)
        prompts.append(pr)
        gens.append(g)
    if not times:
        raise RequestTraceError(f"{p}: no usable request ({len(skipped)} rows did not parse"
                                f"{', first at line ' + str(skipped[0]) if skipped else ''}, "
                                f"{empty} without a prompt token)")
    if all(isinstance(x, int) for x in times):  # dates: exact differences in ns
        ns = np.asarray(times, dtype=np.int64)
        order = np.argsort(ns, kind="stable")
        t = (ns[order] - ns[order[0]]) / 1e9
    else:  # seconds (a file mixing dates and numbers reads both as seconds)
        raw_t = np.asarray([x / 1e9 if isinstance(x, int) else x for x in times], dtype=np.float64)
        order = np.argsort(raw_t, kind="stable")
        t = raw_t[order] - raw_t[order[0]]
    t.setflags(write=False)
    pr = np.asarray(prompts, dtype=np.int64)[order]
    g = np.asarray(gens, dtype=np.int64)[order]
    pr.setflags(write=False)
    g.setflags(write=False)
    return RequestTrace(str(p), fmt, t, pr, g, tuple(skipped), empty,
                        hashlib.sha256(raw).hexdigest())
