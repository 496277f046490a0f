"""Held-out perplexity at long context, and loss by token position: how the held-out data is
cut into windows and how one model scores them. ``kimi_k3.evaluation`` runs this for every
checkpoint and context length; ``kimi_k3.eval_report`` writes what it measured.

What is measured, per checkpoint and context length L:

- windows: the held-out documents are cut into windows of L + 1 tokens (stride L); the model
  reads the first L, and every one of them predicts its next token, so a window scores L
  targets. The target after input position i (0-based) was predicted with i + 1 tokens of
  context: that is its *position*, 1 ... L;
- perplexity = exp(mean next-token NLL over all targets of all windows), in nats;
- loss by position: the mean NLL in log-spaced position buckets [1], [2, 3], [4, 7], ...,
  [2^k, min(2^(k+1) - 1, L)]. A curve that keeps falling at large positions is a model that
  uses far context.

The short-document rule (``short_docs``), always reported with its counts:

- ``"skip"``:   only documents of at least L + 1 tokens are used, each cut into
  floor((len - 1) / L) windows; shorter documents are skipped and counted;
- ``"concat"``: all held-out documents, in order, are one stream (no separator is added beyond
  what the data already has) cut into windows, so a window may span documents.

``max_windows`` (> 0) caps the windows per context length; the kept ones are spread evenly
over the available ones (deterministic), and the output says how many were available.

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
import math
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from kimi_k3.data import load_split_streams
from kimi_k3.mesh import batch_sharding
from kimi_k3.model import MAX_POSITIONS
from kimi_k3.sharding import axis_rules

SHORT_DOC_RULES = ("skip", "concat")


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
    """Windows of L + 1 tokens for one context length, and how they were made."""

    context_length: int
    tokens_NxL1: np.ndarray  # int32 [N, L + 1]
    rule: str
    docs_total: int
    docs_used: int  # documents contributing at least one scored token
    docs_skipped: int  # shorter than L + 1 tokens ("skip" only)
    windows_available: int

    @property
    def num_windows(self) -> int:
        return int(self.tokens_NxL1.shape[0])

    def summary(self) -> dict:
        return {
            "context_length": self.context_length,
            "short_docs": self.rule,
            "docs_total": self.docs_total,
            "docs_used": self.docs_used,
            "docs_skipped": self.docs_skipped,
            "windows_available": self.windows_available,
            "windows_used": self.num_windows,
            "targets": self.num_windows * self.context_length,
        }

    def describe(self) -> str:
        L = self.context_length
        if self.rule == "skip":
            how = (f"short_docs=skip: {self.docs_skipped} of {self.docs_total} documents shorter "
                   f"than {L + 1} tokens skipped, {self.docs_used} used")
        else:
            how = f"short_docs=concat: {self.docs_total} documents concatenated, {self.docs_used} scored"
        return (f"L={L}: {how}; {self.num_windows} of {self.windows_available} windows "
                f"({self.num_windows * L} targets)")


def _even_pick(n: int, k: int) -> np.ndarray:
    """k indices spread evenly over range(n) (all of them when k <= 0 or k >= n)."""
    if k <= 0 or k >= n:
        return np.arange(n)
    return np.unique(np.round(np.linspace(0, n - 1, k)).astype(np.int64))


def make_windows(docs: Sequence[np.ndarray], L: int, rule: str, max_windows: int = 0) -> Windows:
    """Cut ``docs`` into windows of L + 1 tokens by the short-document ``rule`` (module docstring)."""
    if rule not in SHORT_DOC_RULES:
        raise ValueError(f"short_docs: {rule!r} is not one of {SHORT_DOC_RULES}")
    if L < 1:
        raise ValueError(f"context_lengths: {L} must be a positive integer")
    lengths = np.array([len(d) for d in docs], np.int64)
    ends = np.cumsum(lengths)
    if rule == "skip":
        per_doc = np.where(lengths >= L + 1, (lengths - 1) // L, 0)
        first = np.concatenate([[0], np.cumsum(per_doc)])  # window index of each doc's first window
        available = int(first[-1])
        pick = _even_pick(available, max_windows)
        doc_of = np.searchsorted(first, pick, side="right") - 1
        rows = [np.asarray(docs[d][(i - first[d]) * L : (i - first[d]) * L + L + 1])
                for i, d in zip(pick, doc_of, strict=True)]
        used = len(set(doc_of.tolist()))
        skipped = int(np.sum(lengths < L + 1))
    else:
        # Windows of the virtual concatenation, read without copying the whole stream.
        total = int(ends[-1]) if len(ends) else 0
        available = max((total - 1) // L, 0)
        pick = _even_pick(available, max_windows)
        begins = ends - lengths
        doc_at = lambda t: int(np.searchsorted(ends, t, side="right"))  # document holding token t
        rows, scored = [], np.zeros(len(docs), bool)
        for i in pick:
            lo, hi = int(i) * L, int(i) * L + L + 1  # tokens [lo, hi); targets [lo + 1, hi)
            rows.append(np.concatenate([np.asarray(docs[d][max(lo - begins[d], 0) : hi - begins[d]])
                                        for d in range(doc_at(lo), doc_at(hi - 1) + 1)]))
            scored[doc_at(lo + 1) : doc_at(hi - 1) + 1] = True  # a document with a target is used
        used = int(scored.sum())
        skipped = 0
    tokens = np.stack(rows).astype(np.int32) if rows else np.zeros((0, L + 1), np.int32)
    return Windows(L, tokens, rule, len(docs), used, skipped, available)


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
# Position buckets
# ---------------------------------------------------------------------------------------------


def position_buckets(L: int) -> list[tuple[int, int]]:
    """Log-spaced position buckets covering 1 ... L: (1, 1), (2, 3), (4, 7), ..., (2^k, L)."""
    out, lo = [], 1
    while lo <= L:
        out.append((lo, min(2 * lo - 1, L)))
        lo *= 2
    return out


def bucket_losses(nll_sum_L: np.ndarray, count_L: np.ndarray) -> list[dict]:
    """Per bucket: mean NLL of the targets whose position falls in it, and their count."""
    out = []
    for lo, hi in position_buckets(len(nll_sum_L)):
        s, c = float(nll_sum_L[lo - 1 : hi].sum()), float(count_L[lo - 1 : hi].sum())
        out.append({"lo": lo, "hi": hi, "loss": s / c if c else math.nan, "targets": int(c)})
    return out


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
        self.compile_seconds = 0.0  # spent compiling the piece function, so far

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
        """The piece function compiled ahead of time for these shapes, its compile time added
        to ``compile_seconds`` (so evaluation reports compiling and scoring apart)."""
        key = (x0.shape, str(jax.tree.map(lambda a: (a.shape, a.dtype), cache)))
        if key not in self._compiled:
            t0 = time.perf_counter()
            with self._context():
                self._compiled[key] = self._piece.lower(self._state, x0, cache, y0).compile()
            self.compile_seconds += time.perf_counter() - t0
        return self._compiled[key]

    def init_cache(self, batch_size: int, max_len: int):
        return self._model.init_cache(batch_size, max_len)

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
        with self._context():
            like = jax.eval_shape(self._piece, self._state, x0, cache, y0)[1]
        cache = align_cache(cache, like)
        piece = self._piece_fn(x0, cache, y0)
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
    short_docs: str = "skip"  # "skip" | "concat" (module docstring)
    max_windows: int = 16  # per context length; 0 = all
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


def evaluate_windows(
    scorer: Scorer, windows: Windows, opts: EvalOptions, on_piece: Callable[[], None] | None = None
) -> dict:
    """Perplexity and loss-by-position of one model on one context length's windows."""
    L = windows.context_length
    nll_sum_L = np.zeros(L, np.float64)
    count_L = np.zeros(L, np.float64)
    max_diff = None
    t0, compile0 = time.perf_counter(), scorer.compile_seconds
    for start in range(0, windows.num_windows, opts.batch_size):
        batch = windows.tokens_NxL1[start : start + opts.batch_size]
        n = batch.shape[0]
        if n < opts.batch_size:  # pad the last batch to the compiled shape; padded rows don't count
            batch = np.concatenate([batch, np.repeat(batch[:1], opts.batch_size - n, 0)])
        nll_BxL = scorer.piecewise_nll(batch, opts.piece_len, on_piece)[:n]
        if start == 0 and 0 < L <= opts.whole_check_max_len:
            ref = scorer.whole_sequence_nll(batch)[:n]
            max_diff = float(np.max(np.abs(ref - nll_BxL)))
        nll_sum_L += nll_BxL.sum(0)
        count_L += n
    total = float(count_L.sum())
    loss = float(nll_sum_L.sum() / total) if total else math.nan
    out = {
        **windows.summary(),
        "loss": loss,
        "perplexity": math.exp(loss) if total else math.nan,
        "buckets": bucket_losses(nll_sum_L, count_L),
        "seconds": time.perf_counter() - t0,  # compilation included
        "compile_seconds": scorer.compile_seconds - compile0,
    }
    if max_diff is not None:
        out["whole_vs_piecewise_max_abs_nll_diff"] = max_diff
    return out
