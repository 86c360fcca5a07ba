"""Backends by name, one constructor signature (issue 15).

A backend is what makes time pass and bytes move for a run that is already set up:
it takes the run's setup (``RunSetup``: spec, cluster, deployment, router, requests),
the writer its records go to, and whether to show progress, and ``run()`` returns its
counters (a dataclass or a dict), which the runner writes into ``run.json``. Everything
else (placement, routing, the token-layer core, the step scheduler, the request-progress
rule, metrics) is shared, so a backend differs from another only in time and transport.

The registry maps the spec's ``backend`` name to a ``module:Class`` path imported on
first use, as the router registry does: the emulator needs root and Mininet, which a
simulator run must not import.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .records import RecordWriter
    from .setup import RunSetup

#: name -> ``module:Class``; the spec's ``backend`` field takes these names
BACKENDS = MappingProxyType({
    "sim": "testbed.sim.backend:SimBackend",  # discrete events on modeled time
    "emu": "testbed.emu.backend:EmuBackend",  # Mininet hosts, real workers and sockets, dilated
})


class Backend(Protocol):
    """What the runner needs of a backend."""

    def __init__(self, setup: RunSetup, writer: RecordWriter, progress: bool = False) -> None: ...

    def run(self) -> Any:
        """Run the setup's requests to completion, writing records to the writer; returns
        the run's counters (a dataclass or a dict)."""


def backend_class(name: str) -> type[Backend]:
    """The backend class registered under ``name``."""
    if name not in BACKENDS:
        raise KeyError(f"unknown backend {name!r}; known: {', '.join(sorted(BACKENDS))}")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def run_backend(setup: RunSetup, writer: RecordWriter, progress: bool = False) -> dict:
    """Run ``setup`` on the backend its spec names; its counters and the set-up's notes
    (e.g. the calibrated decision time) as one plain dict for ``run.json``."""
    stats = backend_class(setup.spec.backend)(setup, writer, progress=progress).run()
    if dataclasses.is_dataclass(stats):
        stats = dataclasses.asdict(stats)
    return {**stats, **setup.notes}
