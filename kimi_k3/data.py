"""Input pipeline: token sources, packing into fixed-length rows with ``segment_ids``, and a
deterministic, resumable, host-sharded order.

Sources (``config.data.source``):

    "stdlib"  the embedded default: the running interpreter's standard-library ``*.py`` files,
              read from ``sysconfig.get_paths()["stdlib"]`` — every fresh machine has them.
    "text"    UTF-8 text files or globs in ``data.paths`` (comma-separated).
    "tokens"  pre-tokenised token files (flat ``uint16`` / ``uint32`` arrays, read by memmap);
              ``data.eos_id`` (if >= 0) marks the end of each document inside a file.

Text is tokenised to bytes (ids 0..255) unless ``data.tokenizer`` names a Hugging Face
``tokenizers`` JSON file, or a tiktoken BPE file (``tiktoken.model``: one base64 token and its
rank per line, as Kimi's checkpoints ship it), read with Kimi's pre-tokenizer and the special
tokens of the ``tokenizer_config.json`` beside it (``TextTokenizer``).

Held-out data (``load_split``; the first screen names the rule and its sizes), the first rule
that applies:

    "eval_paths"  ``data.eval_paths`` when given: those files, and every ``data.paths`` file
                  trains;
    "none"        ``data.eval_fraction = 0``: nothing is held out;
    "file"        by file: the files whose CRC32 of their path (relative to the files' common
                  folder) falls in the lowest ``eval_fraction`` of the range, when that puts
                  files on both sides and holds out between half and twice ``eval_fraction``
                  of the bytes (the stdlib corpus);
    "tail"        else (one file, a few files, or a hash that picked too much or too little):
                  the last ``eval_fraction`` of the tokens of all files in order, cut at the
                  last document boundary (a file's start, or after an ``eos_id``) that holds
                  out between once and twice that share, or mid-document when none does.

The split depends on the files, ``eval_fraction``, ``eos_id`` and the tokenizer only (never on
``seq_len`` or the batch), so eval.py reads the held-out data a run held out.

Packing: all documents of a split are one virtual stream (document after document, file after
file); row r of an epoch is the window ``[w*T, (w+1)*T)`` of that stream with w = perm_epoch[r],
perm_epoch a permutation seeded by (seed, epoch). ``segment_ids`` number the documents inside a
row from 1, so a document cut by a row boundary continues as a new segment in its next row and
no token is padding. The order is a pure function of (seed, global row index): the position
saved with a checkpoint is the number of global rows consumed, independent of the host count.

Each host materialises only its own rows of every global batch: the rows whose batch indices
its devices hold under the batch sharding.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import dataclasses
import functools
import glob
import json
import logging
import math
import os
import re
import sysconfig
import zlib
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from kimi_k3.config import TOKEN_DTYPES, ConfigError, data_spec

BYTE_VOCAB = 256
_CHECK_CHUNK = 1 << 24  # tokens scanned at a time when checking ids in a token file


# ---------------------------------------------------------------------------------------------
# The token stream: documents back to back, read by window
# ---------------------------------------------------------------------------------------------


class TokenStream:
    """A virtual concatenation of documents (NumPy arrays or memmaps, never copied).

    A document boundary falls at the start of every chunk and, when ``eos_id >= 0``, right after
    every ``eos_id`` token. ``names[i]`` says where chunk i came from, for error messages.
    """

    def __init__(self, chunks: Sequence[np.ndarray], names: Sequence[str], eos_id: int = -1):
        if len(chunks) != len(names):
            raise ValueError(f"TokenStream: {len(chunks)} chunks but {len(names)} names")
        keep = [i for i, c in enumerate(chunks) if len(c) > 0]
        self.chunks = [chunks[i] for i in keep]
        self.names = [names[i] for i in keep]
        self.eos_id = int(eos_id)
        lengths = np.array([len(c) for c in self.chunks], np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def read(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens [start, start+length) as int32, and their segment ids (1, 2, ... per row)."""
        end = start + length
        if start < 0 or end > self.num_tokens:
            raise IndexError(f"TokenStream.read: [{start}, {end}) outside [0, {self.num_tokens})")
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        pieces, new_doc = [], np.zeros(length, bool)
        pos = start
        while pos < end:
            c_start, c_end = int(self.offsets[i]), int(self.offsets[i + 1])
            stop = min(end, c_end)
            pieces.append(np.asarray(self.chunks[i][pos - c_start : stop - c_start]))
            if pos == c_start and pos != start:
                new_doc[pos - start] = True
            pos, i = stop, i + 1
        tokens = np.concatenate(pieces).astype(np.int32)
        if self.eos_id >= 0:
            new_doc[1:] |= tokens[:-1] == self.eos_id
        return tokens, (1 + np.cumsum(new_doc)).astype(np.int32)

    def split_at(self, position: int) -> tuple[TokenStream, TokenStream]:
        """(tokens [0, position), tokens [position, end)): two streams of views of the same
        chunks, nothing copied. The second starts a new document (a chunk start is one)."""
        if not 0 <= position <= self.num_tokens:
            raise IndexError(f"TokenStream.split_at: {position} outside [0, {self.num_tokens}]")
        i = int(np.searchsorted(self.offsets, position, side="right")) - 1
        i = min(i, len(self.chunks) - 1)
        at = position - int(self.offsets[i]) if self.chunks else 0
        head = self.chunks[:i] + ([self.chunks[i][:at]] if self.chunks else [])
        tail = ([self.chunks[i][at:]] if self.chunks else []) + self.chunks[i + 1 :]
        return (TokenStream(head, self.names[: len(head)], self.eos_id),
                TokenStream(tail, self.names[len(self.chunks) - len(tail) :], self.eos_id))


