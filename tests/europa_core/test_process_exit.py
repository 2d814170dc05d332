"""``exit_now`` leaves as ``sys.exit`` would, less the interpreter's teardown: the exit
code, the other threads finished, atexit functions run, buffered output written; and
under a profiler it is ``sys.exit``."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import atexit, sys, threading, time
from europa.core.process_exit import exit_now
def late_writer():
    time.sleep(0.3)
    print("thread finished")
threading.Thread(target=late_writer).start()
atexit.register(lambda: print("atexit ran"))
sys.stdout.write("buffered, no newline")
exit_now(3)
"""


def test_exit_now_keeps_the_code_the_threads_the_atexit_functions_and_the_output():
    process = subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60
    )
    assert process.returncode == 3
    assert process.stdout == "buffered, no newlinethread finished\natexit ran\n"


def test_under_a_profiler_the_process_exits_normally_so_the_profile_is_written(tmp_path):
    script, profile = tmp_path / "leave.py", tmp_path / "leave.prof"
    script.write_text("from europa.core.process_exit import exit_now\nexit_now(0)\n")
    process = subprocess.run(
        [sys.executable, "-m", "cProfile", "-o", str(profile), str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert process.returncode == 0, process.stderr
    assert profile.stat().st_size > 0
