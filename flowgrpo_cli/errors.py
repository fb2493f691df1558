"""The one exception type for user mistakes.

Anything a user can fix (a bad config key, a missing file, a malformed prompt line) raises
FlowGrpoError with a message that says what is wrong and where. The CLI prints it without a
traceback and exits 1; any other exception is a bug and keeps its traceback.
"""


class FlowGrpoError(Exception):
    """A user-facing error: the message alone must tell the user what to fix."""
