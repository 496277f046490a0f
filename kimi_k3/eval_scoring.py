"""Held-out perplexity at long context, bits per byte, and loss by token position: how the
held-out data is cut into windows, how one model scores them, and how sure the figures are.
``kimi_k3.evaluation`` runs this for every checkpoint and context length;
``kimi_k3.eval_report`` writes what it measured.

What is measured, per checkpoint and context length L:

- windows: documents are cut into windows of L + 1 tokens (stride L); the model reads the
  first L, and every one of them predicts its next token, so a window scores L targets. The
  target after input position i (0-based) was predicted with i + 1 tokens of context: that is
  its *position*, 1 ... L;
- perplexity = exp(mean next-token NLL over all targets of all windows), in nats;
- bits per byte = (sum of the targets' NLL in nats) / (ln 2 x the UTF-8 bytes of the target
  tokens), when the text behind the tokens is known (``token_byte_lengths``): with byte tokens
  every token is one byte; with a tokenizers JSON each id counts the bytes it decodes to (exact
  for byte-level BPE, whose token strings spell their bytes; other decoders: the bytes an id
  adds after a fixed token). Token files without ``data.tokenizer`` hold no text: not computed,
  and the report says so. Bits per byte compares models with different tokenizers; perplexity
  only models that share one;
- loss by position: the mean NLL in log-spaced position buckets [1], [2, 3], [4, 7], ...
  (``scored_buckets``), each holding at least ``MIN_BUCKET_TARGETS`` targets (windows x
  positions): a bucket with fewer is merged into the next one (the last into the one before),
  and a last bucket narrower than half its log-spaced width (the single position L of
  [L, 2L - 1], say) is merged into the one before. A curve that keeps falling at large
  positions is a model that uses far context.

Which text is scored: the short-document rule (``short_docs``), always reported with every
document counted (total = too short + left out by the cap + scored):

- ``"same"`` (the default): every length scores the same text. With M the longest requested
  length, only documents of at least M + 1 tokens are used; each is cut into spans of M + 1
  tokens (stride M), and ``max_windows`` (> 0) keeps that many spans, spread evenly over all of
  them. At a length L each kept span is cut into floor(M / L) windows of L + 1 tokens, so every
  length scores the same targets (the first floor(M / L) x L of each span: all of them when L
  divides M) and differences between lengths come from the context alone. ``max_windows``
  counts windows at the longest length. No document of M + 1 tokens is an error that says so
  (use ``"concat"``, or shorter lengths);
- ``"skip"``: at each length L, the documents of at least L + 1 tokens, each cut into
  floor((len - 1) / L) windows, ``max_windows`` of them kept, spread evenly. Longer lengths
  then score fewer, longer documents: a curve over lengths mixes context and text;
- ``"concat"``: all held-out documents, in order, are one stream (no separator is added beyond
  what the data already has) cut into windows, so a window may span documents; ``max_windows``
  of them kept, spread evenly. The stream's last tokens short of a window are not scored.

Intervals: a percentile bootstrap (``bootstrap_ci``, ``BOOTSTRAP_SAMPLES`` resamples with a
fixed seed, so a report is reproducible) of the ratio sum(NLL) / sum(targets), resampling
*documents* with their windows (windows of one document are not independent samples); when
every window comes from one document, windows are resampled instead, and the report names the
unit and how many there were ("concat" counts a window to the document of its first target).
The interval is given for the loss, the perplexity (its exp), bits per byte and every position
bucket. It measures the spread from which text was sampled, not from training noise (another
seed of the same model). With "same", ``add_loss_changes`` also gives each length's change in
loss from the shortest length with a *paired* interval (the same documents resampled together
at every length): much narrower than the per-length intervals, whose width is mostly documents
differing in difficulty, so it is the figure that says whether context helped.

Memory stays bounded at long context: a batch of windows is fed to ``jax.jit(model.prefill)``
in pieces of ``piece_len`` tokens (one compilation per context length), the cache (KDA state,
conv tail, MLA latents, position) carried from piece to piece; the head and the loss run a chunk
of tokens at a time (``HybridLM.token_nll``), and only per-token NLLs leave the device: the
[B, L, V] logits never exist. ``whole_sequence_nll`` is the one-pass reference the
piecewise form is tested against.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from kimi_k3.data import TextTokenizer, is_tiktoken_file, load_split_streams
from kimi_k3.mesh import batch_sharding
from kimi_k3.model import MAX_POSITIONS, flops_per_token
from kimi_k3.model_state import empty_cache_fn
from kimi_k3.sharding import axis_rules

SHORT_DOC_RULES = ("same", "skip", "concat")
DEFAULT_SHORT_DOCS = "same"
# Windows kept per context length (at the longest length with "same"): four times the old 16,
# spread over tens of documents for the bootstrap, at a cost a CPU bears for a small model; the
# interval printed beside every figure says when more are needed (--max_windows=0: all).
DEFAULT_MAX_WINDOWS = 64
MIN_BUCKET_TARGETS = 100  # targets (windows x positions) a position bucket holds at least
CI_LEVEL = 0.95
BOOTSTRAP_SAMPLES = 1000
BOOTSTRAP_SEED = 0


# ---------------------------------------------------------------------------------------------
# Held-out windows and the short-document rule
# ---------------------------------------------------------------------------------------------


def split_documents(stream) -> list[np.ndarray]:
    """The documents of a ``kimi_k3.data.TokenStream``: its chunks, cut after every ``eos_id``."""
    docs = []
    for chunk in stream.chunks:
        arr = np.asarray(chunk)
        if stream.eos_id >= 0:
            cuts = np.nonzero(arr == stream.eos_id)[0] + 1
            docs.extend(p for p in np.split(arr, cuts) if len(p))
        else:
            docs.append(arr)
    return docs


@dataclasses.dataclass
class Windows:
    """Windows of L + 1 tokens for one context length, and how they were made: every document
    is counted once, docs_total = docs_skipped + docs_dropped + docs_used."""

    context_length: int
    tokens_NxL1: np.ndarray  # int32 [N, L + 1]
    rule: str
    docs_total: int
    docs_used: int  # documents contributing at least one scored token
    docs_skipped: int  # too short for the rule: < L + 1 tokens (skip), < span + 1 (same); concat: 0
    windows_available: int
    docs_dropped: int = 0  # long enough, but in no kept window: the max_windows cap (concat: or the tail)
    doc_of_window: np.ndarray | None = None  # int [N]: each window's document (concat: of its first target)
    max_windows: int = 0  # the cap applied (0 = none)
    span: int = 0  # "same": the longest length M (spans of M + 1 tokens); else L
    tokens_total: int = 0  # tokens in all documents

    def __post_init__(self):
        if self.doc_of_window is None:
            self.doc_of_window = np.arange(self.num_windows)
        if not self.span:
            self.span = self.context_length

    @property
    def num_windows(self) -> int:
        return int(self.tokens_NxL1.shape[0])

    @property
    def windows_per_span(self) -> int:
        return self.span // self.context_length if self.rule == "same" else 1

    def summary(self) -> dict:
        out = {
            "context_length": self.context_length,
            "short_docs": self.rule,
            "docs_total": self.docs_total,
            "docs_skipped": self.docs_skipped,
            "docs_dropped": self.docs_dropped,
            "docs_used": self.docs_used,
            "min_doc_tokens": self.span + 1 if self.rule != "concat" else 0,
            "max_windows": self.max_windows,
            "windows_available": self.windows_available,
            "windows_used": self.num_windows,
            "targets": self.num_windows * self.context_length,
        }
        if self.rule == "same":
            k = self.windows_per_span
            out |= {"span_tokens": self.span + 1, "spans_available": self.windows_available // k,
                    "spans_used": self.num_windows // k}
        return out

    def count_documents(self) -> str:
        """'75 documents = 16 shorter than 2049 tokens + 28 left out by --max_windows=64 + 31
        scored' (skip and same; without a cap nothing is left out)."""
        cap = (f" + {self.docs_dropped} left out by --max_windows={self.max_windows}"
               if self.max_windows else "")
        return (f"{self.docs_total} documents = {self.docs_skipped} shorter than {self.span + 1} "
                f"tokens{cap} + {self.docs_used} scored")

    def describe(self) -> str:
        """One line: where the windows came from, with every document counted."""
        L, N, cap = self.context_length, self.num_windows, self.max_windows
        kept = f"{N} of {self.windows_available} windows of {L + 1} tokens ({N * L} targets)"
        if self.rule == "concat":
            reach = f"reach {self.docs_used} documents"
            if self.docs_dropped:
                tail = self.tokens_total - (self.windows_available * L + 1 if self.windows_available else 0)
                why = [f"--max_windows={cap}"] if cap else []
                why += [f"the last {tail} tokens are less than a window"] if tail > 0 else []
                reach += f"; {self.docs_dropped} are in no kept window ({'; '.join(why)})"
            return (f"L={L}: short_docs=concat: {self.docs_total} documents as one stream of "
                    f"{self.tokens_total} tokens; {kept} {reach}")
        count = self.count_documents()
        if self.rule == "skip":
            return f"L={L}: short_docs=skip: {count}; {kept}"
        k = self.windows_per_span
        return (f"L={L}: short_docs=same: {count}; {N // k} of {self.windows_available // k} "
                f"spans of {self.span + 1} tokens, cut into {kept}")


