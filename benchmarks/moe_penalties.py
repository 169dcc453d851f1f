"""FCA penalties of briefly trained tiny Hugging Face MoE models (Mixtral, OLMoE, Qwen3-MoE by default).

Each model (2 layers, hidden 64, 8 experts, top-2, byte vocabulary) trains for --steps steps on the embedded
corpus, then is audited with the codecs of fcaudit.families.hf_moe and the stand-in capture/replay of
fca_min.py: exact replay (fp32 and a bf16 copy), CrossInput (derangement of examples), TokenShuffle (a
permutation of positions per layer and example), CrossShuffle, and the static profiles LayerPositionMean,
StaticMixMean, StaticTopK and ExpertUniformMean from calibration windows (validation split; evaluation windows
come from the test split). Prints one JSON document. Usage:
  PYTHONPATH=src python benchmarks/moe_penalties.py [--families mixtral olmoe qwen3_moe] [--steps 150]
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import numpy as np
import torch

from fcaudit.data import load_corpus, make_windows, random_batch
from fcaudit.families.hf_moe import moe_adapter
from fcaudit.families.hf_moe.execution import expert_execution
from fcaudit.families.hf_moe.fca_min import capture, replay_logits
from fcaudit.families.hf_moe.tiny import tiny_moe
from fcaudit.loss import token_nll


def train(family: str, corpus, args) -> torch.nn.Module:
    model = tiny_moe(family, seed=args.seed, experts=args.experts, top_k=args.top_k, output_router_logits=True)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng = np.random.default_rng(args.seed)
    for step in range(args.steps):
        ids = random_batch(corpus.train, args.batch, args.window, rng)
        loss = model(input_ids=ids, labels=ids).loss  # LM loss + the family's load-balancing loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.config.output_router_logits = False
    return model.eval()


def derangement(n: int, g: torch.Generator) -> torch.Tensor:
    """A uniformly random cyclic derangement: example i takes the coefficients of example perm[i] != i."""
    order = torch.randperm(n, generator=g)
    perm = torch.empty(n, dtype=torch.long)
    perm[order] = order.roll(-1)
    return perm


def token_shuffle(c: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Per example, one permutation of token positions; whole vectors over experts move together."""
    B, T = c.shape[:2]
    perms = torch.stack([torch.randperm(T, generator=g) for _ in range(B)])
    return c.gather(1, perms[:, :, None, None].expand_as(c))


def static_profiles(calib: list[torch.Tensor], eval_shape, top_ks: list[int | None]) -> dict[str, list[torch.Tensor]]:
    """Calibration means per site: LayerPositionMean keeps position, StaticMixMean averages tokens too,
    StaticTopK keeps the mean's top-k at the mean's mass, ExpertUniformMean spreads the mass evenly."""
    out = {"LayerPositionMean": [], "StaticMixMean": [], "StaticTopK": [], "ExpertUniformMean": []}
    for c, k in zip(calib, top_ks):
        B, T = eval_shape
        out["LayerPositionMean"].append(c.mean(0, keepdim=True).expand(B, -1, -1, -1).contiguous())
        mean = c.mean((0, 1), keepdim=True)
        out["StaticMixMean"].append(mean.expand(B, T, -1, -1).contiguous())
        if k is None:  # scalar site (shared-expert gate): its static conditions are its mean
            topk, uniform = mean, mean
        else:
            keep = torch.zeros_like(mean).scatter_(-1, mean.topk(k, dim=-1).indices, 1.0)
            topk = mean * keep * (mean.sum(-1, keepdim=True) / (mean * keep).sum(-1, keepdim=True))
            uniform = mean.sum(-1, keepdim=True).expand_as(mean) / mean.shape[-1]
        out["StaticTopK"].append(topk.expand(B, T, -1, -1).contiguous())
        out["ExpertUniformMean"].append(uniform.expand(B, T, -1, -1).contiguous())
    return out


def audit(model, adapter, ev: torch.Tensor, ca: torch.Tensor, args) -> dict:
    sites = adapter.sites
    cap = capture(model, sites, ev)
    base = token_nll(cap.logits, ev)
    replayed = replay_logits(model, sites, ev, cap.coefficients, cap.metas)
    result = {"exact_replay_fp32": bool(torch.equal(replayed, cap.logits)), "nll_correct": float(base.mean())}

    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    bf16_adapter = moe_adapter(bf16)
    cap16 = capture(bf16, bf16_adapter.sites, ev)
    result["exact_replay_bf16"] = bool(torch.equal(
        replay_logits(bf16, bf16_adapter.sites, ev, cap16.coefficients, cap16.metas), cap16.logits))

    def delta(coeffs) -> float:
        return float((token_nll(replay_logits(model, sites, ev, coeffs, cap.metas), ev) - base).mean())

    g = torch.Generator().manual_seed(args.seed)
    randomized = {"CrossInput": [], "TokenShuffle": [], "CrossShuffle": []}
    for _ in range(args.randomizations):
        perm = derangement(ev.shape[0], g)
        shuffled = [token_shuffle(c, g) for c in cap.coefficients]
        randomized["CrossInput"].append(delta([c[perm] for c in cap.coefficients]))
        randomized["TokenShuffle"].append(delta(shuffled))
        randomized["CrossShuffle"].append(delta([c[perm] for c in shuffled]))
    result["penalties"] = {k: {"mean": float(np.mean(v)), "sd": float(np.std(v, ddof=1)) if len(v) > 1 else 0.0,
                               "draws": v} for k, v in randomized.items()}
    calib = capture(model, sites, ca).coefficients
    profiles = static_profiles(calib, ev.shape, [s.codec.top_k for s in sites])
    for name, coeffs in profiles.items():
        result["penalties"][name] = {"mean": delta(coeffs)}
    result["execution"] = {
        "Correct": expert_execution(model, ev, sites=sites).summary(),
        "StaticMixMean": expert_execution(model, ev, profiles["StaticMixMean"], cap.metas, sites).summary(),
        "StaticTopK": expert_execution(model, ev, profiles["StaticTopK"], cap.metas, sites).summary(),
    }
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=["mixtral", "olmoe", "qwen3_moe"])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--n-eval", type=int, default=32)
    p.add_argument("--n-calib", type=int, default=32)
    p.add_argument("--randomizations", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    corpus = load_corpus("embedded")
    ev = make_windows(corpus.test, args.n_eval, args.window, args.seed, "test").ids
    ca = make_windows(corpus.validation, args.n_calib, args.window, args.seed, "validation").ids
    report = {"config": vars(args), "corpus": corpus.fingerprint, "torch": torch.__version__,
              "transformers": __import__("transformers").__version__, "families": {}}
    for family in args.families:
        t0 = time.perf_counter()
        model = train(family, corpus, args)
        t_train = time.perf_counter() - t0
        adapter = moe_adapter(model)
        res = audit(model, adapter, ev, ca, args)
        res.update(router=type(adapter.routers[0].module).__name__, sites=len(adapter.sites),
                   train_seconds=round(t_train, 1), audit_seconds=round(time.perf_counter() - t0 - t_train, 1))
        report["families"][family] = res
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
