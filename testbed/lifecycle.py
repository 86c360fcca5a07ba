"""Process lifetimes: children that die with their parent, SIGTERM handled as Ctrl-C.

A killed runner must not leave work running (issue 14): emulator workers and sweep pool
processes ask the kernel to kill them when their parent exits, however it exits
(``PR_SET_PDEATHSIG``, Linux), and the runner treats SIGTERM (and a SIGINT its shell
told it to ignore) like Ctrl-C so the same
``finally`` blocks tear down in order and ``run.json`` says ``interrupted``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from typing import Iterator

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent exits; exits at once
    if the parent is already gone. False where prctl is unavailable (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() == 1:  # the parent died before the call above
        os._exit(1)
    return True


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside, SIGTERM raises KeyboardInterrupt as SIGINT does (main thread only), and so
    does SIGINT where it was ignored: a shell without job control starts a background
    command (``cmd &`` in a script, ``nohup cmd &``) with SIGINT ignored, and such a run or
    sweep must still stop on ``kill -INT`` (found 2026-12-05: a sweep launched so ran on
    for a minute after it, until killed)."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    old_int = None
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        old_int = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
        if old_int is not None:
            signal.signal(signal.SIGINT, old_int)
