import zlib

import numpy as np
import pytest
import torch

from fcaudit import data
from fcaudit.errors import FcauditError


@pytest.fixture(scope="module")
def corpus():
    return data.load_corpus("embedded")


def test_embedded_corpus_is_real_text_and_deterministic(corpus):
    sizes = corpus.describe()["tokens"]
    assert sum(sizes.values()) >= 5_000_000
    assert min(sizes.values()) > 100_000
    assert corpus.vocab_size == 256 and "PSF" in corpus.license
    assert b"def " in corpus.train[:200_000].tobytes()
    again = data.load_corpus("embedded")
    assert again.fingerprint == corpus.fingerprint
    assert np.array_equal(again.test, corpus.test)


def test_eval_and_calibration_windows_never_overlap(corpus):
    ev, cal = data.audit_windows(corpus, 64, 64, 256, seed=3)
    assert ev.split == "test" and cal.split == "validation"
    assert ev.ids.shape == (64, 256) and cal.ids.dtype == torch.int64
    for ws, split in ((ev, corpus.test), (cal, corpus.validation)):
        s = np.sort(ws.starts)
        assert np.all(np.diff(s) >= 256), "windows within a set overlap"
        assert torch.equal(ws.ids[0], torch.from_numpy(split[ws.starts[0]:ws.starts[0] + 256].astype(np.int64)))
    # no evaluation window equals a calibration window
    assert not (ev.ids[:, None, :] == cal.ids[None, :, :]).all(-1).any()


def test_windows_are_seeded(corpus):
    a = data.make_windows(corpus.test, 10, 128, seed=1, split="test")
    b = data.make_windows(corpus.test, 10, 128, seed=1, split="test")
    c = data.make_windows(corpus.test, 10, 128, seed=2, split="test")
    assert torch.equal(a.ids, b.ids) and not torch.equal(a.ids, c.ids)


def test_windows_of_a_text_that_repeats_are_drawn_distinct_and_the_draw_is_unchanged_where_nothing_repeats(corpus):
    # the embedded corpus's codec tables repeat across files: at 64 tokens, the default draw of 512 + 512 windows
    # met a calibration window equal to an evaluation window, which the audit refuses
    ev, cal = data.audit_windows(corpus, 512, 512, 64, seed=0)
    texts = lambda ws: {bytes(row) for row in ws.ids.numpy().astype(np.uint8)}  # noqa: E731
    assert len(texts(ev)) == len(texts(cal)) == 512 and not texts(ev) & texts(cal)
    rng = np.random.default_rng([0, zlib.crc32(b"validation")])  # the plain draw, which met one repeat
    slots = len(corpus.validation) // 64
    offset = int(rng.integers(0, len(corpus.validation) - slots * 64 + 1))
    plain = np.sort(rng.choice(slots, size=512, replace=False)) * 64 + offset
    assert len(set(plain) - set(cal.starts)) == 1  # only the repeated window gave way
    a = data.make_windows(corpus.test, 10, 128, seed=1, split="test", avoid=frozenset())  # nothing repeats: plain
    rng = np.random.default_rng([1, zlib.crc32(b"test")])
    slots = len(corpus.test) // 128
    offset = int(rng.integers(0, len(corpus.test) - slots * 128 + 1))
    assert np.array_equal(a.starts, np.sort(rng.choice(slots, size=10, replace=False)) * 128 + offset)


def test_a_split_without_enough_distinct_windows_is_a_clear_error():
    tokens = np.tile(np.arange(10, dtype=np.uint8), 40)  # 400 tokens, 40 slots of 10, one text
    one = data.make_windows(tokens, 1, 10, seed=0, split="test", avoid=frozenset())
    with pytest.raises(FcauditError, match=r"only 1 window\(s\) of 10 tokens whose text is distinct, not 2"):
        data.make_windows(tokens, 2, 10, seed=0, split="test", avoid=frozenset())
    assert len(data.make_windows(tokens, 40, 10, seed=0, split="validation")) == 40  # training's: any text
    with pytest.raises(FcauditError, match="distinct from the evaluation windows"):
        data.make_windows(tokens, 1, 10, seed=0, split="validation", avoid=frozenset({bytes(tokens[:10])}))
    assert one.ids.shape == (1, 10)


def test_window_longer_than_split_is_a_clear_error():
    tokens = np.arange(100, dtype=np.uint8)
    with pytest.raises(FcauditError, match="longer than the test split"):
        data.make_windows(tokens, 1, 101, seed=0, split="test")
    with pytest.raises(FcauditError, match="room for 3"):
        data.make_windows(tokens, 4, 30, seed=0, split="test")
    with pytest.raises(FcauditError, match="longer than the split"):
        data.all_windows(tokens, 200)


