"""Question 3's decoding for every causal LM of the installed transformers with a controller: each built tiny from its
config (hf_zoo's builder), one 12-token window decoded token by token through the cache the model makes, teacher
forced, as `fca.execution` and `fcaudit execution` decode it (`fcaudit.execution.decode.decoding_columns`).

Printed per architecture: the (block, token) pairs computed (1.0: every block ran each token once), the largest
|logit difference| from the window's forward and the seconds; or the note saying why its decoding is not measured
(its logits beyond rounding of the forward's, or the model refusing to decode). Then the counts.
Usage: python benchmarks/hf_decode.py [--only MODEL_TYPE ...]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import hf_zoo  # noqa: E402  (the zoo's tiny configs and its controller rule)


def decode_one(model_type: str, window: int = 12) -> tuple[str, str]:
    """(outcome, what to print) of decoding one window of `model_type`'s tiny model."""
    from fcaudit.execution.decode import decoding_columns

    try:
        model = hf_zoo.tiny_model(model_type).eval()
    except Exception as e:  # noqa: BLE001 (a class this install cannot build: its row says so)
        return "not built", f"{type(e).__name__}: {' '.join(str(e).split())[:100]}"
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (1, window), generator=torch.Generator().manual_seed(0))
    cols = decoding_columns(model, ids)
    if cols["decode_note"]:
        return "not measured", cols["decode_note"]
    fraction = cols["executed_layer_fraction"]
    return ("each once" if fraction == 1.0 else "other",
            f"(block, token) pairs computed {fraction:.4f}, max |Δlogit| {cols['decode_max_abs_dlogit']:.1e}")


def main(argv: list[str] | None = None) -> Counter:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", help="these model types")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    start, outcomes = time.perf_counter(), Counter()
    for mt in args.only or [t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if hf_zoo.controlled(t)]:
        t0 = time.perf_counter()
        outcome, line = decode_one(mt)
        outcomes[outcome] += 1
        print(f"{mt:26s} {outcome:12s} {time.perf_counter() - t0:5.1f}s {line}", flush=True)
    print(f"wall {time.perf_counter() - start:.0f} s", flush=True)
    print(f"{sum(outcomes.values())} architectures: " + ", ".join(f"{n} {o}" for o, n in outcomes.most_common())
          + " (each once: every block computed each token once, as observed at its weights)", flush=True)
    return outcomes


if __name__ == "__main__":
    main(sys.argv[1:])
