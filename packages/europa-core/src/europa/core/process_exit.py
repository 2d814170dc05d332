"""Ending a europa process without Python's interpreter teardown.

A process that has imported torch and torchtitan spends about 1.5 s of one core, after its
work is done, tearing down its modules and objects at exit (0.5 s for torch alone; measured
on a 2-core machine). The ``europa`` command and each worker it launches have nothing left
to lose by then, so they leave through ``exit_now``: everything a normal exit runs that
can matter (other threads joined, atexit functions, stdout and stderr flushed), then
``os._exit``. A file a europa process writes is closed by the code that writes it,
never left to the teardown. Under a profiler or a tracer (``python -m cProfile``, a
coverage tool, a debugger) the process exits normally, so they can write what they
gathered after the program returns."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Exit with ``code`` as ``sys.exit`` would, less the interpreter's teardown."""
    if sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(code)
    for thread in threading.enumerate():  # as at exit: wait for non-daemon threads
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or a pipe no one reads
            stream.flush()
    os._exit(code)
