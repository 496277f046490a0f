"""Held-out perplexity at long context, and loss by token position, for one or more checkpoints.

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
conv tail, MLA latents, position) carried from piece to piece; only per-token NLLs leave the
device, never the [B, L, V] logits. ``whole_sequence_nll`` is the one-pass reference the
piecewise form is tested against.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kimi_k3.data import first_bad_id

SHORT_DOC_RULES = ("skip", "concat")
INIT_CHECKPOINT = "init"  # --checkpoint=init: the config's freshly initialised weights


# ---------------------------------------------------------------------------------------------
# Configs and checkpoint specs
# ---------------------------------------------------------------------------------------------


def load_config(spec: str):
    """``configs/x.py`` or ``configs/x.py:arg`` -> ``get_config(arg)`` (``get_config()`` without arg)."""
    path, sep, arg = spec.partition(".py:")
    path = path + ".py" if sep else spec
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config: {path!r} (from {spec!r}) is not a file")
    mod_spec = importlib.util.spec_from_file_location(f"_eval_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"config: {path!r} defines no get_config()")
    return module.get_config(arg) if sep else module.get_config()


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    """One model to evaluate: a checkpoint path (or ``init``), its label and its config spec."""

    path: str
    label: str
    config: str | None = None  # a config spec; None: the --config given to eval.py

    @classmethod
    def parse(cls, text: str) -> CheckpointSpec:
        """``[LABEL=]PATH[@CONFIG_SPEC]``.

        Example: ``r3=runs/r3/checkpoints/2000@configs/ablate_ratio.py:ratio=3``.

        PATH ``init`` evaluates the config's freshly initialised weights (a baseline, a smoke
        run). The label defaults to the run directory's name (or ``init``).
        """
        body, _, config = text.partition("@")
        label, eq, path = body.partition("=")
        if not eq:
            label, path = "", body
        if not path:
            raise ValueError(f"--checkpoint: {text!r} names no path; expected [LABEL=]PATH[@CONFIG]")
        if not label:
            label = path if path == INIT_CHECKPOINT else _default_label(path)
        return cls(path=path, label=label, config=config or None)


def _default_label(path: str) -> str:
    parts = os.path.normpath(path).split(os.sep)
    if len(parts) >= 3 and parts[-2] == "checkpoints":
        return f"{parts[-3]}@{parts[-1]}"  # runs/r3/checkpoints/2000 -> r3@2000
    return parts[-1]


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
    from kimi_k3.data import load_split_streams

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
    """(piece, whole): jitted next-token NLL functions of (state, tokens, ...)."""

    def piece(state, tokens_BxP, cache, targets_BxP):
        logits, cache = get_model(state).prefill(tokens_BxP, cache)
        return _nll(logits, targets_BxP), cache

    def whole(state, tokens_BxT, targets_BxT):
        return _nll(get_model(state)(tokens_BxT), targets_BxT)

    return jax.jit(piece, donate_argnums=(2,)), jax.jit(whole)


@functools.lru_cache(maxsize=16)
def _nnx_scoring_fns(graphdef):
    """One pair of jitted functions per architecture: checkpoints of the same config share
    their compilations."""
    from flax import nnx

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
    """

    def __init__(self, model):
        from flax import nnx

        self._model = model
        if isinstance(model, nnx.Module):
            graphdef, self._state = nnx.split(model)
            self._piece, self._whole = _nnx_scoring_fns(graphdef)
        else:
            self._state = None
            self._piece, self._whole = _scoring_fns(lambda state: model)

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
        x0, y0 = jnp.asarray(x[:, :P]), jnp.asarray(y[:, :P])
        cache = align_cache(cache, jax.eval_shape(self._piece, self._state, x0, cache, y0)[1])
        out = []
        for i in range(n_pieces):
            sl = slice(i * P, (i + 1) * P)
            nll, cache = self._piece(self._state, jnp.asarray(x[:, sl]), cache, jnp.asarray(y[:, sl]))
            out.append(np.asarray(nll))
            if on_piece is not None:
                on_piece()
        return np.concatenate(out, axis=1)[:, :L]

    def whole_sequence_nll(self, tokens_BxL1: np.ndarray) -> np.ndarray:
        """NLL [B, L] of windows [B, L + 1] in one ``model(tokens)`` pass (the reference)."""
        t = jnp.asarray(np.asarray(tokens_BxL1, np.int32))
        return np.asarray(self._whole(self._state, t[:, :-1], t[:, 1:]))


