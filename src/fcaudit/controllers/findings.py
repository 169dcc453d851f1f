"""A pre-write check's finding (`Finding`: a refusal or a notice, with what it measured) and the names of the
findings other parts of fcaudit read (the causality check's, the token routers')."""

from __future__ import annotations

from dataclasses import dataclass, field

LATER_TOKENS = "routing depends on later tokens"
CAUSALITY, TOKEN_ROUTING = "causality", "token routing"  # the router checks' findings (Finding.check)


@dataclass(frozen=True, eq=False)
class Finding:
    """One pre-write check's finding: a refusal (the audit raises FcauditError(line)) or a notice (kept in replay.json's
    "findings" and said by the CLI, the result and the report), its line for the user and what it measured.

    Attributes
    ----------
    check : str
        The check: e.g. "causality" (a router's decisions against later tokens, data `later_token_flips` and
        `windows`), "token routing", "hidden state".
    refusal : bool
        Whether it stopped the audit.
    line : str
        What the CLI, the result and the report say ("" for a check that measured but found nothing to say).
    data : dict
        What the check measured (JSON-able).

    Examples
    --------
    >>> result.replay.finding("causality") is None  # a gate controller: no router, no causality check
    True
    """

    check: str
    refusal: bool
    line: str
    data: dict = field(default_factory=dict)

    @classmethod
    def notice(cls, check: str, line: str, data: dict | None = None) -> "Finding":
        return cls(check, False, line, data or {})

    @classmethod
    def refused(cls, check: str, line: str, data: dict | None = None) -> "Finding":
        return cls(check, True, line, data or {})

    def to_json(self) -> dict:
        return {"check": self.check, "refusal": self.refusal, "line": self.line, "data": self.data}

    @classmethod
    def from_json(cls, d: dict) -> "Finding":
        """A finding as replay.json keeps it (`to_json`); ValueError for anything else."""
        found = cls(d.get("check"), d.get("refusal"), d.get("line"), d.get("data")) if isinstance(d, dict) else None
        if found is None or not (isinstance(found.check, str) and isinstance(found.refusal, bool)
                                 and isinstance(found.line, str) and isinstance(found.data, dict)):
            raise ValueError(f"not a finding: {str(d)[:80]}")
        return found