def _even_pick(n: int, k: int) -> np.ndarray:
    """k indices spread evenly over range(n) (all of them when k <= 0 or k >= n)."""
    if k <= 0 or k >= n:
        return np.arange(n)
    return np.unique(np.round(np.linspace(0, n - 1, k)).astype(np.int64))


def make_windows(docs: Sequence[np.ndarray], L: int, rule: str, max_windows: int = 0, *,
                 span: int | None = None) -> Windows:
    """Cut ``docs`` into windows of L + 1 tokens by the short-document ``rule`` (module
    docstring). ``span``: with "same", the longest context length of the evaluation (default L)."""
    if rule not in SHORT_DOC_RULES:
        raise ValueError(f"short_docs: {rule!r} is not one of {SHORT_DOC_RULES}")
    if L < 1:
        raise ValueError(f"context_lengths: {L} must be a positive integer")
    lengths = np.array([len(d) for d in docs], np.int64)
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if len(ends) else 0
    if rule in ("skip", "same"):
        S = int(span or L) if rule == "same" else L
        if S < L:
            raise ValueError(f"short_docs=same: the span {S} is shorter than the context length {L}")
        k = S // L  # windows per span
        per_doc = np.where(lengths >= S + 1, (lengths - 1) // S, 0)
        first = np.concatenate([[0], np.cumsum(per_doc)])  # span index of each doc's first span
        pick = _even_pick(int(first[-1]), max_windows)
        doc_of_span = np.searchsorted(first, pick, side="right") - 1
        offsets = np.arange(k)[:, None] * L + np.arange(L + 1)[None, :]  # [k, L + 1] in a span
        rows = [np.asarray(docs[d])[(i - first[d]) * S + offsets]
                for i, d in zip(pick, doc_of_span, strict=True)]
        tokens = np.concatenate(rows) if rows else np.zeros((0, L + 1), np.int32)
        doc_of = np.repeat(doc_of_span, k)
        used = len(set(doc_of_span.tolist()))
        skipped = int(np.sum(lengths < S + 1))
        return Windows(L, tokens.astype(np.int32), rule, len(docs), used, skipped,
                       int(first[-1]) * k, docs_dropped=len(docs) - skipped - used,
                       doc_of_window=doc_of, max_windows=max_windows, span=S, tokens_total=total)
    # "concat": windows of the virtual concatenation, read without copying the whole stream.
    available = max((total - 1) // L, 0)
    pick = _even_pick(available, max_windows)
    begins = ends - lengths
    doc_at = lambda t: int(np.searchsorted(ends, t, side="right"))  # document holding token t
    rows, scored, doc_of = [], np.zeros(len(docs), bool), []
    for i in pick:
        lo, hi = int(i) * L, int(i) * L + L + 1  # tokens [lo, hi); targets [lo + 1, hi)
        rows.append(np.concatenate([np.asarray(docs[d][max(lo - begins[d], 0) : hi - begins[d]])
                                    for d in range(doc_at(lo), doc_at(hi - 1) + 1)]))
        scored[doc_at(lo + 1) : doc_at(hi - 1) + 1] = True  # a document with a target is used
        doc_of.append(doc_at(lo + 1))
    tokens = np.stack(rows).astype(np.int32) if rows else np.zeros((0, L + 1), np.int32)
    used = int(scored.sum())
    return Windows(L, tokens, rule, len(docs), used, 0, available, docs_dropped=len(docs) - used,
                   doc_of_window=np.asarray(doc_of, np.int64), max_windows=max_windows,
                   tokens_total=total)


def cut_windows(docs: Sequence[np.ndarray], lengths: Sequence[int], rule: str,
                max_windows: int = 0) -> dict[int, Windows]:
    """{L: Windows} for every context length, by ``rule``. With "same" and no document of
    max(lengths) + 1 tokens, a ValueError says so and what to do instead."""
    longest = max(lengths)
    out = {L: make_windows(docs, L, rule, max_windows, span=longest) for L in lengths}
    if rule == "same" and not out[longest].num_windows:
        most = max((len(d) for d in docs), default=0)
        raise ValueError(
            f"--short_docs=same: no held-out document holds {longest + 1} tokens (the longest "
            f"--context_lengths + 1; the longest of the {len(docs)} documents has {most}), so no "
            f"length can be scored on the same text; use --short_docs=concat (windows across "
            f"documents), --short_docs=skip (each length on the documents long enough for it) "
            f"or shorter --context_lengths")
    return out


def describe_windows(windows: Mapping[int, Windows]) -> list[str]:
    """The lines eval.py prints about its windows: the rule, every document counted, and a
    length with no window."""
    lines = []
    ws = list(windows.values())
    same = bool(ws) and ws[0].rule == "same"
    if same:
        w = ws[-1]
        lines.append(f"short_docs=same: every length scores the same text, {w.num_windows} of "
                     f"{w.windows_available} spans of {w.span + 1} tokens (the longest length "
                     f"+ 1), spread evenly")
        lines.append(f"  {w.count_documents()}")
    for w in ws:
        L = w.context_length
        lines.append(f"  L={L}: {w.num_windows} windows of {L + 1} tokens "
                     f"({w.num_windows * L} targets)" if same else w.describe())
        if w.num_windows == 0:
            hint = " (try --short_docs=concat)" if w.rule == "skip" else ""
            lines.append(f"  L={w.context_length}: no window of {w.context_length + 1} tokens in "
                         f"the held-out data{hint}; not scored")
    return lines


def heldout_documents(config) -> list[np.ndarray]:
    """The held-out documents of ``config.data`` (``kimi_k3.data``'s split by file)."""
    _, eval_stream = load_split_streams(config.data, int(config.model.vocab_size))
    if eval_stream is None:
        raise ValueError(
            f"config.data: the held-out split is empty (source={config.data.source!r}, "
            f"eval_fraction={config.data.eval_fraction}); set data.eval_paths or raise eval_fraction"
        )
    return split_documents(eval_stream)


# ---------------------------------------------------------------------------------------------
# Bytes behind the tokens (bits per byte)
# ---------------------------------------------------------------------------------------------


def token_byte_lengths(data_cfg) -> tuple[np.ndarray | None, str]:
    """(int64 [ids]: UTF-8 bytes of text behind each token id, where that comes from), or
    (None, why bits per byte cannot be computed). ``data_cfg``: ``config.data``."""
    source, tokenizer = str(data_cfg.get("source", "stdlib")), str(data_cfg.get("tokenizer", ""))
    if not tokenizer:
        if source == "tokens":
            return None, ("not computed: data.source='tokens' holds token ids without their text; "
                          "set data.tokenizer to the tokenizers JSON that made them")
        return np.ones(256, np.int64), "byte tokens, one byte each"
    if is_tiktoken_file(tokenizer):  # byte strings by rank: exact
        return TextTokenizer(tokenizer).byte_lengths(), f"{tokenizer}: the bytes of each token id"
    return tokenizer_byte_lengths(tokenizer), f"{tokenizer}: the bytes each token id decodes to"


def _has_decoder(spec, kind: str) -> bool:
    if not isinstance(spec, dict):
        return False
    return spec.get("type") == kind or any(_has_decoder(d, kind) for d in spec.get("decoders") or ())


def tokenizer_byte_lengths(path: str) -> np.ndarray:
    """int64 [vocab]: the UTF-8 bytes each id of the tokenizers JSON at ``path`` stands for.

    Byte-level BPE (a ``ByteLevel`` decoder): a token's string spells one byte per character,
    so its length is exact even for a piece of a multi-byte character. Any other decoder: the
    bytes an id adds when decoded after a fixed ordinary token (so a leading space that a
    decoder drops at the start of a text is counted); a piece of a character counts as the
    replacement character's 3 bytes there, so the figure is approximate. Special tokens: 0.
    """
    from tokenizers import Tokenizer
    from tokenizers.pre_tokenizers import ByteLevel

    tok = Tokenizer.from_file(path)
    V = tok.get_vocab_size(with_added_tokens=True)
    added = {int(i): t for i, t in tok.get_added_tokens_decoder().items()}
    out = np.zeros(V, np.int64)
    if _has_decoder(json.loads(tok.to_str()).get("decoder"), "ByteLevel"):
        alphabet = set(ByteLevel.alphabet())
        for i in range(V):
            if i in added:
                out[i] = 0 if added[i].special else len(added[i].content.encode())
                continue
            t = tok.id_to_token(i) or ""
            out[i] = len(t) if set(t) <= alphabet else len(t.encode())
        return out
    ordinary = [i for i in tok.encode("a", add_special_tokens=False).ids if i not in added]
    anchor = ordinary[:1]
    base = len(tok.decode(anchor).encode()) if anchor else 0
    texts = tok.decode_batch([anchor + [i] for i in range(V)])
    out[:] = [max(len(t.encode()) - base, 0) for t in texts]
    for i, t in added.items():
        out[i] = 0 if t.special else out[i]
    return out


# ---------------------------------------------------------------------------------------------
# Position buckets and intervals
# ---------------------------------------------------------------------------------------------


def position_buckets(L: int) -> list[tuple[int, int]]:
    """Log-spaced position buckets covering 1 ... L: (1, 1), (2, 3), (4, 7), ..., (2^k, L)."""
    out, lo = [], 1
    while lo <= L:
        out.append((lo, min(2 * lo - 1, L)))
        lo *= 2
    return out


def scored_buckets(L: int, windows: int, min_targets: int = MIN_BUCKET_TARGETS) -> list[tuple[int, int]]:
    """``position_buckets(L)`` merged for ``windows`` windows (each puts one target at every
    position): a last bucket narrower than half its log-spaced width joins the one before; then
    a bucket of fewer than ``min_targets`` targets joins the next one, the last the one before."""
    b = position_buckets(L)
    if len(b) > 1 and b[-1][1] - b[-1][0] + 1 < b[-1][0] / 2:
        b[-2:] = [(b[-2][0], b[-1][1])]
    enough = lambda lo, hi: (hi - lo + 1) * windows >= min_targets
    out = []
    for lo, hi in b:
        if out and not enough(*out[-1]):
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    if len(out) > 1 and not enough(*out[-1]):
        out[-2:] = [(out[-2][0], out[-1][1])]
    return out


def bootstrap_ratios(num_UxC: np.ndarray, den_UxC: np.ndarray, *, samples: int = BOOTSTRAP_SAMPLES,
                     seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """float64 [samples, C]: each column's ratio sum(num) / sum(den) over the U rows (units:
    documents, or windows) resampled with replacement, ``samples`` times from the fixed ``seed``.
    The same U and seed draw the same resamples, so columns of several calls stay paired."""
    num, den = np.asarray(num_UxC, np.float64), np.asarray(den_UxC, np.float64)
    U = num.shape[0]
    rng = np.random.default_rng(seed)
    chunk = max(1, min(samples, 4_000_000 // max(U, 1)))  # draws [chunk, U] at a time
    ratios = []
    for start in range(0, samples, chunk):
        W = rng.multinomial(U, np.full(U, 1.0 / U), size=min(chunk, samples - start))
        with np.errstate(invalid="ignore", divide="ignore"):
            ratios.append((W @ num) / (W @ den))
    return np.concatenate(ratios)


def percentile_interval(samples_SxC: np.ndarray, level: float = CI_LEVEL) -> np.ndarray:
    """float64 [C, 2]: the central ``level`` interval of each column's samples."""
    tail = (1.0 - level) / 2 * 100
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN column: NaN, said by the caller
        return np.stack([np.nanpercentile(samples_SxC, tail, axis=0),
                         np.nanpercentile(samples_SxC, 100 - tail, axis=0)], axis=1)


def bootstrap_ci(num_UxC: np.ndarray, den_UxC: np.ndarray, *, level: float = CI_LEVEL,
                 samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """float64 [C, 2]: the percentile bootstrap interval of each column's ratio
    sum(num) / sum(den), resampling the U rows (``bootstrap_ratios``). NaN with fewer than 2
    units."""
    num = np.asarray(num_UxC, np.float64)
    if num.shape[0] < 2:
        return np.full((num.shape[1], 2), np.nan)
    return percentile_interval(bootstrap_ratios(num, den_UxC, samples=samples, seed=seed), level)


def add_loss_changes(results: Mapping[str, dict]) -> None:
    """Pairs one model's lengths, in place: with ``short_docs="same"`` every length scored the
    same documents, so the change in loss from the shortest length is bootstrapped over those
    documents together (the same resamples at every length). That interval is much narrower than
    the per-length ones, whose width comes mostly from documents differing in difficulty. Adds
    ``loss_change`` = {"from": L0, "value", "ci"} to every other length; removes the per-unit
    sums (``_units``) ``evaluate_windows`` left for this."""
    units = {L: r.pop("_units", None) for L, r in results.items()}
    if len(results) < 2 or any(r.get("short_docs") != "same" for r in results.values()):
        return
    lengths = sorted(results, key=int)
    ids = units[lengths[0]] and units[lengths[0]]["ids"]
    if ids is None or any(u is None or not np.array_equal(u["ids"], ids) for u in units.values()):
        return
    num = np.stack([units[L]["nll"] for L in lengths], 1)
    den = np.stack([units[L]["targets"] for L in lengths], 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        point = num.sum(0) / den.sum(0)
    if len(ids) >= 2:
        r = bootstrap_ratios(num, den)
        ci = percentile_interval(r[:, 1:] - r[:, :1])
    else:
        ci = np.full((len(lengths) - 1, 2), np.nan)
    for k, L in enumerate(lengths[1:]):
        results[L]["loss_change"] = {"from": int(lengths[0]), "value": float(point[k + 1] - point[0]),
                                     "ci": _interval(ci[k])}


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def _interval(lo_hi) -> list[float] | None:
    lo, hi = (float(v) for v in lo_hi)
    return [lo, hi] if math.isfinite(lo) and math.isfinite(hi) else None
# ---------------------------------------------------------------------------------------------
# Scoring: piecewise with the cache, or in one pass
# ---------------------------------------------------------------------------------------------


def _nll(logits_BxTxV, targets_BxT):
    logits = logits_BxTxV.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets_BxT[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


def _scoring_fns(get_model: Callable):
    """(piece, whole): jitted next-token NLL functions of (state, tokens, ...). A model with
    ``token_nll`` (HybridLM) scores through it, a chunk of tokens at a time, so no [B, P, V]
    float32 logits exist even for long pieces; any other model through its logits."""

    def piece(state, tokens_BxP, cache, targets_BxP):
        model = get_model(state)
        if hasattr(model, "token_nll"):
            return model.token_nll(tokens_BxP, targets_BxP, cache=cache)
        logits, cache = model.prefill(tokens_BxP, cache)
        return _nll(logits, targets_BxP), cache

    def whole(state, tokens_BxT, targets_BxT):
        model = get_model(state)
        if hasattr(model, "token_nll"):
            return model.token_nll(tokens_BxT, targets_BxT)[0]
        return _nll(model(tokens_BxT), targets_BxT)

    return jax.jit(piece, donate_argnums=(2,)), jax.jit(whole)


@functools.lru_cache(maxsize=16)
def _nnx_scoring_fns(graphdef):
    """One pair of jitted functions per architecture: checkpoints of the same config share
    their compilations."""
    return _scoring_fns(lambda state: nnx.merge(graphdef, state))


def piece_function(graphdef):
    """The jitted piece function a ``Scorer`` runs for models of ``graphdef``:
    (state, tokens [B, P], cache, targets [B, P]) -> (NLL [B, P], cache), the cache donated
    (``kimi_k3.aot`` compiles it for a TPU topology)."""
    return _nnx_scoring_fns(graphdef)[0]


def align_cache(cache, like):
    """``cache`` re-nested as ``like`` (an abstract cache, e.g. what ``prefill`` returns) when
    the two hold the same arrays in the same order but nest them differently (an empty entry
    present in one, absent in the other). A jitted ``prefill`` then sees one input structure
    for every piece and compiles once; otherwise ``cache`` is returned unchanged."""
    treedef = jax.tree.structure(like)
    leaves, want = jax.tree.leaves(cache), jax.tree.leaves(like)
    if jax.tree.structure(cache) == treedef or len(leaves) != len(want):
        return cache
    if any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(leaves, want, strict=True)):
        return cache
    return jax.tree.unflatten(treedef, leaves)


def _avals(tree) -> tuple:
    """(tree structure, each array's shape, dtype and weak type) of arrays or their shapes:
    what a compiled program checks its arguments against."""
    abstract = jax.eval_shape(lambda t: t, tree)
    return jax.tree.structure(abstract), [(a.shape, a.dtype, a.weak_type)
                                          for a in jax.tree.leaves(abstract)]


class Scorer:
    """Jitted next-token NLL for one model, piecewise (``prefill`` + cache) or whole-sequence.

    ``model`` follows the ``HybridLM`` contract: ``init_cache(B, max_len)``,
    ``prefill(tokens_BxT, cache) -> (logits_BxTxV, cache)``, ``__call__(tokens_BxT) -> logits``.
    An ``nnx.Module`` is split once into (graphdef, state) so the jitted functions take the
    weights as arguments (and are shared by every model of that graphdef); any other object
    with those methods is traced as it is.

    ``mesh`` (with a "context" axis) and ``rules``: each piece's tokens are split over the
    context axis (context parallelism: the layers pass KDA states and read the MLA cache across
    the shards), the weights and the cache sit whole on every device. None: one device.
    """

    def __init__(self, model, mesh=None, rules=()):
        self._model = model
        self._init_cache = empty_cache_fn(model)
        self._mesh, self._rules = mesh, tuple(rules)
        if isinstance(model, nnx.Module):
            graphdef, self._state = nnx.split(model)
            self._piece, self._whole = _nnx_scoring_fns(graphdef)
        else:
            self._state = None
            self._piece, self._whole = _scoring_fns(lambda state: model)
        if mesh is not None:
            self._state = jax.device_put(self._state, NamedSharding(mesh, PartitionSpec()))
        self._compiled = {}  # (B, P, Lpad) -> the piece function compiled for those shapes
        self._cache_after = {}  # the same keys -> the abstract cache a piece returns
        self.compile_seconds = 0.0  # spent compiling the piece function, so far
        self.trace_seconds = 0.0  # of it, tracing and lowering it (before XLA or its cache)

    @property
    def spec(self):
        """The model's ModelSpec (None for a model without one: its pieces weigh the same)."""
        return getattr(self._model, "spec", None)

    @property
    def weights(self):
        """The model's state as the piece function takes it (None for a model that is not an
        ``nnx.Module``)."""
        return self._state

    def _context(self):
        """The mesh and rules in force while tracing and running (nothing without a mesh)."""
        stack = contextlib.ExitStack()
        if self._mesh is not None:
            stack.enter_context(jax.set_mesh(self._mesh))
            stack.enter_context(axis_rules(self._rules))
        return stack

    def _tokens(self, x):
        """A [B, P] piece as a device array: its tokens over the context axis under a mesh."""
        if self._mesh is None:
            return jnp.asarray(x)
        return jax.device_put(np.asarray(x), batch_sharding(self._mesh))

    def _piece_fn(self, x0, cache, y0):
        """(the piece function compiled ahead of time for these shapes, ``cache`` nested as the
        piece function returns it: ``align_cache``), its compile time added to
        ``compile_seconds`` (so evaluation reports compiling and scoring apart): tracing for the
        cache's nesting after a piece is part of it."""
        key = (x0.shape, str(jax.tree.map(lambda a: (a.shape, a.dtype), cache)))
        if key not in self._compiled:
            t0 = time.perf_counter()
            with self._context():
                # jit keeps this trace: lowering the same arguments reuses it
                like = jax.eval_shape(self._piece, self._state, x0, cache, y0)[1]
                lowered = self._piece.lower(self._state, x0, align_cache(cache, like), y0)
                t1 = time.perf_counter()
                self._compiled[key], self._cache_after[key] = lowered.compile(), like
            self.trace_seconds += t1 - t0
            self.compile_seconds += time.perf_counter() - t0
        return self._compiled[key], align_cache(cache, self._cache_after[key])

    def init_cache(self, batch_size: int, max_len: int):
        return self._init_cache(batch_size, max_len)

    def prepare(self, batch_size: int, piece_len: int, context_length: int) -> None:
        """Compiles the piece program ``piecewise_nll`` runs for windows of ``context_length``
        in batches of ``batch_size``, from abstract tokens and cache. One device (no mesh): a
        Scorer of an abstract model (arrays as ``jax.ShapeDtypeStruct``) can do this before the
        weights exist, and ``with_weights`` moves the program to the Scorer of the model once
        it does."""
        if self._mesh is not None:
            raise ValueError("Scorer.prepare: compiling ahead is for one device (no mesh)")
        P = min(piece_len, context_length)
        Lpad = -(-context_length // P) * P
        tokens_BxP = jax.ShapeDtypeStruct((batch_size, P), jnp.int32)
        self._piece_fn(tokens_BxP, jax.eval_shape(self._init_cache, batch_size, Lpad), tokens_BxP)

    def with_weights(self, model) -> Scorer:
        """The Scorer of ``model`` (no mesh), holding the programs this one compiled when
        ``model`` has this one's graphdef and its arrays this one's shapes and dtypes (an
        abstract model's Scorer after ``prepare``, say); any other model gets its own Scorer,
        whose programs compile at its first piece."""
        scorer = Scorer(model)
        if not (isinstance(model, nnx.Module) and isinstance(self._model, nnx.Module)):
            return scorer
        if (nnx.graphdef(model) == nnx.graphdef(self._model)
                and _avals(scorer._state) == _avals(self._state)):
            scorer._compiled, scorer._cache_after = dict(self._compiled), dict(self._cache_after)
        return scorer

    def piecewise_nll(
        self, tokens_BxL1: np.ndarray, piece_len: int, on_piece: Callable[[], None] | None = None
    ) -> np.ndarray:
        """NLL [B, L] of windows [B, L + 1], fed in pieces of ``piece_len`` with the cache carried.

        When L is not a multiple of ``piece_len`` the last piece is padded at the end with
        token 0: causality keeps the padding from touching the real tokens, and its NLLs are
        dropped.
        """
        tokens_BxL1 = np.asarray(tokens_BxL1, np.int32)
        B, L = tokens_BxL1.shape[0], tokens_BxL1.shape[1] - 1
        P = min(piece_len, L)
        n_pieces = -(-L // P)
        Lpad = n_pieces * P
        x = np.zeros((B, Lpad), np.int32)
        y = np.zeros((B, Lpad), np.int32)
        x[:, :L], y[:, :L] = tokens_BxL1[:, :-1], tokens_BxL1[:, 1:]
        cache = self.init_cache(B, Lpad)
        if self._mesh is not None:
            cache = jax.device_put(cache, NamedSharding(self._mesh, PartitionSpec()))
        x0, y0 = self._tokens(x[:, :P]), self._tokens(y[:, :P])
        piece, cache = self._piece_fn(x0, cache, y0)
        out = []
        for i in range(n_pieces):
            sl = slice(i * P, (i + 1) * P)
            with self._context():
                nll, cache = piece(self._state, self._tokens(x[:, sl]), cache,
                                   self._tokens(y[:, sl]))
            out.append(np.asarray(nll))
            if on_piece is not None:
                on_piece()
        return np.concatenate(out, axis=1)[:, :L]

    def whole_sequence_nll(self, tokens_BxL1: np.ndarray) -> np.ndarray:
        """NLL [B, L] of windows [B, L + 1] in one ``model(tokens)`` pass (the reference)."""
        t = np.asarray(tokens_BxL1, np.int32)
        with self._context():
            return np.asarray(self._whole(self._state, self._tokens(t[:, :-1]),
                                          self._tokens(t[:, 1:])))


# ---------------------------------------------------------------------------------------------
# Options, and one model on one context length's windows
# ---------------------------------------------------------------------------------------------


class CompiledAhead:
    """A one-device Scorer's piece program compiled in a background thread, from the abstract
    model ``make_abstract()`` gives (``checkpoint.PendingModel``), while the caller loads the
    weights: reading a checkpoint or running the initialiser (mostly outside Python's lock)
    overlaps tracing, lowering and compiling the program. ``scorer(model)`` waits for the thread and
    gives ``model``'s Scorer with that program (``Scorer.with_weights``). Compiling ahead is an
    optimisation only: if it fails, the first piece compiles the program again and reports
    any error there."""

    def __init__(self, make_abstract: Callable[[], nnx.Module], batch_size: int, piece_len: int,
                 context_length: int):
        self.seconds = 0.0  # the thread's wall time, once joined
        self._scorer = None

        def run():
            t0 = time.perf_counter()
            try:
                scorer = Scorer(make_abstract())
                scorer.prepare(batch_size, piece_len, context_length)
                self._scorer = scorer
            except Exception as e:  # compiled again, and any error reported, at the first piece
                warnings.warn(f"compiling the piece program ahead failed ({type(e).__name__}: "
                              f"{e}); it compiles at the first piece instead", stacklevel=1)
            self.seconds = time.perf_counter() - t0

        self._thread = threading.Thread(target=run, name="compile ahead", daemon=True)
        self._thread.start()

    def scorer(self, model) -> Scorer:
        self._thread.join()
        return Scorer(model) if self._scorer is None else self._scorer.with_weights(model)


def parse_context_lengths(values: Sequence[str | int], flag: str = "--context_lengths") -> tuple[int, ...]:
    """``["512", "8K", "1M"]`` -> (512, 8192, 1048576). Raises ValueError naming ``flag`` and
    the item that is not a positive integer, or that exceeds the cache's ``MAX_POSITIONS``."""
    out = []
    for item in values:
        text = str(item).strip()
        scale = {"k": 2**10, "m": 2**20}.get(text[-1:].lower(), 1)
        digits = text[:-1] if scale > 1 else text
        if not digits.isdigit() or int(digits) == 0:
            raise ValueError(
                f"{flag}: {text!r} is not a positive integer number of tokens "
                f"(e.g. 2048, 8K, 1M)")
        if int(digits) * scale > MAX_POSITIONS:
            raise ValueError(f"{flag}: {text!r} = {int(digits) * scale} tokens exceeds the "
                             f"{MAX_POSITIONS} positions a cache can count (int32)")
        out.append(int(digits) * scale)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """How eval.py measures (the module docstring says what each choice means); ``validate``
    raises ValueError naming the eval.py flag of a field that is out of range (each field is
    the flag of its name)."""

    context_lengths: tuple[int, ...]
    piece_len: int = 2048  # tokens per prefill call
    batch_size: int = 1  # windows per call
    short_docs: str = DEFAULT_SHORT_DOCS  # "same" | "skip" | "concat" (module docstring)
    max_windows: int = DEFAULT_MAX_WINDOWS  # per context length (the longest, with "same"); 0 = all
    whole_check_max_len: int = 0  # also score the first batch in one pass for L <= this; 0 = never

    def validate(self) -> EvalOptions:
        if not self.context_lengths:
            raise ValueError("--context_lengths: empty; give e.g. --context_lengths=2048,8192")
        for L in self.context_lengths:
            if not (isinstance(L, int) and L > 0):
                raise ValueError(f"--context_lengths: {L!r} must be a positive integer")
            if self.context_lengths.count(L) > 1:
                raise ValueError(f"--context_lengths: {L} is given more than once (8K is "
                                 f"8192); give each length once")
        for field in ("piece_len", "batch_size"):
            v = getattr(self, field)
            if not (isinstance(v, int) and v > 0):
                raise ValueError(f"--{field}: {v!r} must be a positive integer")
        for L in self.context_lengths:
            # Pieces of min(piece_len, L) tokens, the last padded: the cache holds Lpad tokens.
            P = min(self.piece_len, L)
            if -(-L // P) * P > MAX_POSITIONS:
                raise ValueError(
                    f"--context_lengths / --piece_len: L={L} in pieces of {P} pads to "
                    f"{-(-L // P) * P} tokens, more than the {MAX_POSITIONS} positions a cache "
                    f"can count; use a --piece_len that divides {L}")
        if self.short_docs not in SHORT_DOC_RULES:
            raise ValueError(f"--short_docs: {self.short_docs!r} is not one of {SHORT_DOC_RULES}")
        for field in ("max_windows", "whole_check_max_len"):
            v = getattr(self, field)
            if not (isinstance(v, int) and v >= 0):
                raise ValueError(f"--{field}: {v!r} must be an integer >= 0 (0 = "
                                 f"{'all' if field == 'max_windows' else 'never'})")
        return self


def piece_flops(spec, L: int, piece_len: int) -> np.ndarray:
    """Forward FLOPs of one row's pieces of a window of L targets, in order: [ceil(L / P)],
    P = min(piece_len, L). Piece j's P tokens go through every weight and, in each MLA layer,
    attend to j P + (P + 1) / 2 keys on average (the cache before the piece, then its own
    causal block): ``model.flops_per_token``'s count, forward only. The last piece, padded,
    counts whole. At long context the last pieces cost many times the first, so these are
    what scoring's progress weighs its pieces by. ``spec``: a ModelSpec or config.model."""
    P = min(piece_len, L)
    # flops_per_token is linear in the keys a token sees, (seq_len + 1) / 2: 1 at seq_len 1,
    # 2 at seq_len 3; the difference is one key's FLOPs.
    fwd_1, fwd_3 = (flops_per_token(spec, n) / 3.0 for n in (1, 3))
    per_key = fwd_3 - fwd_1
    per_token = fwd_1 - per_key
    keys_J = np.arange(-(-L // P)) * P + (P + 1) / 2
    return P * (per_token + per_key * keys_J)


class ScoringProgress:
    """How the scoring of one context length goes, on stderr. In a log (stderr not a terminal,
    where eval.py's bar is off) a line after the first piece (its time holds the compilation)
    and then at most every ``every`` seconds until the last: pieces done of all, tokens per
    second over the pieces after the first, and the time left. ``costs``: each piece's
    relative cost in scoring order (``piece_flops``); the time left is the time per unit of
    cost so far (after the first piece) times the cost still to come, which at long context,
    where later pieces cost more, is far from the pieces left times the mean so far. Without
    ``costs`` every piece costs the same. Always, at the end (``done``), one line with the
    scoring time and the compiling part of it."""

    def __init__(self, label: str, pieces: int, tokens_per_piece: int, every: float = 10.0,
                 stream=None, costs: Sequence[float] | None = None):
        self.label, self.pieces, self.tokens = label, pieces, tokens_per_piece
        self.every, self.stream = every, stream or sys.stderr
        self.costs_N = np.ones(pieces) if costs is None else np.asarray(costs, np.float64)
        if self.costs_N.shape != (pieces,) or not np.all(self.costs_N > 0):
            raise ValueError(f"ScoringProgress: costs must be {pieces} positive numbers, got "
                             f"shape {self.costs_N.shape}")
        self.log = not self.stream.isatty()
        self.n, self.t0 = 0, time.perf_counter()
        self.t_first = self.last = None

    def _say(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def piece(self) -> None:
        self.n += 1
        now = time.perf_counter()
        if self.n == 1:
            self.t_first = now
        if not self.log or self.n == self.pieces or (
                self.last is not None and now - self.last < self.every):
            return  # the last piece: ``done`` says it
        self.last = now
        c = self.costs_N
        if self.n == 1:
            rate = self.tokens / (now - self.t0)
            left = (now - self.t0) / c[0] * c[1:].sum()
            how = "first piece, compiling included"
        else:
            rate = self.tokens * (self.n - 1) / (now - self.t_first)
            left = (now - self.t_first) / c[1 : self.n].sum() * c[self.n :].sum()
            how = "after the first piece"
        self._say(f"{self.label}: {self.n}/{self.pieces} pieces, {rate:,.0f} tokens/s ({how}), "
                  f"ETA {left:.0f} s")

    def done(self, seconds: float, compile_seconds: float, trace_seconds: float = 0.0) -> None:
        """The closing line: the scoring time, its compiling part (of that, tracing: the rest
        is XLA, or loading from its cache), and the first piece's time against the others'
        (the first also runs whatever the program sets up on the device when first called)."""
        total = self.n * self.tokens
        first = "" if self.t_first is None else f", first piece {self.t_first - self.t0:.1f} s"
        if self.t_first is not None and self.n > 1:
            first += f", the others {(seconds - (self.t_first - self.t0)) / (self.n - 1):.2f} s each"
        self._say(f"{self.label}: {self.n} pieces ({total:,} tokens) scored in {seconds:.1f} s, "
                  f"{compile_seconds:.1f} s of it compiling ({trace_seconds:.1f} s tracing)"
                  f"{first}: {total / max(seconds, 1e-9):,.0f} tokens/s")


def scoring_flops(spec, L: int, piece_len: int, windows: int, batch_size: int) -> np.ndarray:
    """Forward FLOPs of every piece that scoring ``windows`` windows of L targets runs, in its
    order: each batch of ``batch_size`` rows (the last one padded) runs the pieces of
    ``piece_flops``. With ``spec`` None (a model without a ModelSpec) every piece counts 1."""
    batches = -(-windows // batch_size)
    if spec is None:
        return np.ones(batches * -(-L // min(piece_len, L)))
    return np.tile(piece_flops(spec, L, piece_len), batches) * batch_size


def evaluate_windows(
    scorer: Scorer, windows: Windows, opts: EvalOptions,
    on_piece: Callable[[float], None] | None = None, byte_lengths: np.ndarray | None = None,
) -> dict:
    """Perplexity, bits per byte (given ``byte_lengths``, ``token_byte_lengths``' table) and
    loss by position of one model on one context length's windows, each with its bootstrap
    interval over documents (module docstring). ``on_piece(flops)`` after each piece, with
    its forward FLOPs (``scoring_flops``)."""
    L, N = windows.context_length, windows.num_windows
    buckets = scored_buckets(L, N)
    starts = np.array([lo - 1 for lo, _ in buckets])
    widths = np.array([hi - lo + 1 for lo, hi in buckets], np.float64)
    nll_NxK = np.zeros((N, len(buckets)), np.float64)  # each window's NLL summed per bucket
    max_diff = None
    P = min(opts.piece_len, L)
    flops_N = scoring_flops(scorer.spec, L, opts.piece_len, N, opts.batch_size)
    progress = ScoringProgress(f"L={L:,}", len(flops_N), opts.batch_size * P, costs=flops_N)
    done = iter(flops_N)

    def piece_done():
        progress.piece()
        if on_piece is not None:
            on_piece(next(done))

    t0, compile0, trace0 = time.perf_counter(), scorer.compile_seconds, scorer.trace_seconds
    for start in range(0, N, opts.batch_size):
        batch = windows.tokens_NxL1[start : start + opts.batch_size]
        n = batch.shape[0]
        if n < opts.batch_size:  # pad the last batch to the compiled shape; padded rows don't count
            batch = np.concatenate([batch, np.repeat(batch[:1], opts.batch_size - n, 0)])
        nll_BxL = scorer.piecewise_nll(batch, opts.piece_len, piece_done)[:n]
        if start == 0 and 0 < L <= opts.whole_check_max_len:
            ref = scorer.whole_sequence_nll(batch)[:n]
            max_diff = float(np.max(np.abs(ref - nll_BxL)))
        nll_NxK[start : start + n] = np.add.reduceat(nll_BxL.astype(np.float64), starts, axis=1)
    seconds = time.perf_counter() - t0
    if N:
        progress.done(seconds, scorer.compile_seconds - compile0, scorer.trace_seconds - trace0)

    # Per window: [NLL, bytes, NLL per bucket] over [targets, bytes, targets per bucket].
    nbytes_N = np.zeros(N)
    if byte_lengths is not None and N:
        table = np.asarray(byte_lengths, np.int64)
        top = int(windows.tokens_NxL1[:, 1:].max()) + 1
        if top > len(table):  # ids the table does not know (none for checked data): no bytes
            table = np.concatenate([table, np.zeros(top - len(table), np.int64)])
        nbytes_N = table[windows.tokens_NxL1[:, 1:]].sum(axis=1).astype(np.float64)
    num_NxC = np.concatenate([nll_NxK.sum(1, keepdims=True), nll_NxK.sum(1, keepdims=True), nll_NxK], 1)
    den_NxC = np.concatenate([np.full((N, 1), float(L)), nbytes_N[:, None], np.tile(widths, (N, 1))], 1)
    docs = np.asarray(windows.doc_of_window)
    unit = "documents" if len(np.unique(docs)) >= 2 else "windows"
    _, group = np.unique(docs if unit == "documents" else np.arange(N), return_inverse=True)
    U = int(group.max()) + 1 if N else 0
    num_UxC, den_UxC = np.zeros((U, num_NxC.shape[1])), np.zeros((U, num_NxC.shape[1]))
    np.add.at(num_UxC, group, num_NxC)
    np.add.at(den_UxC, group, den_NxC)
    ci = bootstrap_ci(num_UxC, den_UxC)
    with np.errstate(invalid="ignore", divide="ignore"):
        point = num_NxC.sum(0) / den_NxC.sum(0)

    loss = float(point[0]) if N else math.nan
    bpb_known = byte_lengths is not None and N and nbytes_N.sum() > 0
    out = {
        **windows.summary(),
        "loss": loss,
        "loss_ci": _interval(ci[0]),
        "perplexity": math.exp(loss) if N else math.nan,
        "perplexity_ci": _interval(np.exp(ci[0])),
        "bytes": int(nbytes_N.sum()) if byte_lengths is not None else None,
        "bits_per_byte": _finite(point[1] / math.log(2)) if bpb_known else None,
        "bits_per_byte_ci": _interval(ci[1] / math.log(2)) if bpb_known else None,
        "ci_unit": unit,
        "ci_units": U,
        "buckets": [{"lo": lo, "hi": hi, "loss": float(point[2 + k]) if N else math.nan,
                     "loss_ci": _interval(ci[2 + k]), "targets": int(widths[k]) * N}
                    for k, (lo, hi) in enumerate(buckets)],
        "seconds": seconds,  # compilation included
        "compile_seconds": scorer.compile_seconds - compile0,
        "trace_seconds": scorer.trace_seconds - trace0,  # of compile_seconds
        "first_piece_seconds": (None if progress.t_first is None
                                else progress.t_first - progress.t0),  # compiling included
    }
    if max_diff is not None:
        out["whole_vs_piecewise_max_abs_nll_diff"] = max_diff
    # For add_loss_changes (which removes it): each unit's NLL and targets, by unit id.
    out["_units"] = {"ids": np.unique(docs) if unit == "documents" else np.arange(N),
                     "nll": num_UxC[:, 0], "targets": den_UxC[:, 0]}
    return out
