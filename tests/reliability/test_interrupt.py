"""Ctrl-C in one process (the launcher's own handling is tested with real workers in
``test_dead_rank``, on the run it resumes)."""

from __future__ import annotations

import os
import signal

import pytest

from europa.core.train.stop import StopRequest


def test_in_one_process_a_first_ctrl_c_asks_to_stop_and_a_second_interrupts():
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signal_name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
