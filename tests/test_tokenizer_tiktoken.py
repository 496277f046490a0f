"""Kimi's tokenizer: a tiktoken BPE file (``tiktoken.model``) with the special tokens of its
``tokenizer_config.json``, read by ``kimi_k3.data.TextTokenizer`` and carried by the Kimi Linear
import (``kimi_k3.hf``) into a run that takes text.

Held to a direct implementation of byte-pair encoding: the text split by Kimi's pre-tokenizer
regex, each piece's bytes merged pair by pair, always the adjacent pair whose merge has the
lowest rank, until no merge applies.
"""

import base64
import json
import pathlib
import shutil

import numpy as np
import pytest
import regex

from kimi_k3.data import (
    KIMI_PAT_STR,
    TIKTOKEN_MAX_CHARS,
    TIKTOKEN_MAX_RUN,
    TIKTOKEN_SPECIAL_IDS,
    TextTokenizer,
    _tiktoken_pieces,
    is_tiktoken_file,
)
from kimi_k3.eval_scoring import token_byte_lengths
from kimi_k3.hf import import_to_workdir
from kimi_k3.hf import main as hf_main

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "kimi_linear"
# Text the random documents are drawn from: ASCII words, digits, Han, accents, punctuation and
# whitespace runs, so every branch of the pre-tokenizer is used.
ALPHABET = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789 .,'!?-\n\t") + \
    ["the", " the", "ing", "'s", "'LL", "你", "好", "世界", "é", "ü", "  ", "\n\n", "   "]


def write_tiktoken(folder: pathlib.Path, rng, n_merges: int = 200, specials=True) -> dict:
    """A small tiktoken file: the 256 bytes, then ``n_merges`` merges of the most frequent
    adjacent pairs of random ALPHABET text (a tiny BPE training), with a tokenizer_config.json
    naming a few special tokens. Returns {bytes: rank}."""
    ranks = {bytes([b]): b for b in range(256)}
    sample = "".join(rng.choice(ALPHABET, 4000))
    words = [[bytes([b]) for b in w.encode()]
             for w in regex.findall(KIMI_PAT_STR, sample, flags=regex.V1)]
    while len(ranks) < 256 + n_merges:
        pairs = {}
        for w in words:
            for a, b in zip(w, w[1:], strict=False):
                pairs[a + b] = pairs.get(a + b, 0) + 1
        fresh = [p for p in sorted(pairs, key=lambda p: (-pairs[p], p)) if p not in ranks]
        if not fresh:
            break
        ranks[fresh[0]] = len(ranks)
        words = [bpe_merge_all(w, {fresh[0]: 0}) for w in words]
    (folder / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    if specials:
        n = len(ranks)
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "added_tokens_decoder": {str(n): {"content": "[BOS]", "special": True},
                                     str(n + 1): {"content": "[EOS]", "special": True},
                                     str(n + 4): {"content": "<|im_end|>", "special": True}},
            "bos_token": "[BOS]", "eos_token": {"content": "[EOS]"}}))
    return ranks


def bpe_merge_all(parts: list[bytes], ranks: dict[bytes, int]) -> list[bytes]:
    """Merge adjacent parts, lowest-ranked merge first (leftmost on a tie), until none applies."""
    parts = list(parts)
    while len(parts) > 1:
        cands = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:], strict=False))
                 if a + b in ranks]
        if not cands:
            break
        _, i = min(cands)
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def reference_encode(text: str, ranks: dict[bytes, int]) -> list[int]:
    ids = []
    for piece in regex.findall(KIMI_PAT_STR, text, flags=regex.V1):
        ids += [ranks[p] for p in bpe_merge_all([bytes([b]) for b in piece.encode()], ranks)]
    return ids


def test_kimi_pre_tokenizer_splits_as_tokenization_kimi():
    """Han runs alone, cased words with contractions, numbers by three, whitespace runs."""
    got = regex.findall(KIMI_PAT_STR, "Hello World 12345 你好abc's DON'T\n\n  x!? ",
                        flags=regex.V1)
    assert got == ["Hello", " World", " ", "123", "45", " ", "你好", "abc's", " DON'T", "\n\n",
                   " ", " x", "!?", " "]


def test_tiktoken_file_encodes_as_byte_pair_merges(tmp_path, rng):
    ranks = write_tiktoken(tmp_path, rng)
    path = str(tmp_path / "tiktoken.model")
    assert is_tiktoken_file(path) and not is_tiktoken_file(str(tmp_path / "tokenizer_config.json"))
    tok = TextTokenizer(path)
    n = len(ranks)
    assert tok.kind == "tiktoken" and tok.vocab_size == n + TIKTOKEN_SPECIAL_IDS
    assert (tok.bos_id, tok.eos_id) == (n, n + 1)
    for _ in range(20):
        text = "".join(rng.choice(ALPHABET, int(rng.integers(1, 80))))
        ids = tok.encode(text)
        assert ids.dtype == np.int32
        assert ids.tolist() == reference_encode(text, ranks), text
        assert tok.decode(ids) == text
    sample = "".join(rng.choice(ALPHABET, 200))
    assert len(tok.encode(sample)) < len(sample.encode())  # the merges merge
    # special tokens: their text is their id (as tokenization_kimi.py encodes), the unnamed
    # ones reserved; a decode skips ids the tokenizer does not know
    assert tok.encode("a[EOS]<|im_end|>").tolist() == [ranks[b"a"], n + 1, n + 4]
    assert tok.encode(f"<|reserved_token_{n + 2}|>").tolist() == [n + 2]
    assert tok.decode([ranks[b"a"], n + 1, 10**7, -1, ranks[b"b"]]) == "a[EOS]b"
    # bits per byte: every token's bytes, the special tokens none
    lengths, where = token_byte_lengths({"source": "text", "tokenizer": path})
    want = np.zeros(tok.vocab_size, np.int64)
    for t, r in ranks.items():
        want[r] = len(t)
    np.testing.assert_array_equal(lengths, want)
    assert path in where
    # the file written as the ranks say: no tokenizer_config.json -> every special reserved
    (tmp_path / "tokenizer_config.json").unlink()
    bare = TextTokenizer(path)
    assert bare.bos_id is None and bare.eos_id is None and bare.vocab_size == tok.vocab_size


