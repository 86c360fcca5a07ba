"""The fidelity command never crashes on a failed probe: it becomes a failed check with
what the probe said (issue 14). Runs without root: a stand-in network runs the probes as
local processes."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

from testbed.emu import fidelity


class _FakeNet:
    """Just what measure_rtts uses: pong waits for its newline, ping fails or answers."""

    def __init__(self, ping_code: str):
        self.cluster = SimpleNamespace(n=2)
        self.ping_code = ping_code

    def transport_delays(self):
        return [[0.0, 0.0], [0.0, 0.0]]

    def addr(self, i, j):
        return "127.0.0.1"

    def popen(self, i, args, **kw):
        code = "import sys; sys.stdin.readline()" if "pong" in args else self.ping_code
        return subprocess.Popen([sys.executable, "-c", code], **kw)


def test_a_probe_that_dies_is_a_failed_check_with_its_stderr():
    net = _FakeNet("import sys; sys.stderr.write('Traceback...\\nOSError: no route to host\\n'); sys.exit(3)")
    out = fidelity.measure_rtts(net, [(0, 1)], count=3)
    assert isinstance(out[(0, 1)], fidelity.ProbeFailed)
    assert "exit 3" in out[(0, 1)] and "OSError: no route to host" in out[(0, 1)]


def test_a_probe_that_answers_is_read():
    out = fidelity.measure_rtts(_FakeNet("print('[0.001, 0.002]')"), [(0, 1)], count=2)
    assert out[(0, 1)] == [0.001, 0.002]


def test_lateness_flags_say_their_units():
    """Release lateness is measured on the wall clock: the flag says so and gives the
    emulated equivalent (issue 14: flags say their units)."""
    from testbed.emu.backend import fidelity_summary
    flags = fidelity_summary({"dilation": 32, "workers": [
        {"rank": 0, "late_over_tolerance": 174, "release_late_p99_ms": 7.94}]})["flags"]
    assert flags == ["w0: 174 releases late beyond 5% of their service time (p99 7.94 ms of "
                     "wall time = 0.248 ms emulated at T=32)"]


def test_a_worker_whose_kernels_outlast_their_padding_is_flagged():
    from testbed.emu.backend import fidelity_summary
    ok = fidelity_summary({"dilation": 32, "workers": [  # a step now and then is host noise
        {"rank": 1, "kernel_over_padding": 2, "kernel_padding_share_p99": 0.45}]})["flags"]
    bad = fidelity_summary({"dilation": 32, "workers": [
        {"rank": 1, "kernel_over_padding": 3, "kernel_padding_share_p99": 1.7}]})["flags"]
    assert ok == [] and len(bad) == 1 and bad[0].startswith("w1: 3 steps whose real kernels")
    assert "p99 1.70" in bad[0]
    # under 100 steps one preempted kernel is the p99 by itself: still noise (it failed the
    # small3 smoke run once on this host: w2, 1 step at 1.53 of its padding)
    few = fidelity_summary({"dilation": 32, "workers": [
        {"rank": 2, "batches": 60, "kernel_over_padding": 1, "kernel_padding_share_p99": 1.53}]})
    many = fidelity_summary({"dilation": 32, "workers": [
        {"rank": 2, "batches": 1000, "kernel_over_padding": 11, "kernel_padding_share_p99": 1.2}]})
    assert few["flags"] == [] and len(many["flags"]) == 1


def test_jobs_that_missed_their_step_are_flagged_over_one_percent():
    """A job whose modeled arrival is before a step's start but that reached the stream
    after it started changes that step's batch (the simulator runs it in it)."""
    from testbed.emu.backend import fidelity_summary
    few = fidelity_summary({"dilation": 32, "workers": [
        {"rank": 1, "jobs": 1000, "jobs_missed_step": 9, "missed_late_ms_p99": 4.0}]})["flags"]
    many = fidelity_summary({"dilation": 32, "workers": [
        {"rank": 1, "jobs": 1000, "jobs_missed_step": 11, "missed_late_ms_p99": 4.0}]})["flags"]
    assert few == [] and many == [
        "w1: 11 jobs (1.1%) delivered late for the step they had arrived for (p99 4.00 ms of "
        "wall time after its start): the simulator runs them in it; raise T"]


def test_one_early_burst_message_fails_the_check_but_one_late_one_does_not():
    """A shaper leak shows in any message (deterministic); a late one can be the host's
    scheduler, so slowness is judged on the median."""
    floor, full = 0.050, 0.060
    assert fidelity.burst_ok([0.061, 0.062, 0.0726, 0.063], floor, full)  # CI's outlier
    assert not fidelity.burst_ok([0.061, 0.040, 0.062, 0.063], floor, full)  # one leaked
    assert not fidelity.burst_ok([0.075, 0.072, 0.071, 0.061], floor, full)  # the link is slow
