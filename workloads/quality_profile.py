"""Reading and writing quality profiles (q per replica precision, Q_sub per substitute).

File format (``.npz``): ``q`` float array (n_experts, n_precisions) with the
FP16 column 0; ``sub_target``, ``sub_expert``, ``sub_loss`` flat arrays listing
every (E, E^, Q_sub(E, E^)); ``meta`` a JSON string (model, source, how measured).

A file that is missing or not a profile raises ``ProfileError`` (a plain
``ValueError``) naming the file; the spec layer (``testbed.setup``) turns it
into its one-line message about the field ``quality.profile``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hetroute.quality import QualityModel
from hetroute.system import MoEShape


class ProfileError(ValueError):
    """A quality profile that is missing or does not fit the model; one line, names the file."""


def save_profile(path: Path, quality: QualityModel, meta: dict) -> None:
    t, e, loss = [], [], []
    for target, group in enumerate(quality.substitutes):
        for e_hat, ls in group:
            t.append(target)
            e.append(e_hat)
            loss.append(ls)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, q=quality.q, sub_target=np.array(t, dtype=np.int64),
             sub_expert=np.array(e, dtype=np.int64), sub_loss=np.array(loss, dtype=float),
             meta=np.array(json.dumps(meta)))


def load_profile(path: Path, shape: MoEShape) -> QualityModel:
    try:
        with np.load(path, allow_pickle=False) as z:
            q = np.array(z["q"], dtype=float)
            t, e, loss = z["sub_target"], z["sub_expert"], z["sub_loss"]
            meta = json.loads(str(z["meta"]))
    except FileNotFoundError:
        raise ProfileError(f"no such file {path}") from None
    except (KeyError, ValueError, OSError) as err:
        raise ProfileError(f"{path} is not a quality profile ({err})") from None
    if q.shape[0] != shape.n_experts:
        raise ProfileError(f"{path} has {q.shape[0]} experts, {shape.name} has {shape.n_experts}")
    groups: list[list[tuple[int, float]]] = [[] for _ in range(shape.n_experts)]
    for a, b, c in zip(t.tolist(), e.tolist(), loss.tolist()):
        groups[a].append((b, c))
    try:
        return QualityModel(q=q, substitutes=tuple(tuple(sorted(g, key=lambda x: x[1]))
                                                   for g in groups),
                            source=str(meta.get("source", path.name)))
    except ValueError as err:
        raise ProfileError(f"{path}: {err}") from None


def profile_ce(profile: Path | None) -> float | None:
    """The reference cross-entropy a measured profile records (the unit of q and Lambda)."""
    if profile is None or profile.suffix != ".npz":
        return None
    with np.load(profile) as z:
        ce = json.loads(str(z["meta"])).get("ce_ref_nats")
    return None if ce is None else float(ce)
