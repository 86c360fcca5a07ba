"""``python -m workloads.proxy train|profile|trace`` (see the package docstring).

Runs torch single-threaded (the machine is shared and results must be
bit-reproducible); errors in user input print one line and exit 2. Replaying a
run folder is the testbed's (``python -m testbed quality-replay RUN``) and the
surrogate plot the analysis' (``python -m analysis.quality.surrogate``):
``replay`` here only points there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..models import MODELS, get_model
from ..quality_profile import load_profile, save_profile
from .data import load_corpus
from .model import proxy_config
from .profile import SEGMENT, ProfileParams, default_profile_params, measure
from .report import surrogate_check, write_report
from .trace import export_trace
from .train import cache_path, default_cache_dir, load_or_train


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _models(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    if args.all:
        return list(MODELS)
    if not args.model:
        parser.error("give --model NAME or --all")
    try:
        return [get_model(m).name for m in args.model]
    except KeyError as err:
        parser.error(str(err.args[0]))
    return []


def cmd_train(args: argparse.Namespace, names: list[str]) -> int:
    corpus = load_corpus()
    for name in names:
        _, info = load_or_train(proxy_config(name), corpus, args.cache, _log, retrain=args.retrain)
        print(f"{name}: train loss {info['train_loss_final']:.3f}, held-out {info['heldout_loss']:.3f} "
              f"nats/byte, {info['train_s']} s -> {info['cached']}")
    return 0


def profile_one(name: str, out_root: Path, cache: Path | None, segments: int | None,
                group_size: int, check_requests: int, trace_requests: int = 512,
                retrain: bool = False) -> dict:
    """Train (or load), profile, check the surrogate, write the report and the trace of one model.

    The surrogate check's rows go to ``surrogate.csv``; its plot ``surrogate.png``
    is drawn by ``python -m analysis.quality.surrogate`` (``make quality-profile``).
    """
    t0 = time.perf_counter()
    corpus = load_corpus()
    cfg = proxy_config(name)
    model, info = load_or_train(cfg, corpus, cache, _log, retrain=retrain)
    t_train = time.perf_counter() - t0
    base = default_profile_params(name)
    params = ProfileParams(calibration_segments=segments or base.calibration_segments,
                           group_size=group_size, max_tokens=base.max_tokens)
    m = measure(model, corpus, params, _log)
    out = out_root / name
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": name, "source": f"proxy:{name}", "proxy": asdict(cfg),
            "proxy_key": cache_path(cfg, corpus, cache or default_cache_dir()).stem,
            "unit": "q = sum over calibration positions of KL(full precision || perturbed) per "
                    "execution of the expert, divided by CE_ref (the full-precision mean next-byte "
                    "cross-entropy on calibration text): a fraction of the per-token loss",
            "ce_ref_nats": m.ce_ref, "text": corpus.source, "text_sha256": corpus.digest,
            "calibration_segments": params.calibration_segments, "segment_tokens": SEGMENT,
            "group_size": params.group_size, "int8": "symmetric per output channel",
            "int4": "symmetric, groups of min(128, fan_in) input weights",
            "routing": "teacher-forced to the full-precision top-k",
            "imputed": m.imputed, "n_exec": m.n_exec.tolist(),
            "train": {k: info.get(k) for k in ("train_s", "train_loss_final", "heldout_loss")}}
    save_profile(out / "profile.npz", m.quality, meta)
    load_profile(out / "profile.npz", get_model(name).shape())  # must load for the real shape
    t1 = time.perf_counter()
    df, check = surrogate_check(model, corpus, m.quality, m.ce_ref, check_requests)
    df.to_csv(out / "surrogate.csv", index=False)
    report = write_report(out, m, info, check, meta)
    t2 = time.perf_counter()
    if trace_requests:
        export_trace(model, corpus, out / "trace.jsonl", trace_requests, 64, meta["proxy_key"])
    timing = {"train_or_load_s": round(t_train, 1), "profile_s": round(m.profile_s, 1),
              "check_s": round(t2 - t1, 1), "trace_s": round(time.perf_counter() - t2, 1),
              "total_s": round(time.perf_counter() - t0, 1)}
    report["timing"] = timing
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    _log(f"{name}: {json.dumps(timing)} -> {out}")
    return report


def cmd_profile(args: argparse.Namespace, names: list[str]) -> int:
    t0 = time.perf_counter()
    reports = {n: profile_one(n, args.out, args.cache, args.segments, args.group_size,
                              args.check_requests, args.trace_requests, args.retrain) for n in names}
    total = round(time.perf_counter() - t0, 1)
    for n, r in reports.items():
        p, c = r["profile"], r["surrogate_check"]["all"]
        print(f"{n}: q int8 {p['q_int8']['mean']:.3g} int4 {p['q_int4']['mean']:.3g} "
              f"Q_sub median {p['q_sub']['median']:.3g}; surrogate Spearman {c['spearman_rho']:.3f} "
              f"(p={c['spearman_p']:.2g}); {r['timing']['total_s']} s -> {args.out / n}/profile.npz")
    print(f"total {total} s")
    _log("surrogate plots: python -m analysis.quality.surrogate OUT/MODEL --out OUT/MODEL/surrogate.png "
         "(make quality-profile draws them)")
    if len(names) > 1:
        (args.out / "summary.json").write_text(json.dumps(
            {"total_s": total, "models": {n: {"timing": r["timing"], "profile": r["profile"],
                                              "surrogate_check": r["surrogate_check"]}
                                          for n, r in reports.items()}}, indent=1, default=str))
    return 0


def cmd_trace(args: argparse.Namespace, names: list[str]) -> int:
    if len(names) != 1:
        _log("error: trace takes one --model")
        return 2
    corpus = load_corpus()
    cfg = proxy_config(names[0])
    model, _ = load_or_train(cfg, corpus, args.cache, _log)
    try:
        export_trace(model, corpus, args.out, args.requests, args.calibration_requests,
                     cache_path(cfg, corpus, args.cache or default_cache_dir()).stem)
    except ValueError as err:
        _log(f"error: {err}")
        return 2
    print(f"written: {args.out} ({args.requests} held-out + {args.calibration_requests} calibration "
          f"requests of 36 tokens)")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    _log("error: replaying a run moved to the testbed: python -m testbed quality-replay RUN "
         "[--trace PATH] [--profile PATH] [--cache DIR]")
    return 2


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(prog="python -m workloads.proxy",
                                     description="Proxy MoE models: train, profile quality, export "
                                                 "traces (replaying a run: python -m testbed "
                                                 "quality-replay RUN).")
    sub = parser.add_subparsers(dest="command", required=True)

    def models_opts(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", action="append", help="mixtral, qwen, switch (repeatable)")
        p.add_argument("--all", action="store_true", help="all three models")
        p.add_argument("--cache", type=Path, default=None, help="weight cache (default <repo>/.cache/proxy)")

    p_train = sub.add_parser("train", help="train (or load cached) proxies")
    models_opts(p_train)
    p_train.add_argument("--retrain", action="store_true")
    p_prof = sub.add_parser("profile", help="measure q and Q_sub, write profile.npz and a report")
    models_opts(p_prof)
    p_prof.add_argument("--out", type=Path, default=Path("results/quality"))
    p_prof.add_argument("--segments", type=int, default=None, help="calibration segments of 36 tokens")
    p_prof.add_argument("--group-size", type=int, default=2, help="substitutes per expert |V_E|")
    p_prof.add_argument("--check-requests", type=int, default=96, help="held-out segments in the check")
    p_prof.add_argument("--trace-requests", type=int, default=512,
                        help="held-out requests of <out>/<model>/trace.jsonl (0: no trace)")
    p_prof.add_argument("--retrain", action="store_true")
    p_trace = sub.add_parser("trace", help="export the proxy's routing on held-out text (JSONL)")
    models_opts(p_trace)
    p_trace.add_argument("--out", type=Path, required=True)
    p_trace.add_argument("--requests", type=int, default=512, help="held-out requests (ids 0..n-1)")
    p_trace.add_argument("--calibration-requests", type=int, default=64)
    p_replay = sub.add_parser("replay", help="moved: python -m testbed quality-replay RUN")
    p_replay.add_argument("run", type=Path)
    p_replay.add_argument("--trace", type=Path, default=None, help="default: the run's workload.trace")
    p_replay.add_argument("--profile", type=Path, default=None, help="default: the run's quality.profile")
    p_replay.add_argument("--cache", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.command == "replay":
        return cmd_replay(args)
    names = _models(args, parser)
    return {"train": cmd_train, "profile": cmd_profile, "trace": cmd_trace}[args.command](args, names)


if __name__ == "__main__":
    sys.exit(main())