def parse_context_lengths(values: Sequence[str | int]) -> tuple[int, ...]:
    """``["512", "8K", "1M"]`` -> (512, 8192, 1048576). Raises ValueError naming
    ``--context_lengths`` and the item that is not a positive integer."""
    out = []
    for item in values:
        text = str(item).strip()
        scale = {"k": 2**10, "m": 2**20}.get(text[-1:].lower(), 1)
        digits = text[:-1] if scale > 1 else text
        if not digits.isdigit() or int(digits) == 0:
            raise ValueError(
                f"--context_lengths: {text!r} is not a positive integer number of tokens "
                f"(e.g. 2048, 8K, 1M)")
        out.append(int(digits) * scale)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    context_lengths: tuple[int, ...]
    piece_len: int = 2048  # tokens per prefill call
    batch_size: int = 1  # windows per call
    short_docs: str = "skip"  # "skip" | "concat" (module docstring)
    max_windows: int = 16  # per context length; 0 = all
    whole_check_max_len: int = 0  # also score the first batch in one pass for L <= this; 0 = never

    def validate(self) -> EvalOptions:
        if not self.context_lengths:
            raise ValueError("context_lengths: empty; give e.g. --context_lengths=2048,8192")
        for L in self.context_lengths:
            if not (isinstance(L, int) and L > 0):
                raise ValueError(f"context_lengths: {L!r} must be a positive integer")
        for field in ("piece_len", "batch_size"):
            v = getattr(self, field)
            if not (isinstance(v, int) and v > 0):
                raise ValueError(f"{field}: {v!r} must be a positive integer")
        if self.short_docs not in SHORT_DOC_RULES:
            raise ValueError(f"short_docs: {self.short_docs!r} is not one of {SHORT_DOC_RULES}")
        if self.max_windows < 0:
            raise ValueError(f"max_windows: {self.max_windows} must be >= 0 (0 = all)")
        return self


def evaluate_windows(
    scorer: Scorer, windows: Windows, opts: EvalOptions, on_piece: Callable[[], None] | None = None
) -> dict:
    """Perplexity and loss-by-position of one model on one context length's windows."""
    L = windows.context_length
    nll_sum_L = np.zeros(L, np.float64)
    count_L = np.zeros(L, np.float64)
    max_diff = None
    t0 = time.perf_counter()
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
        "seconds": time.perf_counter() - t0,
    }
    if max_diff is not None:
        out["whole_vs_piecewise_max_abs_nll_diff"] = max_diff
    return out


# ---------------------------------------------------------------------------------------------
# Models: build, restore, check against the checkpoint
# ---------------------------------------------------------------------------------------------


def build_model(config, checkpoint: str, seed: int = 0, config_name: str = "--config"):
    """A ``HybridLM`` for ``config.model`` with the weights of ``checkpoint`` (or ``init``).

    Returns (model, step): step is None for ``init``. Raises FileNotFoundError naming a missing
    path, ValueError naming the parameters where ``config`` and the checkpoint disagree.
    """
    from flax import nnx

    from kimi_k3.model import HybridLM

    if checkpoint == INIT_CHECKPOINT:
        return HybridLM(config.model, rngs=nnx.Rngs(seed)), None
    return restore_model(config, checkpoint, seed=seed, config_name=config_name)