def kimi_cuts(text: str, max_chars: int, max_run: int) -> list[str]:
    """tokenization_kimi.py's cutting, character by character: pieces of ``max_chars``, and
    within each a slice ends where a run of whitespace or non-whitespace passes ``max_run``."""
    out = []
    for lo in range(0, len(text), max_chars):
        s, start, run = text[lo : lo + max_chars], 0, 0
        space = s[0].isspace() if s else False
        for i, c in enumerate(s):
            if c.isspace() != space:
                run, space = 1, c.isspace()
            else:
                run += 1
                if run > max_run:
                    out.append(s[start:i])
                    start, run = i, 1
        out.append(s[start:])
    return out


def test_long_runs_are_cut_before_tiktoken(tmp_path, rng):
    """Texts and runs longer than tiktoken takes at once are cut (openai/tiktoken#195) where
    tokenization_kimi.py cuts them; the ids are those of the pieces, one after the other."""
    for _ in range(30):
        text = "".join(rng.choice(["a", "b", " ", "\n", "xyz", "    "], int(rng.integers(0, 60))))
        max_chars, max_run = int(rng.integers(5, 30)), int(rng.integers(1, 6))
        assert list(_tiktoken_pieces(text, max_chars, max_run)) == \
            kimi_cuts(text, max_chars, max_run), (text, max_chars, max_run)
    write_tiktoken(tmp_path, rng, n_merges=30)
    tok = TextTokenizer(str(tmp_path / "tiktoken.model"))
    k = int(rng.integers(1, 5000))
    text = "ab" * 20_000 + "x" * k + " " * 30_001 + "z"
    pieces = kimi_cuts(text, TIKTOKEN_MAX_CHARS, TIKTOKEN_MAX_RUN)
    assert len(pieces) == 3  # cut 25,000 characters into each long run
    ids = tok.encode(text).tolist()
    assert ids == [i for p in pieces for i in tok.encode(p).tolist()]
    assert tok.decode(ids) == text


def test_bad_tiktoken_files_are_named(tmp_path, rng):
    write_tiktoken(tmp_path, rng, n_merges=5)
    path = tmp_path / "tiktoken.model"
    lines = path.read_text().splitlines()
    (tmp_path / "gap.model").write_text("\n".join(lines[:10] + lines[11:]) + "\n")
    with pytest.raises(ValueError, match=r"data.tokenizer: .*gap.model.* not 0 \.\. 259"):
        TextTokenizer(str(tmp_path / "gap.model"))
    (tmp_path / "bad.model").write_text("\n".join(lines[:3] + ["YWJj 3 4"] + lines[4:]))
    with pytest.raises(ValueError, match=r"data.tokenizer: .*bad.model' line 4 is not"):
        TextTokenizer(str(tmp_path / "bad.model"))
    (tmp_path / "tokenizer_config.json").write_text("{")
    with pytest.raises(ValueError, match=r"tokenizer_config.json' is not a JSON file"):
        TextTokenizer(str(path))
    with pytest.raises(ValueError, match=r"tokenizer.*tiktoken.model"):
        TextTokenizer("none")


def test_imported_kimi_folder_with_tiktoken_takes_text(tmp_path, rng, capsys):
    """A Kimi Linear folder shipping tiktoken.model + tokenizer_config.json (as the published
    checkpoints do, with no tokenizer.json) imports to a run whose data.tokenizer reads them,
    prints commands that take text, and exports both files back."""
    src = tmp_path / "hf"
    shutil.copytree(FIXTURES / "all_dense_noqlora", src)
    ranks = write_tiktoken(src, rng, n_merges=20)
    run = tmp_path / "run"
    hf_main(["import", f"--hf_dir={src}", f"--workdir={run}"])
    printed = capsys.readouterr().out
    assert "--prompt='Hello'" in printed and "eval.py" in printed
    from tests.helpers import load_config

    config = load_config(str(run / "config.py"))
    assert config.data.tokenizer == str(run / "tiktoken.model")
    assert (run / "tokenizer_config.json").is_file()
    tok = TextTokenizer(config.data.tokenizer)
    text = "".join(rng.choice(ALPHABET[:40], 30))
    assert tok.encode(text).tolist() == reference_encode(text, ranks)
    out = tmp_path / "out"
    hf_main(["export", f"--workdir={run}", f"--hf_dir={out}"])
    assert (out / "tiktoken.model").read_bytes() == (src / "tiktoken.model").read_bytes()
    assert (out / "tokenizer_config.json").is_file()
    # a damaged tiktoken file is refused before anything is written
    lines = (src / "tiktoken.model").read_text().splitlines()
    (src / "tiktoken.model").write_text("\n".join([lines[0], "not base64!! 1", *lines[2:]]))
    with pytest.raises(ValueError, match="tiktoken.model' line 2 is not"):
        import_to_workdir(src, tmp_path / "run2")
    assert not (tmp_path / "run2").exists()
