"""The one exception type for user mistakes.

Anything a user can fix (a bad config key, a missing file, a malformed prompt line) raises
FlowGrpoError with a message that says what is wrong and where. The CLI prints it without a
traceback and exits 1; any other exception is a bug and keeps its traceback.
"""

import errno
import os


class FlowGrpoError(Exception):
    """A user-facing error: the message alone must tell the user what to fix."""


# OS errors a user fixes on their machine, not in flowgrpo, with what to do about each. They
# become one-line messages naming the file.
_STORAGE_HINTS = {
    errno.ENOSPC: "free some space, or move the run to a larger disk",
    errno.EDQUOT: "free some space within your quota",
    errno.EROFS: "give a run folder on a writable file system",
    errno.EACCES: "check the owner and mode of the file and its folder",
    errno.EPERM: "check the owner and mode of the file and its folder",
    errno.EFBIG: "the file outgrew a size limit: raise the shell's `ulimit -f`, or move the run "
    "to a file system that takes larger files",
    errno.ENAMETOOLONG: "choose a shorter run path (a name may have 255 bytes, a path 4096)",
}


def storage_error(err: OSError, path: object = None) -> FlowGrpoError | None:
    """`err` as a FlowGrpoError naming `path` (or the file the OS named) when it is a full or
    read-only disk, a permission error, a file-size limit or a path too long; None for any
    other error, which stays a bug and keeps its traceback."""
    if err.errno is None or (hint := _STORAGE_HINTS.get(err.errno)) is None:
        return None
    where = path if path is not None else err.filename
    prefix = f"{where}: " if where is not None else ""
    return FlowGrpoError(f"{prefix}{os.strerror(err.errno)}; {hint}")
