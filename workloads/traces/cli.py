"""Command line: ``python -m workloads.traces stats|calibrate|convert`` (``__main__`` runs it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Sequence


from ..models import ModelSpec, get_model
from .fit import fit_params
from .generator import SyntheticTrace, TraceSource
from .params import TARGETS, default_trace_params
from .readers import JsonlTrace, TraceFormatError
from .convert import convert
from .stats import compare_to_targets, measure_stats, sample_tokens


def _format_rows(rows: list[tuple[str, str, float, float, float, float]]) -> str:
    head = f"{'metric':<22}{'where':<22}{'measured':>9}{'target':>9}{'uniform':>9}{'indep.':>9}"
    lines = [head, "-" * len(head)]
    cell = (lambda v: f"{v:>9.3f}" if math.isfinite(v) else f"{'-':>9}")
    for metric, where, *values in rows:
        lines.append(f"{metric:<22}{where:<22}" + "".join(cell(v) for v in values))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.traces",
                                     description="Routing statistics of expert-activation traces.")
    parser.add_argument("command", choices=("stats", "calibrate", "convert"))
    parser.add_argument("paths", nargs="*", help="convert: IN OUT (a routing log, the trace to write)")
    parser.add_argument("--format", dest="fmt", choices=("hf", "vllm"),
                        help="convert: the log's shape (workloads/traces/convert.py)")
    parser.add_argument("--model", default="mixtral")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--trace", help="a JSON-lines trace to measure instead of the synthetic one")
    parser.add_argument("--tasks", type=int, default=3,
                        help="stats: tasks of the synthetic trace (requests cycle through them)")
    args = parser.parse_intermixed_args(argv)  # convert takes IN OUT after options
    try:
        model = get_model(args.model)
    except KeyError as e:
        parser.error(str(e.args[0]))
    if args.command == "convert":
        return _convert(parser, args, model)
    targets = TARGETS[model.name]
    if args.command == "calibrate":
        seeds = range(args.seed, args.seed + 4)
        fitted = fit_params(model, targets, default_trace_params(model.name), seeds,
                            max(args.requests // 4, 1), args.tokens)
        print(json.dumps(fitted.model_dump(), indent=2))
        return 0
    try:
        source: TraceSource = (JsonlTrace(args.trace, model) if args.trace
                               else SyntheticTrace(model, default_trace_params(model.name)
                                                   .with_overrides({"n_tasks": args.tasks}),
                                                   seed=args.seed))
    except (OSError, TraceFormatError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n_tasks = getattr(source, "n_tasks", 1)
    tasks = [r % n_tasks for r in range(args.requests)]  # synthetic: an even task mix
    stats = measure_stats(model, sample_tokens(source, range(args.requests), args.tokens, tasks),
                          groups={"task": tasks} if n_tasks > 1 else None)
    print(f"{model.name}: {stats['n_tokens']} tokens, {stats['n_pairs']} consecutive pairs, "
          f"{stats['burst']['n_windows']} windows of {stats['burst']['window']} tokens"
          + (f", {n_tasks} tasks" if n_tasks > 1 else "") + f"; targets: {targets.source}")
    print(_format_rows(compare_to_targets(stats, targets)))
    return 0


def _convert(parser: argparse.ArgumentParser, args: argparse.Namespace, model: ModelSpec) -> int:


    if len(args.paths) != 2 or args.fmt is None:
        parser.error("convert needs --format hf|vllm IN OUT")
    try:
        report = convert(args.paths[0], args.paths[1], model, args.fmt)
        JsonlTrace(args.paths[1], model)  # what was written reads back
    except (OSError, ValueError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(report.format())
    print(f"written: {args.paths[1]} ({model.name}, top-{model.top_k})")
    return 0
