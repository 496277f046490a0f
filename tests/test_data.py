"""The input pipeline: packing with segment ids, a deterministic resumable order, host shards,
the embedded stdlib corpus and its held-out split, user text / token files, and the errors
that must stop a run before its first step."""

from __future__ import annotations

import json
import math
import os

import ml_collections
import numpy as np
import pytest

from kimi_k3 import data


def data_config(**kw) -> ml_collections.ConfigDict:
    c = dict(source="stdlib", paths="", eval_paths="", eval_fraction=0.05, tokenizer="",
             token_dtype="uint16", eos_id=-1, seq_len=64, global_batch_size=4, shuffle=True)
    c.update(kw)
    return ml_collections.ConfigDict(c)


def test_windows_cover_the_stream_and_segment_ids_follow_documents():
    docs = [np.arange(5), np.arange(100, 103), np.arange(200, 207)]  # 15 tokens
    stream = data.TokenStream(docs, ["a", "b", "c"])
    rows = data.PackedRows(stream, seq_len=4, seed=0, shuffle=False)
    assert rows.num_rows == 3  # the tail of 3 tokens is dropped
    b = rows.rows(range(3))
    np.testing.assert_array_equal(b["tokens"].reshape(-1), np.concatenate(docs)[:12])
    # Row 0: doc a (0..3); row 1: end of a, all of b -> segments 1, 2, 2, 2; row 2: c.
    np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 1, 1], [1, 2, 2, 2], [1, 1, 1, 1]])
    assert b["tokens"].dtype == np.int32 and b["segment_ids"].dtype == np.int32


def test_eos_id_splits_documents_inside_a_chunk():
    stream = data.TokenStream([np.array([5, 6, 0, 7, 8, 0, 9, 9], np.uint16)], ["f"], eos_id=0)
    toks, segs = stream.read(0, 8)
    np.testing.assert_array_equal(toks, [5, 6, 0, 7, 8, 0, 9, 9])
    np.testing.assert_array_equal(segs, [1, 1, 1, 2, 2, 2, 3, 3])  # the eos ends its document


def test_order_is_a_seeded_permutation_per_epoch_and_resumes():
    stream = data.TokenStream([np.arange(10 * 8)], ["x"])
    rows = data.PackedRows(stream, seq_len=8, seed=3, shuffle=True)
    first = rows.rows(range(10))["tokens"][:, 0] // 8
    second = rows.rows(range(10, 20))["tokens"][:, 0] // 8
    assert sorted(first) == list(range(10)) and sorted(second) == list(range(10))
    assert list(first) != list(second)  # a new order each epoch
    again = data.PackedRows(stream, seq_len=8, seed=3).rows(range(10))["tokens"][:, 0] // 8
    np.testing.assert_array_equal(first, again)

    it = data.BatchIterator(rows, global_batch=4, host_rows=(0, 4))
    batches = [next(it)["tokens"] for _ in range(5)]
    resumed = data.BatchIterator(rows, global_batch=4, host_rows=(0, 4))
    resumed.restore(json.loads(json.dumps({"position": 8})))  # after 2 batches, via JSON
    np.testing.assert_array_equal(next(resumed)["tokens"], batches[2])
    assert resumed.state() == {"position": 12}


def test_each_host_reads_its_own_rows_of_the_global_batch():
    stream = data.TokenStream([np.arange(40 * 4)], ["x"])
    rows = data.PackedRows(stream, seq_len=4, seed=0)
    whole = data.BatchIterator(rows, 6, (0, 6))
    hosts = [data.BatchIterator(rows, 6, (0, 3)), data.BatchIterator(rows, 6, (3, 6))]
    for _ in range(3):
        np.testing.assert_array_equal(next(whole)["tokens"],
                                      np.concatenate([next(h)["tokens"] for h in hosts]))


def test_host_batch_slice_on_one_device():
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"))
    sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))
    assert data.host_batch_slice(sharding, (8, 16)) == (0, 8)


def test_stdlib_corpus_has_a_held_out_split_by_file():
    root, files = data.stdlib_files()
    assert len(files) > 100 and all(f.endswith(".py") for f in files)
    train, held = data.load_split_streams(data_config(), vocab_size=256)
    assert held is not None and held.num_tokens > 64
    assert not set(train.names) & set(held.names)
    for name in held.names[:20]:
        assert data.is_eval_file(os.path.relpath(name, root), 0.05)
    share = held.num_tokens / (train.num_tokens + held.num_tokens)
    assert 0.01 < share < 0.15
    toks, segs = train.read(0, 4096)
    assert toks.max() < 256 and segs[0] == 1


