"""Token routers (Mixture-of-Depths, routed branches): per (layer, token) a score and whether the token was chosen,
canonical [batch, token, 1, (score, chosen)]. The routed block runs on the chosen tokens only, so a (score, chosen)
pair moves as one and every condition keeps each window's budget k per layer exactly; the reference is RandomRoute
(random k-sets). The mean of a 0/1 choice is no set of k tokens, so LayerPositionMean, StaticProfile and GlobalMean
are not offered. For execution a token router is counted in token x block pairs."""

from __future__ import annotations

import numpy as np
import torch

from fcaudit.kinds.base import RANDOMIZED, Context, Kind, register
from fcaudit.kinds.moves import ROUTE_PAST, ROUTE_RANDOM, Coeffs

TOKEN_NOTE = ("token routing: LayerPositionMean, StaticProfile and GlobalMean are not offered (the mean of a 0/1 "
              "choice is no set of k tokens); StaticTopK and RandomRoute keep each window's budget")


def chosen(c: torch.Tensor) -> torch.Tensor:
    """[batch, token] bool: the tokens a token router chose, from its canonical [batch, token, 1, (score, chosen)]."""
    return c[:, :, 0, 1] > 0.5


def routes_past(coeffs: Coeffs, examples: np.ndarray, seed: int, r: int) -> Coeffs:
    """TokenResamplePast for token routers: each chosen position s moves, with its score, to a uniformly drawn free
    position t >= s (latest s first, so a free one always exists); the unchosen tokens fill the other positions in
    their order. So a choice only moves later, where the tokens it was computed from are visible, and k is kept."""
    out = []
    for layer, c in enumerate(coeffs):
        picked = chosen(c).cpu().numpy()
        T = c.shape[1]
        index = np.empty(picked.shape, np.int64)
        for row, (example, mask) in enumerate(zip(examples, picked)):
            rng = np.random.default_rng([ROUTE_PAST, seed, r, int(example), layer])
            taken = np.zeros(T, bool)
            for s in np.flatnonzero(mask)[::-1]:
                free = np.flatnonzero(~taken[s:]) + s
                t = free[rng.integers(len(free))]
                taken[t] = True
                index[row, t] = s
            index[row, ~taken] = np.flatnonzero(~mask)
        out.append(torch.gather(c, 1, torch.from_numpy(index).to(c.device)[:, :, None, None].expand_as(c)))
    return out


def random_routes(coeffs: Coeffs, examples: np.ndarray, seed: int, r: int) -> Coeffs:
    """RandomRoute: per window and layer a uniformly random set of as many tokens as the router chose, each chosen
    token weighted by the mean score of the window's own chosen tokens (which tokens, and how each is weighted, are
    removed; the budget and the window's mean weight are kept)."""
    out = []
    for layer, c in enumerate(coeffs):
        picked = chosen(c)
        k = picked.sum(1).cpu().numpy()
        mean = (c[:, :, 0, 0] * picked).sum(1) / picked.sum(1).clamp_min(1)
        mask = np.zeros(picked.shape, bool)
        for row, (example, n) in enumerate(zip(examples, k)):
            rng = np.random.default_rng([ROUTE_RANDOM, seed, r, int(example), layer])
            mask[row, rng.choice(c.shape[1], int(n), replace=False)] = True
        new = torch.zeros_like(c)
        m = torch.from_numpy(mask).to(c.device)
        new[:, :, 0, 1] = m.to(c.dtype)
        new[:, :, 0, 0] = torch.where(m, mean[:, None].to(c.dtype), 0.0)
        out.append(new)
    return out


def static_routes(profile: Coeffs, taken: Coeffs) -> Coeffs:
    """StaticTopK for token routers: each window's k (as its router chose) tokens are the k positions chosen most
    often in the calibration windows (ties: the higher mean score, then the earlier position), each weighted by its
    calibration mean score (LayerPositionMean)."""
    out = []
    for p, c in zip(profile, taken):
        k = chosen(c).sum(1)
        often, score = p[0, :, 0, 1].cpu().numpy(), p[0, :, 0, 0].cpu().numpy()
        order = torch.from_numpy(np.lexsort((np.arange(len(often)), -score, -often))).to(c.device)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=order.device)
        m = rank[None, :] < k[:, None].to(rank.device)
        new = torch.zeros_like(c)
        new[:, :, 0, 1] = m.to(c.dtype)
        new[:, :, 0, 0] = torch.where(m, p[:, :, 0, 0].to(c.dtype), 0.0)
        out.append(new)
    return out


def other_choices(c: torch.Tensor) -> torch.Tensor:
    """A token router's canonical coefficients with no scores and, per window, another set of as many tokens: the
    first k of its unchosen positions, then of its chosen ones (a different set wherever 0 < k < T)."""
    picked = chosen(c)
    order = torch.argsort(picked.to(torch.int8), dim=1, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(c.shape[1], device=c.device).expand_as(order))
    out = torch.zeros_like(c)
    out[:, :, 0, 1] = (rank < picked.sum(1, keepdim=True)).to(c.dtype)
    return out


class TokenRouter(Kind):
    name = "token_router"
    conditions = RANDOMIZED + ("StaticTopK", "RandomRoute")
    reference = "RandomRoute"
    references = ("RandomRoute",)
    static = "StaticTopK"
    note = TOKEN_NOTE
    router = True
    tokens = True
    codec, coefficient, reads = "TokenRoute", "(score, chosen) per token", "TokenRoute reads a (scores, index) output"
    execution = "tokens"  # counted in token x block pairs
    compared = ("Correct", "StaticTopK", "RandomRoute")  # execution's conditions, in this order (equal budgets)
    slots = False  # its conditions keep a set of tokens
    runs = "block"  # the tokens entering its routed block (`Controller.from_modules(..., runs=)`)

    def decisions(self, c: torch.Tensor) -> torch.Tensor:
        return chosen(c)[:, :, None, None]

    def select(self, c: torch.Tensor) -> torch.Tensor:
        """The tokens chosen per window: the rows its routed block runs."""
        return chosen(c).sum(1).long()

    def null(self, c: torch.Tensor) -> torch.Tensor:
        """No scores and another set of as many tokens, so that its choices are tested too."""
        return other_choices(c)

    def everything(self, c: torch.Tensor) -> torch.Tensor:
        """Every token chosen, with its own score (a replay runs the block on every token)."""
        out = c.clone()
        out[:, :, 0, 1] = 1.0
        return out

    def budget(self, info, coeffs: Coeffs) -> np.ndarray:
        """Per window the tokens chosen over all its layers (each layer keeps its own k)."""
        return sum(chosen(c).sum(1).long() for c in coeffs).cpu().numpy()

    def token_resample_past(self, ctx: Context, r: int, examples: np.ndarray) -> Coeffs:
        return routes_past(ctx.take(examples), examples, ctx.seed, r)

    def static_top_k(self, ctx: Context, r: int, examples: np.ndarray) -> Coeffs:
        return static_routes(ctx.static("StaticTopK", len(examples)), ctx.take(examples))

    def random_route(self, ctx: Context, r: int, examples: np.ndarray) -> Coeffs:
        return random_routes(ctx.take(examples), examples, ctx.seed, r)

    def profile(self, condition, cal, info):
        """StaticTopK's profile is the per-position chosen rate and mean score (static_routes ranks it)."""
        return cal.layer_position_mean() if condition == "StaticTopK" else super().profile(condition, cal, info)


TOKEN_ROUTER = register(TokenRouter())
