"""How a rank of `--nproc` hands its one-line error to the launching process, which prints an
error that every rank raised once (launch/distributed.py `launch_local`).

Kept apart from distributed.py, and free of torch: the CLI reaches for it on every user error,
and a mistyped config key should not cost a torch import before its message.
"""

from __future__ import annotations

import os
from pathlib import Path

# Set for the ranks `launch_local` starts: the launching process holds the run's lock for them
# and reports their errors; a rank without it was started by torchrun or another launcher.
LOCAL_RANK_ENV = "FLOWGRPO_LOCAL_RANK"
# Folder where a rank of `launch_local` leaves its one-line error instead of printing it.
ERROR_DIR_ENV = "FLOWGRPO_RANK_ERRORS"


def record_rank_error(message: str) -> bool:
    """In a rank of `launch_local`, leave `message` for the launcher to print (once, however
    many ranks raise it) and return True; elsewhere return False (print it yourself)."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder or os.environ.get(LOCAL_RANK_ENV) != "1":
        return False
    rank = int(os.environ.get("RANK", 0))
    Path(folder, f"rank-{rank}.txt").write_text(message)
    return True


def read_rank_errors(folder: Path) -> dict[int, str]:
    """rank -> the error it recorded in `folder`."""
    return {
        int(path.stem.removeprefix("rank-")): path.read_text()
        for path in sorted(folder.glob("rank-*.txt"))
    }
