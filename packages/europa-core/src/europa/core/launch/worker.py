"""One local worker started by ``launch_local_workers``: reads the resolved config
from the run directory and trains as the rank torch's launcher assigned, from the
checkpoint the launcher chose for this start of the workers (``launch.resume``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from europa.core.errors import WorkerFailed, is_user_error, one_line
from europa.core.launch.orphan import exit_with_launcher
from europa.core.run_dir import worker_error_file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="europa-worker")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--resume-from-older", action="store_true")
    args = parser.parse_args(argv)
    exit_with_launcher()
    rank = int(os.environ.get("RANK", "0"))
    try:
        from europa.core.launch.progress import RankProgress

        RankProgress(args.run_dir, rank).mark("starting")  # the pid, for the launcher
        from europa.core.launch.distributed import detect_launcher
        from europa.core.launch.resume import resume_from_environment
        from europa.core.session import load_run_config
        from europa.core.train.loop import run_training

        config, plugins = load_run_config(args.run_dir)
        place = detect_launcher()
        if place is None:
            print(
                "europa: error (worker): RANK/WORLD_SIZE are not set: expected to be "
                "started by torch's launcher",
                file=sys.stderr,
            )
            return 2
        run_training(
            config,
            args.run_dir,
            place,
            plugins,
            resume_from=resume_from_environment(),
            from_older=args.resume_from_older,
        )
    except WorkerFailed as err:  # lost contact with a rank that died: the launcher names it
        print(f"europa: error (worker): {err}", file=sys.stderr)
        return err.exit_code
    except Exception as err:
        if not is_user_error(err):
            raise
        # The launcher prints the first failed rank's line, once, for all ranks.
        report = worker_error_file(args.run_dir, rank)
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(f"{one_line(err)}\n")
        return 2
    except KeyboardInterrupt:
        return 130  # Ctrl-C reached every process; the launcher reports it once
    return 0


if __name__ == "__main__":
    from europa.core.process_exit import exit_now

    try:
        code = main()
    except Exception:
        # Reported as Python reports an uncaught error (its traceback, exit code 1), then
        # gone at once: a rank still in its teardown would let the ranks that lost contact
        # with it exit first, and the launcher would name one of them as the first failure.
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_now(code)
