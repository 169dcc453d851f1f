"""The kinds of controller coefficient, each defined once: which conditions are meaningful for it, its own static
condition and structure-removed reference, and, for a router, which cells of its canonical tensor are its discrete
decisions. `Description` is a controller as the protocol, the engine, the statistics and execution see it: each
site's kind, reference and group; it answers which sites form a layer, which are routers, and the per-layer counts.

A new kind is one more entry in KINDS, with its conditions registered in fcaudit.protocol. The depth kinds (exit
depth, halting weights, skip masks: fcaudit.depth) have their own conditions, which keep each window's budget of
executed (layer, token) pairs. Imports nothing of fcaudit but its error type and fcaudit.depth.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Mapping, Sequence

import torch

from fcaudit import depth as depths
from fcaudit.errors import FcauditError

RANDOMIZED = ("Correct", "CrossInput", "TokenShuffle", "CrossShuffle", "TokenResamplePast")  # every kind's
PAPER = RANDOMIZED + ("LayerPositionMean", "StaticProfile", "StructureRemoved")  # the paper's, for soft coefficients
STATIC_REFERENCES = ("GlobalMean", "SourceUniformMean", "ExpertUniformMean")  # the rules of fcaudit.protocol
TOKEN_NOTE = ("token routing: LayerPositionMean, StaticProfile and GlobalMean are not offered (the mean of a 0/1 "
              "choice is no set of k tokens); StaticTopK and RandomRoute keep each window's budget")
DEPTH = RANDOMIZED + ("StaticDepth",)  # every depth kind's, each with its structure-removed reference
DEPTH_NOTE = ("depth: LayerPositionMean, StaticProfile and GlobalMean are not offered (the mean of exits or of run/skip "
              "choices is no depth); every condition keeps each window's budget of executed (layer, token) pairs")


def chosen(c: torch.Tensor) -> torch.Tensor:
    """[batch, token] bool: the tokens a token router chose, from its canonical [batch, token, 1, (score, chosen)]."""
    return c[:, :, 0, 1] > 0.5


def _chosen_cells(c: torch.Tensor) -> torch.Tensor:
    return chosen(c)[:, :, None, None]


def _nonzero(c: torch.Tensor) -> torch.Tensor:
    return c != 0


def _decided(c: torch.Tensor) -> torch.Tensor:
    return c > 0.5


@dataclass(frozen=True)
class Kind:
    """What one kind of coefficient means to an audit.

    `conditions` are the conditions it offers; `follows` those it is replayed under when another site of the same
    controller offers them (a shared-expert gate beside top-k routers keeps its static mean under StaticTopK). A
    router's `decisions(canonical)` are its discrete choices, [batch, token, stream, *] bool: route flips, the
    causality check and the active counts read them.
    """

    name: str
    conditions: tuple[str, ...]
    reference: str  # its structure-removed reference (a static rule of STATIC_REFERENCES, or a condition)
    references: tuple[str, ...] = STATIC_REFERENCES  # the references a site of this kind may take
    static: str = "StaticProfile"  # its own static condition: retention's default and the criteria's
    decisions: Callable[[torch.Tensor], torch.Tensor] | None = None
    follows: tuple[str, ...] = ()
    note: str | None = None  # said with the results: why conditions are not offered
    depth: bool = False  # decides how deep tokens go (fcaudit.depth): its sites form their controller alone

    @property
    def router(self) -> bool:
        return self.decisions is not None


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("scalar_gate", PAPER, "GlobalMean", follows=("StaticTopK",)),
    Kind("vector_gate", PAPER, "GlobalMean", follows=("StaticTopK",)),
    Kind("source_mixture", PAPER, "SourceUniformMean", follows=("StaticTopK",)),
    Kind("expert_router", PAPER + ("StaticTopK",), "ExpertUniformMean", static="StaticTopK", decisions=_nonzero),
    Kind("capacity_router", PAPER + ("StaticTopK",), "ExpertUniformMean", static="StaticTopK", decisions=_nonzero),
    Kind("token_router", RANDOMIZED + ("StaticTopK", "RandomRoute"), "RandomRoute", ("RandomRoute",),
         static="StaticTopK", decisions=_chosen_cells, note=TOKEN_NOTE),
    Kind("exit_depth", DEPTH + ("RandomExit",), "RandomExit", ("RandomExit",), static="StaticDepth",
         decisions=_decided, note=DEPTH_NOTE, depth=True),
    Kind("halting", DEPTH + ("RandomHalt",), "RandomHalt", ("RandomHalt",), static="StaticDepth",
         decisions=_nonzero, note=DEPTH_NOTE, depth=True),
    Kind("skip_mask", DEPTH + ("RandomSkip",), "RandomSkip", ("RandomSkip",), static="StaticDepth",
         decisions=_decided, note=DEPTH_NOTE, depth=True),
)}


def lookup(name: str) -> Kind:
    if name not in KINDS:
        raise FcauditError(f"unknown kind {name!r}; use one of {', '.join(KINDS)}")
    return KINDS[name]


@dataclass(frozen=True)
class Description:
    """A controller as the audit sees it: per site its kind (a KINDS name), its reference and its group (sites of one
    group are one layer: the randomized conditions move them together); () = each kind's reference, one group per
    site. `top_k`: per site, a top-k router's experts per token, else None; `windows`: per site, whether its decisions
    are made once per window (a depth site's codec says so), else () (per token).

    Examples
    --------
    >>> from fcaudit.kinds import Description
    >>> d = Description(("source_mixture", "scalar_gate", "source_mixture", "scalar_gate"), groups=(0, 0, 1, 1))
    >>> d.layers, d.references[:2], d.static
    (((0, 1), (2, 3)), ('SourceUniformMean', 'GlobalMean'), 'StaticProfile')
    """

    kinds: tuple[str, ...]
    references: tuple[str, ...] = ()
    groups: tuple[int, ...] = ()
    top_k: tuple[int | None, ...] = ()
    windows: tuple[bool, ...] = ()

    def __post_init__(self):
        n = len(self.kinds)
        of = [lookup(k) for k in self.kinds]
        references = tuple(self.references) or tuple(k.reference for k in of)
        for name, values in (("references", references), ("groups", self.groups), ("top_k", self.top_k),
                             ("windows", self.windows)):
            if values and len(values) != n:
                raise FcauditError(f"{len(values)} {name} for {n} sites; give one per site")
        odd = next(((k, r) for k, r in zip(of, references) if r not in k.references), None)
        if odd is not None:
            raise FcauditError(f"a {odd[0].name} takes the reference {' or '.join(odd[0].references)}, not "
                               f"{odd[1]!r}")
        distinct = {k.name: k for k in of}.values()
        if len(distinct) > 1 and (deep := next((k for k in distinct if k.depth), None)) is not None:
            other = next(k for k in distinct if k is not deep)
            raise FcauditError(f"a {deep.name} and a {other.name} cannot be audited together (a depth controller's "
                               "conditions keep one budget over all its sites); give each kind its own controller")
        for a in distinct:  # every condition some site offers, each other site offers or follows
            for b in distinct:
                if extra := sorted(set(b.conditions) - set(a.conditions) - set(a.follows)):
                    raise FcauditError(f"a {a.name} and a {b.name} cannot be audited together (the {b.name}'s "
                                       f"{', '.join(extra)} mean nothing for the other); give each kind its own "
                                       "controller")
        object.__setattr__(self, "kinds", tuple(self.kinds))
        object.__setattr__(self, "references", references)
        object.__setattr__(self, "groups", tuple(self.groups) or tuple(range(n)))
        object.__setattr__(self, "top_k", tuple(self.top_k) or (None,) * n)
        object.__setattr__(self, "windows", tuple(self.windows) or (False,) * n)
        if self.of[0].depth and len(set(self.windows)) > 1:
            raise FcauditError("decisions made once per window and once per token cannot share a depth controller; "
                               "give each its own controller")

    @cached_property
    def of(self) -> tuple[Kind, ...]:
        """Each site's Kind."""
        return tuple(KINDS[k] for k in self.kinds)

    @cached_property
    def layers(self) -> tuple[tuple[int, ...], ...]:
        """The sites of each layer (group), layers in the order they first appear: the one grouping that draws,
        counts and the variance decomposition use."""
        out: dict[int, list[int]] = {}
        for i, g in enumerate(self.groups):
            out.setdefault(g, []).append(i)
        return tuple(tuple(sites) for sites in out.values())

    @property
    def merged(self) -> bool:
        """Whether some layer holds more than one site."""
        return len(self.layers) < len(self.kinds)

    @cached_property
    def routers(self) -> tuple[int, ...]:
        """The sites whose coefficients are discrete decisions (expert, capacity and token routers, depth)."""
        return tuple(i for i, k in enumerate(self.of) if k.router)

    @cached_property
    def draws(self) -> tuple[tuple[int, ...], ...]:
        """The sites each randomized draw moves together: each layer's (`layers`); a depth controller's all at once,
        so that a token's whole depth moves as one."""
        return (tuple(range(len(self.kinds))),) if self.depth else self.layers

    @property
    def depth(self) -> str | None:
        """The depth kind of a depth controller (fcaudit.depth), else None."""
        return self.kinds[0] if self.of[0].depth else None

    @property
    def window(self) -> bool:
        """Whether a depth controller decides once per window (every token of a window goes as deep)."""
        return bool(self.depth) and self.windows[0]

    def canonical(self, coeffs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Captured coefficients as the model obeys them: exit decisions kept from a token's first exit on
        (`fcaudit.depth.canonical`); every other kind as it is."""
        return depths.canonical(self.depth, coeffs) if self.depth else list(coeffs)

    def decided(self, coeffs: Sequence[torch.Tensor]) -> float:
        """The share of the work its decisions select, over the windows of `coeffs` (canonical): the tokens a token
        router chose, the (layer, token) pairs a depth controller runs, an expert router's experts per token of its
        E (the widest source axis of its routers); 1.0 without routers (a soft gate or mixture runs everything)."""
        if not self.routers:
            return 1.0
        share = float(self.active(coeffs).mean())
        return share if self.tokens or self.depth else share / max(coeffs[i].shape[3] for i in self.routers)

    def top(self, coeffs: Sequence[torch.Tensor]) -> int:
        """A depth controller's most units a token can execute (blocks, steps or skippable blocks); 1 per site else."""
        return depths.top(self.depth, coeffs) if self.depth else len(coeffs)

    @property
    def tokens(self) -> bool:
        """Whether its sites choose the tokens a block runs on (a controller of token routers only)."""
        return "token_router" in self.kinds

    @cached_property
    def conditions(self) -> frozenset[str]:
        """The conditions some site offers (every other site follows them)."""
        return frozenset(c for k in self.of for c in k.conditions)

    @property
    def static(self) -> str:
        """The controller's own static condition: its routers' (StaticTopK; depth: StaticDepth) where it has any, else
        StaticProfile."""
        return next((k.static for k in self.of if k.router), self.of[0].static)

    @property
    def notes(self) -> tuple[str, ...]:
        """What its kinds say with the results (why conditions are not offered)."""
        return tuple(dict.fromkeys(k.note for k in self.of if k.note))

    def decisions(self, i: int, c: torch.Tensor) -> torch.Tensor:
        """Router site i's discrete decisions in its canonical tensor c, [batch, token, stream, *] bool."""
        return self.of[i].decisions(c)

    def changed(self, i: int, a: torch.Tensor, b: torch.Tensor) -> int:
        """The (window, token, stream) cells of router site i whose decisions differ between a and b."""
        return int((self.decisions(i, a) != self.decisions(i, b.to(a.device))).any(-1).sum())

    def active(self, coeffs: Sequence[torch.Tensor], ran: Mapping[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Per window [B] float64: the mean over layers of the routers (of all sites without routers) of the active
        cells per (token, stream): nonzero coefficients, or a router's decisions (a token router: the fraction of
        tokens chosen). A merged layer counts once, its sites' sources side by side over its widest stream axis.
        `ran`: per site, the sources its module really ran summed over (token, stream) (`Codec.executed`). A depth
        controller: the fraction of the (layer, token) pairs it could run that run (`fcaudit.depth.executed`)."""
        if self.depth:
            return depths.executed(self.depth, coeffs, self.window)
        ran = ran or {}
        counted = set(self.routers or range(len(coeffs)))
        cells = {i: self.decisions(i, coeffs[i]) if self.of[i].router else coeffs[i] for i in sorted(counted)}
        # integer counts are exact in float64; c.bool() is what count_nonzero counts (nan yes, -0.0 no)
        counts = {i: ran[i] if i in ran else c.bool().reshape(c.shape[0], -1).sum(1).double() for i, c in cells.items()}
        layers = sorted((sites for layer in self.layers if (sites := [i for i in layer if i in counted])),
                        key=lambda sites: sites[0])
        return torch.stack([sum(counts[i] for i in sites) / (cells[sites[0]].shape[1] *
                                                             max(cells[i].shape[2] for i in sites))
                            for sites in layers]).mean(0)
