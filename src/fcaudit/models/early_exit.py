"""Early exit (CALM, Schuster et al. 2022): a byte-level pre-LN decoder in which each token leaves the stack at the
first block whose exit decision says so, and the shared head reads its state there. The blocks and decoder are
FeatureGate's Dense ones, so comparisons with Dense of the same shape measure the mechanism.

Decisions. `blocks[l].exit` (every block but the last) returns block l's decision for every token, [B, T] bool:
True = the token exits after block l (its state h[l+1] is final), False = it continues. That output is the only way
a decision enters the model, which obeys it: a token that exited skips every later block, its state copied upward
unchanged ("state propagation"), and the later blocks compute its keys and values from that copied state, so later
tokens attend to it. Exits are monotone by construction: the model ORs the decisions, so a token that exited stays
exited whatever the later decisions say, and a replayed non-monotone mask still gives a well-defined forward. Scoring
a window calls every exit module on every token; the forward is deterministic and runs the same operators whoever
made the decisions. (Decoding stops asking once every row has exited: no later decision could change anything.)

Execution. Scoring a window computes every block at every position (the exited tokens' keys and values are needed
anyway) and keeps the exited tokens' states; the saving is in decoding with the KV cache (`start_decoding`), where a
token that has exited runs only the key and value projections of the blocks above it.

Exit rule: CALM's learned exit classifier, sigmoid(w_l . h + b_l) > exit_threshold (config; compared as logits). It costs one dot product per
token and block, where the other CALM rule, the softmax confidence of the shared head, costs the head's d x V
product at every block (a fifth of a demo block), which would eat much of the saving being measured. That rule
remains possible as another `exit` module of the same signature (hidden state -> decisions). Training (`loss`): every
token through every block, the shared head's NLL after each block weighted by depth (l + 1, as in CALM), plus each
classifier's BCE against CALM's consistency oracle (block l's top prediction equals the last block's), on detached
states so that it trains the classifiers only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from fcaudit.errors import FcauditError
from fcaudit.loss import token_nll
from fcaudit.models import featuregate
from fcaudit.models.featuregate import GPT, Decoding, KVCache, check_config

VARIANTS = ("early-exit",)


@dataclass
class EarlyExitConfig:
    variant: str = "early-exit"
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 96
    block_size: int = 128
    vocab_size: int = 256
    exit_threshold: float = 0.9  # a token exits where its exit classifier's probability exceeds this
    norm_eps: float = 1e-5

    def __post_init__(self):
        check_config(self, VARIANTS, dict(n_layer=1, n_head=1, d_model=1, block_size=2, vocab_size=1))
        t = self.exit_threshold
        if not (isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and 0 <= t <= 1):
            raise FcauditError(f"EarlyExitConfig exit_threshold={t!r} is invalid: set exit_threshold to a number in "
                               "[0, 1] in config.json (1: no token exits)")


# FeatureGate's shapes, so that each preset has a Dense baseline of the same shape
PRESETS: dict[str, EarlyExitConfig] = {
    name: EarlyExitConfig(n_layer=c.n_layer, n_head=c.n_head, d_model=c.d_model, block_size=c.block_size)
    for name, c in featuregate.PRESETS.items()}


def config_for(preset: str) -> EarlyExitConfig:
    if preset not in PRESETS:
        raise FcauditError(f"unknown early-exit preset {preset!r}: use one of {', '.join(PRESETS)}")
    return replace(PRESETS[preset])


def logit(p: float) -> float:
    """log(p / (1 - p)), infinite at 0 and 1."""
    return -math.inf if p <= 0 else math.inf if p >= 1 else math.log(p / (1 - p))


class ExitClassifier(nn.Module):
    """One block's exit rule: p = sigmoid(w . h + b), trained to tell whether this block's prediction is already
    the last block's; the token exits where p > exit_threshold (read from the model's config when it runs)."""

    def __init__(self, cfg: EarlyExitConfig):
        super().__init__()
        self.cfg = cfg
        self.score = nn.Linear(cfg.d_model, 1)

    def logit(self, h: torch.Tensor) -> torch.Tensor:
        return self.score(h).squeeze(-1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The decisions [B, T] (True = exit after this block) from the block's output h [B, T, D]."""
        return self.logit(h) > logit(self.cfg.exit_threshold)


class Block(featuregate.Block):
    """FeatureGate's ungated block, with an exit decision after it (all blocks but the last)."""

    def __init__(self, cfg: EarlyExitConfig, exits: bool):
        super().__init__(cfg, gate=None)
        self.exit = ExitClassifier(cfg) if exits else None

    def forward(self, h: torch.Tensor, done: torch.Tensor, kv: KVCache | None = None,
                run: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream after this block: the tokens not `done` [B, T] run it, the others keep their state.
        Decoding (`kv`): `run` holds the rows not done (None: every row)."""
        if kv is None:
            return torch.where(done.unsqueeze(-1), h, h + self.update(h)[0])
        if run is None:
            return h + self.update(h, kv)[0]
        if not len(run):  # every token has exited: only its keys and values, for the tokens after it
            self.attn.remember(self.ln1(h), kv)
            return h
        return h.index_add(0, run, self.update(h, kv, run=run)[0])


def running(done: torch.Tensor) -> torch.Tensor | None:
    """The decoding rows not `done` [B, 1], or None when that is every row."""
    rows = (~done[:, 0]).nonzero().squeeze(-1)
    return None if len(rows) == len(done) else rows


class EarlyExitGPT(GPT):
    config_class = EarlyExitConfig

    def make_blocks(self) -> list[Block]:
        n = self.config.n_layer
        return [Block(self.config, exits=i < n - 1) for i in range(n)]

    def forward(self, ids: torch.Tensor, *, return_executed: bool = False, cache: Decoding | None = None):
        """Logits [B, T, V] of each token's state where it exited; with return_executed also which (block, token)
        pairs ran, [L, B, T] bool. With `cache` (start_decoding), ids [B, 1] is the next token of each sequence."""
        h = self.embed(ids, cache)
        done = torch.zeros(h.shape[:2], dtype=torch.bool, device=h.device)
        run, executed = None, []
        for block, kv in zip(self.blocks, self.caches(cache)):
            h = block(h, done, kv, run)
            if return_executed:
                executed.append(~done)
            if block.exit is not None and (run is None or len(run)):
                done = done | block.exit(h)
                run = None if cache is None else running(done)
        logits = self.lm_head(self.ln_f(h))
        return (logits, torch.stack(executed)) if return_executed else logits

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        """The training objective (every token through every block): the shared head's next-token NLL after each
        block, weighted by depth, plus the mean BCE of the exit classifiers against the consistency oracle."""
        h = self.embed(ids)
        nll, top, logits = [], [], []
        for block in self.blocks:
            h = h + block.update(h)[0]
            out = self.lm_head(self.ln_f(h))
            nll.append(token_nll(out, ids).mean())
            top.append(out.detach().argmax(-1))
            if block.exit is not None:
                logits.append(block.exit.logit(h.detach()))
        weights = torch.arange(1, len(nll) + 1, dtype=torch.float32, device=ids.device)
        loss = (torch.stack(nll) * weights).sum() / weights.sum()
        if not logits:
            return loss
        bce = [F.binary_cross_entropy_with_logits(x.float(), (t == top[-1]).float()) for x, t in zip(logits, top)]
        return loss + torch.stack(bce).mean()