def test_text_files_with_a_tokenizers_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    corpus = ["the cat sat on the mat", "a dog ate the cat food", "the end of the story"]
    for i, text in enumerate(corpus * 4):
        (tmp_path / f"doc{i:02d}.txt").write_text(text)
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok_path = str(tmp_path / "tok.json")
    tok.save(tok_path)

    cfg = data_config(source="text", paths=str(tmp_path / "*.txt"), tokenizer=tok_path,
                      eval_fraction=0.0, seq_len=4)
    train, held = data.load_split_streams(cfg, vocab_size=tok.get_vocab_size())
    assert held is None and len(train.chunks) == 12
    np.testing.assert_array_equal(train.chunks[0], tok.encode(corpus[0]).ids)
    with pytest.raises(ValueError, match=r"doc00\.txt: token id \d+ .* >= model.vocab_size 3"):
        data.load_split_streams(cfg, vocab_size=3)


def test_token_files_round_trip_through_tokenize_to_file(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.txt").write_bytes(bytes([65 + i]) * (10 + i))
    out = str(tmp_path / "corpus.u16")
    n = data.tokenize_to_file([str(tmp_path / "*.txt")], "", out, "uint16", eos_id=256)
    assert n == 10 + 11 + 12 + 3
    cfg = data_config(source="tokens", paths=out, eos_id=256, eval_fraction=0.0, seq_len=12)
    train, _ = data.load_split_streams(cfg, vocab_size=257)
    toks, segs = train.read(0, 12)
    np.testing.assert_array_equal(toks, [65] * 10 + [256, 66])
    np.testing.assert_array_equal(segs, [1] * 11 + [2])


@pytest.mark.parametrize("case", ["missing", "empty", "vocab", "odd_size", "tokenizer", "source"])
def test_bad_data_stops_with_an_error_naming_it(tmp_path, case):
    good = tmp_path / "good.txt"
    good.write_text("hello world " * 20)
    if case == "missing":
        cfg, vocab = data_config(source="text", paths=str(tmp_path / "nope*.txt")), 256
        err, match = FileNotFoundError, r"data.paths: '.*nope\*\.txt' matches no file"
    elif case == "empty":
        (tmp_path / "empty.txt").write_text("")
        cfg, vocab = data_config(source="text", paths=str(tmp_path / "*.txt"),
                                 eval_fraction=0.0), 256
        err, match = ValueError, r"empty\.txt' is an empty file"
    elif case == "vocab":
        np.array([1, 2, 3, 60000], np.uint16).tofile(tmp_path / "t.u16")
        cfg = data_config(source="tokens", paths=str(tmp_path / "t.u16"), eval_fraction=0.0)
        vocab = 1000
        err, match = ValueError, r"t\.u16: token id 60000 .* >= model.vocab_size 1000"
    elif case == "odd_size":
        (tmp_path / "t.u16").write_bytes(b"\x01\x02\x03")
        cfg = data_config(source="tokens", paths=str(tmp_path / "t.u16"), eval_fraction=0.0)
        vocab = 1000
        err, match = ValueError, r"t\.u16' has 3 bytes, not a multiple of 2"
    elif case == "tokenizer":
        cfg = data_config(source="text", paths=str(good), eval_fraction=0.0,
                          tokenizer=str(tmp_path / "no.json"))
        vocab = 256
        err, match = FileNotFoundError, r"data.tokenizer: '.*no\.json' is not a file"
    else:
        cfg, vocab = data_config(source="web"), 256
        err, match = ValueError, r"data.source: 'web' is not one of"
    with pytest.raises(err, match=match):
        data.load_split_streams(cfg, vocab)


def test_bytes_above_a_small_vocab_name_the_file(tmp_path):
    (tmp_path / "a.txt").write_text("abc\u00e9")  # UTF-8: bytes 97, 98, 99, 195, 169
    cfg = data_config(source="text", paths=str(tmp_path / "a.txt"), eval_fraction=0.0, seq_len=2)
    with pytest.raises(ValueError, match=r"a\.txt: token id 195 \(first bad id at token 3\)"):
        data.load_split_streams(cfg, vocab_size=128)


def test_seq_len_longer_than_the_data_is_an_error(tmp_path):
    (tmp_path / "a.txt").write_text("short")
    cfg = data_config(source="text", paths=str(tmp_path / "a.txt"), eval_fraction=0.0)
    train, _ = data.load_split_streams(cfg, vocab_size=256)
    with pytest.raises(ValueError, match="data.seq_len: 64 is longer than the whole split"):
        data.PackedRows(train, 64, seed=0)


# ---------------------------------------------------------------------------------------------
# The held-out split: data.eval_paths, none, by file, or the tail
# ---------------------------------------------------------------------------------------------


def test_the_stdlib_corpus_is_split_by_file_and_the_split_says_so():
    split = data.load_split(data_config(), vocab_size=256)
    assert split.rule == "file" and split.tokenizer == "bytes (ids 0..255)"
    assert split.train_files + split.eval_files == len(data.stdlib_files()[1])
    assert split.describe().startswith(
        f"by file (CRC32 of each path in the lowest 5%): train {split.train_files:,} files, "
        f"{split.train.num_tokens:,} tokens; held out {split.eval_files:,} files, "
        f"{split.eval_tokens:,} tokens")


def test_one_token_file_holds_out_its_tail_cut_after_an_eos(tmp_path):
    """The README's recipe: one file from `python -m kimi_k3.data --eos_id=0`. The tail holds
    between 5% and 10% of the tokens and starts right after an end-of-document id."""
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(1, 256, rng.integers(50, 300)), 0) for _ in range(100)]
    corpus = np.concatenate(docs).astype(np.uint16)
    corpus.tofile(tmp_path / "corpus.bin")
    cfg = data_config(source="tokens", paths=str(tmp_path / "corpus.bin"), eos_id=0)
    split = data.load_split(cfg, vocab_size=256)
    n, cut = len(corpus), split.train.num_tokens
    assert split.rule == "tail" and split.at_boundary and split.eval is not None
    assert cut + split.eval.num_tokens == n and split.eval_tokens == n - cut
    assert 0.05 * n <= n - cut <= 0.1 * n and corpus[cut - 1] == 0
    # The last end of a document that holds out at least 5%: no later one does.
    assert not (corpus[cut : n - math.ceil(0.05 * n) - 1] == 0).any()
    np.testing.assert_array_equal(split.eval.read(0, 10)[0], corpus[cut : cut + 10])
    assert split.eval.read(0, 10)[1][0] == 1  # a document of its own
    assert split.describe() == (
        f"tail (the last 5% of the tokens, cut at a document end in corpus.bin): train 1 "
        f"file, {cut:,} tokens; held out 1 file, {n - cut:,} tokens")
    assert split.tokenizer == "none (pre-tokenised uint16 files)"
    # Without eos_id the one document is cut exactly at 95%.
    split = data.load_split(data_config(source="tokens", paths=str(tmp_path / "corpus.bin"),
                                        eval_fraction=0.1), vocab_size=256)
    assert split.rule == "tail" and not split.at_boundary
    assert split.eval_tokens == math.ceil(0.1 * n) and "cut inside a document" in split.describe()


