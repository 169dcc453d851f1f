"""transformers' logged warnings held while fcaudit may still refuse: a refusal's one line is all a user reads, not
the warnings about the config.json values that led to it. Used by whatever loads or runs a Hugging Face model."""

from __future__ import annotations

import contextlib
import functools
import logging

_HOLDING: list[list[tuple[logging.Handler, logging.LogRecord]]] = []  # the blocks holding warnings, innermost last


@contextlib.contextmanager
def warnings_held():
    """transformers' logged warnings held until the block ends, then shown (or handed to the block around it); where
    the block raises, dropped: a refusal's one line is all that is printed, not the warnings about the config.json
    values that led to it, or those of the load before a controller is refused."""
    kept: list[tuple[logging.Handler, logging.LogRecord]] = []
    holds = [(h, functools.partial(lambda h, record: kept.append((h, record)), h))  # None: the record is dropped
             for h in logging.getLogger("transformers").handlers]  # none until transformers is imported
    for h, hold in holds:
        h.addFilter(hold)
    _HOLDING.append(kept)
    try:
        yield
    finally:
        _HOLDING.pop()
        for h, hold in holds:
            h.removeFilter(hold)
    if _HOLDING:
        _HOLDING[-1].extend(kept)
    else:
        for h, record in kept:
            h.handle(record)
