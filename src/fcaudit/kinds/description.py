"""`Description`: a controller as the protocol, the engine, the statistics and execution see it: each site's kind
(fcaudit.kinds.base.Kind), reference and group; it answers which sites form a layer, which are routers, and the
per-layer counts, and asks its kinds (`lead`) what their coefficients mean. Imports nothing of fcaudit but its error
type and this package's base.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Mapping, Sequence

import torch

from fcaudit.errors import FcauditError
from fcaudit.kinds.base import KINDS, Kind, lookup


@dataclass(frozen=True)
class Description:
    """A controller as the audit sees it: per site its kind (a KINDS name), its reference and its group (sites of one
    group are one layer: the randomized conditions move them together); () = each kind's reference, one group per
    site. `top_k`: per site, a top-k router's experts per token, else None; `windows`: per site, whether its decisions
    are made once per window (a depth site's codec says so), else () (per token); `always`: per site, the blocks that
    always run before a depth controller's decided ones (its codec's `always`), else ().

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
    always: tuple[int, ...] = ()

    def __post_init__(self):
        n = len(self.kinds)
        of = [lookup(k) for k in self.kinds]
        references = tuple(self.references) or tuple(k.reference for k in of)
        for name, values in (("references", references), ("groups", self.groups), ("top_k", self.top_k),
                             ("windows", self.windows), ("always", self.always)):
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
        object.__setattr__(self, "always", tuple(self.always) or (0,) * n)
        if self.of[0].depth and len(set(self.windows)) > 1:
            raise FcauditError("decisions made once per window and once per token cannot share a depth controller; "
                               "give each its own controller")

    @cached_property
    def of(self) -> tuple[Kind, ...]:
        """Each site's Kind."""
        return tuple(KINDS[k] for k in self.kinds)

    @cached_property
    def lead(self) -> Kind:
        """The kind the conditions ask how coefficients move: the routers' where there are any, else the first
        site's (the soft kinds that may share a controller move alike)."""
        return next((k for k in self.of if k.router), self.of[0])

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
    def depth(self) -> bool:
        """Whether it decides how deep tokens go (a depth controller: fcaudit.kinds.depth)."""
        return self.lead.depth

    @property
    def window(self) -> bool:
        """Whether a depth controller decides once per window (every token of a window goes as deep)."""
        return bool(self.depth) and self.windows[0]

    def canonical(self, coeffs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Captured coefficients as the model obeys them (its kind's `canonical`: exit decisions kept from a token's
        first exit on)."""
        return self.lead.canonical(coeffs)

    def validate(self, names: Sequence[str], coeffs: Sequence[torch.Tensor]) -> None:
        """Refuses captured coefficients a site's kind cannot mean (`Kind.validate`, per kind over its sites);
        `names`: the sites' names."""
        for kind in {k.name: k for k in self.of}.values():
            sites = [i for i, k in enumerate(self.of) if k is kind]
            kind.validate([names[i] for i in sites], [coeffs[i] for i in sites], self.window)

    @property
    def tokens(self) -> bool:
        """Whether its sites choose the tokens a block runs on (a controller of token routers only)."""
        return self.lead.tokens

    @cached_property
    def conditions(self) -> frozenset[str]:
        """The conditions some site offers (every other site follows them)."""
        return frozenset(c for k in self.of for c in k.conditions)

    @property
    def static(self) -> str:
        """The controller's own static condition: its routers' (StaticTopK; depth: StaticDepth) where it has any, else
        StaticProfile."""
        return self.lead.static

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
        """Per window [B] float64: the work its decisions select (`Kind.active`): the mean over layers of the routers
        (of all sites without routers) of the active cells per (token, stream); a depth controller's fraction of the
        (layer, token) pairs it could run that run. `ran`: per site, the sources its module really ran summed over
        (token, stream) (`Codec.executed`)."""
        return self.lead.active(self, coeffs, ran or {})

    def decided(self, coeffs: Sequence[torch.Tensor]) -> float:
        """The share of the work its decisions select, over the windows of `coeffs` (canonical): the tokens a token
        router chose, the (layer, token) pairs a depth controller runs, an expert router's experts per token of its
        E (the widest source axis of its routers); 1.0 without routers (a soft gate or mixture runs everything)."""
        if not self.routers:
            return 1.0
        share = float(self.active(coeffs).mean())
        return share if self.tokens or self.depth else share / max(coeffs[i].shape[3] for i in self.routers)

    def everything(self, coeffs: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """Its decisions with nothing decided away (each kind's `everything`), or None where some kind has none."""
        out = [k.everything(c) for k, c in zip(self.of, coeffs)]
        return None if any(c is None for c in out) else out

    def top(self, coeffs: Sequence[torch.Tensor]) -> int:
        """A depth controller's most units a token can execute (blocks or steps, with the blocks that always run);
        one per site for any other controller."""
        return self.lead.top(coeffs) + self.always[0] if self.depth else len(coeffs)

    @cached_property
    def zero(self) -> dict[str, str]:
        """The conditions that cannot change anything for this controller (ΔNLL 0 by construction), each with why."""
        return {c: why for c, why in self.lead.zero(self).items() if c in self.conditions or c.startswith("E_")}