def test_a_few_text_files_hold_out_a_tail_at_a_file_start(tmp_path):
    """Three files that the hash leaves all on the train side: the tail starts where the last
    file does when that holds out between 1 and 2 times eval_fraction of the tokens."""
    for name, size in (("a.txt", 900), ("b.txt", 1000), ("c.txt", 100)):
        (tmp_path / name).write_text("x" * size)
    files = sorted(str(p) for p in tmp_path.glob("*.txt"))
    assert data.split_by_file(files, 0.05)[1] == []  # by file: nothing held out
    split = data.load_split(data_config(source="text", paths=str(tmp_path / "*.txt")), 256)
    assert split.rule == "tail" and split.at_boundary and split.eval_tokens == 100
    assert split.eval.names == [files[2]] and split.train_files == 2 and split.eval_files == 1


def test_tail_start_takes_the_last_boundary_within_twice_the_share():
    stream = data.TokenStream([np.ones(100, np.int32), np.ones(100, np.int32)], ["a", "b"],
                              eos_id=0)
    # 10% of 200 = 20 tokens; the only boundary (200 - 100) holds out 50%: cut inside.
    assert data.tail_start(stream, 0.1) == (180, False)
    tokens = np.ones(200, np.int32)
    tokens[[150, 170, 185]] = 0  # ends of documents: boundaries 151, 171, 186
    stream = data.TokenStream([tokens], ["a"], eos_id=0)
    assert data.tail_start(stream, 0.1) == (171, True)  # 186 holds out too little, 151 too much
    assert data.tail_start(stream, 0.01) == (198, False)  # 2 to 4 tokens: no boundary there


def test_eval_paths_and_no_held_out_split_are_named(tmp_path):
    (tmp_path / "train.txt").write_text("abc " * 100)
    (tmp_path / "held.txt").write_text("def " * 50)
    split = data.load_split(data_config(source="text", paths=str(tmp_path / "train.txt"),
                                        eval_paths=str(tmp_path / "held.txt")), 256)
    assert split.rule == "eval_paths" and split.eval_tokens == 200
    assert split.describe() == ("data.eval_paths: train 1 file, 400 tokens; held out 1 file, "
                                "200 tokens")
    split = data.load_split(data_config(source="text", paths=str(tmp_path / "train.txt"),
                                        eval_fraction=0.0), 256)
    assert split.rule == "none" and split.eval is None
    assert split.describe() == ("none (data.eval_fraction=0): train 1 file, 400 tokens; no "
                                "held-out loss")
