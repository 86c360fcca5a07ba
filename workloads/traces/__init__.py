"""Expert-activation traces: which experts each token's gate picks at each layer.

A trace source answers ``route(request_id, n_tokens, task=0)`` with the top-k LOCAL
expert indices (and gate weights) of every token of a request at every MoE layer.
Consecutive tokens of a request form a sequence (prefill tokens first, then decode
tokens). Two sources exist: ``SyntheticTrace``, calibrated to published routing
statistics, and ``JsonlTrace``, which replays a recorded one.

Modules, one concern each:

- ``generator``: the synthetic routing model (``SyntheticTrace``) and the interface;
- ``params``: its knobs (``TraceParams``), the statistics it is calibrated to
  (``TARGETS``, with their sources) and the per-model defaults;
- ``stats``: statistics of any trace (``measure_stats``, ``compare_to_targets``);
- ``fit``: how the defaults were fitted to the targets (``fit_params``);
- ``readers``: the JSON-lines format (``JsonlTrace``, ``write_jsonl``);
- ``convert``: routing logs of other tools (Hugging Face, vLLM-style) into it;
- ``cli``: ``python -m workloads.traces stats|calibrate|convert``.
"""

from __future__ import annotations

from .cli import main
from .fit import fit_params
from .generator import CALIBRATION_ID_BASE, Routing, SyntheticTrace, TraceSource
from .params import TARGETS, Anchors, TraceParams, TraceTargets, default_trace_params, profile
from .readers import JsonlTrace, TraceFormatError, write_jsonl
from .stats import compare_to_targets, depth_bands, measure_stats, sample_tokens

__all__ = ["CALIBRATION_ID_BASE", "TARGETS", "Anchors", "JsonlTrace", "Routing", "SyntheticTrace",
           "TraceFormatError", "TraceParams", "TraceSource", "TraceTargets", "compare_to_targets",
           "default_trace_params", "depth_bands", "fit_params", "main", "measure_stats", "profile",
           "sample_tokens", "write_jsonl"]
