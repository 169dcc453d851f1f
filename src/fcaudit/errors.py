"""The one error type users see: a one-line message that names the fix (CLI exit code 2)."""


class FcauditError(Exception):
    """Bad input or a failed check. The message is one line and says what to do."""
