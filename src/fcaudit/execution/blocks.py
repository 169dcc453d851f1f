"""A model's blocks, and what a forward pass computed in each, observed on the model rather than read from a
controller's decisions: the token rows that entered each block's computing modules. A block that gathers the tokens
it runs on shows fewer rows; one that masks or multiplies by zero shows every row; a block whose modules never ran
shows none. Blocks are often run through something other than their own forward (a parent calling `block.mlp` on a
gathered subset), so the rows are counted where the work is done: at every module inside the block that holds a
weight matrix (Linear, Conv1D, a custom projection), each call adding the rows of its first floating-point input
(its elements over its last axis). Fused experts (3-D weights that take every token and index inside) show every
row: their FLOPs say what ran (fcaudit.families.hf.execution).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence

from torch import nn

from fcaudit.controllers.rows import largest_list
from fcaudit.controllers.sites import path_matches
from fcaudit.errors import FcauditError


def block_pattern(model: nn.Module) -> str:
    """The path pattern of a model's blocks: the children of its ModuleList that holds the most parameters
    ("blocks.*" for FeatureGateGPT, "layers.*" for MUDDPythia, "model.layers.*" for HF decoders)."""
    pattern = largest_list(model)
    if pattern is None:
        raise FcauditError(f"{type(model).__name__} has no nn.ModuleList of blocks; pass the block pattern, e.g. "
                           "'blocks.*'")
    return pattern


def block_modules(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    found = [(name, m) for name, m in model.named_modules() if name and path_matches(name, pattern)]
    if not found:
        sample = [n for n, _ in model.named_modules() if n][:6]
        raise FcauditError(f"block pattern {pattern!r} matches no module of {type(model).__name__}; "
                           f"module paths look like {sample}")
    return found


def row_fraction(count: Counter, tokens: int, uncalled: Collection[nn.Module] = ()) -> float:
    """One block's computed rows over `tokens` rows (the tokens its forward could run on), weighting each computing
    module by its weight elements (what one row costs it): 1.0 where every module ran every token once, 0.0 where
    none ran. A module run twice on every token (a shared block applied in two steps) counts 2. `uncalled`: modules
    the model reads the weights of without calling them (`uncalled`), left out."""
    weights = {m: sum(p.numel() for p in m.parameters(recurse=False) if p.dim() >= 2) for m in count
               if m not in uncalled}
    total = sum(weights.values())
    return sum(weights[m] * count[m] for m in weights) / (total * tokens) if total and tokens else 0.0


def uncalled(*passes: Sequence[Counter]) -> set[nn.Module]:
    """The computing modules that took no row in any of the passes' counts (each a Counter per block), one of them
    a pass in which nothing was decided away: the model reads their weights without calling them (Mamba's conv1d
    and dt_proj on its torch path), so their rows cannot show what ran."""
    idle = [{m for count in counts for m, rows in count.items() if not rows} for counts in passes]
    return set.intersection(*idle) if idle else set()
