"""Codecs of transformers (>= 5) MoE sites (docs/tutorials/hf-moe.md): a top-k router's coefficient is its post-top-k
combine vector [batch, token, 1, E], as the experts receive it; a score router's (Llama 4) its scores; a shared-expert
gate's its pre-sigmoid scalar. Replay needs the eager experts (summed per expert in expert order, the sentinel index E
skipped): `grouped_mm` leaves sentinel rows uninitialized (NaN * 0 reaches the output), `batched_mm` indexes with E.
"""

from __future__ import annotations

import torch
from torch import nn

from fcaudit.controllers.codecs import Codec
from fcaudit.controllers.routing import CapacityRoute, slots
from fcaudit.device import dtype_name
from fcaudit.errors import FcauditError
from fcaudit.kinds import EXPERT_ROUTER
from fcaudit.kinds.routers import SWITCH_ROUTER

PADDINGS = ("sentinel", "repeat")  # how decode fills a row's slots beyond its support (TopKRouterCodec.decode)


def canonical_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or wider when the site is wider: bf16 / fp16 / fp32 values convert to it and back exactly."""
    return torch.promote_types(dtype, torch.float32)


def experts_implementation(experts: nn.Module | None) -> str:
    """The experts implementation a transformers experts module dispatches to ("eager" for plain modules)."""
    return getattr(getattr(experts, "config", None), "_experts_implementation", None) or "eager"


def _require_eager(experts: nn.Module | None, where: str) -> None:
    impl = experts_implementation(experts)
    if impl != "eager":
        raise FcauditError(f"{where}: the experts run the {impl!r} implementation; FCA replay needs 'eager' "
                           f"(call fcaudit.families.hf.ensure_eager_experts(model) before capturing)")


def _shapes(output) -> str:
    """What a router returned, for an error message: "(Tensor[4, 8], list)"."""
    if not isinstance(output, (tuple, list)):
        return type(output).__name__
    return "(" + ", ".join(f"Tensor{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                           for t in output) + ")"


def split_router_output(output, num_experts: int, where: str = "router") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check and unpack (router_logits [N, E], top_k_weights [N, k], top_k_index [N, k])."""
    if not (isinstance(output, (tuple, list)) and len(output) == 3 and all(isinstance(t, torch.Tensor) for t in output)):
        raise FcauditError(f"{where} returned {_shapes(output)}, not (router_logits, top_k_weights, top_k_index)")
    logits, weights, index = output
    ok = (logits.dim() == 2 and logits.shape[1] == num_experts and weights.dim() == 2 and index.shape == weights.shape
          and weights.shape[0] == logits.shape[0] and weights.is_floating_point() and logits.is_floating_point()
          and not index.is_floating_point() and not index.is_complex())
    if not ok:
        raise FcauditError(f"{where} returned shapes {list(logits.shape)}, {list(weights.shape)}, {list(index.shape)} "
                           f"({weights.dtype}, {index.dtype}), not logits [N, {num_experts}], weights [N, k], "
                           f"integer index [N, k]")
    return logits, weights, index


ROUTER_PARTS = ("logits", "weights", "index")  # what a transformers router returns, in this order
STATE = "state"  # a leaf a router returns beyond its choices (Zaya's router state for the next layer's router)
SHARED = "shared"  # its shared experts' weights, returned beside its choices (Inkling): the block runs them itself
LIVE = (STATE, SHARED)  # the leaves beyond the choices: a replay recomputes them live from the router's input


def split_parts(output, parts: tuple[str, ...], num_experts: int, where: str = "router") -> dict[str, torch.Tensor]:
    """A router output whose leaves are `parts` (some order of ROUTER_PARTS, logits optional: DBRX's block method
    returns (top_k_weights, top_k_index); then any LIVE leaves), checked and named (the LIVE ones left out)."""
    if parts == ROUTER_PARTS:
        return dict(zip(parts, split_router_output(output, num_experts, where)))
    if not (isinstance(output, (tuple, list)) and len(output) == len(parts)
            and all(isinstance(t, torch.Tensor) for t in output)):
        raise FcauditError(f"{where} returned {_shapes(output)}, not ({', '.join(parts)})")
    named = {p: t for p, t in zip(parts, output) if p not in LIVE}
    if tuple(named) == ROUTER_PARTS:
        return dict(zip(ROUTER_PARTS, split_router_output(tuple(named.values()), num_experts, where)))
    full = (named.get("logits", torch.zeros(named["weights"].shape[0], num_experts)), named["weights"], named["index"])
    split_router_output(full, num_experts, where)  # the same checks of shapes and dtypes
    return named