class PackedRows:
    """The stream cut into rows of ``seq_len`` tokens, in a seeded order per epoch.

    ``rows(indices)`` takes global row indices (0, 1, ... over all epochs): row r is window
    ``perm_e[r % n]`` of epoch ``e = r // n``. Without shuffling, row r is window ``r % n``.
    """

    def __init__(self, stream: TokenStream, seq_len: int, seed: int, shuffle: bool = True):
        self.stream, self.seq_len, self.seed, self.shuffle = stream, seq_len, seed, shuffle
        self.num_rows = stream.num_tokens // seq_len
        if self.num_rows == 0:
            raise ValueError(
                f"data.seq_len: {seq_len} is longer than the whole split ({stream.num_tokens} "
                f"tokens); give more data or a shorter data.seq_len"
            )
        self._perms: dict[int, np.ndarray] = {}

    def _window(self, row: int) -> int:
        epoch, r = divmod(int(row), self.num_rows)
        if not self.shuffle:
            return r
        if epoch not in self._perms:
            if len(self._perms) > 2:
                self._perms.pop(min(self._perms))
            rng = np.random.default_rng([self.seed, epoch])
            self._perms[epoch] = rng.permutation(self.num_rows)
        return int(self._perms[epoch][r])

    def rows(self, indices: Sequence[int]) -> dict[str, np.ndarray]:
        toks, segs = zip(
            *(self.stream.read(self._window(r) * self.seq_len, self.seq_len) for r in indices),
            strict=True,
        )
        return {"tokens": np.stack(toks), "segment_ids": np.stack(segs)}


@dataclasses.dataclass
class BatchIterator:
    """This host's rows of each global batch, from global row ``position`` on.

    ``host_rows`` = (lo, hi): the slice of the global batch this host feeds (from
    ``host_batch_slice``). ``position`` is global rows consumed: save it, restore it.
    """

    rows: PackedRows
    global_batch: int
    host_rows: tuple[int, int]
    position: int = 0

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        lo, hi = self.host_rows
        batch = self.rows.rows(range(self.position + lo, self.position + hi))
        self.position += self.global_batch
        return batch

    def state(self) -> dict[str, int]:
        return {"position": int(self.position)}

    def restore(self, state: dict) -> None:
        self.position = int(state["position"])


def host_batch_slice(sharding, global_shape: tuple[int, ...]) -> tuple[int, int]:
    """The contiguous range of batch rows (dim 0) that this process's devices hold under
    ``sharding`` — the rows this host must read. Raises if they are not contiguous."""
    axes = sharding.spec[0] if len(sharding.spec) else None
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    ways = math.prod(sharding.mesh.shape[a] for a in axes)
    if global_shape[0] % ways:
        sizes = " x ".join(f"{a} {sharding.mesh.shape[a]}" for a in axes)
        lower = global_shape[0] // ways * ways
        raise ConfigError(
            f"config.data.global_batch_size: {global_shape[0]} rows do not split over the mesh's "
            f"{ways} data-parallel devices ({sizes}); allowed: a multiple of {ways}, e.g. "
            f"{lower or ways} or {lower + ways}, or a mesh whose data x fsdp x expert divides "
            f"{global_shape[0]} (--config.mesh.*)")
    idx = sharding.addressable_devices_indices_map(global_shape).values()
    spans = sorted({(s[0].start or 0, global_shape[0] if s[0].stop is None else s[0].stop)
                    for s in idx})
    lo, hi = spans[0][0], spans[-1][1]
    covered = sum(b - a for a, b in spans)
    if covered != hi - lo:
        raise ValueError(
            f"batch sharding: this process's devices hold batch rows {spans}, which are not one "
            f"contiguous range; order the mesh so each host's devices are adjacent on the batch "
            f"axes (data x fsdp x expert)"
        )
    return lo, hi


