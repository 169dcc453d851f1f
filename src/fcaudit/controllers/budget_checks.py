"""The budget observed: the rows the blocks named by `runs=` computed under a condition against what its replayed
decisions run (`observed_budget`, a refusal), and the notices on window 0 where no `runs=` names the blocks (a
token router's routed block, a depth controller's blocks found by structure, blocks before the first decision)."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from torch import nn

from fcaudit.controllers.controller import Controller, Seen
from fcaudit.controllers.findings import Finding
from fcaudit.controllers.rows import block_rows, fused_part, input_rows, largest_list
from fcaudit.controllers.sites import Site, path_matches


# ---- the budget observed -------------------------------------------------------------------------------------------

def observed_budget(controller: Controller, coeffs: Sequence[torch.Tensor], seen: Seen,
                    condition: str) -> Finding | None:
    """Refused, naming the site or block and the counts, when the rows the replayed model ran where `runs=` named
    (`seen`, from `Controller.observing` during a replay of `coeffs`) differ from the rows its replayed decisions
    select: the model re-derives its set (a threshold from the replayed scores on its live router weights, depths
    from its live exit rule, experts from its own top-k), so the budget the records say is not what ran. The budget's
    equivalent of the exact replay check."""
    for i, site in enumerate(controller.sites):
        if site.runs is None:
            continue
        want = controller.info.of[i].select(coeffs[i]).cpu().long()
        calls = seen.calls.get(i, [])
        per_window = [c for c in calls if isinstance(c, torch.Tensor)]
        got_total = sum(int(c.sum()) for c in per_window) + sum(c for c in calls if isinstance(c, int))
        if per_window and len(per_window) == len(calls):
            got = sum(per_window)
            if not torch.equal(got, want):
                w = int(torch.nonzero(got != want)[0, 0])
                return _budget_refusal(site, condition, f"window {w} of the first batch sent {int(got[w])} tokens "
                                                        f"into it for {int(want[w])} chosen", got_total, want)
        elif got_total != int(want.sum()):
            return _budget_refusal(site, condition, f"the first batch sent {got_total} tokens into it for "
                                                    f"{int(want.sum())} chosen", got_total, want)
    if controller.runs:
        ran = [block_rows(c) for c in seen.blocks]
        return (_experts_budget if controller.info.of[0].runs == "experts" else _depth_budget)(
            controller, coeffs, ran, condition)
    return None


def _budget_refusal(site: Site, condition: str, how: str, got: int, want: torch.Tensor) -> Finding:
    return Finding.refused("budget", f"site {site.name!r}: under {condition} its routed block {site.runs[0]!r} did not "
                           f"run the tokens the replayed decisions chose: {how}; the model re-derives the set (e.g. a "
                           "threshold from the replayed scores on its live router weights): make the block run "
                           "the chosen index (gather), or declare the site where the set is decided",
                           {"site": site.name, "condition": condition, "ran": got, "chosen": int(want.sum())})


def _depth_budget(controller: Controller, coeffs: Sequence[torch.Tensor], ran: list[int],
                  condition: str) -> Finding | None:
    """A depth controller's blocks (`runs=`, in order): each must compute exactly the (block, token) pairs the
    replayed decisions run in it (`Kind.rows`); one block run at every step (halting), their sum."""
    info = controller.info
    kind, always = info.of[0], info.always[0]
    want = kind.rows(coeffs, always)
    blocks = [name for name, _ in controller.runs]
    if len(blocks) == 1 and len(want) > 1:  # one block shared by every step (halting, a looped block)
        want = [sum(want)]
    if len(blocks) != len(want):
        late = len(blocks) - len(want) + always
        hint = (f"where the first {late} block(s) run for every token before the first decision, declare "
                f"Decisions(always={late})" if late > 0 else "give a pattern matching the blocks the decisions run")
        return Finding.refused("budget", f"runs= names {len(blocks)} blocks ({blocks[0]!r}...) for the {len(want)} "
                               f"that the decisions of {len(controller.sites)} {kind.name} sites run"
                               f"{f' ({always} of them always)' if always else ''}, or one block run at every "
                               f"step: {hint}",
                               {"blocks": len(blocks), "units": len(want), "condition": condition})
    for name, got, need in zip(blocks, ran, want):
        if got != need:
            return Finding.refused("budget", f"block {name!r}: under {condition} it computed {got} rows on the first "
                                   f"batch for the {need} (block, token) pairs the replayed {kind.name} decisions run "
                                   "in it; " + ("it computes tokens the decisions stop (a model that masks rather "
                                                "than gathers shows every row: drop runs=, its budget is then the "
                                                "decisions', not observed), or the model re-derives its depths"
                                                if got > need else "the model re-derives its depths (its live rule, "
                                                "not the replayed decisions, says which tokens run)")
                                   + ": declare the decisions the model obeys, and runs= only for blocks that "
                                     "run the decided tokens alone",
                                   {"block": name, "condition": condition, "ran": got, "decided": need})
    return None


def _experts_budget(controller: Controller, coeffs: Sequence[torch.Tensor], ran: list[int],
                    condition: str) -> Finding | None:
    """Capacity routers' experts (`runs=`, each router's in order): each must compute the slots the replayed
    decisions fill (`Codec.executed`), or every slot of its capacity (a fixed-shape dispatch computes empty slots
    too, and then rows cannot show the slots filled)."""
    at = 0
    for i, site in enumerate(controller.sites):
        codec = site.codec
        filled = codec.executed(coeffs[i])[1][:, :codec.num_experts].sum(0)
        every = coeffs[i].shape[0] * codec.capacity
        for e in range(codec.num_experts):
            name, got = controller.runs[at][0], ran[at]
            at += 1
            if got not in (int(filled[e]), every):
                return Finding.refused("budget", f"site {site.name!r}: under {condition} its expert {name!r} "
                                       f"computed {got} rows on the first batch for the {int(filled[e])} slots the "
                                       f"replayed decisions fill (of {every}); the experts run other tokens than "
                                       "the dispatch says (their own top-k on live router weights, or past the "
                                       "capacity): make the experts run the dispatched tokens, or declare the "
                                       "router whose slots they obey",
                                       {"site": site.name, "expert": name, "condition": condition, "ran": got,
                                        "filled": int(filled[e])})
    return None


# ---- where no `runs=` names the blocks: notices on window 0 ---------------------------------------------

@contextmanager
def routed_inputs(model: nn.Module, controller: Controller) -> Iterator[dict[int, dict[str, int]]]:
    """For each token-router site without `runs=`: the rows every module under the site's parent (the site's own
    left out) took in the passes run in the context, by path; for `routed_blocks_notice`. Pre-hooks only read."""
    took: dict[int, dict[str, int]] = {}
    handles = []
    for i, site in enumerate(controller.sites):
        if site.runs is not None or controller.info.of[i].runs != "block" or "." not in site.path:
            continue
        parent, own = site.path.rsplit(".", 1)[0], {id(m) for m in site.module.modules()}
        if fused_part(model, [parent]) is not None:  # hooks would change the pass's numerics
            continue
        for name, m in model.get_submodule(parent).named_modules(prefix=parent):
            if name != parent and id(m) not in own:
                def pre(module, args, rows=took.setdefault(i, {}), name=name):
                    rows[name] = rows.get(name, 0) + input_rows(module, args)
                handles.append(m.register_forward_pre_hook(pre))
    try:
        yield took
    finally:
        for h in handles:
            h.remove()


def routed_blocks_notice(model: nn.Module, controller: Controller, took: dict[int, dict[str, int]],
                         alone: Sequence[torch.Tensor]) -> Finding | None:
    """A notice naming `runs=` where a token router's routed block is found by structure: the outermost module under
    the site's parent (the largest of several) that took exactly the rows the site chose in the live forward of window
    0 (0 < k < its tokens). A notice, not an observation made on its own: a module found this way could take k rows
    by coincidence, and an observation of the wrong block would refuse an honest model."""
    found: dict[int, str] = {}
    for i, rows in took.items():
        k, tokens = int(controller.info.of[i].select(alone[i]).sum()), alone[i].shape[1]
        took_k = [n for n, r in rows.items() if r == k] if 0 < k < tokens else []
        outer = [n for n in took_k if not any(n.startswith(c + ".") for c in took_k)]
        if outer:
            found[i] = max(outer, key=lambda n: sum(p.numel() for p in model.get_submodule(n).parameters()))
    if not found:
        return None
    paths = [found[i] for i in sorted(found)]
    parts = [p.split(".") for p in paths]
    glob = ".".join(c[0] if len(set(c)) == 1 else "*" for c in zip(*parts)) if len({len(p) for p in parts}) == 1 \
        else ""
    routers = [i for i, k in enumerate(controller.info.of) if k.runs == "block"]
    exact = sorted(found) == routers and [n for n, _ in model.named_modules() if n and path_matches(n, glob)] == paths
    how = (f"pass runs={glob!r}" if exact else "pass runs= a pattern matching one such block per token router, in "
           "order")
    first = controller.sites[min(found)].name
    return Finding.notice("budget", f"note: the tokens token router {first!r} chose in window 0 entered {paths[0]!r} "
                          f"(found by structure: the rows it took){f' ({len(paths)} sites)' if len(paths) > 1 else ''}:"
                          f" {how} to have the audit observe the tokens entering it on the first batch of every "
                          "condition", {"sites": [controller.sites[i].name for i in sorted(found)], "blocks": paths})


def depth_blocks(model: nn.Module, controller: Controller) -> tuple[str, list[tuple[str, nn.Module]]]:
    """A depth controller's blocks found by structure where `runs=` names none (the children of the model's largest
    ModuleList), as (pattern, blocks), for `depth_rows_notice`; else ("", [])."""
    pattern = largest_list(model) if controller.info.depth and not controller.runs else None
    blocks = [(n, m) for n, m in model.named_modules() if n and path_matches(n, pattern)] if pattern else []
    if not blocks or fused_part(model, [n for n, _ in blocks]) is not None:  # hooks would change the pass's numerics
        return "", []
    return pattern, blocks


def depth_rows_notice(controller: Controller, pattern: str, counts: list[Counter], alone: Sequence[torch.Tensor],
                      ) -> Finding | None:
    """Where no `runs=` names a depth controller's blocks: the rows the model's blocks (found by structure, the
    controller's own modules left out) computed in the live forward of window 0, beside the (block, token) pairs its
    decisions run (`Kind.rows`). A notice, never a refusal: a model that masks computes every row honestly, and blocks
    found by structure need not be the decided ones. It says when the blocks outnumber what the decisions run (exits
    that start after block k), when a block computed fewer rows than its decisions run (they are not what the model
    obeys), and when every block computed exactly them (`runs=` would observe them under every condition)."""
    if not counts:
        return None
    info = controller.info
    kind, always = info.of[0], info.always[0]
    want = kind.rows(list(alone), always)
    own = {m for s in controller.sites if s.op is None and s.method == "forward" for m in s.module.modules()}
    if any(all(m in own for m in c) for c in counts):  # the list found holds the controller, not the blocks
        return None
    ran = [block_rows(Counter({m: r for m, r in c.items() if m not in own})) for c in counts]
    if len(ran) > len(want) > 1:
        k = len(ran) - len(want) + always
        return Finding.notice("depth", f"note: the model's {len(ran)} blocks ({pattern!r}) are more than the "
                              f"{len(want)} its {kind.name} decisions run: if its first {k} run for every token "
                              f"before the first decision, pass codec=Decisions(always={k}), or `active` and the "
                              "budget count only the decided blocks", {"blocks": len(ran), "units": len(want)})
    if len(ran) != len(want):
        return None
    short = next(((i, g, w) for i, (g, w) in enumerate(zip(ran, want)) if g < w), None)
    if short is not None:
        i, g, w = short
        return Finding.notice("depth", f"note: block {pattern[:-1]}{i} computed {g} rows of window 0 for the {w} "
                              f"(block, token) pairs the {kind.name} decisions run in it: the model runs less than "
                              "its decisions say, and the budget counts what they say: declare the decisions it "
                              "obeys (its own stop rule, the blocks that always run)",
                              {"block": i, "ran": g, "decided": w})
    if ran == want and sum(want) < len(want) * alone[0].shape[1]:
        return Finding.notice("depth", f"note: the blocks {pattern!r} computed exactly the (block, token) pairs the "
                              f"{kind.name} decisions run (they gather the running tokens): pass runs={pattern!r} to "
                              "have the audit observe them on the first batch of every condition",
                              {"blocks": len(ran)})
    return None


def first_blocks_notice(controller: Controller) -> Finding | None:
    """A notice when a depth controller's first site is on block k > 0 of a numbered path ("blocks.2.exit") and no
    blocks are declared to run always: blocks before its first decision run for every token, which `active` counts
    only when the codec says so (`Decisions(always=k)`)."""
    info = controller.info
    if not info.depth or info.always[0] or info.lead.codec is None:
        return None
    path = controller.sites[0].path
    k = next((int(p) for p in path.split(".") if p.isdigit()), 0)
    if k == 0:
        return None
    return Finding.notice("depth", f"note: the first depth site {path!r} is on block {k}: if blocks 0..{k - 1} run "
                                   "for every token before it, pass codec=Decisions(always=" + str(k) + ") (or the "
                                   "number that do), or `active` and the budget's fraction count only the decided "
                                   "blocks", {"site": path, "block": k})
