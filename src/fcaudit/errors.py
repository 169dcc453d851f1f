"""The one error type users see: a one-line message that names the fix (CLI exit code 2)."""


class FcauditError(Exception):
    """Bad input or a failed check, with a one-line message that says what to do.

    Every such error fcaudit raises is this type, so a script can tell it apart from a bug; the CLI prints the
    message and exits with code 2, and the troubleshooting page lists the messages.

    Examples
    --------
    >>> try:
    ...     fca.Criteria(confidence=1.5)
    ... except fca.FcauditError as e:
    ...     print(e)
    criteria confidence must be in (0, 1), got 1.5; e.g. 0.95
    """


def one_line(e: BaseException, limit: int = 160) -> str:
    """An exception's message on one line, cut to `limit` characters: for the part of an FcauditError that quotes
    a library's error."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."
