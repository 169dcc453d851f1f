"""What `fcaudit audit CHECKPOINT` takes from a checkpoint directory: the weights in their own dtype (unless --dtype
says otherwise), and a tokenizer only for a model whose config says it is tokenized."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fcaudit as fca
from fcaudit.models.checkpoint import save_checkpoint
from fcaudit.models.featuregate import FeatureGateGPT, config_for
from harness import cli, edit_config, fg_ckpt, ok, refusal

AUDIT = ["--eval", "4", "--calib", "2", "--window", "16", "--randomizations", "1", "--batch-size", "2", "--quiet",
         "--device", "cpu"]


def stored_in(t: Path, dtype: torch.dtype) -> Path:
    """A tiny FeatureGate checkpoint whose weights are stored in `dtype`."""
    torch.manual_seed(0)
    return save_checkpoint(t / str(dtype).removeprefix("torch."), FeatureGateGPT(config_for("tiny", "featuregate"))
                           .to(dtype), {"variant": "featuregate"})


def audited_model(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())["model"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_a_checkpoint_is_loaded_and_audited_in_its_own_dtype(tmp_path, dtype):
    d = stored_in(tmp_path, dtype)
    model = fca.load(d, device="cpu")
    stored = load_file(str(d / "model.safetensors"))
    # every value as stored, bit for bit: no round trip through float32 (float64 would lose digits)
    assert all(p.dtype == dtype for p in model.parameters())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in stored.items())
    ok(cli("audit", d, *AUDIT, "--out", tmp_path / "a"))
    assert audited_model(tmp_path / "a")["dtype"] == str(dtype).removeprefix("torch.")


def test_dtype_says_otherwise_and_float64_is_accepted(tmp_path):
    d = stored_in(tmp_path, torch.float32)
    assert next(fca.load(d, device="cpu", dtype="float64").parameters()).dtype == torch.float64
    half = stored_in(tmp_path, torch.float16)
    ok(cli("audit", half, *AUDIT, "--dtype", "float32", "--out", tmp_path / "a"))
    assert audited_model(tmp_path / "a")["dtype"] == "float32"
    assert "float64" in cli("audit", "--help").output
    assert "use one of float32, bfloat16, float16, float64" in refusal(cli("audit", d, *AUDIT, "--dtype", "int8",
                                                                           "--out", tmp_path / "b"))


def word_tokenizer(d: Path) -> Path:
    """A 27-token word-level tokenizer.json in `d`: every id it gives fits a 256-token vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join("abcdefghijklmnopqrstuvwxyz")],
                            trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    assert tok.get_vocab_size() == 27
    tok.save(str(d / "tokenizer.json"))
    return d


def test_a_stray_tokenizer_beside_a_byte_level_model_is_not_used_and_a_note_says_so(tmp_path):
    plain = fg_ckpt(tmp_path / "plain")
    ok(cli("audit", plain, *AUDIT, "--out", tmp_path / "bytes"))
    stray = word_tokenizer(fg_ckpt(tmp_path / "stray"))
    r = cli("audit", stray, *AUDIT, "--out", tmp_path / "a")
    ok(r)
    assert f"note: {stray / 'tokenizer.json'} is not used" in r.output
    read, as_bytes = audited_model(tmp_path / "a")["corpus"], audited_model(tmp_path / "bytes")["corpus"]
    assert read["vocab_size"] == 256 and read == as_bytes  # the same byte windows as without the file
    # a config that says the model is tokenized: its tokenizer encodes the corpus
    said = edit_config(word_tokenizer(fg_ckpt(tmp_path / "said")), tokenizer_class="PreTrainedTokenizerFast")
    letters = tmp_path / "letters.txt"  # words the tokenizer knows, in an order that does not repeat
    rng = torch.Generator().manual_seed(0)
    letters.write_text(" ".join(chr(97 + int(i)) for i in torch.randint(0, 26, (20000,), generator=rng)))
    r = cli("audit", said, *AUDIT, "--corpus", letters, "--out", tmp_path / "b")
    ok(r)
    assert "is not used" not in r.output and audited_model(tmp_path / "b")["corpus"]["vocab_size"] == 27


def test_a_tokenized_vocabulary_without_its_tokenizer_is_refused(tmp_path):
    d = fg_ckpt(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    torch.manual_seed(0)
    big = save_checkpoint(tmp_path / "big", FeatureGateGPT(type(config_for("tiny", "featuregate"))(
        **{**{k: cfg[k] for k in cfg if k not in ("model_type", "meta")}, "vocab_size": 300})), {})
    assert "has a 300-token vocabulary but no tokenizer.json" in refusal(cli("audit", big, *AUDIT,
                                                                             "--out", tmp_path / "a"))
