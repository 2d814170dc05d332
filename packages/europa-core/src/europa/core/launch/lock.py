"""One training per run directory: the launcher (node 0's, or rank 0 under torchrun or
SLURM) holds an exclusive ``fcntl`` lock on ``RUN_DIR/training.lock`` for as long as it
lives, and writes its host and pid there. A second ``europa train`` (or ``--resume``) into
that directory is refused in one line naming them, before it reads or writes anything
else; the first goes on undisturbed. The kernel releases the lock when its holder exits or
dies, so a crashed run never leaves a stale lock behind (what the file still says then is
only a note). A lock on a network file system is as good as that file system's ``flock``.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from europa.core.errors import LaunchError
from europa.core.launch.prepare import check_usable
from europa.core.run_dir import LOCK_FILE


class RunDirLock:
    """Held from ``hold`` until ``release`` (or the process's end)."""

    def __init__(self, path: Path, fd: int, created: Path | None, new_file: bool) -> None:
        self.path = path
        self._fd = fd
        self.created = created  # the top directory this lock had to create, if any
        self.new_file = new_file  # the lock file was not there before

    @classmethod
    def hold(cls, run_dir: Path) -> RunDirLock:
        check_usable(run_dir)
        created = next((p for p in (*reversed(run_dir.parents), run_dir) if not p.exists()), None)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_FILE
        new_file = not path.exists()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise LaunchError(
                f"--run-dir = {str(run_dir)!r}: a training is using it ({holder}); expected "
                "a run directory no live training uses: wait for it, stop it, or choose "
                "another --run-dir"
            ) from None
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        note = f"pid {os.getpid()} on host {socket.gethostname()}, since {since}\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, note.encode(), 0)
        return cls(path, fd, created, new_file)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = -1

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
