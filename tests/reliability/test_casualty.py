"""The launcher's line after a worker failed: the rank that died, not the ranks that
then lost contact with it (progress files written by hand)."""

from __future__ import annotations

from europa.core.launch.casualty import describe_failure
from europa.core.launch.progress import RankProgress


def test_the_rank_that_lost_contact_is_not_blamed(tmp_path):
    RankProgress(tmp_path, 0).mark("lost-contact", 7)
    RankProgress(tmp_path, 1).mark("failed", 7)
    line, code = describe_failure(tmp_path, {0: 1, 1: 1})
    assert line.startswith(
        "worker rank 1 exited with code 1 (its error is printed above) at step 7; "
        "no checkpoint was saved: start again"
    )
    assert code == 1


def test_a_rank_the_launcher_stopped_with_sigterm_is_not_blamed(tmp_path):
    """Rank 1 is killed in a save; torch's agent SIGTERMs rank 0 before it notes the
    lost contact."""
    RankProgress(tmp_path, 0).mark("saving", 4)
    RankProgress(tmp_path, 1).mark("saving", 4)
    line, code = describe_failure(tmp_path, {0: -15, 1: -9})
    assert line.startswith("worker rank 1 was killed by SIGKILL while saving the checkpoint of")
    assert code == 137
    line, code = describe_failure(tmp_path, {0: -15, 1: -15})  # a stop to both: the first
    assert line.startswith("worker rank 0 was killed by SIGTERM") and code == 143


def test_a_rank_killed_before_its_first_step(tmp_path):
    RankProgress(tmp_path, 0).mark("step", 1)
    RankProgress(tmp_path, 1).mark("starting")
    line, code = describe_failure(tmp_path, {1: -9})
    assert line.startswith("worker rank 1 was killed by SIGKILL before its first step;")
    assert code == 137
