"""The one error type users see: a one-line message that names the fix (CLI exit code 2)."""


class FcauditError(Exception):
    """Bad input or a failed check. The message is one line and says what to do."""


def one_line(e: BaseException, limit: int = 160) -> str:
    """An exception's message on one line, cut to `limit` characters: for the part of an FcauditError that quotes
    a library's error."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."