def split_score_output(output, num_experts: int, where: str = "router") -> tuple[torch.Tensor, torch.Tensor]:
    """Check and unpack (router_scores [N, E], router_logits [N, E])."""
    ok = (isinstance(output, (tuple, list)) and len(output) == 2
          and all(isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 2 for t in output)
          and output[0].shape == output[1].shape and output[0].shape[1] == num_experts)
    if not ok:
        raise FcauditError(f"{where} returned {_shapes(output)}, not (router_scores [N, {num_experts}], "
                           f"router_logits [N, {num_experts}])")
    return output[0], output[1]


def _expert_rows(canonical: torch.Tensor, num_experts: int, name: str) -> torch.Tensor:
    """Canonical router coefficients [batch, token, 1, E] as one row per token [N, E]."""
    if canonical.shape[-1] != num_experts or canonical.shape[-2] != 1:
        raise FcauditError(f"{name}: coefficients of shape {list(canonical.shape)} are not "
                           f"[batch, token, 1, {num_experts}]")
    return canonical.reshape(-1, num_experts)


def _placeholder_logits(c: torch.Tensor, dtype: str) -> torch.Tensor:
    """Router logits for the auxiliary loss only (the forward pass does not read them): log(c) on the support,
    finfo.min off it, so that their softmax is the normalized vector."""
    out = getattr(torch, dtype)
    return torch.where(c != 0, c.abs().clamp_min(torch.finfo(c.dtype).tiny).log(),
                       torch.full_like(c, torch.finfo(out).min)).to(out)


