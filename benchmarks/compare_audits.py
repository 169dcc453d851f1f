"""Re-audit the checkpoints of an earlier demo with this fcaudit and compare the records with the earlier audits.

For every audit directory under OLD/audit, the same checkpoint is audited again with the same corpus, windows,
seed, R and batch size into NEW/audit, and each (condition, randomization) present in both is compared: how many
windows have bit-identical NLLs, the largest |ΔNLL| difference, and per condition the mean ΔNLL before and after
with the earlier audit's Monte Carlo SE. Conditions new in this version are listed, not compared.
Usage: python benchmarks/compare_audits.py OLD_DEMO_DIR NEW_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch


def old_records(audit_dir: Path) -> pd.DataFrame:
    frames = [pd.read_parquet(p) for p in sorted((audit_dir / "records").rglob("*.parquet"))]
    return pd.concat(frames, ignore_index=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    from fcaudit.auditor import AuditResult
    from fcaudit.checkpoint_audit import audit_checkpoint
    from fcaudit.config import AuditConfig

    print(f"load before: {os.getloadavg()[0]:.2f}")
    rows = []
    for old_dir in sorted(d for d in (args.old / "audit").iterdir() if (d / "config.json").is_file()):
        cfg = json.loads((old_dir / "config.json").read_text())
        model = cfg["model"]
        new_dir = args.new / "audit" / old_dir.name
        t0 = time.perf_counter()
        config = AuditConfig(out=new_dir, n_eval=cfg["windows"]["n_eval"], n_calib=cfg["windows"]["n_calib"],
                             window=cfg["windows"]["window"], randomizations=cfg["randomizations"], seed=cfg["seed"],
                             batch_size=cfg["batch_size"], device="cpu", quiet=True)
        audit_checkpoint(model["checkpoint"], model["corpus"]["name"], config)
        seconds = time.perf_counter() - t0
        old, new = old_records(old_dir), AuditResult.load(new_dir).records
        merged = old.merge(new, on=["condition", "randomization", "example"], suffixes=("_old", "_new"))
        equal = int((merged.nll_old.to_numpy() == merged.nll_new.to_numpy()).sum())
        base = {c: merged[merged.condition == "Correct"].set_index("example")[f"nll_{c}"] for c in ("old", "new")}
        for cond, g in merged[merged.condition != "Correct"].groupby("condition", sort=False):
            d_old = (g.nll_old.to_numpy() - base["old"].loc[g.example].to_numpy())
            d_new = (g.nll_new.to_numpy() - base["new"].loc[g.example].to_numpy())
            per_r = g.assign(d=d_old).groupby("randomization")["d"].mean()
            mc_se = float(per_r.std(ddof=1) / np.sqrt(len(per_r))) if len(per_r) > 1 else float("nan")
            rows.append({"audit": old_dir.name, "condition": cond, "old": d_old.mean(), "new": d_new.mean(),
                         "diff": d_new.mean() - d_old.mean(), "old_mc_se": mc_se})
        only_new = sorted(set(new.condition) - set(old.condition))
        print(f"{old_dir.name:<16} {equal}/{len(merged)} records bit-identical, max |ΔNLL| "
              f"{np.abs(merged.nll_old - merged.nll_new).max():.3g}; new conditions: {', '.join(only_new) or '-'}; "
              f"audit {seconds:.1f} s", flush=True)
    df = pd.DataFrame(rows)
    df.to_csv(args.new / "comparison.csv", index=False)
    moved = df[df["diff"] != 0]
    if len(moved):
        within = (moved["diff"].abs() <= moved["old_mc_se"].fillna(0)).sum()
        print(f"conditions whose mean ΔNLL changed: {len(moved)}; within the earlier MC SE (randomized) or exactly "
              f"equal: {within}; largest change {moved['diff'].abs().max():.3g}")
    print(f"load after: {os.getloadavg()[0]:.2f}; table: {args.new / 'comparison.csv'}")


if __name__ == "__main__":
    sys.exit(main())
