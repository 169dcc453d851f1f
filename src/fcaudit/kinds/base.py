"""What a kind of controller coefficient is, as one object: `Kind`, whose subclasses (one module each: gates,
mixtures, routers, tokens, depth) say everything the audit needs to know about their coefficients, and the registry
`KINDS` that names them. Nothing outside this package branches on a kind's name: the protocol's conditions, the
pre-write checks and execution ask the kind.

A kind owns: how its captured decisions are validated (`check`, `canonical`), how each condition moves its
coefficients and what budget that keeps (`move`, one method per condition, and `keep`, `budget`), its static
condition and reference (`static`, `reference`, `references`: those it takes), the work its decisions select
(`active`), what is zero by construction under it (`zero`), its default codec (`codec`, a name: the codecs live in
fcaudit.controllers, above this package, which maps it) and what its decisions mean for execution (`execution`).
Adding a kind is one subclass and `register(...)`. Imports nothing of fcaudit but its error type.
"""

from __future__ import annotations

import re
from typing import Mapping, Protocol, Sequence

import numpy as np
import torch

from fcaudit.errors import FcauditError
from fcaudit.kinds import profiles
from fcaudit.kinds.moves import DERANGE, RESAMPLE, Coeffs, resample_past, shuffle_tokens

RANDOMIZED = ("Correct", "CrossInput", "TokenShuffle", "CrossShuffle", "TokenResamplePast")  # every kind's
PAPER = RANDOMIZED + ("LayerPositionMean", "StaticProfile", "StructureRemoved")  # the paper's, for soft coefficients
STATIC_REFERENCES = tuple(profiles.REFERENCES)  # GlobalMean, SourceUniformMean, ExpertUniformMean


class Controlled(Protocol):
    """What a kind reads of the controller its sites are part of: fcaudit.kinds.description.Description, which is
    built on this module (so this module names it by what it reads, not by importing it)."""

    always: tuple[int, ...]
    draws: tuple[tuple[int, ...], ...]
    layers: tuple[tuple[int, ...], ...]
    of: tuple["Kind", ...]
    references: tuple[str, ...]
    routers: tuple[int, ...]
    window: bool

    def decisions(self, i: int, c: torch.Tensor) -> torch.Tensor: ...


class Context(Protocol):
    """What a condition may use to make a batch's replay coefficients (implemented by the audit engine)."""

    seed: int
    info: Controlled  # the controller as the conditions see it: its sites' kinds, references and layers

    def take(self, examples: np.ndarray) -> Coeffs: ...  # captured coefficients of these evaluation examples
    def derangement(self, r: int) -> np.ndarray: ...  # the donor of each example in randomization r
    def static(self, condition: str, batch: int) -> Coeffs: ...  # a static profile, expanded to a batch