class TopKRouterCodec(Codec):
    """Top-k router output <-> post-top-k combine vector c [batch, token, 1, num_experts]."""

    kind = EXPERT_ROUTER.name
    placeholders = ("[0]",)  # the router logits: rebuilt as a placeholder the forward pass does not read
    unordered = ("[1]", "[2]")  # (weights, index): the check of decode(encode(x)) tells a mere slot order apart

    def __init__(self, num_experts: int, top_k: int, experts: nn.Module | None = None, name: str = "router",
                 experts_path: str | None = None, pad: str = "sentinel", parts: tuple[str, ...] = ROUTER_PARTS):
        if pad not in PADDINGS:
            raise FcauditError(f"{name}: padding {pad!r} is not one of {', '.join(PADDINGS)}")
        choices = [p for p in parts if p not in LIVE]
        if sorted(choices) not in (sorted(ROUTER_PARTS), ["index", "weights"]) or \
                not all(p in LIVE for p in parts[len(choices):]):
            raise FcauditError(f"{name}: parts {parts} are not an order of {ROUTER_PARTS}, logits optional, then any "
                               f"of {LIVE} leaves")
        self.num_experts, self.top_k, self.name, self.pad = int(num_experts), int(top_k), name, pad
        self._experts, self.experts_path = experts, experts_path  # the experts it feeds: checked to run eager
        self.parts = tuple(parts)  # the output's leaves, by name
        # the logits (for auxiliary losses), any router state (which only routers read) and shared experts' weights
        # (a replay computes both live): not compared by the round-trip check
        self.placeholders = tuple(f"[{i}]" for i, p in enumerate(parts) if p == "logits" or p in LIVE)
        self.unordered = tuple(f"[{parts.index(p)}]" for p in ("weights", "index"))

    def _split(self, output) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        named = split_parts(output, self.parts, self.num_experts, self.name)
        return named.get("logits"), named["weights"], named["index"]

    def encode(self, output, batch: int, token: int) -> torch.Tensor:
        _require_eager(self._experts, self.name)
        _, weights, index = self._split(output)
        if weights.shape[0] != batch * token:
            raise FcauditError(f"{self.name} routed {weights.shape[0]} tokens, not batch {batch} x token {token}")
        E = self.num_experts
        c = torch.zeros(index.shape[0], E + 1, dtype=canonical_dtype(weights.dtype), device=weights.device)
        # Column E absorbs sentinel slots a router may already emit (expert parallelism); dropped below. Added, not
        # set: a repeated expert's zero-weight padding slot must not overwrite its weight (distinct experts: the same)
        c.scatter_add_(1, index.long().clamp(0, E), weights.detach().to(c.dtype))
        return c[:, :E].reshape(batch, token, 1, E).contiguous()  # compact copy, not a view of c

    def meta(self, output) -> dict:
        logits, weights, index = self._split(output)
        states = {"states": [_state_meta(t, weights.shape[0]) for p, t in zip(self.parts, output) if p in LIVE]} \
            if any(p in LIVE for p in self.parts) else {}
        if logits is None:
            return {"weights_dtype": dtype_name(weights.dtype), "index_dtype": dtype_name(index.dtype),
                    "num_experts": self.num_experts, "top_k": self.top_k, **states}
        return {"logits_dtype": dtype_name(logits.dtype), "weights_dtype": dtype_name(weights.dtype),
                "index_dtype": dtype_name(index.dtype), "num_experts": self.num_experts, "top_k": self.top_k,
                **({"slot_order": "logits"} if _in_logit_order_only(logits, weights, index) else {}), **states}

    def decode(self, canonical: torch.Tensor, meta: dict, inputs=None) -> tuple[torch.Tensor, ...]:
        """The support of c by descending weight (ties: lower expert first, as torch.topk), or by live router logit
        if captured in that order only (PhiMoE's sparsemixer). Narrower rows are padded at weight 0 with the sentinel
        E or ("repeat": experts that refuse E, GPT-OSS) the row's first expert again, moving only others' rounding."""
        _require_eager(self._experts, self.name)
        E = self.num_experts
        c = _expert_rows(canonical, E, self.name)
        selected = c != 0
        width = max(self.top_k, int(selected.sum(1).max().item()) if c.numel() else 0)
        order_by = c
        if meta.get("slot_order") == "logits" and inputs is not None and isinstance(inputs.module, nn.Linear):
            with torch.no_grad():
                order_by = nn.Linear.forward(inputs.module, inputs.args[0]).reshape(c.shape).to(c.dtype)
        key = torch.where(selected, order_by, torch.full_like(c, -torch.inf))
        order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :width]
        keep = selected.gather(1, order)
        filler = torch.full_like(order[:, :1], E) if self.pad == "sentinel" else \
            torch.where(keep[:, :1], order[:, :1], torch.zeros_like(order[:, :1]))  # the row's top expert, or 0
        index = torch.where(keep, order, filler).to(getattr(torch, meta["index_dtype"]))
        weights = torch.where(keep, c.gather(1, order), torch.zeros((), dtype=c.dtype, device=c.device))
        named = {"weights": weights.to(getattr(torch, meta["weights_dtype"])).contiguous(), "index": index.contiguous()}
        if "logits" in self.parts:
            named["logits"] = _placeholder_logits(c, meta["logits_dtype"])
        return tuple(named[p] for p in self.parts if p not in LIVE) + self._states(canonical, meta, inputs)

    def _states(self, canonical: torch.Tensor, meta: dict, inputs) -> tuple[torch.Tensor, ...]:
        """The router's LIVE leaves, as its class's forward computes them from the live call (a state feeds the next
        layer's router alone: the route-flip check recomputes it on them; shared experts' weights, the controller's
        notes say, are not audited), else placeholders."""
        live_from = next((i for i, p in enumerate(self.parts) if p in LIVE), None)
        if live_from is None:
            return ()
        if inputs is None:
            return tuple(_state_placeholder(m, canonical.shape[:2], canonical.device) for m in meta["states"])
        with torch.no_grad():  # the class's forward: the instance's is the replay's own wrapper
            live = type(inputs.module).forward(inputs.module, *inputs.args, **inputs.kwargs)
        return tuple(live[live_from:])

    def describe(self) -> str:
        pad = "" if self.pad == "sentinel" else ", absent slots padded with a selected expert at weight 0"
        return f"top-{self.top_k} router over {self.num_experts} experts: (batch token) expert combine vector{pad}"