def resolve_checkpoint(path: str) -> tuple[str, int]:
    """(step directory, step) for a step dir (``.../checkpoints/<step>``), a checkpoints dir
    (its newest step) or a run's workdir (``<workdir>/checkpoints``'s newest step)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"--checkpoint: {path!r} does not exist")
    if os.path.isdir(os.path.join(path, "state")):
        base = os.path.basename(os.path.normpath(path))
        if not base.isdigit():
            raise ValueError(f"--checkpoint: {path!r} holds a state/ folder but is not named by its step")
        return path, int(base)
    for directory in (path, os.path.join(path, "checkpoints")):
        latest = latest_checkpoint(directory)
        if latest is not None and os.path.isdir(os.path.join(latest, "state")):
            return latest, int(os.path.basename(latest))
    raise FileNotFoundError(
        f"--checkpoint: {path!r} is not a checkpoint step folder (<run>/checkpoints/<step> with a "
        f"state/ inside), a checkpoints folder or a run folder holding one"
    )


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _shape_table(tree) -> dict[str, tuple]:
    return {_path_str(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_params_match(expected: dict[str, tuple], saved: dict[str, tuple], checkpoint: str,
                       config_name: str) -> None:
    """Raise ValueError naming the checkpoint, the config and the parameters that differ."""
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    shapes = sorted(k for k in set(expected) & set(saved) if expected[k] != saved[k])
    if not (missing or extra or shapes):
        return
    lines = [f"{k}: checkpoint {saved[k]}, config {expected[k]}" for k in shapes[:3]]
    lines += [f"{k}: in the config's model, not in the checkpoint" for k in missing[:3]]
    lines += [f"{k}: in the checkpoint, not in the config's model" for k in extra[:3]]
    counts = (f"{len(shapes)} parameters differ in shape, {len(missing)} are missing from the "
              f"checkpoint, {len(extra)} are not in the config's model")
    more = len(missing) + len(extra) + len(shapes) - len(lines)
    run_dir = os.path.dirname(os.path.dirname(os.path.normpath(checkpoint)))
    saved_cfg = os.path.join(run_dir, "config.json")
    hint = f"; the run's own config is in {saved_cfg}" if os.path.isfile(saved_cfg) else ""
    raise ValueError(
        f"--checkpoint {checkpoint!r} does not match the model of config {config_name} ({counts}): "
        + "; ".join(lines) + (f"; and {more} more" if more > 0 else "")
        + f". Pass the config the checkpoint was trained with (--checkpoint=PATH@CONFIG){hint}"
    )


def restore_model(config, checkpoint: str, seed: int = 0, config_name: str = "--config"):
    """(model, step): a ``HybridLM`` for ``config.model`` holding the parameters saved at
    ``checkpoint`` (the trainer's layout: ``<step>/state`` = {"params", "opt_state", ...}).

    Only the parameters are read (Orbax partial restore, onto the first device); the optimizer
    state is never loaded. The parameter tree and every shape are checked against the
    config's model first, and any difference is an error naming both.
    """
    import orbax.checkpoint as ocp
    from flax import nnx

    from kimi_k3.model import HybridLM

    step_dir, step = resolve_checkpoint(checkpoint)
    state_dir = os.path.join(os.path.abspath(step_dir), "state")
    make = lambda: HybridLM(config.model, rngs=nnx.Rngs(seed))
    abstract = nnx.eval_shape(make)
    graphdef, abs_params, abs_rest = nnx.split(abstract, nnx.Param, ...)
    target = nnx.to_pure_dict(abs_params)

    ckptr = ocp.PyTreeCheckpointer()
    try:
        meta = ckptr.metadata(state_dir)
        tree = getattr(meta, "item_metadata", meta)
        tree = getattr(tree, "tree", tree)
        saved_params = tree["params"]
    except Exception as e:  # Orbax raises several kinds for unreadable folders
        raise ValueError(f"--checkpoint {checkpoint!r}: cannot read parameters from {state_dir!r} "
                         f"({type(e).__name__}: {str(e)[:300]})") from e
    check_params_match(_shape_table(target), _shape_table(saved_params), checkpoint, config_name)

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    item = {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                                   target)}
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=sharding, dtype=x.dtype), item)
    out = ckptr.restore(state_dir, args=ocp.args.PyTreeRestore(
        item=item, restore_args=restore_args, partial_restore=True))
    nnx.replace_by_pure_dict(abs_params, out["params"])
    rest = nnx.split(make(), nnx.Param, ...)[2] if jax.tree.leaves(abs_rest) else abs_rest
    return nnx.merge(graphdef, abs_params, rest), step


# ---------------------------------------------------------------------------------------------
# The whole evaluation: every checkpoint at every length, then tables, files and plots
# ---------------------------------------------------------------------------------------------


def run(
    config,
    checkpoints: Sequence[CheckpointSpec],
    opts: EvalOptions,
    workdir: str,
    *,
    docs: Sequence[np.ndarray] | None = None,
    models: dict | None = None,
    progress: bool = True,
    config_name: str = "--config",
) -> dict:
    """Evaluate every checkpoint at every context length; write JSON, CSV and PNGs to ``workdir``.

    ``docs`` overrides the held-out documents of ``config.data``; ``models`` ({label: model})
    supplies ready models instead of building them (tests). Returns the JSON-able report.
    """
    from tqdm.auto import tqdm

    opts.validate()
    if not checkpoints:
        raise ValueError("checkpoint: none given")
    labels = [c.label for c in checkpoints]
    if len(set(labels)) != len(labels):
        raise ValueError(f"checkpoint: labels must be distinct, got {labels}; name them LABEL=PATH")
    os.makedirs(workdir, exist_ok=True)
    if docs is None:
        docs = heldout_documents(config)
    windows = {}
    for L in opts.context_lengths:
        w = make_windows(docs, L, opts.short_docs, opts.max_windows)
        windows[L] = w
        print(w.describe())
        if w.num_windows == 0:
            hint = " (try --short_docs=concat)" if opts.short_docs == "skip" else ""
            print(f"  L={L}: no window of {L + 1} tokens in the held-out data{hint}; not scored")

    report = {
        "short_docs": opts.short_docs,
        "piece_len": opts.piece_len,
        "batch_size": opts.batch_size,
        "max_windows": opts.max_windows,
        "windows": {str(L): w.summary() for L, w in windows.items()},
        "models": [],
    }
    pieces_per_model = sum(
        -(-w.num_windows // opts.batch_size) * -(-L // min(opts.piece_len, L))
        for L, w in windows.items()
    )
    for spec in checkpoints:
        cfg = config if spec.config is None else load_config(spec.config)
        if models is not None and spec.label in models:
            model, step = models[spec.label], None
        else:
            model, step = build_model(cfg, spec.path, seed=int(cfg.get("seed", 0)),
                                      config_name=spec.config or config_name)
            if step is not None:
                print(f"{spec.label}: restored step {step} from {spec.path}")
        vocab = int(cfg.model.vocab_size)
        for L, w in windows.items():
            bad = first_bad_id(w.tokens_NxL1, vocab)
            if bad is not None:
                (window, position), tok = bad
                raise ValueError(
                    f"checkpoint {spec.label!r}: held-out token id {tok} (window {window} of "
                    f"L={L}, position {position}) is outside [0, {vocab}) = its "
                    f"model.vocab_size")
        scorer = Scorer(model)
        entry = {
            "label": spec.label,
            "checkpoint": spec.path,
            "config": spec.config or config_name,
            "step": step,
            "params": _param_count(model),
            "results": {},
        }
        # No bar in a log file: its carriage-return redraws would pile up there.
        with tqdm(total=pieces_per_model, desc=f"eval {spec.label}", unit="piece",
                  disable=not (progress and sys.stderr.isatty())) as bar:
            for L, w in windows.items():
                if w.num_windows == 0:
                    continue
                bar.set_postfix(L=L)
                entry["results"][str(L)] = evaluate_windows(scorer, w, opts, on_piece=lambda: bar.update(1))
        report["models"].append(entry)
        del scorer, model

    write_outputs(report, workdir)
    print(format_table(report))
    return report


def _param_count(model) -> int | None:
    """Parameters of an ``nnx.Module``; None for any other model object (a test double)."""
    from flax import nnx

    if not isinstance(model, nnx.Module):
        return None
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def format_table(report: dict) -> str:
    """Perplexity table: one row per model, one column per context length."""
    lengths = sorted(int(L) for L in report["windows"])
    head = ["model"] + [f"L={L}" for L in lengths]
    rows = []
    for m in report["models"]:
        cells = [m["label"]]
        for L in lengths:
            r = m["results"].get(str(L))
            cells.append(f"{r['perplexity']:.3f}" if r else "-")
        rows.append(cells)
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows, strict=True)]
    fmt = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths, strict=True))
    lines = ["perplexity (held-out, short_docs=" + report["short_docs"] + ")", fmt(head)]
    lines += [fmt(r) for r in rows]
    return "\n".join(lines)


def write_outputs(report: dict, workdir: str) -> dict[str, str]:
    """eval.json, eval_perplexity.csv, eval_loss_by_position.csv and two PNGs in ``workdir``."""
    from kimi_k3 import plots

    paths = {
        "json": os.path.join(workdir, "eval.json"),
        "csv": os.path.join(workdir, "eval_perplexity.csv"),
        "positions_csv": os.path.join(workdir, "eval_loss_by_position.csv"),
        "perplexity_png": os.path.join(workdir, "eval_perplexity.png"),
        "positions_png": os.path.join(workdir, "eval_loss_by_position.png"),
    }
    with open(paths["json"], "w") as f:
        json.dump(report, f, indent=1)
    with open(paths["csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "context_length", "windows", "targets", "loss", "perplexity",
                    "short_docs", "docs_used", "docs_skipped", "seconds"])
        for m in report["models"]:
            for L, r in m["results"].items():
                w.writerow([m["label"], L, r["windows_used"], r["targets"], f"{r['loss']:.6f}",
                            f"{r['perplexity']:.6f}", r["short_docs"], r["docs_used"],
                            r["docs_skipped"], f"{r['seconds']:.3f}"])
    with open(paths["positions_csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "context_length", "position_lo", "position_hi", "loss", "targets"])
        for m in report["models"]:
            for L, r in m["results"].items():
                for b in r["buckets"]:
                    w.writerow([m["label"], L, b["lo"], b["hi"], f"{b['loss']:.6f}", b["targets"]])

    ppl_series, pos_series = {}, {}
    for m in report["models"]:
        res = {int(L): r for L, r in m["results"].items()}
        if not res:
            continue
        Ls = sorted(res)
        ppl_series[m["label"]] = (Ls, [res[L]["perplexity"] for L in Ls])
        longest = res[Ls[-1]]
        mids = [math.sqrt(b["lo"] * b["hi"]) for b in longest["buckets"]]
        pos_series[f"{m['label']} (L={Ls[-1]})"] = (mids, [b["loss"] for b in longest["buckets"]])
    note = f"held-out data, short_docs={report['short_docs']}"
    if ppl_series:
        plots.line_plot(paths["perplexity_png"], ppl_series, title="Perplexity against context length",
                        xlabel="context length (tokens)", ylabel="perplexity", logx=True,
                        token_axis=True, note=note)
        plots.line_plot(paths["positions_png"], pos_series,
                        title="Loss against token position (longest context)",
                        xlabel="token position (log-spaced buckets)", ylabel="NLL (nats / token)",
                        logx=True, note=note)
    else:
        for key in ("perplexity_png", "positions_png"):
            paths.pop(key)
    return paths


def main(
    config,
    workdir: str,
    checkpoints: Sequence[str],
    context_lengths: Sequence[int],
    *,
    piece_len: int = 2048,
    batch_size: int = 1,
    short_docs: str = "skip",
    max_windows: int = 16,
    whole_check_max_len: int = 0,
    progress: bool = True,
    config_name: str = "--config",
) -> dict:
    """eval.py's body. With no ``checkpoints``, the latest checkpoint under ``workdir/checkpoints``."""
    from kimi_k3.train_lib import quiet_library_logs

    if config is None:
        raise ValueError("--config: required (the model and the held-out data to use)")
    quiet_library_logs()  # Orbax reports every read in INFO lines
    if not checkpoints:
        latest = latest_checkpoint(os.path.join(workdir, "checkpoints"))
        if latest is None:
            raise FileNotFoundError(
                f"--checkpoint: none given and no checkpoint under {os.path.join(workdir, 'checkpoints')!r}; "
                f"pass --checkpoint=PATH (or --checkpoint=init for untrained weights)"
            )
        checkpoints = [latest]
    specs = [CheckpointSpec.parse(c) for c in checkpoints]
    for s in specs:
        if s.path != INIT_CHECKPOINT and not os.path.exists(s.path):
            raise FileNotFoundError(f"--checkpoint: {s.path!r} does not exist")
    opts = EvalOptions(
        context_lengths=tuple(int(x) for x in context_lengths),
        piece_len=piece_len,
        batch_size=batch_size,
        short_docs=short_docs,
        max_windows=max_windows,
        whole_check_max_len=whole_check_max_len,
    )
    return run(config, specs, opts, workdir, progress=progress, config_name=config_name)


def latest_checkpoint(directory: str) -> str | None:
    """The highest-numbered step directory in ``directory``, or None."""
    if not os.path.isdir(directory):
        return None
    steps = [d for d in os.listdir(directory) if d.isdigit() and os.path.isdir(os.path.join(directory, d))]
    return os.path.join(directory, max(steps, key=int)) if steps else None

