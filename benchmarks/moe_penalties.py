"""FCA of briefly trained tiny Hugging Face MoE models (Mixtral, OLMoE, Qwen3-MoE by default), through the public
API only: `fca.controller_for(model)` and `fca.audit(...)`, no wrapper.

Each model (2 layers, hidden 64, 8 experts, top-2, byte vocabulary) trains for --steps steps on the embedded corpus
(language-modelling loss plus the family's load-balancing loss), then is audited in float32 and, as a bf16 copy, for
exact replay; the expert execution is measured under Correct and the static conditions. Prints one JSON document.
Usage:  python benchmarks/moe_penalties.py [--families mixtral olmoe qwen3_moe] [--steps 150] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import fcaudit as fca
from fcaudit.data import load_corpus, make_windows, random_batch
from fcaudit.families.hf.tiny import tiny_moe


def train(family: str, corpus, args) -> torch.nn.Module:
    model = tiny_moe(family, seed=args.seed, experts=args.experts, top_k=args.top_k, output_router_logits=True)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng = np.random.default_rng(args.seed)
    for _ in range(args.steps):
        ids = random_batch(corpus.train, args.batch, args.window, rng)
        loss = model(input_ids=ids, labels=ids).loss  # LM loss + the family's load-balancing loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.config.output_router_logits = False
    return model.eval()


def audit(model, ev, ca, out: Path, args) -> dict:
    res = fca.audit(model, fca.controller_for(model), ev, ca, randomizations=args.randomizations, seed=args.seed,
                    out=out, batch_size=8, quiet=True)
    pen = res.penalties().to_frame()
    return {"replay": res.replay.to_dict(), "labels": res.labels,
            "penalties": {c: {"mean": float(r["statistic"]), "ci": [float(r["ci_low"]), float(r["ci_high"])],
                              "mc_se": None if np.isnan(r["mc_se"]) else float(r["mc_se"]),
                              "experts_per_token": float(r["active"])} for c, r in pen.iterrows()},
            "correct_experts_per_token": float(res.records[res.records.condition == "Correct"].active.mean()),
            "factor_effects": res.factor_effects().to_frame()["statistic"].to_dict()}


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
    p.add_argument("--out", type=Path, default=None, help="keep the audit directories here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    out = args.out or Path(tempfile.mkdtemp(prefix="moe-penalties-"))
    corpus = load_corpus("embedded")
    ev = make_windows(corpus.test, args.n_eval, args.window, args.seed, "test").ids
    ca = make_windows(corpus.validation, args.n_calib, args.window, args.seed, "validation").ids
    report = {"config": {k: str(v) for k, v in vars(args).items()}, "corpus": corpus.fingerprint,
              "torch": torch.__version__, "transformers": __import__("transformers").__version__, "families": {}}
    for family in args.families:
        t0 = time.perf_counter()
        model = train(family, corpus, args)
        t_train = time.perf_counter() - t0
        res = audit(model, ev, ca, out / family, args)
        bf16 = copy.deepcopy(model).to(torch.bfloat16)
        res["replay_bf16"] = fca.audit(bf16, fca.controller_for(bf16), ev[:8], ca[:8], randomizations=1,
                                       out=out / f"{family}-bf16", batch_size=8, quiet=True).replay.to_dict()
        res.update(controller=fca.controller_for(model).description, train_seconds=round(t_train, 1),
                   audit_seconds=round(time.perf_counter() - t0 - t_train, 1))
        report["families"][family] = res
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