LEADING = {"(batch token)": 1, "batch token": 2, "": 0}  # a router state's token axes, by name


def _state_meta(state: torch.Tensor, tokens: int) -> dict:
    """What rebuilds a router state's placeholder for any batch: its dtype and shape, its leading axes named as the
    tokens' ("(batch token)" rows, or "batch token")."""
    shape = list(state.shape)
    lead = "(batch token)" if shape[:1] == [tokens] else "batch token" if len(shape) > 1 and \
        shape[0] * shape[1] == tokens else ""
    return {"dtype": dtype_name(state.dtype), "lead": lead, "tail": shape[LEADING[lead]:]}


def _state_placeholder(meta: dict, batch_token: torch.Size, device: torch.device) -> torch.Tensor:
    lead = {"(batch token)": [batch_token[0] * batch_token[1]], "batch token": list(batch_token), "": []}[meta["lead"]]
    return torch.zeros(lead + meta["tail"], dtype=getattr(torch, meta["dtype"]), device=device)


def _in_logit_order_only(logits: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> bool:
    """Whether a captured router output's slots are in descending router-logit order but not in the descending
    weight order (ties: lower expert first) that decode gives by default."""
    w, l = weights.float(), logits.gather(1, index.long()).float()
    by_weight = ((w[:, :-1] > w[:, 1:]) | ((w[:, :-1] == w[:, 1:]) & (index[:, :-1] < index[:, 1:]))).all()
    return bool(not by_weight and (l[:, :-1] >= l[:, 1:]).all())


def is_grouped(output, num_experts: int) -> bool:
    """Whether a router output is ScatterMoE's grouped form (JetMoE): (index_sorted_experts [N k], batch_index
    [N k], batch_gates [N k], expert_size: a list of E counts, router_logits [N, E])."""
    return (isinstance(output, (tuple, list)) and len(output) == 5 and isinstance(output[3], list)
            and len(output[3]) == num_experts and all(isinstance(output[i], torch.Tensor) for i in (0, 1, 2, 4))
            and output[4].dim() == 2 and output[4].shape[1] == num_experts)


class GroupedRouterCodec(Codec):
    """A top-k router in ScatterMoE's grouped form (JetMoE: `is_grouped`) <-> the post-top-k combine vector [batch,
    token, 1, E]. Decode lists each token's experts by descending weight (as torch.topk gives them; ties: lower
    expert first) and groups them by the router's own sort; a narrower row is padded with its first expert again at
    weight 0, which adds an exact 0 to that token's output."""

    kind = EXPERT_ROUTER.name
    placeholders = ("[4]",)  # the router logits (auxiliary losses only)
    pad = "repeat"  # how decode fills a row's absent slots (PADDINGS)

    def __init__(self, num_experts: int, top_k: int, name: str = "router", experts_path: str | None = None):
        self.num_experts, self.top_k, self.name, self.experts_path = int(num_experts), int(top_k), name, experts_path

    def _split(self, output) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list, torch.Tensor]:
        if not is_grouped(output, self.num_experts):
            raise FcauditError(f"{self.name} returned {_shapes(output)}, not (index_sorted_experts, batch_index, "
                               f"batch_gates, expert_size [{self.num_experts} counts], router_logits)")
        return tuple(output)

    def encode(self, output, batch: int, token: int) -> torch.Tensor:
        _, rows, gates, sizes, logits = self._split(output)
        if logits.shape[0] != batch * token:
            raise FcauditError(f"{self.name} routed {logits.shape[0]} tokens, not batch {batch} x token {token}")
        experts = torch.repeat_interleave(torch.arange(self.num_experts, device=rows.device),
                                          torch.tensor(sizes, device=rows.device))
        c = torch.zeros(logits.shape[0], self.num_experts, dtype=canonical_dtype(gates.dtype), device=gates.device)
        c.index_put_((rows.long(), experts), gates.detach().to(c.dtype), accumulate=True)
        return c.reshape(batch, token, 1, self.num_experts)

    def meta(self, output) -> dict:
        index, rows, gates, _, logits = self._split(output)
        return {"index_dtype": dtype_name(index.dtype), "rows_dtype": dtype_name(rows.dtype),
                "gates_dtype": dtype_name(gates.dtype), "logits_dtype": dtype_name(logits.dtype)}

    def decode(self, canonical: torch.Tensor, meta: dict) -> tuple:
        c = _expert_rows(canonical, self.num_experts, self.name)
        selected = c != 0
        width = max(self.top_k, int(selected.sum(1).max()) if c.numel() else 0)
        key = torch.where(selected, c, torch.full_like(c, -torch.inf))
        order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :width]
        keep = selected.gather(1, order)
        chosen = torch.where(keep, order, order[:, :1])  # an absent slot: the row's first expert at weight 0
        weights = torch.where(keep, c.gather(1, order), torch.zeros((), dtype=c.dtype, device=c.device))
        _, index = chosen.flatten().sort(0)  # grouped by expert, as the router groups them
        rows = index.div(width, rounding_mode="trunc")
        sizes = torch.bincount(chosen.flatten(), minlength=self.num_experts).tolist()
        return (index.to(getattr(torch, meta["index_dtype"])), rows.to(getattr(torch, meta["rows_dtype"])),
                weights.flatten()[index].to(getattr(torch, meta["gates_dtype"])), sizes,
                _placeholder_logits(c, meta["logits_dtype"]))

    def describe(self) -> str:
        return f"top-{self.top_k} grouped router over {self.num_experts} experts: (batch token) expert combine vector"