# ---------------------------------------------------------------------------------------------
# Sources: files, tokenisation, validation
# ---------------------------------------------------------------------------------------------


def split_paths(paths) -> list[str]:
    """``data.paths`` as a list: a comma-separated string, or a list/tuple of strings."""
    if isinstance(paths, str):
        return [p.strip() for p in paths.split(",") if p.strip()]
    return [str(p) for p in paths]


def expand_paths(patterns: Sequence[str], field: str) -> list[str]:
    """Files matched by each pattern (globs, ``**`` recursive), sorted, de-duplicated.
    A pattern that matches no file is an error naming it."""
    files: list[str] = []
    for pat in patterns:
        if os.path.isdir(os.path.expanduser(pat)):
            raise ValueError(
                f"{field}: {pat!r} is a directory; give files or a glob, e.g. "
                f"{os.path.join(pat, '**', '*.txt')!r}")
        hits = sorted(p for p in glob.glob(os.path.expanduser(pat), recursive=True)
                      if os.path.isfile(p))
        if not hits:
            raise FileNotFoundError(f"{field}: {pat!r} matches no file")
        files.extend(hits)
    return list(dict.fromkeys(files))


def stdlib_files() -> tuple[str, list[str]]:
    """The interpreter's standard-library source files (no site-packages), sorted."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages",
                                                               "__pycache__"))
        files.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    if not files:
        raise FileNotFoundError(f"data.source='stdlib': no *.py files under {root!r}")
    return root, files


def is_eval_file(relpath: str, eval_fraction: float) -> bool:
    """The held-out rule: CRC32 of the relative path in the lowest ``eval_fraction`` of 2^32."""
    return zlib.crc32(relpath.replace(os.sep, "/").encode()) < eval_fraction * 2**32


def split_by_file(files: Sequence[str], eval_fraction: float) -> tuple[list[str], list[str]]:
    if not files:
        return [], []
    root = os.path.commonpath([os.path.abspath(f) for f in files])
    if len(files) == 1:
        root = os.path.dirname(root)
    ev = [is_eval_file(os.path.relpath(os.path.abspath(f), root), eval_fraction) for f in files]
    return ([f for f, e in zip(files, ev, strict=True) if not e],
            [f for f, e in zip(files, ev, strict=True) if e])


def file_bytes(files: Sequence[str]) -> int:
    """The files' total size in bytes (what the split by file is weighed by)."""
    total = 0
    for f in files:
        try:
            total += os.path.getsize(f)
        except OSError as e:
            raise OSError(f"data.paths: cannot read {f!r} ({e.strerror or e})") from e
    return total


def split_by_file_fits(train_files: Sequence[str], eval_files: Sequence[str],
                       eval_fraction: float) -> bool:
    """Whether the split by file is used: files on both sides, and the held-out files hold
    between half and twice ``eval_fraction`` of the bytes (else the tail rule)."""
    if not train_files or not eval_files:
        return False
    held, total = file_bytes(eval_files), file_bytes(train_files) + file_bytes(eval_files)
    return total > 0 and eval_fraction / 2 <= held / total <= 2 * eval_fraction


def _last_boundary(stream: TokenStream, lo: int, hi: int) -> int | None:
    """The last document boundary b with lo <= b <= hi: a chunk's start, or the position after
    an ``eos_id`` token (scanned backwards from ``hi`` a block at a time); None if none."""
    best = max((int(o) for o in stream.offsets[1:-1] if lo <= o <= hi), default=None)
    if stream.eos_id < 0:
        return best
    end, first = hi, max(lo - 1, 0)  # token i ends a document at boundary i + 1
    while end > first and (best is None or end > best):
        start = max(first, end - _CHECK_CHUNK)
        toks, _ = stream.read(start, end - start)
        hits = np.nonzero(toks == stream.eos_id)[0]
        if hits.size:
            best = max(best or 0, start + int(hits[-1]) + 1)
            break
        end = start
    return best


def tail_start(stream: TokenStream, eval_fraction: float) -> tuple[int, bool]:
    """(where the held-out tail of ``stream`` starts, whether that is a document boundary).

    The tail holds h = ceil(eval_fraction x tokens) tokens or more: it starts at the last
    document boundary b with tokens - 2h <= b <= tokens - h (b >= 1: the train side keeps a
    token), or at tokens - h, inside a document, when there is none."""
    n = stream.num_tokens
    h = max(1, math.ceil(eval_fraction * n))
    hi = n - h
    if hi < 1:
        return max(hi, 0), False
    b = _last_boundary(stream, max(1, n - 2 * h), hi)
    return (hi, False) if b is None else (b, True)