def test_local_file_and_directory(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"hello world " * 1000)
    c = data.load_corpus(str(f))
    assert len(c.train) + len(c.validation) + len(c.test) == 12_000
    assert c.train.tobytes().startswith(b"hello")
    d = tmp_path / "docs"
    d.mkdir()
    for i in range(60):
        (d / f"{i}.txt").write_text(f"document {i} " * 50)
    c = data.load_corpus(str(d))
    assert all(len(getattr(c, s)) > 0 for s in ("train", "validation", "test"))
    with pytest.raises(FcauditError, match="unknown corpus"):
        data.load_corpus(str(tmp_path / "missing"))


def test_hub_corpus_offline_fails_in_one_line(monkeypatch):
    monkeypatch.setattr(data, "hub_reachable", lambda: False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    with pytest.raises(FcauditError, match="--corpus PATH") as e:
        data.load_corpus("wikitext-103")
    assert "\n" not in str(e.value)


def test_tokenizer_encoding(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sat on the mat"] * 20, trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    f = tmp_path / "t.txt"
    f.write_text("the cat sat on the mat. " * 400)
    c = data.load_corpus(str(f), tokenizer=tok)
    assert c.vocab_size == tok.get_vocab_size() and c.train.dtype == np.int32
    assert c.train.max() < c.vocab_size


def test_random_batch(corpus):
    rng = np.random.default_rng(0)
    x = data.random_batch(corpus.train, 4, 64, rng)
    assert x.shape == (4, 64) and x.dtype == torch.int64


def test_a_small_directory_still_gets_three_splits_and_hidden_files_are_not_read(tmp_path):
    d = tmp_path / "repo"
    (d / ".git" / "objects").mkdir(parents=True)
    (d / ".git" / "objects" / "ab").write_bytes(b"\x78\x9c compressed object " * 100)
    (d / ".env").write_text("SECRET=1\n")
    (d / "blob.bin").write_bytes(bytes(range(256)) * 40)  # binary: a NUL byte in its first bytes
    for i in range(3):
        (d / f"{i}.txt").write_text(f"document {i}: plain text\n" * 200)
    c = data.load_corpus(str(d))
    assert all(len(getattr(c, s)) > 0 for s in ("train", "validation", "test"))
    text = b"".join(getattr(c, s).astype("uint8").tobytes() for s in ("train", "validation", "test"))
    assert b"compressed object" not in text and b"SECRET" not in text and bytes(range(256)) not in text
    assert text == b"".join((d / f"{i}.txt").read_bytes() for i in range(3))  # joined in path order, 90/5/5
    many = tmp_path / "docs"
    many.mkdir()
    for i in range(60):
        (many / f"{i}.txt").write_text(f"document {i} " * 50)
    corpus = data.load_corpus(str(many))
    # whole files go to splits by a stable hash of their path, in path order: these files, in every version
    held_out = {"validation": [58], "test": [1, 22, 25, 26, 3, 38, 49, 56, 6, 7]}
    held_out["train"] = [i for i in sorted(range(60), key=str) if i not in held_out["validation"] + held_out["test"]]
    for split, ids in held_out.items():
        want = b"".join((many / f"{i}.txt").read_bytes() for i in ids)
        assert getattr(corpus, split).astype("uint8").tobytes() == want, split


def test_text_that_is_not_utf8_is_noted_when_a_tokenizer_reads_it(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["hello world"] * 10, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    latin1, utf8 = tmp_path / "latin1.txt", tmp_path / "utf8.txt"
    latin1.write_bytes("caf\xe9 au lait\n".encode("latin-1") * 100)
    utf8.write_text("café au lait \ufffd\n" * 100)  # a replacement character the text holds itself
    data.load_corpus(str(utf8), tokenizer=tok)
    assert "not UTF-8" not in capsys.readouterr().err
    data.load_corpus(str(latin1), tokenizer=tok)
    assert "the corpus holds 100 bytes that are not UTF-8" in capsys.readouterr().err


def test_a_binary_corpus_file_is_treated_as_a_binary_file_in_a_directory(tmp_path):
    """Left out as it would be inside a corpus directory, which leaves no text: one line, whatever its size."""
    blob = tmp_path / "random.bin"
    blob.write_bytes(bytes(range(256)) * 200)
    with pytest.raises(FcauditError, match="is binary") as e:
        data.load_corpus(str(blob))
    assert "\n" not in str(e.value)
    d = tmp_path / "only-binary"
    d.mkdir()
    (d / "random.bin").write_bytes(blob.read_bytes())
    with pytest.raises(FcauditError, match="holds no text files"):
        data.load_corpus(str(d))
    late = tmp_path / "late.txt"  # a NUL byte past the first 8000 bytes: text, as in a directory
    late.write_bytes(b"plain text " * 1000 + b"\0")
    assert len(data.load_corpus(str(late)).train) > 0


def test_a_hub_corpus_without_datasets_names_the_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(FcauditError, match="needs the datasets package: pip install datasets"):
        data.load_corpus("wikitext-103")