class ScoreRouterCodec(Codec):
    """(router_scores [N, E], router_logits [N, E]) <-> the scores [batch, token, 1, E] (Llama 4: the sigmoid of the
    top-k logits, 0 elsewhere), unpadded: a score of 0 is a zero input to that expert, which runs all the same."""

    kind = EXPERT_ROUTER.name
    placeholders = ("[1]",)  # the router logits (placeholders, passed on for the auxiliary loss only)

    def __init__(self, num_experts: int, top_k: int, name: str = "router", experts_path: str | None = None):
        self.num_experts, self.top_k, self.name, self.experts_path = int(num_experts), int(top_k), name, experts_path

    def encode(self, output, batch: int, token: int) -> torch.Tensor:
        scores, _ = split_score_output(output, self.num_experts, self.name)
        if scores.shape[0] != batch * token:
            raise FcauditError(f"{self.name} routed {scores.shape[0]} tokens, not batch {batch} x token {token}")
        return scores.detach().to(canonical_dtype(scores.dtype)).reshape(batch, token, 1, self.num_experts).clone()

    def meta(self, output) -> dict:
        scores, logits = split_score_output(output, self.num_experts, self.name)
        return {"scores_dtype": dtype_name(scores.dtype), "logits_dtype": dtype_name(logits.dtype),
                "num_experts": self.num_experts, "top_k": self.top_k}

    def decode(self, canonical: torch.Tensor, meta: dict) -> tuple[torch.Tensor, torch.Tensor]:
        c = _expert_rows(canonical, self.num_experts, self.name)
        return c.to(getattr(torch, meta["scores_dtype"])).contiguous(), _placeholder_logits(c, meta["logits_dtype"])

    def describe(self) -> str:
        return (f"top-{self.top_k} score router over {self.num_experts} experts: (batch token) expert scores, "
                f"each expert's input scaled by its score")