RULES = ("eval_paths", "none", "file", "tail")


@dataclasses.dataclass(frozen=True)
class Split:
    """The train and held-out streams of ``config.data`` (``load_split``) and how they were
    made: which rule (``RULES``, module docstring), and the sizes on each side."""

    train: TokenStream
    eval: TokenStream | None  # None: nothing held out, or fewer tokens than one row
    rule: str
    eval_fraction: float
    train_files: int
    eval_files: int  # the tail rule: files with tokens in the tail (the first maybe in part)
    eval_tokens: int  # held out, counted even when too few for a row
    tokenizer: str  # what made the ids, in words
    at_boundary: bool = True  # the tail rule: cut at a document boundary (else inside one)
    cut_file: str = ""  # the tail rule: the file the tail starts in

    def describe(self) -> str:
        """The rule and the sizes on each side, one line for the first screen."""
        files = lambda k: f"{k:,} file{'s' if k != 1 else ''}"
        train = f"train {files(self.train_files)}, {self.train.num_tokens:,} tokens"
        held = f"held out {files(self.eval_files)}, {self.eval_tokens:,} tokens"
        share = f"{self.eval_fraction * 100:.4g}%"
        if self.rule == "eval_paths":
            how = "data.eval_paths"
        elif self.rule == "none":
            return f"none (data.eval_fraction=0): {train}; no held-out loss"
        elif self.rule == "file":
            how = f"by file (CRC32 of each path in the lowest {share})"
        else:
            where = "at a document end" if self.at_boundary else "inside a document"
            how = (f"tail (the last {share} of the tokens, cut {where} in "
                   f"{os.path.basename(self.cut_file)})")
        return f"{how}: {train}; {held}"


def _tokenizer_words(data_cfg, tok: TextTokenizer | None) -> str:
    if tok is None:  # data.tokenizer, if any, is generate.py's (text in and out)
        named = f"; data.tokenizer {data_cfg.tokenizer!r}" if data_cfg.tokenizer else ""
        return f"none (pre-tokenised {data_cfg.token_dtype} files){named}"
    if not tok.path:
        return f"bytes (ids 0..{BYTE_VOCAB - 1})"
    return f"{os.path.abspath(tok.path)} ({tok.vocab_size:,} ids)"


# data.tokenizer = NO_TOKENIZER: the model's ids are not bytes and no tokenizer is known (a
# checkpoint imported without one): text is refused rather than read as bytes.
NO_TOKENIZER = "none"

# Kimi's pre-tokenizer: the regular expression ``TikTokenTokenizer.pat_str`` of the
# tokenization_kimi.py that ships with Moonshot AI's checkpoints on the Hugging Face Hub
# (moonshotai/Kimi-Linear-48B-A3B-Instruct, moonshotai/Kimi-K2-Instruct). Runs of Han
# characters stand alone; a word is an optional leading non-letter, its cased letters (Han
# excluded) and an English contraction; numbers go in groups of up to three digits; then
# punctuation, newlines and whitespace as in GPT-4's cl100k pattern.
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# tokenization_kimi.py's special ids: the ``num_reserved_special_tokens`` (256) + 2 ids right
# after the BPE ranks, named by tokenizer_config.json's added_tokens_decoder (the rest
# "<|reserved_token_{id}|>"); [BOS] and [EOS] unless the config names other ones.
TIKTOKEN_SPECIAL_IDS = 256 + 2
TIKTOKEN_CONFIG = "tokenizer_config.json"  # read from the folder of the tiktoken file
# tiktoken's encoder fails on very long inputs and on very long runs of whitespace or of
# non-whitespace (openai/tiktoken#195): texts are cut into pieces of at most this many
# characters, and such runs every this many characters, before encoding, as Kimi's does.
TIKTOKEN_MAX_CHARS = 400_000
TIKTOKEN_MAX_RUN = 25_000


