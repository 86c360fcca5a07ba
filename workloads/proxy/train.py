"""Training a proxy on the documentation text, and the weight cache.

Deterministic: parameters come from a generator seeded by ``cfg.seed``,
training windows from ``numpy.random.default_rng([seed, tag])``, and the
caller runs torch single-threaded (``torch.set_num_threads(1)``; the command
line does), so the same config gives bit-identical weights.

The cache holds ``<cache>/<model>-<key>.pt`` (state dict plus a JSON-able
training log); the key hashes the config, the text's SHA-256 and the code of
the modules that define the model and its training (``model``, ``data``
and this file; comments and docstrings excluded), so any change of
those retrains instead of loading stale weights.
"""

from __future__ import annotations

import ast
import hashlib
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from .data import Corpus, segments, windows
from .model import ProxyConfig, ProxyMoE

_WINDOW_TAG = 0x7EA1
_EVAL_SEGMENTS = 64  # held-out segments for the logged held-out loss


def default_cache_dir() -> Path:
    """``<repo>/.cache/proxy`` (git-ignored), found from this file, not from the cwd."""
    return Path(__file__).resolve().parents[2] / ".cache" / "proxy"


def code_version() -> str:
    """Hash of the code that defines training, blind to comments, docstrings and layout.

    Hashing the syntax tree (docstrings removed) rather than the bytes means
    editing documentation does not throw away minutes of training.
    """
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in ("model.py", "data.py", "train.py"):
        tree = ast.parse((here / name).read_text())
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                    and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
                node.body = body[1:] or [ast.Pass()]
        h.update(ast.dump(tree).encode())
    return h.hexdigest()[:16]


def cache_path(cfg: ProxyConfig, corpus: Corpus, cache_dir: Path) -> Path:
    return cache_dir / f"{cfg.model}-{cfg.key(corpus.digest, code_version())}.pt"


@torch.no_grad()
def mean_loss(model: ProxyMoE, text: bytes, length: int, count: int) -> float:
    """Mean next-byte cross-entropy (nats) over ``count`` consecutive segments of ``text``."""
    seg = torch.from_numpy(segments(text, length, count).astype(np.int64))
    logits = model(seg[:, :-1]).logits
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seg[:, 1:].reshape(-1)))


def train(cfg: ProxyConfig, corpus: Corpus, log: Callable[[str], None] | None = None
          ) -> tuple[ProxyMoE, dict]:
    """AdamW with linear warm-up and cosine decay; next-byte loss + load balancing."""
    model = ProxyMoE(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    rng = np.random.default_rng([cfg.seed, _WINDOW_TAG])

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    t0 = time.perf_counter()
    history = []
    for step in range(cfg.steps):
        batch = torch.from_numpy(windows(corpus.train, cfg.context, cfg.batch, rng).astype(np.int64))
        out = model(batch[:, :-1])
        ce = F.cross_entropy(out.logits.reshape(-1, cfg.vocab), batch[:, 1:].reshape(-1))
        loss = ce + cfg.aux_loss * out.aux
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        history.append(float(ce.detach()))
        if log and (step % 100 == 0 or step == cfg.steps - 1):
            log(f"{cfg.model}: step {step + 1}/{cfg.steps} loss {history[-1]:.3f} "
                f"aux {float(out.aux.detach()):.3f} ({time.perf_counter() - t0:.0f} s)")
    model.eval()
    tail = history[-max(1, len(history) // 20):]
    n_eval = min(_EVAL_SEGMENTS, (len(corpus.heldout) - 1) // 36)
    info = {
        "config": asdict(cfg), "train_s": round(time.perf_counter() - t0, 1),
        "train_loss_final": float(np.mean(tail)), "train_loss_first": history[0],
        "heldout_loss": mean_loss(model, corpus.heldout, 36, n_eval) if n_eval > 0 else math.nan,
        "tokens_seen": cfg.steps * cfg.batch * cfg.context,
        "params": sum(p.numel() for p in model.parameters()),
        "text": corpus.source, "text_sha256": corpus.digest, "torch": str(torch.__version__),
    }
    return model, info


def load_or_train(cfg: ProxyConfig, corpus: Corpus, cache_dir: Path | None = None,
                  log: Callable[[str], None] | None = None, retrain: bool = False
                  ) -> tuple[ProxyMoE, dict]:
    """Cached weights for ``cfg`` if present, else train and cache them."""
    path = cache_path(cfg, corpus, cache_dir or default_cache_dir())
    if path.exists() and not retrain:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        model = ProxyMoE(cfg)
        model.load_state_dict(blob["state"])
        model.eval()
        info = {**blob["info"], "cached": str(path)}
        return model, info
    model, info = train(cfg, corpus, log)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"state": model.state_dict(), "info": info}, tmp)
    tmp.replace(path)
    return model, {**info, "cached": str(path)}
