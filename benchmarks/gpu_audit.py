"""What a full paper-scale audit costs on one GPU, measured on a short audit and extrapolated.

    python benchmarks/gpu_audit.py [--out DIR] [--fast-mix]        one CUDA device, under 8 minutes on an H200
    python benchmarks/gpu_audit.py --smoke [--out DIR]             tiny configs on the CPU, seconds

For each model (random weights; a trained-looking, non-silent controller):
  MUDDPythia-1.4B  the published config (shared/specs/muddpythia.md) in bfloat16, windows of 2048 tokens
  FeatureGate      the paper-76m preset in float32 (its features are float32 by definition), windows of 512 tokens
  OLMoE-1B-7B      the public config of allenai/OLMoE-1B-7B-0924 (64 experts, top-8, 16 layers) in bfloat16 through
                   transformers, windows of 2048 tokens (the experts run eager, as in every audit)
it times one forward at batch 8 (median of 5 after 2 warm-ups; MUDDPythia also with fast_mix), counts its FLOPs
with fcaudit.execution.measure.flops (torch.utils.flop_counter: matmuls and attention kernels as executed, the
T x T products counted in full, causal masking not discounted; elementwise work not counted), runs a short audit
through the public API (16 eval + 16 calibration windows of random token ids, R = 2, batch 8), times a bare loop
of the same number of forward passes, and prints forward ms, the audit / bare-loop ratio, peak GPU memory and
MFU = FLOPs / time / peak, with the peak of the model's dtype on an
H100/H200 SXM (dense, no sparsity): bfloat16 989e12 FLOP/s (tensor cores), float32 67e12 FLOP/s (no TF32: torch's
default for float32 matmuls). The bare loop runs as many forward passes as the audit ran (counted with a hook on
the model). It then extrapolates the paper's audit (512 eval + 512 calibration windows, R = 20) as fcaudit runs it:
calibration batches + eval batches x (capture, replay check, R per randomized condition, one per static condition;
protocol.forward_passes, so TokenResamplePast, which the paper does not have, counts too), each costing the
measured forward time times the measured audit / bare-loop ratio. Results also go to DIR/gpu_audit.json.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import fcaudit as fca
from fcaudit import protocol
from fcaudit.errors import FcauditError
from fcaudit.execution.measure import flops
from fcaudit.models.featuregate import FeatureGateGPT, GPTConfig, config_for
from fcaudit.models.muddpythia import MUDDConfig, MUDDPythia

PEAK_FLOPS = {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12}  # H100/H200 SXM, dense
PUBLISHED_1P4B = dict(block_size=2048, vocab_size=50432, n_layer=24, n_head=16, n_local_heads=16, dim=2048,
                      intermediate_size=8192, rope_base=10000, rotary_pct=0.25, norm_eps=1e-5, use_qk_norm=True,
                      use_parallel_residual=True, use_linear_bias=True, expand_last=True, round64=True)
SMOKE_MUDD = dict(block_size=64, vocab_size=300, n_layer=3, n_head=4, dim=64, intermediate_size=128,
                  use_qk_norm=True, expand_last=True, round64=True)


def forward_passes(controller, n_eval: int, n_calib: int, batch: int, R: int) -> int:
    """The forward passes of an audit of `controller` with these windows (its registered conditions)."""
    conditions = protocol.for_controller(controller.info)
    return protocol.forward_passes(conditions, math.ceil(n_eval / batch), math.ceil(n_calib / batch), R)


def build_mudd(device: torch.device, smoke: bool, fast_mix: bool) -> tuple[MUDDPythia, int]:
    cfg = MUDDConfig(**(SMOKE_MUDD if smoke else PUBLISHED_1P4B))
    torch.manual_seed(0)
    with torch.device(device):
        model = MUDDPythia(cfg, fast_mix=fast_mix)
        with torch.no_grad():  # init leaves the controller silent (w2 = 0): give it a say, as after training
            for dd in model.dynamic_dense:
                dd.w2.weight.normal_(std=0.02)
    dtype = torch.float32 if smoke else torch.bfloat16
    return model.to(dtype).eval(), (32 if smoke else cfg.block_size)


def build_featuregate(device: torch.device, smoke: bool) -> tuple[FeatureGateGPT, int]:
    cfg: GPTConfig = config_for("tiny" if smoke else "paper-76m", "featuregate")
    torch.manual_seed(0)
    with torch.device(device):
        model = FeatureGateGPT(cfg)
        with torch.no_grad():  # controller weights off their init, so gates vary across tokens
            for block in model.blocks:
                for p in block.gate.parameters():
                    p.add_(torch.randn_like(p) * 0.5)
    return model.eval(), (32 if smoke else cfg.block_size)


# allenai/OLMoE-1B-7B-0924's config.json (its sizes; 6.9B parameters, 1.3B active per token)
OLMOE_1B_7B = dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                   num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                   max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5, clip_qkv=None,
                   norm_topk_prob=False, tie_word_embeddings=False, pad_token_id=1, eos_token_id=50279)


def build_olmoe(device: torch.device, smoke: bool) -> tuple[torch.nn.Module, int]:
    from transformers import AutoModelForCausalLM, OlmoeConfig

    from fcaudit.families.hf.tiny import tiny_moe_config

    cfg = tiny_moe_config("olmoe", experts=8, top_k=2) if smoke else \
        OlmoeConfig(**OLMOE_1B_7B, experts_implementation="eager")
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32 if smoke else torch.bfloat16)
    return model.eval(), (32 if smoke else 2048)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(model, ids: torch.Tensor, reps: int = 5) -> float:
    with torch.inference_mode():
        for _ in range(2):
            model(ids)
        times = []
        for _ in range(reps):
            sync(ids.device)
            t0 = time.perf_counter()
            model(ids)
            sync(ids.device)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_mib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def run_case(name: str, model, T: int, args, device: torch.device) -> dict:
    B, R = args.batch, args.randomizations
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    eval_ids = torch.randint(0, vocab, (args.n_eval, T), generator=g)
    calib_ids = torch.randint(0, vocab, (args.n_calib, T), generator=g)
    batch = eval_ids[:B].to(device)
    dtype = next(model.parameters()).dtype
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    row: dict = {"model": name, "dtype": str(dtype).removeprefix("torch."), "batch": B, "tokens": T}
    row["forward_ms"] = 1e3 * time_forward(model, batch)
    if isinstance(model, MUDDPythia):  # the other mixing path, for comparison (the audit uses args.fast_mix)
        model.fast_mix = not model.fast_mix
        row["forward_ms_fast_mix" if model.fast_mix else "forward_ms_published_mix"] = 1e3 * time_forward(model, batch)
        model.fast_mix = not model.fast_mix
        row["fast_mix"] = model.fast_mix
    row["flops_per_forward"] = flops(model, batch) * batch.numel()
    row["peak_flops"] = PEAK_FLOPS[dtype]
    mfu = row["flops_per_forward"] / (row["forward_ms"] / 1e3) / PEAK_FLOPS[dtype]
    row["mfu"] = mfu if device.type == "cuda" else None  # a GPU's peak means nothing for a CPU run
    row["forward_peak_mib"] = peak_mib(device)

    controller = fca.controller_for(model)
    calls = [0]  # the audit's forward passes, for a bare loop of as many
    counting = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out) / f"audit-{name}" if args.out else Path(tmp)
        sync(device)
        t0 = time.perf_counter()
        try:
            result = fca.audit(model, controller, eval_ids, calib_ids, randomizations=R, seed=0, out=out,
                               batch_size=B, quiet=True)
        finally:
            counting.remove()
        sync(device)
        row["audit_s"] = time.perf_counter() - t0
    passes = calls[0]
    row["replay_passed"] = bool(result.replay.passed)
    row["audit_peak_mib"] = peak_mib(device)
    batches = [eval_ids[i:i + B].to(device) for i in range(0, args.n_eval, B)]
    with torch.inference_mode():  # the same number of forward passes, nothing else
        sync(device)
        t0 = time.perf_counter()
        for i in range(passes):
            model(batches[i % len(batches)])
        sync(device)
        row["bare_loop_s"] = time.perf_counter() - t0
    row["forward_passes"] = passes
    row["audit_over_bare"] = row["audit_s"] / row["bare_loop_s"]
    full = forward_passes(controller, 512, 512, 8, 20)
    row["paper_forward_passes"] = full
    row["paper_audit_h_extrapolated"] = full * row["forward_ms"] / 1e3 * row["audit_over_bare"] / 3600
    return row


def report(row: dict) -> None:
    gib = lambda mib: "n/a (CPU)" if mib is None else f"{mib / 1024:.1f} GiB"  # noqa: E731
    extra = "".join(f", {k.removeprefix('forward_ms_').replace('_', ' ')} {row[k]:.1f} ms"
                    for k in ("forward_ms_fast_mix", "forward_ms_published_mix") if k in row)
    print(f"\n{row['model']} ({row['dtype']}, batch {row['batch']} x {row['tokens']} tokens)")
    print(f"  forward            {row['forward_ms']:.1f} ms{extra}")
    mfu = "n/a (CPU)" if row["mfu"] is None else f"{100 * row['mfu']:.1f}% of {row['peak_flops'] / 1e12:.0f} TFLOP/s"
    print(f"  FLOPs / forward    {row['flops_per_forward'] / 1e9:.4g} GFLOP (torch.utils.flop_counter); MFU {mfu}")
    print(f"  audit              {row['audit_s']:.1f} s vs bare loop of {row['forward_passes']} forwards "
          f"{row['bare_loop_s']:.1f} s: ratio {row['audit_over_bare']:.2f}; replay exact: {row['replay_passed']}")
    print(f"  peak GPU memory    forward {gib(row['forward_peak_mib'])}, audit {gib(row['audit_peak_mib'])}")
    print(f"  paper audit        512 + 512 windows, R = 20: {row['paper_forward_passes']} forwards, "
          f"about {row['paper_audit_h_extrapolated']:.2f} h (extrapolated)")


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny configs on the CPU (checks the script, in seconds)")
    p.add_argument("--only", choices=["mudd", "featuregate", "olmoe"], help="run one model only")
    p.add_argument("--fast-mix", action="store_true", help="audit MUDDPythia with fast_mix (default: published order)")
    p.add_argument("--n-eval", type=int, default=16)
    p.add_argument("--n-calib", type=int, default=16)
    p.add_argument("--randomizations", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", help="keep the audit directories and gpu_audit.json here")
    args = p.parse_args(argv)
    if args.smoke:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # tiny models gain nothing from threads; on a busy machine threads only wait
        args.n_eval, args.n_calib, args.batch = min(args.n_eval, 4), min(args.n_calib, 4), min(args.batch, 2)
    elif not torch.cuda.is_available():
        raise FcauditError("no CUDA device is visible: run on a GPU machine, or pass --smoke to check the script on "
                           "the CPU")
    else:
        device = torch.device("cuda")
        print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    t_start = time.perf_counter()
    rows = []
    cases = {"mudd": ("muddpythia-1.4b", "muddpythia-tiny", lambda: build_mudd(device, args.smoke, args.fast_mix)),
             "featuregate": ("featuregate-76m", "featuregate-tiny", lambda: build_featuregate(device, args.smoke)),
             "olmoe": ("olmoe-1b-7b", "olmoe-tiny", lambda: build_olmoe(device, args.smoke))}
    for key, (name, smoke_name, build) in cases.items():
        if args.only not in (None, key):
            continue
        model, T = build()
        rows.append(run_case(smoke_name if args.smoke else name, model, T, args, device))
        report(rows[-1])
        del model  # one model on the device at a time
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_audit.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    try:
        main()
    except FcauditError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