def is_tiktoken_file(path: str) -> bool:
    """Whether ``path`` is a tiktoken BPE file (its first line a base64 token and a rank),
    not a tokenizers JSON."""
    try:
        with open(path, "rb") as f:
            first = f.readline(4096).split()
    except OSError:
        return False
    return len(first) == 2 and first[1].isdigit() and not first[0].startswith(b"{")


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """{token bytes: rank} of a tiktoken BPE file: one ``<base64 token> <rank>`` per line.
    Raises ValueError naming ``data.tokenizer``, the file and the line that does not parse, or
    ranks that are not 0 .. n - 1 (the special ids follow the last rank)."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            try:
                token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
                if len(parts) != 2:
                    raise ValueError
            except (ValueError, IndexError, binascii.Error):
                raise ValueError(f"data.tokenizer: {path!r} line {n} is not '<base64 token> "
                                 f"<rank>': {line[:80]!r}") from None
            ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"data.tokenizer: {path!r}: the ranks of its {len(ranks)} tokens are "
                         f"not 0 .. {len(ranks) - 1} each once (a token listed twice, or a gap)")
    return ranks


def _token_name(value) -> str | None:
    """A tokenizer_config.json token entry: a string, or {"content": string, ...}."""
    return value.get("content") if isinstance(value, dict) else value


def tiktoken_special_tokens(config_path: str | None, num_base: int) -> tuple[dict[str, int], str, str]:
    """(special tokens {name: id}, the BOS name, the EOS name) for a tiktoken file of
    ``num_base`` ranks, as tokenization_kimi.py makes them: ids num_base .. num_base + 257,
    named by ``config_path``'s added_tokens_decoder (None or no file: all reserved)."""
    names, cfg = {}, {}
    if config_path and os.path.isfile(config_path):
        try:
            with open(config_path) as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"data.tokenizer: {config_path!r} is not a JSON file: {e}") from e
        for key, entry in (cfg.get("added_tokens_decoder") or {}).items():
            name = _token_name(entry)
            if not (str(key).isdigit() and isinstance(name, str)):
                raise ValueError(f"data.tokenizer: {config_path!r}: added_tokens_decoder entry "
                                 f"{key!r} is not '<id>': {{'content': '<token>'}}")
            names[int(key)] = name
    special = {names.get(i, f"<|reserved_token_{i}|>"): i
               for i in range(num_base, num_base + TIKTOKEN_SPECIAL_IDS)}
    bos = _token_name(cfg.get("bos_token")) or "[BOS]"
    eos = _token_name(cfg.get("eos_token")) or "[EOS]"
    return special, bos, eos


def _tiktoken_pieces(text: str, max_chars: int = TIKTOKEN_MAX_CHARS,
                     max_run: int = TIKTOKEN_MAX_RUN) -> Iterator[str]:
    """``text`` cut as tokenization_kimi.py cuts it before tiktoken: pieces of at most
    ``max_chars`` characters, and in each a run of whitespace or of non-whitespace longer than
    ``max_run`` split every ``max_run`` characters."""
    long_run = re.compile(rf"\s{{{max_run + 1},}}|\S{{{max_run + 1},}}")
    for lo in range(0, len(text), max_chars):
        chunk, at = text[lo : lo + max_chars], 0
        for m in long_run.finditer(chunk):
            for cut in range(m.start() + max_run, m.end(), max_run):
                yield chunk[at:cut]
                at = cut
        yield chunk[at:]


