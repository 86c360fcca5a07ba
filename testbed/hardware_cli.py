"""``python -m testbed hardware ...``: the hardware model from the command line.

- ``kernel``: predicted milliseconds of one FFN kernel per token count, on a GPU
  class, a server of a topology (``paper10:s2``) or the calibrated CPU (``cpu``);
- ``calibrate-cpu``: measure this machine's CPU (``testbed/cpu_profile.py``);
- ``validate``: the model against operator profiles in Vidur's CSV layout
  (Agrawal et al., MLSys 2024, ``data/profiling/compute/<gpu>/<model>/mlp.csv``),
  which are not in this repository: pass the folder that holds them;
- ``measure-gpu``: real kernels on this machine's CUDA GPU beside the model's
  predictions for its class (``testbed/gpu_profile.py``);
- ``classes``: the catalogue.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from hetroute.hardware import (CATALOGUE, Device, FfnShape, HardwareError, ffn_seconds, gpu_class)

CPU_FILE = Path("results/hardware/cpu.json")

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="The hardware model: GPU classes, kernel times, CPU calibration.")


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def resolve_device(gpu: str, cpu_file: Path = CPU_FILE) -> Device:
    """A class name (``a40``), ``TOPOLOGY:SERVER`` (``paper10:s2``) or ``cpu``."""
    if gpu == "cpu":
        from .cpu_profile import device_from
        if not cpu_file.exists():
            raise HardwareError(f"--gpu cpu: no calibration at {cpu_file}; run "
                                "`python -m testbed hardware calibrate-cpu` first")
        return device_from(json.loads(cpu_file.read_text()))
    if ":" in gpu:
        from topologies import TopologyError, load_topology
        topo, _, server = gpu.rpartition(":")
        try:
            cl = load_topology(topo).to_cluster()
        except TopologyError as err:
            raise HardwareError(f"--gpu: {err}") from None
        if server not in cl.names:
            raise HardwareError(f"--gpu: topology {topo} has no server {server!r} "
                                f"(has {', '.join(cl.names)})")
        return cl.device(cl.names.index(server))
    try:
        return Device.from_class(gpu_class(gpu))
    except HardwareError as err:
        raise HardwareError(f"--gpu: {err}") from None


def _tokens(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise HardwareError(f"--tokens: expected comma-separated integers, got {text!r}") from None
    if not out or any(t < 1 or t > 10_000_000 for t in out):
        raise HardwareError(f"--tokens: each count must be in 1..10^7, got {text!r}")
    return out


@app.command()
def kernel(gpu: str = typer.Option(..., help="GPU class, TOPOLOGY:SERVER, or cpu"),
           d_model: int = typer.Option(..., "--d-model", help="hidden size"),
           d_ff: int = typer.Option(..., "--d-ff", help="intermediate size"),
           gated: bool = typer.Option(False, "--gated/--no-gated", help="SwiGLU (3 matrices)"),
           tokens: str = typer.Option("1,8,64,512", help="token counts, comma-separated"),
           precision: str = typer.Option("fp16", help="fp16, int8 or int4 (weight-only)")) -> None:
    """Predicted time of one FFN over each token count: one line ``tokens=N ms=X`` each."""
    try:
        dev = resolve_device(gpu)
        if precision not in ("fp16", "int8", "int4"):
            raise HardwareError(f"--precision: one of fp16, int8, int4, got {precision!r}")
        ffn = FfnShape(d_model, d_ff, gated)
        counts = _tokens(tokens)
        dev.check_precision(precision)
    except HardwareError as err:
        _fail(str(err).replace("ffn: ", "--d-model/--d-ff: "))
        return
    for b in counts:
        typer.echo(f"tokens={b} ms={ffn_seconds(dev, ffn, b, precision) * 1e3:.4f}")


@app.command()
def classes() -> None:
    """The catalogue: datasheet numbers and the source of each row."""
    typer.echo(f"{'class':10s} {'FP16 TF':>8s} {'mem GB':>7s} {'GB/s':>7s} {'PCIe':>6s} "
               f"{'sm':>4s}  precisions")
    for g in CATALOGUE.values():
        typer.echo(f"{g.name:10s} {g.fp16_tflops:8.1f} {g.mem_gb:7.0f} {g.mem_bw_gb_s:7.0f} "
                   f"{g.pcie_gb_s:6.1f} {g.sm:4.1f}  {','.join(g.precisions)}")


@app.command("measure-gpu")
def measure_gpu(out: Path = typer.Option(..., help="folder for kernels.csv and env.json"),
                gpu: str | None = typer.Option(None, help="catalogue class to compare with "
                                               "(default: from the device's name)"),
                parts: str = typer.Option("ceiling,ffn,step,dense,prefill,int4", help="comma-separated"),
                quick: bool = typer.Option(False, help="five token counts instead of 13"),
                reps: int = typer.Option(7, min=3, max=100, help="repetitions per point"),
                note: str = typer.Option("", help="free text kept in env.json (e.g. the git revision)")
                ) -> None:
    """Measure real kernels on this machine's CUDA GPU beside the model's predictions."""
    import csv
    import dataclasses
    import datetime
    from .gpu_profile import Row, measure
    names = [p.strip() for p in parts.split(",") if p.strip()]
    out.mkdir(parents=True, exist_ok=True)
    fields = [f.name for f in dataclasses.fields(Row)] + ["ratio", "ratio_nolaunch"]
    rows_all, env = [], {}
    with open(out / "kernels.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        for part in names:  # one part at a time: a killed run keeps what it measured
            try:
                rows, env = measure([part], gpu=gpu, quick=quick, reps=reps,
                                    progress=lambda m: typer.echo(m, err=True))
            except HardwareError as err:
                _fail(str(err))
                return
            for r in rows:
                w.writerow(r.as_dict())
            fh.flush()
            rows_all += rows
    env.update(note=note, parts=names, reps=reps, quick=quick,
               measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    (out / "env.json").write_text(json.dumps(env, indent=1))
    typer.echo(f"{env.get('name')} (compared with class {env.get('catalogue_class')}), torch "
               f"{env.get('torch')}: {len(rows_all)} rows -> {out / 'kernels.csv'}")
    typer.echo(f"{'part':8s} {'shape':18s} {'method':7s} {'prec':4s} {'tok':>5s} {'E':>2s} "
               f"{'P':>5s} {'meas ms':>8s} {'model':>8s} {'ratio':>6s} {'no-launch':>9s}  note")
    for r in rows_all:
        typer.echo(f"{r.part:8s} {r.shape[:18]:18s} {r.method:7s} {r.precision:4s} {r.tokens:5d} "
                   f"{r.experts:2d} {r.positions:5d} {r.measured_ms:8.4f} {r.model_ms:8.4f} "
                   f"{r.ratio:6.3f} {r.ratio_nolaunch:9.3f}  {r.note}")


@app.command("calibrate-cpu")
def calibrate_cpu(out: Path = typer.Option(CPU_FILE, help="where to write the measurement"),
                  threads: int = typer.Option(1, min=1, max=256, help="torch threads"),
                  reps: int = typer.Option(5, min=1, max=100, help="repetitions per point")) -> None:
    """Measure this CPU as a device (GEMM profile, bandwidths, overhead); about 30 s."""
    from .cpu_profile import measure_cpu
    d = measure_cpu(threads=threads, reps=reps)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(d, indent=1))
    typer.echo(f"{d['name']}: GEMM {d['flops'] / 1e9:.1f} GFLOP/s at 512 tokens, GEMV "
               f"{d['mem_bw'] / 1e9:.1f} GB/s, element-wise {d['elementwise_bw'] / 1e9:.1f} GB/s, "
               f"{d['launch_s'] * 1e6:.1f} us per operator ({threads} thread(s)) -> {out}")


#: Vidur names its GPUs by folder; the catalogue class each stands for.
VIDUR_GPUS = {"a40": "a40", "a100": "a100-80", "h100": "h100-sxm"}


def validate_rows(root: Path, tokens: tuple[int, ...] = (1, 8, 32, 64, 128, 256, 512, 1024, 4096)
                  ) -> list[dict]:
    """Model vs measured MLP kernel time for every ``<gpu>/<org>/<model>/mlp.csv`` under root
    (TP=1 rows, median of up + act + down projections, milliseconds)."""
    import pandas as pd
    rows = []
    for csv in sorted(root.glob("*/*/*/mlp.csv")):
        gpu = csv.parts[-4]
        if gpu not in VIDUR_GPUS:
            continue
        df = pd.read_csv(csv)
        df = df[df.num_tensor_parallel_workers == 1]
        if df.empty or not df.use_gated_mlp.iloc[0]:
            continue
        d_model, d_ff = int(df.n_embd.iloc[0]), int(df.n_expanded_embd.iloc[0])
        dev = Device.from_class(gpu_class(VIDUR_GPUS[gpu]))
        ffn = FfnShape(d_model, d_ff, gated=True)
        for b in tokens:
            hit = df[df.num_tokens == b]
            if hit.empty:
                continue
            r = hit.iloc[0]
            meas = sum(float(r[f"time_stats.{op}.median"]) for op in ("mlp_up_proj", "mlp_act", "mlp_down_proj"))
            # Vidur times kernels only (no launch gaps): compare without launch overhead
            pred = (ffn_seconds(dev, ffn, b) - 3 * dev.launch_s) * 1e3
            rows.append({"gpu": gpu, "model": f"{csv.parts[-3]}/{csv.parts[-2]}", "d_model": d_model,
                         "d_ff": d_ff, "tokens": b, "measured_ms": meas, "model_ms": pred,
                         "ratio": pred / meas})
    return rows


@app.command()
def validate(root: Path = typer.Argument(..., help="folder with <gpu>/<org>/<model>/mlp.csv (Vidur's "
                                          "data/profiling/compute)"),
             out: Path | None = typer.Option(None, help="also write the rows as CSV")) -> None:
    """The kernel model against measured MLP times of real GPUs (not shipped here)."""
    if not root.is_dir():
        _fail(f"{root}: no such folder")
    rows = validate_rows(root)
    if not rows:
        _fail(f"{root}: no <gpu>/<org>/<model>/mlp.csv with TP=1 gated-MLP rows for "
              f"{', '.join(VIDUR_GPUS)}")
    import pandas as pd
    df = pd.DataFrame(rows)
    typer.echo(df.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    err = (df.ratio - 1).abs()
    typer.echo(f"\n{len(df)} points: median |error| {err.median():.1%}, within 15%: "
               f"{(err <= 0.15).mean():.0%}, within 30%: {(err <= 0.30).mean():.0%}")
    for b, g in df.groupby("tokens"):
        typer.echo(f"tokens={b}: median model/measured {g.ratio.median():.2f} "
                   f"(min {g.ratio.min():.2f}, max {g.ratio.max():.2f})")
    if out is not None:
        df.to_csv(out, index=False)


@app.command("replay-steps")
def replay_steps(runs: list[Path] = typer.Argument(..., help="run folders written with "
                                                   "`python -m testbed run SPEC --trace-steps`"),
                 out: Path = typer.Option(..., help="folder for steps.csv, summary.json, env.json"),
                 steps: int = typer.Option(200, min=1, max=100_000, help="steps drawn per run"),
                 gpu: str | None = typer.Option(None, help="catalogue class to charge on "
                                                "(default: from the device's name)"),
                 reps: int = typer.Option(7, min=3, max=100, help="repetitions per step"),
                 seed: int = typer.Option(0, help="seeds the sample and the random weights"),
                 methods: str = typer.Option("loop,grouped", help="comma-separated: loop, grouped"),
                 attention: str = typer.Option("varlen", help="dense part's attention: varlen "
                                               "(flash, packed; CUDA) or masked (padded SDPA)"),
                 cpu: bool = typer.Option(False, help="run on this CPU (eagerly, FP32; "
                                          "loop only) instead of a CUDA GPU: to try the command"),
                 note: str = typer.Option("", help="free text kept in env.json")) -> None:
    """Traced steps of a run as real kernels on this GPU, beside the step rule's charge."""
    import csv
    import dataclasses
    import datetime

    import torch

    from workloads.models import get_model

    from .gpu_profile import class_for, environment, l2_bytes
    from .step_replay import METHODS, RULE_OF, Replay, replay, sample, summarise, trace_of
    chosen = tuple(m.strip() for m in methods.split(",") if m.strip())
    bad = [m for m in chosen if m not in METHODS]
    if bad or not chosen:
        _fail(f"--methods: unknown {', '.join(bad) or '(none)'}; one of {', '.join(METHODS)}")
    if cpu:
        dev = torch.device("cpu")
        attention = "masked"  # varlen attention is flash attention: CUDA only
        if "grouped" in chosen:
            _fail("--methods grouped needs CUDA (torch._grouped_mm); use --methods loop with --cpu")
    elif not torch.cuda.is_available():
        _fail("replay-steps: no CUDA device here (torch.cuda.is_available() is False); "
              "--cpu runs it on this CPU")
    else:
        dev = torch.device("cuda")
    env = environment(dev)
    try:
        cls = gpu_class(gpu or (class_for(env["name"]) if dev.type == "cuda" else "a40")).name
        traces = [(r, *trace_of(r)) for r in runs]
    except HardwareError as err:
        _fail(str(err))
        return
    out.mkdir(parents=True, exist_ok=True)
    fields = ["run"] + [f.name for f in dataclasses.fields(Replay)] + ["ratio"]
    rows_all: list[Replay] = []
    per_run = {}
    with open(out / "steps.csv", "w", newline="") as fh, torch.inference_mode():
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        for run_dir, spec, trace in traces:
            pick = sample(trace, steps, seed)
            model = get_model(spec.workload.model)
            rows = []
            try:
                for i, r in enumerate(replay(pick, model, cls, dev, reps=reps, seed=seed,
                                             l2=l2_bytes(dev), methods=chosen,
                                             attention=attention)):
                    w.writerow({"run": str(run_dir), **dataclasses.asdict(r), "ratio": r.ratio})
                    fh.flush()  # a killed replay keeps what it measured
                    rows.append(r)
                    if (i + 1) % (20 * len(chosen)) == 0:
                        typer.echo(f"{run_dir}: {(i + 1) // len(chosen)}/{len(pick)} steps", err=True)
            except HardwareError as err:
                _fail(str(err))
                return
            per_run[str(run_dir)] = {"model": model.name, "router": spec.router.name,
                                     "rate_per_s": spec.workload.rate_per_s,
                                     "trace_steps": len(trace), "sampled": len(pick),
                                     "summary": summarise(rows)}
            rows_all += rows
    env.update(note=note, catalogue_class=cls, steps=steps, reps=reps, seed=seed, methods=chosen,
               attention=attention,
               measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    (out / "env.json").write_text(json.dumps(env, indent=1))
    (out / "summary.json").write_text(json.dumps(per_run, indent=1))
    typer.echo(f"{env.get('name', env['device'])} charged as class {cls}: {len(rows_all)} rows -> "
               f"{out / 'steps.csv'}")
    for run_dir, s in per_run.items():
        for method, m in s["summary"].items():
            if not m.get("steps"):
                typer.echo(f"{run_dir} {method}: no step measured")
                continue
            typer.echo(f"{run_dir} {method} (rule {RULE_OF[method]}): {m['steps']} steps, "
                       f"model/measured median {m['ratio_median']:.3f} (p10 {m['ratio_p10']:.3f}, "
                       f"p90 {m['ratio_p90']:.3f}), sums {m['model_ms_sum']:.2f} / "
                       f"{m['measured_ms_sum']:.2f} ms = {m['ratio_of_sums']:.3f}")