def method(condition: str) -> str:
    """The Kind method that makes a condition: TokenResamplePast -> token_resample_past."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", condition).lower()


class Kind:
    """What one kind of coefficient means to an audit; a controller's conditions ask the kind of its sites
    (`Description.lead`: its routers' kind where it has any; the soft kinds that may share a controller move alike).

    `conditions` are the conditions it offers; `follows` those it is replayed under when another site of the same
    controller offers them (a shared-expert gate beside top-k routers keeps its static mean under StaticTopK). A
    router's `decisions(canonical)` are its discrete choices, [batch, token, stream, *] bool: route flips, the
    causality check and the active counts read them.
    """

    name: str = ""
    conditions: tuple[str, ...] = PAPER
    reference: str = "GlobalMean"  # its structure-removed reference (a static rule of STATIC_REFERENCES, or a condition)
    references: tuple[str, ...] = STATIC_REFERENCES  # the references a site of this kind may take
    static: str = "StaticProfile"  # its own static condition: retention's default and the criteria's
    follows: tuple[str, ...] = ()
    note: str | None = None  # said with the results: why conditions are not offered
    router: bool = False  # its coefficients are discrete decisions (`decisions`)
    depth: bool = False  # decides how deep tokens go (fcaudit.kinds.depth): its sites form their controller alone
    tokens: bool = False  # chooses the tokens a block runs on (its sites form their controller alone)
    # its default codec, by name: codecs live in fcaudit.controllers, above this package, which maps the name to the
    # class; `coefficient` says what one coefficient is, `reads` what that codec reads (for a refused layout)
    codec: str | None = None
    coefficient: str = ""
    reads: str = ""
    # what its decisions mean for execution: "tokens" = counted in token x block pairs of its own blocks, "experts" =
    # the experts it runs per token (their FLOPs); None = every block's rows (soft kinds decide nothing away, depth
    # kinds decide over every block)
    execution: str | None = None
    # what `runs=` names for its sites, whose rows the audit observes on the replayed model: "block" (one routed block
    # per site: `select`), "experts" (each site's experts, in order) or "units" (the controller's blocks in order:
    # `rows`); None: nothing its decisions select can be observed
    runs: str | None = None
    slots: bool = True  # the pre-write slot check moves its coefficients between tokens (a token router's keep a set)
    # what a failed exact replay's refusal tells the user to do
    replay_fix: str = "make the output path independent of the controller's computation (and deterministic), or pass a tolerance"

    def __repr__(self) -> str:
        return f"<kind {self.name}>"

    # ---- its captured decisions ----------------------------------------------------------------------------------
    def decisions(self, c: torch.Tensor) -> torch.Tensor:
        """A router's discrete decisions in its canonical tensor c, [batch, token, stream, *] bool."""
        raise FcauditError(f"a {self.name} makes no discrete decisions")

    def check(self, site: str, c: torch.Tensor, window: bool) -> None:
        """Refuses captured coefficients this kind cannot mean (one line naming the fix); site: its name."""

    def validate(self, sites: Sequence[str], coeffs: Coeffs, window: bool) -> None:
        """Refuses the captured coefficients of its sites (named `sites`) this kind cannot mean: each site's `check`
        (a kind whose meaning spans its sites, a halting distribution over steps, adds to it)."""
        for site, c in zip(sites, coeffs):
            self.check(site, c, window)

    def canonical(self, coeffs: Coeffs) -> list[torch.Tensor]:
        """Captured coefficients as the model obeys them (exit decisions kept from a token's first exit on)."""
        return list(coeffs)

    def null(self, c: torch.Tensor) -> torch.Tensor:
        """What removes every coefficient's effect (the pre-write effect check replays it): zeros."""
        return torch.zeros_like(c)

    def everything(self, c: torch.Tensor) -> torch.Tensor | None:
        """Its decisions with nothing decided away, execution's default reference: a soft kind's own (the same graph
        runs); None where no replay of its decisions runs everything (a top-k codec keeps k experts)."""
        return c

    # ---- the conditions ------------------------------------------------------------------------------------------
    def move(self, condition: str, ctx: Context, r: int, examples: np.ndarray) -> Coeffs:
        """The batch's replay coefficients under `condition` (randomization r), kept to this kind's budget."""
        how = getattr(self, method(condition), None)
        if how is None or condition not in self.conditions + self.follows:
            raise FcauditError(f"a {self.name} does not offer {condition}; its conditions: {', '.join(self.conditions)}")
        return how(ctx, r, examples)

    def keep(self, ctx: Context, coeffs: Coeffs, r: int, examples: np.ndarray, tag: int) -> Coeffs:
        """`coeffs` received from other windows (CrossInput, TokenResamplePast) kept to the receiving windows' own
        budget, with draws keyed by the condition's `tag`: as they are for a kind without a budget."""
        return coeffs

    def budget(self, info: Controlled, coeffs: Coeffs) -> np.ndarray | None:
        """Each window's budget, int64 [batch] (what every condition keeps), or None for a kind without one."""
        return None

    def correct(self, ctx: Context, r: int, examples: np.ndarray) -> Coeffs:
        return ctx.take(examples)

    def cross_input(self, ctx: Context, r: int, examples: np.ndarray) -> Coeffs:
        """CrossInput r: each window gets its donor's whole tensor (kept to its own budget)."""
        return self.keep(ctx, ctx.take(ctx.derangement(r)[examples]), r, examples, DERANGE)

    def token_shuffle(self, ctx: Context, r: int, examples: np.ndarray) -> Coeffs:
        return shuffle_tokens(ctx.take(examples), examples, ctx.seed, r, ctx.info.draws)

    def cross_shuffle(self, ctx: Context, r: int, examples: np.ndarray) -> Coeffs:
        """The paired CrossInput donor and TokenShuffle draws."""
        return shuffle_tokens(self.cross_input(ctx, r, examples), examples, ctx.seed, r, ctx.info.draws)

    def token_resample_past(self, ctx: Context, r: int, examples: np.ndarray) -> Coeffs:
        return self.keep(ctx, resample_past(ctx.take(examples), examples, ctx.seed, r, ctx.info.draws), r, examples,
                         RESAMPLE)

    def layer_position_mean(self, ctx: Context, r: int, examples: np.ndarray) -> Coeffs:
        return ctx.static("LayerPositionMean", len(examples))

    def static_profile(self, ctx: Context, r: int, examples: np.ndarray) -> Coeffs:
        return ctx.static("StaticProfile", len(examples))

    def static_top_k(self, ctx: Context, r: int, examples: np.ndarray) -> Coeffs:
        return ctx.static("StaticTopK", len(examples))

    def structure_removed(self, ctx: Context, r: int, examples: np.ndarray) -> Coeffs:
        return ctx.static("StructureRemoved", len(examples))

    def profile(self, condition: str, cal: profiles.Calibration, info: Controlled) -> list[torch.Tensor]:
        """A static condition's profile from the calibration sums."""
        if condition == "StaticProfile":
            return cal.layer_mean()
        if condition == "StaticTopK":
            return profiles.static_top_k(cal)
        if condition == "StructureRemoved":
            return profiles.reference_profiles(cal, info)
        return cal.layer_position_mean()  # LayerPositionMean, and the per-position profiles of other static rules

    # ---- what its decisions select ---------------------------------------------------------------------------------
    def active(self, info: Controlled, coeffs: Coeffs, ran: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """Per window [B] float64: the mean over layers of the routers (of all sites without routers) of the active
        cells per (token, stream): nonzero coefficients, or a router's decisions (a token router: the fraction of
        tokens chosen). A merged layer counts once, its sites' sources side by side over its widest stream axis.
        `ran`: per site, the sources its module really ran summed over (token, stream) (`Codec.executed`)."""
        counted = set(info.routers or range(len(coeffs)))
        cells = {i: info.decisions(i, coeffs[i]) if info.of[i].router else coeffs[i] for i in sorted(counted)}
        # integer counts are exact in float64; c.bool() is what count_nonzero counts (nan yes, -0.0 no)
        counts = {i: ran[i] if i in ran else c.bool().reshape(c.shape[0], -1).sum(1).double() for i, c in cells.items()}
        layers = sorted((sites for layer in info.layers if (sites := [i for i in layer if i in counted])),
                        key=lambda sites: sites[0])
        return torch.stack([sum(counts[i] for i in sites) / (cells[sites[0]].shape[1] *
                                                             max(cells[i].shape[2] for i in sites))
                            for sites in layers]).mean(0)

    def select(self, c: torch.Tensor) -> torch.Tensor:
        """Per window [batch] int64, the rows its decisions send into the block they route (`runs` "block"): what
        the audit observes the replayed model run."""
        raise FcauditError(f"a {self.name}'s decisions route no rows into a block")

    def rows(self, coeffs: Coeffs, always: int = 0) -> list[int]:
        """The rows its decisions run in each of the controller's blocks (`runs` "units"), over the batch: what the
        audit observes the replayed model run."""
        raise FcauditError(f"a {self.name}'s decisions run no blocks")

    def zero(self, info: Controlled) -> dict[str, str]:
        """The conditions (and factor effects, "E_token") that cannot change anything under this kind for this
        controller (0 by construction, not a finding), each with why."""
        return {}


# ---- the registry ----------------------------------------------------------------------------------------------

KINDS: dict[str, Kind] = {}


def register(kind: Kind) -> Kind:
    """Adds a kind (a Kind instance with its own `name`) to the registry, for `kind=` of every site; returns it."""
    if not isinstance(kind, Kind) or not kind.name:
        raise FcauditError("register a Kind instance with a name (class MyKind(fca.kinds.Kind): name = 'my_kind')")
    if kind.name in KINDS and type(KINDS[kind.name]) is not type(kind):
        raise FcauditError(f"a kind {kind.name!r} is registered already; give yours another name")
    if kind.reference not in kind.references:
        raise FcauditError(f"kind {kind.name!r}: its reference {kind.reference!r} is not among its references")
    KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Removes a kind from the registry (a controller already built with it keeps working until it is asked)."""
    KINDS.pop(name, None)


def lookup(name: str) -> Kind:
    if name not in KINDS:
        raise FcauditError(f"unknown kind {name!r}; use one of {', '.join(KINDS)}")
    return KINDS[name]


def names(kinds: Sequence[Kind]) -> str:
    return ", ".join(k.name for k in kinds)
