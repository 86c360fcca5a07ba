"""Real text for the proxy models: the prose of Python's own documentation.

Source: ``pydoc_data.topics`` of the running interpreter's standard library
(the reference-manual topics that ``help()`` prints, ~465k characters for
CPython 3.11). It ships with every CPython, so nothing is downloaded; it is
part of the Python documentation, distributed under the PSF License Agreement
(Python 2.0 licence; the interpreter's ``LICENSE.txt``). Other CPython
versions ship a different text, so its SHA-256 goes into every cache key and
profile.

Tokens are UTF-8 bytes (vocabulary 256): no tokenizer to build or store.

Topics overlap (``specialnames`` contains ``numeric-types`` and others, ~20%
of the text), so paragraphs are de-duplicated first: a paragraph is kept only
in the first topic (in the order below) that has it, and held-out text never
reappears in training text.

Splits are by topic (document), never inside one, as WikiText splits by
article: topics are ordered by the SHA-256 of their name (independent of dict
order and of Python's hash seed) and dealt out in that order: a topic goes to
the held-out split while that split is below ``heldout_share`` of the bytes
and the topic does not overshoot it by more than 20% (one huge topic must not
take the split), else likewise to calibration, else to training. Held-out
text feeds evaluation (traces, replay); calibration text feeds profiling;
neither is trained on.
"""

from __future__ import annotations

import hashlib
import platform
import re
from dataclasses import dataclass

import numpy as np

SOURCE = "pydoc_data.topics (CPython documentation; PSF License Agreement)"


@dataclass(frozen=True)
class Corpus:
    """Byte strings of the three splits and the identity of the text."""

    train: bytes
    calibration: bytes
    heldout: bytes
    digest: str  # SHA-256 of the whole text, for cache keys
    source: str

    def split(self, name: str) -> bytes:
        if name not in ("train", "calibration", "heldout"):
            raise ValueError(f"unknown split {name!r}")
        return getattr(self, name)


def _name_order(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def load_corpus(heldout_share: float = 0.1, calibration_share: float = 0.1) -> Corpus:
    """The documentation topics, split as in the module docstring."""
    from pydoc_data.topics import topics  # stdlib; imported here, so importing this module is cheap

    if not (0 < heldout_share < 1 and 0 < calibration_share < 1 and heldout_share + calibration_share < 1):
        raise ValueError("shares must be in (0, 1) and leave room for training text")
    docs = []
    seen: set[str] = set()
    for name in sorted(topics, key=_name_order):
        kept = []
        for para in re.split(r"\n[ \t]*\n", topics[name].strip()):
            key = para.strip()
            if key and key not in seen:
                seen.add(key)
                kept.append(para)
        if kept:
            docs.append((name, ("\n\n".join(kept) + "\n\n").encode("utf-8")))
    total = sum(len(d) for _, d in docs)
    parts: dict[str, list[bytes]] = {"heldout": [], "calibration": [], "train": []}
    filled = {"heldout": 0, "calibration": 0}
    quota = {"heldout": heldout_share * total, "calibration": calibration_share * total}
    for _, doc in docs:
        split = next((s for s in ("heldout", "calibration")
                      if filled[s] < quota[s] and filled[s] + len(doc) <= 1.2 * quota[s]), "train")
        parts[split].append(doc)
        if split in filled:
            filled[split] += len(doc)
    digest = hashlib.sha256(b"".join(d for _, d in sorted(docs))).hexdigest()
    return Corpus(train=b"".join(parts["train"]), calibration=b"".join(parts["calibration"]),
                  heldout=b"".join(parts["heldout"]), digest=digest,
                  source=f"{SOURCE}, Python {platform.python_version()}")


def segments(text: bytes, length: int, count: int | None = None) -> np.ndarray:
    """Consecutive, non-overlapping segments: ``(n, length + 1)`` uint8 rows.

    Row r holds bytes [r*length, (r+1)*length + 1): the ``length`` input tokens
    of request r and, one further, the target of its last token (the first
    byte of segment r+1). This is the request <-> text mapping of traces.
    """
    if length < 1:
        raise ValueError("length must be >= 1")
    n = (len(text) - 1) // length
    if count is not None:
        if count > n:
            raise ValueError(f"only {n} segments of {length} tokens in {len(text)} bytes, {count} asked")
        n = count
    buf = np.frombuffer(text, dtype=np.uint8)
    idx = np.arange(n)[:, None] * length + np.arange(length + 1)[None, :]
    return buf[idx]


def windows(text: bytes, length: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` random training windows of ``length + 1`` bytes (inputs + shifted targets)."""
    buf = np.frombuffer(text, dtype=np.uint8)
    starts = rng.integers(0, len(buf) - length - 1, size=count)
    return buf[starts[:, None] + np.arange(length + 1)[None, :]]
