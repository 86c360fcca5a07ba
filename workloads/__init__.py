"""Workloads: model catalogue, expert-activation traces, arrivals and users.

``models`` holds the three evaluated MoE models with their real sizes and
converts them to ``hetroute.system.MoEShape``; ``traces`` generates calibrated
synthetic routing or replays a recorded JSON-lines trace; ``requests`` draws
Poisson arrivals from users attached to home servers and the held-out
calibration traffic T_cal. Nothing here does I/O at import or keeps state.

Names are re-exported lazily so that ``python -m workloads.traces`` does not
import the module twice.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "models": ("MODELS", "ModelSpec", "get_model"),
    "requests": ("DEFAULT_GEN_TOKENS", "DEFAULT_PROMPT_TOKENS", "DEFAULT_TASKS",
                 "DEFAULT_TASK_SPECIFICITY", "Request", "RequestShape", "Users",
                 "calibration_traffic", "generate_requests", "poisson_arrivals"),
    "traces": ("CALIBRATION_ID_BASE", "TARGETS", "JsonlTrace", "Routing", "SyntheticTrace",
               "TraceFormatError", "TraceParams", "TraceSource", "TraceTargets",
               "default_trace_params", "measure_stats", "write_jsonl"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'workloads' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
