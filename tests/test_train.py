"""Training: loss goes down on the embedded corpus, seeds reproduce, resume is exact, run dirs are guarded."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

import fcaudit.data as data
from fcaudit import families
from fcaudit.errors import FcauditError
from fcaudit.families import load_model
from fcaudit.train import TrainConfig, lr_at, make_optimizer, train

FAST = dict(preset="tiny", steps=24, batch_size=4, window=32, eval_interval=8, eval_windows=4, test_windows=8,
            progress=False)


@pytest.fixture(scope="module")
def corpus():
    return data.load_corpus("embedded")


def weights(run_dir):
    return load_file(str(run_dir / "model.safetensors"))


def same_weights(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_few_dozen_steps_lower_the_loss_and_write_metrics(tmp_path, corpus):
    result = train(TrainConfig(model="featuregate", out=str(tmp_path / "fg"), **FAST), corpus=corpus)
    hist = result.metrics["history"]
    assert [h["step"] for h in hist] == [8, 16, 24]
    assert hist[-1]["val_nll"] < hist[0]["val_nll"] < math.log(256)  # better than uniform bytes, and improving
    metrics = json.loads((tmp_path / "fg" / "metrics.json").read_text())
    assert metrics["byte_ppl"] == pytest.approx(math.exp(metrics["test_nll"]))
    assert 1 < metrics["byte_ppl"] < 256 and metrics["test_tokens"] == 8 * 31
    assert 0 < metrics["gate_mass"] < 1 and metrics["variant"] == "featuregate"
    model, meta = load_model(tmp_path / "fg")  # the final model is a loadable checkpoint
    assert meta["byte_ppl"] == metrics["byte_ppl"]
    assert sum(p.numel() for p in model.parameters()) == metrics["n_params"] == result.n_params


def test_same_seed_gives_identical_weights_and_another_seed_does_not(tmp_path, corpus):
    cfg = dict(model="layerstatic", **{**FAST, "steps": 6, "eval_interval": 6})
    a = train(TrainConfig(out=str(tmp_path / "a"), seed=1, **cfg), corpus=corpus)
    b = train(TrainConfig(out=str(tmp_path / "b"), seed=1, **cfg), corpus=corpus)
    c = train(TrainConfig(out=str(tmp_path / "c"), seed=2, **cfg), corpus=corpus)
    assert same_weights(weights(a.out), weights(b.out)) and a.byte_ppl == b.byte_ppl
    assert not same_weights(weights(a.out), weights(c.out))


def test_resume_after_interruption_gives_the_uninterrupted_weights(tmp_path, corpus, monkeypatch):
    cfg = dict(model="featuregate", **{**FAST, "steps": 8, "eval_interval": 4})
    full = train(TrainConfig(out=str(tmp_path / "full"), **cfg), corpus=corpus)

    calls, real = [0], data.random_batch

    def interrupted(*args, **kw):
        calls[0] += 1
        if calls[0] > 6:  # dies during step 7, after the step-4 checkpoint
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(data, "random_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(out=str(tmp_path / "resumed"), **cfg), corpus=corpus)
    assert json.loads((tmp_path / "resumed" / "latest.json").read_text())["step"] == 4
    assert not (tmp_path / "resumed" / "metrics.json").exists()
    monkeypatch.setattr(data, "random_batch", real)
    resumed = train(TrainConfig(out=str(tmp_path / "resumed"), **cfg), corpus=corpus)
    assert same_weights(weights(full.out), weights(resumed.out))
    assert resumed.byte_ppl == full.byte_ppl
    assert [h["step"] for h in resumed.metrics["history"]] == [4, 8]
    # rerunning a finished run returns it without training again
    monkeypatch.setattr(data, "random_batch", lambda *a, **k: pytest.fail("a finished run trained again"))
    assert train(TrainConfig(out=str(tmp_path / "resumed"), **cfg), corpus=corpus).byte_ppl == full.byte_ppl


def test_a_different_config_in_the_same_run_dir_is_refused(tmp_path, corpus):
    cfg = dict(model="dense", **{**FAST, "steps": 2, "eval_interval": 2})
    train(TrainConfig(out=str(tmp_path / "run"), **cfg), corpus=corpus)
    with pytest.raises(FcauditError, match="different config.*seed"):
        train(TrainConfig(out=str(tmp_path / "run"), seed=5, **cfg), corpus=corpus)


@pytest.mark.parametrize("model", ["dense", "uniform", "uniform-fixed", "fixeddepth"])
def test_other_variants_train_and_report_gate_mass(tmp_path, corpus, model):
    r = train(TrainConfig(model=model, out=str(tmp_path / model), fixed_depth=1 if model == "fixeddepth" else None,
                          **{**FAST, "steps": 2, "eval_interval": 2}), corpus=corpus)
    expected = {"dense": 1.0, "fixeddepth": 1.0, "uniform-fixed": pytest.approx(0.6)}.get(model)
    if expected is not None:
        assert r.gate_mass == expected
    else:
        assert 0 < r.gate_mass < 1
    assert math.isfinite(r.byte_ppl)


def test_uniform_matched_takes_the_measured_gate_mass(tmp_path, corpus):
    fast = {**FAST, "steps": 2, "eval_interval": 2}
    fg = train(TrainConfig(model="featuregate", out=str(tmp_path / "fg"), **fast), corpus=corpus)
    cfg = TrainConfig(model="uniform-matched", matched_to=str(tmp_path / "fg"), out=str(tmp_path / "um"), **fast)
    assert cfg.gate_value == fg.gate_mass
    assert train(cfg, corpus=corpus).gate_mass == pytest.approx(fg.gate_mass)
    with pytest.raises(FcauditError, match="gate mass"):
        TrainConfig(model="uniform-matched", out=str(tmp_path / "x"), **fast)


@pytest.mark.parametrize("kw, match", [(dict(model="gpt-9"), "unknown model"), (dict(preset="huge"), "unknown preset"),
                                       (dict(device="tpu"), "unknown device"), (dict(steps=0), "--steps 0"),
                                       (dict(lr=-1.0), "--lr -1.0"), (dict(lr=float("inf")), "--lr inf"),
                                       (dict(model="fixeddepth"), "--depth K"),
                                       (dict(model="uniform-matched"), "--matched-to"),
                                       (dict(model="mudd", preset="paper-76m"), "unknown preset 'paper-76m' for mudd"),
                                       (dict(model="mudd", fixed_depth=2), "--depth is for --model fixeddepth, not mudd"),
                                       (dict(model="dense", fixed_depth=2), "--depth is for --model fixeddepth"),
                                       (dict(model="featuregate", matched_to="x"), "--matched-to is for")])
def test_bad_config_is_refused_with_one_line(kw, match):
    with pytest.raises(FcauditError, match=match) as e:
        TrainConfig(**kw)
    assert "\n" not in str(e.value)


def test_window_longer_than_block_size_is_refused(tmp_path, corpus):
    with pytest.raises(FcauditError, match="context of 64 tokens"):
        train(TrainConfig(model="dense", out=str(tmp_path / "w"), **{**FAST, "window": 65}), corpus=corpus)
    assert not (tmp_path / "w").exists()  # nothing written


def test_schedule_warms_up_then_decays_to_min_lr():
    cfg = TrainConfig(preset="tiny", steps=100, lr=1e-3, min_lr=1e-4, warmup=10)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] == pytest.approx(1e-4)


def test_mudd_trains_and_saves_in_its_own_format(tmp_path, corpus):
    r = train(TrainConfig(model="mudd", out=str(tmp_path / "mudd"), **{**FAST, "steps": 2, "eval_interval": 2}),
              corpus=corpus)
    assert r.gate_mass is None and math.isfinite(r.byte_ppl)
    model, _ = load_model(tmp_path / "mudd")
    assert type(model).__name__ == "MUDDPythia"
    assert sum(p.numel() for p in model.parameters()) == r.n_params


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error when no CUDA device is visible")
def test_cuda_without_a_gpu_is_refused(tmp_path, corpus):
    with pytest.raises(FcauditError, match="--device cpu"):
        train(TrainConfig(model="dense", device="cuda", out=str(tmp_path / "c"), **FAST), corpus=corpus)


def test_a_run_whose_corpus_file_changed_is_refused_and_a_busy_run_dir_too(tmp_path):
    """The corpus path is the same, its content is not: resuming would train the rest of the steps on other data.
    And one run directory has one writer."""
    from fcaudit.io import OutDir

    text = tmp_path / "corpus.txt"
    text.write_bytes(b"".join(f"line {i}: the quick brown fox jumps over the lazy dog\n".encode() for i in range(2000)))
    cfg = dict(model="dense", corpus=str(text), out=str(tmp_path / "run"), **{**FAST, "steps": 2, "eval_interval": 2})
    train(TrainConfig(**cfg))
    with open(text, "ab") as f:
        f.write(b"more text that was not there before\n" * 50)
    with pytest.raises(FcauditError, match=r"different config \(corpus_fingerprint\)"):
        train(TrainConfig(**cfg))
    with OutDir(tmp_path / "run2", "training run"):  # held by this object: another writer is refused
        with pytest.raises(FcauditError, match="being written by another fcaudit process"):
            train(TrainConfig(**{**cfg, "out": str(tmp_path / "run2")}))


def test_a_run_directory_without_its_marker_is_refused_in_one_line_and_a_new_out_trains(tmp_path, corpus):
    """A directory is a training run by its .fcaudit-train marker only, never by a train_config.json (as an earlier
    fcaudit left it): refused in one line naming the fix, a new --out, which trains."""
    from harness import api_refusal

    old = tmp_path / "run"
    old.mkdir()
    (old / "train_config.json").write_text("{}")
    line = api_refusal(lambda: train(TrainConfig(model="dense", out=str(old), **FAST), corpus=corpus))
    assert line == (f"--out {old} is not an fcaudit training run directory (it holds files fcaudit did not write "
                    "(train_config.json)): pass a new or empty directory for the training run")
    assert sorted(p.name for p in old.iterdir()) == ["train_config.json"]
    assert train(TrainConfig(model="dense", out=str(tmp_path / "new"), **FAST), corpus=corpus).out.is_dir()


def test_a_run_logged_to_a_file_prints_a_line_per_validation(tmp_path, corpus, capsys):
    """No progress bar in a log file (it would leave stray lines): one line per validation instead."""
    train(TrainConfig(model="dense", out=str(tmp_path / "run"), **{**FAST, "steps": 16, "progress": True}),
          corpus=corpus)
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("train dense s0: step")]
    assert [l.split(" loss")[0] for l in lines] == ["train dense s0: step 8/16", "train dense s0: step 16/16"]


def test_weight_decay_skips_vectors_and_what_the_family_keeps_from_it():
    """MUDD's static mix dense_bs (a matrix per layer) starts as "take the latest hidden state": no decay pulls it."""
    cfg = TrainConfig(model="mudd", preset="tiny")
    model = families.for_training("mudd").build(cfg)
    decay, no_decay = make_optimizer(model, cfg, torch.device("cpu")).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    kept = [names[id(p)] for p in no_decay["params"]]
    assert decay["weight_decay"] == cfg.weight_decay and no_decay["weight_decay"] == 0.0
    assert all(n.startswith("dense_bs") or p.dim() < 2 for n, p in model.named_parameters() if n in kept)
    assert any(n.startswith("dense_bs") and p.dim() == 2 for n, p in model.named_parameters() if n in kept)
    assert not any(names[id(p)].startswith("dense_bs") for p in decay["params"])
