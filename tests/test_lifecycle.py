"""A killed sweep leaves no pool process behind (issue 14): SIGTERM stops the pool and
reports an interrupt; SIGKILL of the sweep takes its pool processes along (they asked the
kernel to, testbed/lifecycle.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

#: signals and process deaths within deadlines: `make test` runs these alone
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[1]

FIG = {"figure": 97, "title": "lifecycle",
       "base": {"topology": "small3", "engine": {"decision_s": 0.0},
                "workload": {"model": "switch", "calibration_tokens": 64, "gen_tokens": 0}},
       "axes": {"workload.rate_per_s": [5, 10, 15, 20]},
       "scales": {"smoke": {"seeds": [0], "set": {"workload.duration_s": 30.0,
                                                   "workload.warmup_s": 0.1}}}}


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start(tmp_path: Path, preexec=None) -> tuple[subprocess.Popen, list[psutil.Process]]:
    spec = tmp_path / "fig.yaml"
    spec.write_text(yaml.safe_dump(FIG))
    p = subprocess.Popen([sys.executable, "-m", "testbed", "sweep", "--fig", "97", "--spec", str(spec),
                          "--scale", "smoke", "--jobs", "2", "--quiet", "--results", str(tmp_path / "r")],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=preexec)
    deadline = time.monotonic() + 120
    kids: list[psutil.Process] = []
    while time.monotonic() < deadline and len(kids) < 2:
        assert p.poll() is None, p.stderr.read()[-2000:]
        kids = psutil.Process(p.pid).children(recursive=True)
        time.sleep(0.3)
    assert len(kids) >= 2, "the pool did not start"
    time.sleep(3)  # the pool is running points
    return p, kids


def _gone(procs: list[psutil.Process], within: float) -> bool:
    _, alive = psutil.wait_procs(procs, timeout=within)
    return not alive


@pytest.mark.slow
def test_sigterm_stops_the_pool_and_says_so(tmp_path):
    p, kids = _start(tmp_path)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "interrupted" in err, err[-2000:]
    assert _gone(kids, 5), [k.pid for k in kids if k.is_running()]


@pytest.mark.slow
def test_sigint_stops_a_sweep_started_with_sigint_ignored(tmp_path):
    """A shell without job control starts ``cmd &`` with SIGINT ignored; ``kill -INT`` must
    still stop the sweep and its pool (it ran on until SIGKILL before 2026-12-05)."""
    p, kids = _start(tmp_path, preexec=_ignore_sigint)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "interrupted (signal SIGINT)" in err, err[-2000:]
    assert _gone(kids, 5), [k.pid for k in kids if k.is_running()]


@pytest.mark.slow
def test_sigkilled_sweep_takes_its_pool_along(tmp_path):
    p, kids = _start(tmp_path)
    p.kill()
    p.wait(timeout=10)
    assert _gone(kids, 5), [k.pid for k in kids if k.is_running()]
