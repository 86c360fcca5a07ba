"""Sweep points as Ray tasks: on a local Ray instance or an existing Ray cluster (issue 16).

Each point runs the same function the local process pool runs (``sweep._run_one``), so a
point's folder is written the same way and the skip rule (``runner.is_done``, checked by
the sweep before anything is submitted) decides what a re-run repeats. The workers write
into the sweep's results folder themselves: on a cluster it must be a filesystem that every
node mounts at the same path.

Ray is imported here only, so the testbed runs without it. A local instance is stopped
with ``ray.shutdown()`` on any end, signals included; a SIGKILLed sweep takes it along too:
its GCS server, raylet and workers go within seconds on their own, but Ray's per-node agents
were seen to linger about a minute, so a small guard process kills every process of the
instance the moment the sweep's process is gone.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from .lifecycle import sigterm_as_interrupt
from .spec import SpecError

if TYPE_CHECKING:
    from tqdm import tqdm

    from .sweep import Point

INSTALL_HINT = "pip install 'hetroute-testbed[ray]'"

# Reads its stdin to EOF, which comes when the sweep exits however it exits, then kills the
# processes named on its command line (psutil refuses a pid that was reused meanwhile).
_GUARD = """
import sys, psutil
procs = []
for pid in sys.argv[1:]:
    try:
        procs.append(psutil.Process(int(pid)))
    except psutil.Error:
        pass
sys.stdin.read()
for p in procs:
    try:
        p.kill()
    except psutil.Error:
        pass
"""


def import_ray() -> Any:
    """The ``ray`` module, or a one-line SpecError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise SpecError(f"executor ray: Ray is not installed ({INSTALL_HINT})") from None
    return ray


class RaySession:
    """One connection to Ray for one sweep: ``start``, then ``run``, then ``stop``.

    Without ``address`` a local instance with ``jobs`` CPUs is started (and stopped at the
    end); with one (``auto`` or ``host:port``) the sweep joins that cluster as a driver and
    leaves it running when it is done.
    """

    def __init__(self, jobs: int, address: str | None = None) -> None:
        self.ray = import_ray()
        self.jobs, self.address = jobs, address
        self.slots = jobs
        self._guard: subprocess.Popen | None = None

    def start(self) -> None:
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        sigterm = signal.getsignal(signal.SIGTERM)
        try:
            self.ray.init(address=self.address, num_cpus=None if self.address else self.jobs,
                          include_dashboard=False, logging_level=logging.WARNING)
        except ConnectionError as err:  # no cluster at that address
            raise SpecError(f"executor ray: cannot connect to {self.address}: "
                            f"{' '.join(str(err).split())[:200]}") from None
        if threading.current_thread() is threading.main_thread():
            # ray.init makes SIGTERM exit at once; the sweep's own handling stops its tasks first
            signal.signal(signal.SIGTERM, sigterm)
        if self.address is None:
            started = [p.pid for p in psutil.Process().children(recursive=True)
                       if p.pid not in before]
            self._guard = subprocess.Popen([sys.executable, "-c", _GUARD, *map(str, started)],
                                           stdin=subprocess.PIPE, start_new_session=True)
        else:  # points run one per CPU anywhere in the cluster
            self.slots = max(1, int(self.ray.cluster_resources().get("CPU", 1)))

    def run(self, todo: list[Point], cache: Path, bar: tqdm) -> list[tuple[str, str]]:
        """Run every point, one CPU each; (folder, error) of each point that failed."""
        from .sweep import _run_one

        ray = self.ray
        # a failed point is reported and rerun by the next sweep, as in the local pool
        task = ray.remote(num_cpus=1, max_retries=0)(_run_one)
        failed: list[tuple[str, str]] = []
        with sigterm_as_interrupt():
            refs = {task.remote(p, cache): p for p in todo}
            pending = list(refs)
            try:
                while pending:
                    # polled, not waited for inside Ray: a signal's KeyboardInterrupt raised
                    # there comes back without its message (which signal it was)
                    ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
                    for ref in ready:
                        try:
                            ray.get(ref)
                        except Exception as err:  # noqa: BLE001 - reported per point
                            failed.append((str(refs[ref].out_dir), repr(_cause(err))))
                        bar.update(1)
                    if not ready:
                        time.sleep(0.2)
            except BaseException:
                for ref in pending:  # the killed points' run.json says running: redone next time
                    ray.cancel(ref, force=True)
                raise
        return failed

    def stop(self) -> None:
        """Disconnect; a local instance is shut down and its guard finds nothing left."""
        try:
            self.ray.shutdown()
        finally:
            if self._guard is not None:
                self._guard.stdin.close()  # type: ignore[union-attr]
                self._guard.wait()
                self._guard = None


def _cause(err: Exception) -> BaseException:
    """The point's own exception, as the local executor reports it, not Ray's wrapper."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err
