"""Each seed's emulated ratio beside the jittered simulator's (analysis/seed_scatter.py,
``python -m analysis seed-scatter``), on folders laid out as agree-sweep leaves them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from analysis.seed_scatter import sweep_scatter
from testbed.runner import run_experiment
from testbed.spec import parse_spec

TINY = {"topology": "small3", "workload": {"model": "switch", "duration_s": 0.4, "warmup_s": 0.1,
                                           "rate_per_s": 60, "calibration_tokens": 64,
                                           "gen_tokens": 0}}
REL = "name=hetroute,rate_per_s=60"


def _as_emulated(src, dst):
    """A simulated run filed as the emulated run of its seed."""
    shutil.copytree(src, dst)
    info = json.loads((dst / "run.json").read_text())
    (dst / "run.json").write_text(json.dumps({**info, "backend": "emu"}))


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """agree-sweep's twins of seeds 0 and 1: exact and under 10 us of hop jitter."""
    root = tmp_path_factory.mktemp("scatter")
    for s in (0, 1):
        spec = parse_spec({**TINY, "seed": s})
        run_experiment(spec, root / "agree" / REL / f"seed{s}", progress=False)
        run_experiment(spec.with_overrides({"sim.hop_jitter_s": 1e-5}),
                       root / "agree" / REL / f"seed{s}-jitter1e-05", progress=False)
    return root


def test_an_emulator_that_strays_as_the_jittered_simulator_does_scatters_as_it(twins, tmp_path):
    agree = tmp_path / "agree"
    shutil.copytree(twins / "agree", agree)
    _as_emulated(agree / REL / "seed0-jitter1e-05", tmp_path / "sweep" / REL / "seed0")
    _as_emulated(agree / REL / "seed1-jitter1e-05", agree / REL / "emu-seed1")
    (p,) = sweep_scatter(tmp_path / "sweep", agree)
    assert p.seeds == [0, 1] and set(p.sides) == {"emu", "1e-05"}
    for metric in ("work", "mean"):
        e, j = p.sides["emu"][metric], p.sides["1e-05"][metric]
        np.testing.assert_array_equal(e.ratios, j.ratios)
    np.testing.assert_array_equal(p.forks["emu"], p.forks["1e-05"])
    moved = [m for m in ("work", "mean") if p.sides["1e-05"][m].rms() > 0]
    assert moved, "10 us of jitter moved nothing: the check below would be empty"
    for m in moved:
        q, lo, hi = p.quotient("1e-05", m)
        assert q == pytest.approx(1) and lo == pytest.approx(1) and hi == pytest.approx(1)


def test_an_emulator_exact_to_the_simulator_does_not_scatter_and_bad_folders_are_said(twins, tmp_path):
    agree = tmp_path / "agree"
    shutil.copytree(twins / "agree", agree)
    _as_emulated(agree / REL / "seed0", tmp_path / "sweep" / REL / "seed0")
    (p,) = sweep_scatter(tmp_path / "sweep", agree)
    assert p.seeds == [0]  # seed 1 has twins but no emulated run
    assert p.sides["emu"]["work"].rms() == 0 and p.sides["emu"]["work"].out(0.05) == 0
    assert np.isnan(p.forks["emu"][0, 0]) and p.forks["emu"][0, 1] == 0  # never parts
    assert p.forks["emu"][0, 2] == 0  # (nothing parted, so no decision fork either)
    assert p.forks["1e-05"][0, 1] > 0  # the jittered twin's starts moved
    cli = subprocess.run([sys.executable, "-m", "analysis", "seed-scatter", str(tmp_path / "sweep"),
                          str(agree), "--per-seed"], capture_output=True, text=True)
    assert cli.returncode == 0 and "rms 0.000" in cli.stdout
    assert "seed=0 mean emu=1.0000" in cli.stdout and "seed=1 " not in cli.stdout
    bad = subprocess.run([sys.executable, "-m", "analysis", "seed-scatter", str(tmp_path / "sweep"),
                          str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 2 and "has a folder under" in bad.stderr