class SharedGateCodec(Codec):
    """A Linear(hidden, 1) gate's output [N, 1] (pre-sigmoid: the block applies the sigmoid after the site) <->
    canonical [batch, token, 1, 1]."""

    kind = "scalar_gate"

    def __init__(self, name: str = "shared_expert_gate"):
        self.name = name

    def encode(self, output, batch: int, token: int) -> torch.Tensor:
        if not isinstance(output, torch.Tensor) or output.numel() != batch * token:
            shape = list(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
            raise FcauditError(f"{self.name} returned {shape}, not one scalar per token for batch {batch} x token {token}")
        return output.detach().to(canonical_dtype(output.dtype)).reshape(batch, token, 1, 1).clone()

    def meta(self, output) -> dict:
        return {"dtype": dtype_name(output.dtype), "shape_tail": list(output.shape[1:])}

    def decode(self, canonical: torch.Tensor, meta: dict) -> torch.Tensor:
        out = canonical.reshape(-1, *meta["shape_tail"]).to(getattr(torch, meta["dtype"]))
        return out.clone(memory_format=torch.contiguous_format)

    def describe(self) -> str:
        return "shared-expert gate: (batch token) 1, pre-sigmoid logit"


class SwitchRoute(CapacityRoute):
    """A Switch Transformers top-1 router's (expert_index: one-hot [batch, token, E], zero past an expert's capacity;
    router_probs [batch, token, 1]; router_logits [batch, token, E]) <-> each token's combine vector [batch, token, 1,
    E]: its top expert's probability, whether or not the capacity drops it. Decode rebuilds the drops by the router's
    own rule (CapacityRoute's slots in sequence order per window); the logits feed its auxiliary losses only."""

    name = "Switch router"
    kind = SWITCH_ROUTER.name
    placeholders = ("[2]",)

    def __init__(self, num_experts: int, capacity: int):
        super().__init__(num_experts, capacity, top_k=1)

    def _split(self, output, batch: int, token: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = (batch, token, self.num_experts)
        ok = (isinstance(output, (tuple, list)) and len(output) == 3
              and all(isinstance(t, torch.Tensor) for t in output) and tuple(output[0].shape) == shape
              and tuple(output[1].shape) == (batch, token, 1) and tuple(output[2].shape) == shape
              and output[1].is_floating_point() and output[2].is_floating_point())
        if not ok:
            raise FcauditError(f"{self.name} returned {_shapes(output)}, not (expert_index {list(shape)}, router_probs "
                               f"[{batch}, {token}, 1], router_logits {list(shape)}); pass SwitchRoute(num_experts, "
                               "capacity) as the router has them")
        return output[0], output[1], output[2]

    def encode(self, output, batch: int, token: int) -> torch.Tensor:
        index, probs, logits = self._split(output, batch, token)
        # each token's top expert, dropped or not: as the router picks it, the argmax of its probabilities
        top = torch.softmax(logits.detach(), dim=-1, dtype=logits.dtype).to(probs.dtype).argmax(-1)
        c = (nn.functional.one_hot(top, self.num_experts) * probs.detach()).to(canonical_dtype(probs.dtype))
        c = c[:, :, None, :].contiguous()
        if not torch.equal(slots(c, self.capacity)[0], index.detach() != 0):
            raise FcauditError(f"{self.name}: its one-hot is not each token's top expert with the first "
                               f"{self.capacity} tokens per expert and window kept (or a probability is 0); "
                               "SwitchRoute rebuilds that rule only, so this router needs its own codec")
        return c

    def meta(self, output) -> dict:
        return {"index_dtype": dtype_name(output[0].dtype), "probs_dtype": dtype_name(output[1].dtype),
                "logits_dtype": dtype_name(output[2].dtype)}

    def decode(self, canonical: torch.Tensor, meta: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = _expert_rows(canonical, self.num_experts, self.name)
        weight = c.abs().amax(1, keepdim=True)
        if not torch.equal(torch.where(c != 0, c.abs(), weight), weight.expand_as(c)):
            raise FcauditError(f"{self.name}: coefficients that weight one token's experts differently; a Switch "
                               "router scales them all by one weight (replay rows of equal weights, or one expert)")
        kept = slots(canonical, self.capacity)[0]
        index = kept.to(getattr(torch, meta["index_dtype"]))
        probs = canonical[:, :, 0, :].gather(-1, canonical[:, :, 0, :].abs().argmax(-1, keepdim=True))  # the row's
        probs = probs.to(getattr(torch, meta["probs_dtype"]))  # weight (0 where it routes nowhere)
        logits = _placeholder_logits(c, meta["logits_dtype"]).reshape(index.shape)
        return index, probs, logits

    def describe(self) -> str:
        return (f"Switch router: top-1 of {self.num_experts} experts, capacity {self.capacity} per expert and window, "
                "slots in sequence order: (batch token) expert combine vector")