class TextTokenizer:
    """Bytes (ids 0..255) by default; a Hugging Face ``tokenizers`` JSON, or a tiktoken BPE file
    (``is_tiktoken_file``: Kimi's ``tiktoken.model``), when a path is given; ``"none"``
    (NO_TOKENIZER) refuses text, naming what to give instead.

    A tiktoken file is read as Kimi's tokenization_kimi.py reads it: ``KIMI_PAT_STR`` splits the
    text, the ranks merge the bytes of each piece, and the special tokens
    (``tiktoken_special_tokens``) come from the ``tokenizer_config.json`` beside the file; a
    special token's text in the input encodes to its id, as there. ``bos_id`` / ``eos_id``: the
    tokenizer's own, when it names them (tiktoken), else None.
    """

    def __init__(self, path: str = ""):
        self.path = path
        self.kind = "bytes"
        self.bos_id = self.eos_id = None
        self._tok = self._tiktoken = None
        self._known = None  # tiktoken: the number of ranks (ids below it are tokens)
        self._containing: dict[tuple[str, ...], list[int]] = {}  # ids_containing's answers
        if path == NO_TOKENIZER:
            raise ValueError(
                "config.data.tokenizer='none': this model's token ids are not bytes and no "
                "tokenizer came with it, so text cannot be read; give token ids (generate.py "
                "--prompt_ids=...) or token files (--config.data.source=tokens "
                "--config.data.paths=FILE), or its tokenizer (--config.data.tokenizer=PATH: a "
                "tokenizers JSON, or a tiktoken.model)")
        if not path:
            self.vocab_size = BYTE_VOCAB
            return
        if not os.path.isfile(path):
            raise FileNotFoundError(f"data.tokenizer: {path!r} is not a file")
        if is_tiktoken_file(path):
            self._init_tiktoken(path)
            return
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # the library's own error types vary by version
            raise ValueError(f"data.tokenizer: {path!r} is neither a tokenizers JSON nor a "
                             f"tiktoken file ('<base64 token> <rank>' lines): {e}") from e
        self.kind = "tokenizers"
        self.vocab_size = self._tok.get_vocab_size()

    def _init_tiktoken(self, path: str) -> None:
        import tiktoken  # only for a tiktoken file

        ranks = read_tiktoken_ranks(path)
        config = os.path.join(os.path.dirname(os.path.abspath(path)), TIKTOKEN_CONFIG)
        special, bos, eos = tiktoken_special_tokens(config, len(ranks))
        self._tiktoken = tiktoken.Encoding(os.path.basename(path), pat_str=KIMI_PAT_STR,
                                           mergeable_ranks=ranks, special_tokens=special)
        self.kind, self._known = "tiktoken", len(ranks)
        self._special_ids = set(special.values())
        self.bos_id, self.eos_id = special.get(bos), special.get(eos)
        self.vocab_size = self._tiktoken.n_vocab

    def encode(self, text: str) -> np.ndarray:
        """int32 ids of ``text``: its UTF-8 bytes, or the tokenizer's ids (no special tokens
        added; with tiktoken a special token's text is its id)."""
        if self._tiktoken is not None:
            ids = [i for piece in _tiktoken_pieces(text)
                   for i in self._tiktoken.encode(piece, allowed_special="all")]
            return np.asarray(ids, np.int32)
        if self._tok is None:
            return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``. Bytes are decoded as UTF-8 with U+FFFD for invalid sequences and
        for ids outside 0..255 (a model whose vocabulary is wider than the bytes can emit them);
        a tokenizer skips ids it does not know (tiktoken: U+FFFD for a token's bytes that are
        not UTF-8 on their own)."""
        ids = [int(i) for i in ids]
        if self._tiktoken is not None:
            known = [i for i in ids if 0 <= i < self._known or i in self._special_ids]
            return self._tiktoken.decode(known, errors="replace")
        if self._tok is None:
            text, run = [], bytearray()
            for i in ids:
                if 0 <= i < BYTE_VOCAB:
                    run.append(i)
                    continue
                text.append(run.decode("utf-8", errors="replace") + "\ufffd")
                run = bytearray()
            return "".join(text) + run.decode("utf-8", errors="replace")
        return self._tok.decode(ids)

    def token_bytes(self, i: int) -> bytes:
        """The bytes id ``i`` stands for (tiktoken and bytes; a special token: b"")."""
        if self._tiktoken is not None:
            return b"" if i in self._special_ids or not 0 <= i < self._known else \
                self._tiktoken.decode_single_token_bytes(i)
        if self._tok is None:
            return bytes([i]) if 0 <= i < BYTE_VOCAB else b""
        raise ValueError(f"data.tokenizer: {self.path!r} is a tokenizers JSON; use "
                         f"kimi_k3.eval_scoring.tokenizer_byte_lengths for its bytes")

    def ids_containing(self, texts: Sequence[str]) -> list[int]:
        """The ids whose own text holds one of ``texts`` (empty strings ignored): a decoder
        that stops at them stops at every such string that lies inside one token; one that
        spans tokens is found in the decoded text afterwards."""
        texts = tuple(t for t in texts if t)
        if not texts:
            return []
        if texts not in self._containing:  # a scan of the vocabulary, once per set of texts
            own = [self.decode([i]) for i in range(self.vocab_size)]
            self._containing[texts] = [i for i, t in enumerate(own) if any(x in t for x in texts)]
        return list(self._containing[texts])

    def byte_lengths(self) -> np.ndarray:
        """int64 [vocab_size]: the UTF-8 bytes behind each id (special tokens 0): exact for bytes
        and for tiktoken, whose ranks are byte strings."""
        return np.array([len(self.token_bytes(i)) for i in range(self.vocab_size)], np.int64)

    def encode_files(self, files: Sequence[str], skip_empty: bool,
                     check_text: bool = False) -> list[np.ndarray]:
        """The ids of each file. ``check_text``: refuse a file that is not UTF-8 text (a NUL
        byte or an invalid sequence: a binary file given as ``data.source='text'``), naming it
        and the byte where it stops being text."""
        raw = []
        for f in files:
            try:
                with open(f, "rb") as fh:
                    b = fh.read()
            except OSError as e:
                raise OSError(f"data.paths: cannot read {f!r} ({e.strerror or e})") from e
            if not b and not skip_empty:
                raise ValueError(f"data.paths: {f!r} is an empty file")
            if check_text:
                _check_text(b, f)
            raw.append(b)
        if self._tok is None and self._tiktoken is None:
            return [np.frombuffer(b, np.uint8) for b in raw]
        texts = [b.decode("utf-8", errors="replace") for b in raw]
        dtype = np.uint16 if self.vocab_size <= 2**16 else np.uint32
        if self._tiktoken is not None:
            return [self.encode(t).astype(dtype) for t in texts]
        return [np.asarray(e.ids, dtype) for e in self._tok.encode_batch(texts)]


def _check_text(data: bytes, path: str) -> None:
    """Raises ValueError naming ``path`` unless ``data`` is UTF-8 text without NUL bytes."""
    at = data.find(b"\0")
    if at < 0:
        try:
            data.decode("utf-8")
            return
        except UnicodeDecodeError as e:
            at = e.start
    raise ValueError(
        f"data.paths: {path!r} is not UTF-8 text (byte {at} of {len(data)}: "
        f"{data[at:at + 8]!r}); data.source='text' reads text files — for token ids written "
        f"by `python -m kimi_k3.data` use --config.data.source=tokens")


def first_bad_id(tokens: np.ndarray, vocab_size: int) -> tuple[tuple[int, ...], int] | None:
    """(index, id) of the first token id outside [0, vocab_size) in row-major order, or None."""
    tokens = np.asarray(tokens)
    if tokens.size == 0:
        return None
    bad = (tokens < 0) | (tokens >= vocab_size)
    if not bad.any():
        return None
    flat = int(np.argmax(bad.reshape(-1)))
    index = tuple(int(i) for i in np.unravel_index(flat, tokens.shape))
    return index, int(tokens.reshape(-1)[flat])


def check_ids(chunks: Sequence[np.ndarray], names: Sequence[str], vocab_size: int) -> None:
    """Every id must lie in [0, vocab_size); the first offending file is named with the first
    bad id and its position."""
    for chunk, name in zip(chunks, names, strict=True):
        for s in range(0, len(chunk), _CHECK_CHUNK):
            found = first_bad_id(chunk[s : s + _CHECK_CHUNK], vocab_size)
            if found is not None:
                (at,), tok = found
                what = f">= model.vocab_size {vocab_size}" if tok >= vocab_size else "negative"
                raise ValueError(
                    f"{name}: token id {tok} (first bad id at token {s + at}) is {what}; ids "
                    f"must lie in [0, {vocab_size})")


def open_token_file(path: str, dtype: str) -> np.ndarray:
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise OSError(f"data.paths: cannot read {path!r} ({e.strerror or e})") from e
    itemsize = np.dtype(dtype).itemsize
    if size == 0:
        raise ValueError(f"data.paths: {path!r} is an empty file")
    if size % itemsize:
        raise ValueError(
            f"data.paths: {path!r} has {size} bytes, not a multiple of {itemsize} "
            f"(data.token_dtype={dtype!r}); is it a token file of that dtype?"
        )
    try:
        return np.memmap(path, dtype=dtype, mode="r")
    except OSError as e:
        raise OSError(f"data.paths: cannot read {path!r} ({e.strerror or e})") from e


def _check_token_files(chunks, names, vocab_size: int) -> None:
    """Token files are checked in parallel across hosts: host p scans files p, p+P, ...;
    the per-file maxima are then gathered so every host raises the same error."""
    n, p = jax.process_count(), jax.process_index()
    if n == 1:
        check_ids(chunks, names, vocab_size)
        return
    maxima = np.full(len(chunks), -1, np.int64)
    for i in range(p, len(chunks), n):
        for s in range(0, len(chunks[i]), _CHECK_CHUNK):
            maxima[i] = max(maxima[i], int(np.asarray(chunks[i][s : s + _CHECK_CHUNK]).max()))
    maxima = np.asarray(multihost_utils.process_allgather(maxima)).max(axis=0)
    for i in np.nonzero(maxima >= vocab_size)[0]:
        check_ids([chunks[i]], [names[i]], vocab_size)


def load_split(data_cfg, vocab_size: int) -> Split:
    """The train and held-out streams for ``config.data``, by the first rule that applies
    (module docstring), with the rule and the sizes (``Split``). Raises (naming the field and
    path) before any step runs. ``data_cfg``: a DataSpec, or the ``config.data`` ConfigDict
    (checked into one)."""
    data_cfg = data_spec(data_cfg)
    source = data_cfg.source
    eval_fraction = float(data_cfg.eval_fraction)
    eval_patterns = split_paths(data_cfg.eval_paths)

    if source == "stdlib":
        _, files = stdlib_files()
    else:
        patterns = split_paths(data_cfg.paths)
        if not patterns:
            raise ValueError(f"data.paths: empty; data.source={source!r} needs files or globs")
        files = expand_paths(patterns, "data.paths")
    user = source != "stdlib"
    tok = None if source == "tokens" else TextTokenizer(data_cfg.tokenizer)

    def build(split_files: list[str], user_files: bool) -> TokenStream:
        if tok is None:
            chunks = [open_token_file(f, data_cfg.token_dtype) for f in split_files]
            _check_token_files(chunks, split_files, vocab_size)
            return TokenStream(chunks, split_files, eos_id=int(data_cfg.eos_id))
        chunks = tok.encode_files(split_files, skip_empty=not user_files, check_text=user_files)
        check_ids(chunks, split_files, vocab_size)
        return TokenStream(chunks, split_files)

    split = functools.partial(Split, eval_fraction=eval_fraction,
                              tokenizer=_tokenizer_words(data_cfg, tok))
    train_files, eval_files = split_by_file(files, eval_fraction)
    if eval_patterns:
        eval_files = expand_paths(eval_patterns, "data.eval_paths")
        held = build(eval_files, True)
        out = split(build(files, user), held, "eval_paths", train_files=len(files),
                    eval_files=len(eval_files), eval_tokens=held.num_tokens)
    elif eval_fraction == 0:
        out = split(build(files, user), None, "none", train_files=len(files), eval_files=0,
                    eval_tokens=0)
    elif split_by_file_fits(train_files, eval_files, eval_fraction):
        held = build(eval_files, user)
        out = split(build(train_files, user), held, "file", train_files=len(train_files),
                    eval_files=len(eval_files), eval_tokens=held.num_tokens)
    else:
        whole = build(files, user)
        cut, at_boundary = tail_start(whole, eval_fraction)
        train, held = whole.split_at(cut)
        out = split(train, held, "tail", train_files=len(set(train.names)),
                    eval_files=len(set(held.names)), eval_tokens=held.num_tokens,
                    at_boundary=at_boundary, cut_file=held.names[0] if held.names else "")
    if out.eval is not None and out.eval.num_tokens < data_cfg.seq_len:
        logging.warning("data: the held-out split (%s) has %d tokens, fewer than one row of %d: "
                        "no held-out loss; raise data.eval_fraction or give data.eval_paths",
                        out.rule, out.eval.num_tokens, data_cfg.seq_len)
        out = dataclasses.replace(out, eval=None)
    return out


def load_split_streams(data_cfg, vocab_size: int) -> tuple[TokenStream, TokenStream | None]:
    """(train stream, held-out stream) of ``load_split``; the held-out one is None when nothing
    is held out (``data.eval_fraction = 0``) or it holds fewer tokens than one row."""
    split = load_split(data_cfg, vocab_size)
    return split.train, split.eval


# ---------------------------------------------------------------------------------------------
# Pre-tokenising text into a token file
# ---------------------------------------------------------------------------------------------


def tokenize_to_file(patterns: Sequence[str], tokenizer: str, out_path: str,
                     dtype: str = "uint16", eos_id: int = -1) -> int:
    """Tokenise text files (globs) into one flat token file for ``data.source='tokens'``,
    appending ``eos_id`` after each document when it is >= 0. Returns the token count."""
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {TOKEN_DTYPES}")
    tok = TextTokenizer(tokenizer)
    limit = np.iinfo(dtype).max
    if tok.vocab_size - 1 > limit or eos_id > limit:
        raise ValueError(f"dtype: {dtype!r} cannot hold ids up to {max(tok.vocab_size - 1, eos_id)}")
    files = expand_paths(patterns, "paths")
    total = 0
    with open(out_path, "wb") as out:
        for f in files:
            ids = tok.encode_files([f], skip_empty=False)[0].astype(dtype)
            if eos_id >= 0:
                ids = np.append(ids, np.array(eos_id, dtype))
            out.write(ids.tobytes())
            total += len(ids)
    return total


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m kimi_k3.data",
        description="Tokenise text files into a flat token file for data.source='tokens'.",
    )
    p.add_argument("paths", nargs="+", help="text files or globs")
    p.add_argument("--out", required=True, help="output token file")
    p.add_argument("--tokenizer", default="", help="tokenizers JSON; default: bytes")
    p.add_argument("--dtype", default="uint16", choices=TOKEN_DTYPES)
    p.add_argument("--eos_id", type=int, default=-1, help="id appended after each document")
    a = p.parse_args(argv)
    n = tokenize_to_file(a.paths, a.tokenizer, a.out, a.dtype, a.eos_id)
    print(f"wrote {n} tokens to {a.out}")


if __name__ == "__main__":
    main()
