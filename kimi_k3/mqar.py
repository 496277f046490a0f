"""Multi-query associative recall (MQAR): the synthetic task where a fixed-size memory runs out.

Zoology-style (Arora et al., 2023). One example of ``seq_len`` tokens:

    k_1 v_1 k_2 v_2 ... k_N v_N | 0 0 k_a v_a 0 0 0 k_b v_b 0 ...
    \\_____ N key-value pairs ____/ \\___ queries of keys seen earlier, filler 0 between ___/

- token 0 is the filler; keys come from [1, 1 + n_keys), values from [1 + n_keys, vocab_size),
  n_keys = (vocab_size - 1) // 2, so a key is never a value;
- the N keys of an example are distinct; values are drawn independently (they may repeat);
- ``num_queries`` of the N keys (each at most once, in random order) are asked again in the
  query region, at uniformly random non-overlapping 2-token slots, each followed by its value;
- the loss and the accuracy count only the answers: the prediction made at a query key must be
  that key's value. Every other position has weight 0.

A layer with exact recall (softmax attention) can solve any N; a fixed state of d_k x d_v per
head (KDA) holds about d_k keys before they interfere, so accuracy drops as N grows.

Chance (``MQARSpec.chance``): values are drawn uniformly from the n_values = vocab_size - 1 -
n_keys value ids, so a model that recalls nothing and guesses uniformly is right 1 / n_values
of the time (1/128 for configs/mqar.py's vocabulary of 256). A model that has learned which
values the context holds, but not which key each belongs to, gets about 1 / N. The sweep's
table, CSV and plot carry both.

Why a stack of MLA layers alone is expected to struggle: this codebase's MLA has no positional
encoding (NoPE; order comes from the KDA layers, whose short convolution mixes each token with
the ones just before it). Answering a query k_a means attending to the token *right after* the
earlier k_a (an induction head), which needs each value to carry the key that preceded it.
KDA's convolution makes that binding in one layer; NoPE attention sees the earlier tokens as an
unordered set under the causal mask and has to derive relative position from the mask alone
(possible in principle, hard to learn at this size in a few hundred steps). Without the binding
the best it can do is pick among the values it saw: about 1 / N, which is what all-MLA scored
in BENCHMARKS.md's sweep. A low all-MLA score here is the expected result, not a fault of the
MLA layer's recall.

Generation is NumPy, deterministic in ``seed``. ``train_mqar`` / ``mqar_accuracy`` train and
score a ``HybridLM`` on it (used by ``benchmarks/mqar_sweep.py``).
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from kimi_k3 import optim, plots
from kimi_k3.model_state import make_model, merge_model, split_model

FILLER = 0


@dataclasses.dataclass(frozen=True)
class MQARSpec:
    """What one MQAR example looks like."""

    seq_len: int  # tokens per example (T)
    num_kv_pairs: int  # N key-value pairs at the start
    vocab_size: int = 256  # token ids in [0, vocab_size)
    num_queries: int | None = None  # keys asked again; None = all N

    @property
    def n_keys(self) -> int:
        return (self.vocab_size - 1) // 2

    @property
    def n_values(self) -> int:
        return self.vocab_size - 1 - self.n_keys

    @property
    def chance(self) -> float:
        """Answer accuracy of a uniform guess among the values the generator draws from."""
        return 1.0 / self.n_values

    @property
    def queries(self) -> int:
        return self.num_kv_pairs if self.num_queries is None else self.num_queries

    def validate(self) -> MQARSpec:
        def bad(field, msg):
            raise ValueError(f"MQARSpec.{field}: {msg} (spec: {self})")

        if self.vocab_size < 5:
            bad("vocab_size", f"must be >= 5 (filler + keys + values), got {self.vocab_size}")
        if self.num_kv_pairs < 1:
            bad("num_kv_pairs", f"must be >= 1, got {self.num_kv_pairs}")
        if self.num_kv_pairs > self.n_keys:
            bad(
                "num_kv_pairs",
                f"must be <= {self.n_keys} distinct keys available in vocab_size={self.vocab_size}, "
                f"got {self.num_kv_pairs}",
            )
        if not 1 <= self.queries <= self.num_kv_pairs:
            bad("num_queries", f"must be in [1, num_kv_pairs={self.num_kv_pairs}], got {self.queries}")
        need = 2 * self.num_kv_pairs + 2 * self.queries
        if self.seq_len < need:
            bad(
                "seq_len",
                f"must be >= 2 * num_kv_pairs + 2 * num_queries = {need}, got {self.seq_len}",
            )
        return self


def generate(spec: MQARSpec, num_examples: int, seed: int | tuple[int, ...]) -> dict[str, np.ndarray]:
    """``num_examples`` MQAR examples, deterministic in (spec, num_examples, seed).

    ``seed`` is an int or a tuple of ints (NumPy ``SeedSequence`` entropy), so training batches
    ``(seed, 0, step)`` and the evaluation set ``(seed, 1)`` never share a stream.

    Returns a dict of NumPy arrays:
      inputs_NxT   int32: the tokens fed to the model;
      targets_NxT  int32: the next token (inputs shifted left, 0 at the end);
      weights_NxT  float32: 1 at each query key (whose next token is the answer), else 0.
    """
    spec.validate()
    T, N, Q = spec.seq_len, spec.num_kv_pairs, spec.queries
    rng = np.random.default_rng(seed)
    n_keys = spec.n_keys
    n_values = spec.n_values

    # Distinct keys per example: the first N of a random permutation of the key range.
    keys_NxP = 1 + np.argsort(rng.random((num_examples, n_keys)), axis=1)[:, :N]
    values_NxP = 1 + n_keys + rng.integers(0, n_values, (num_examples, N))
    inputs = np.full((num_examples, T), FILLER, np.int32)
    inputs[:, 0 : 2 * N : 2] = keys_NxP
    inputs[:, 1 : 2 * N : 2] = values_NxP

    # Query slots: Q distinct 2-token slots in the region after the pairs, in increasing order;
    # the queried pairs are a random subset of the N, in random order.
    n_slots = (T - 2 * N) // 2
    slots_NxQ = np.sort(np.argsort(rng.random((num_examples, n_slots)), axis=1)[:, :Q], axis=1)
    which_NxQ = np.argsort(rng.random((num_examples, N)), axis=1)[:, :Q]
    qpos_NxQ = 2 * N + 2 * slots_NxQ
    rows = np.arange(num_examples)[:, None]
    inputs[rows, qpos_NxQ] = keys_NxP[rows, which_NxQ]
    inputs[rows, qpos_NxQ + 1] = values_NxP[rows, which_NxQ]

    targets = np.zeros_like(inputs)
    targets[:, :-1] = inputs[:, 1:]
    weights = np.zeros((num_examples, T), np.float32)
    weights[rows, qpos_NxQ] = 1.0
    return {"inputs_NxT": inputs, "targets_NxT": targets, "weights_NxT": weights}


def masked_cross_entropy(logits_BxTxV, targets_BxT, weights_BxT):
    """Mean next-token cross-entropy over the positions with weight 1 (the answers)."""
    logp = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
    nll_BxT = -jnp.take_along_axis(logp, targets_BxT[..., None], axis=-1)[..., 0]
    return jnp.sum(nll_BxT * weights_BxT) / jnp.maximum(jnp.sum(weights_BxT), 1.0)


def masked_train_step(graphdef, rest, tx):
    """The jitted step ``(params, opt_state, inputs, targets, weights) -> (params, opt_state,
    loss)`` of the model (graphdef, rest) under optimizer ``tx``, on the loss of
    :func:`masked_cross_entropy` (the synthetic tasks' answers only)."""

    def loss_fn(params, inputs, targets, weights):
        logits = merge_model(graphdef, params, rest)(inputs)
        return masked_cross_entropy(logits, targets, weights)

    @jax.jit
    def train_step(params, opt_state, inputs, targets, weights):
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets, weights)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def train_on_answers(model, opt_cfg, next_batch: Callable[[int], dict[str, np.ndarray]], *,
                     steps: int, desc: str, progress: bool = False):
    """(``model`` trained ``steps`` steps of :func:`masked_train_step`, the last loss; nan for no
    step). ``opt_cfg``: ``config.opt`` (``kimi_k3.optim.make_optimizer``); ``next_batch(step)``
    gives inputs_NxT, targets_NxT and weights_NxT, as :func:`generate` does. Shared by the
    synthetic tasks: MQAR, passkey and RULER."""
    graphdef, params, rest = split_model(model)
    tx, _ = optim.make_optimizer(opt_cfg, steps, params)
    opt_state = tx.init(params)
    train_step = masked_train_step(graphdef, rest, tx)
    loss = math.nan
    # A bar on a terminal only: in a log file its carriage-return redraws would pile up.
    bar = tqdm(range(steps), desc=desc, disable=not (progress and sys.stderr.isatty()), leave=False)
    for step in bar:
        b = next_batch(step)
        params, opt_state, loss = train_step(
            params, opt_state, b["inputs_NxT"], b["targets_NxT"], b["weights_NxT"]
        )
        if (step + 1) % 25 == 0:
            bar.set_postfix(loss=f"{float(loss):.3f}")
    return merge_model(graphdef, params, rest), float(loss)


def answer_hits(logits_BxTxV, targets_BxT, weights_BxT):
    """(number of answers predicted exactly by argmax, number of answers)."""
    hit = (jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT).astype(jnp.float32)
    return jnp.sum(hit * weights_BxT), jnp.sum(weights_BxT)


def mqar_accuracy(
    logits_fn: Callable[[jax.Array], jax.Array], data: dict[str, np.ndarray], batch_size: int = 64
) -> float:
    """Fraction of answers (query positions) where argmax of ``logits_fn(inputs_BxT)`` is the value."""
    hits = total = 0.0
    n = data["inputs_NxT"].shape[0]
    for start in range(0, n, batch_size):
        sl = slice(start, start + batch_size)
        logits = logits_fn(jnp.asarray(data["inputs_NxT"][sl]))
        h, t = answer_hits(logits, jnp.asarray(data["targets_NxT"][sl]), jnp.asarray(data["weights_NxT"][sl]))
        hits += float(h)
        total += float(t)
    return hits / max(total, 1.0)


def spec_from_config(mqar_cfg, seq_len: int | None = None, num_kv_pairs: int | None = None) -> MQARSpec:
    """An ``MQARSpec`` from a config's ``mqar`` section, with optional overrides.

    ``num_kv_pairs = 0`` in the config means "scale with length": seq_len // kv_pairs_divisor.
    """
    T = int(seq_len if seq_len is not None else mqar_cfg.seq_len)
    N = num_kv_pairs if num_kv_pairs is not None else int(mqar_cfg.num_kv_pairs)
    if N == 0:
        N = max(1, T // int(mqar_cfg.kv_pairs_divisor))
    nq = int(mqar_cfg.num_queries)
    return MQARSpec(
        seq_len=T, num_kv_pairs=N, vocab_size=int(mqar_cfg.vocab_size), num_queries=nq or None
    ).validate()


def train_mqar(
    config,
    spec: MQARSpec,
    *,
    seed: int | None = None,
    progress: bool = True,
    desc: str = "mqar",
) -> dict:
    """Train a fresh ``HybridLM(config.model)`` on freshly generated MQAR batches, then score it.

    The optimizer is the trainer's (``kimi_k3.optim.make_optimizer(config.opt, ...)``: AdamW,
    warmup + schedule, clipping, masked weight decay); ``config.train.steps`` steps of
    ``config.mqar.train_batch_size`` examples, the loss on the answers only. Returns the
    accuracy on ``config.mqar.eval_examples`` held-out examples (a generator stream no training
    batch uses), the last training loss, the parameter count and the wall time.
    """
    if config.model.vocab_size < spec.vocab_size:
        raise ValueError(
            f"config.model.vocab_size={config.model.vocab_size} must be >= the MQAR "
            f"vocab_size={spec.vocab_size}"
        )
    seed = int(config.seed if seed is None else seed)
    steps = int(config.train.steps)
    batch_size = int(config.mqar.train_batch_size)
    model = make_model(config.model, seed)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(split_model(model)[1]))

    # Training batches come from streams (seed, 0, step); the evaluation set from (seed, 1).
    t0 = time.perf_counter()
    model, loss = train_on_answers(
        model, config.opt, lambda step: generate(spec, batch_size, seed=(seed, 0, step)),
        steps=steps, desc=desc, progress=progress,
    )
    graphdef, params, rest = split_model(model)

    @jax.jit
    def logits_fn(params, inputs):
        return merge_model(graphdef, params, rest)(inputs)

    eval_data = generate(spec, int(config.mqar.eval_examples), seed=(seed, 1))
    acc = mqar_accuracy(lambda x: logits_fn(params, x), eval_data, batch_size=batch_size)
    return {
        "accuracy": acc,
        "final_loss": loss,
        "params": n_params,
        "seconds": time.perf_counter() - t0,
    }


# ---------------------------------------------------------------------------------------------
# The sweep: layer patterns x sequence lengths, one small model each
# ---------------------------------------------------------------------------------------------


def pattern_label(pattern: str) -> str:
    """"KKKK" -> "all-KDA", "MMMM" -> "all-MLA", "KKKM" -> "3:1", "KM" -> "1:1"."""
    k, m = pattern.count("K"), pattern.count("M")
    if not m:
        return "all-KDA"
    if not k:
        return "all-MLA"
    g = math.gcd(k, m)
    return f"{k // g}:{m // g}"


def sweep_config(config, pattern: str, seq_len: int):
    """A copy of ``config`` with the model's layer ``pattern`` and the task's ``seq_len``."""
    cfg = config.copy_and_resolve_references()
    with cfg.unlocked():
        cfg.model.pattern = pattern
        cfg.model.num_layers = len(pattern)
        cfg.mqar.seq_len = int(seq_len)
        cfg.data.seq_len = int(seq_len)
    return cfg


def run_sweep(config, patterns, seq_lens, out_dir: str, *, progress: bool = True) -> list[dict]:
    """Train and score one model per (pattern, seq_len); write mqar_sweep.csv / .md / .png.

    Key-value pairs per example follow ``config.mqar`` (configs/mqar.py: seq_len // 4, so longer
    sequences also ask the fixed KDA state to hold more keys).
    """
    patterns, seq_lens = list(patterns), [int(t) for t in seq_lens]
    for p in patterns:
        if not p or set(p) - {"K", "M"}:
            raise ValueError(f"patterns: {p!r} must be a non-empty string of 'K' and 'M'")
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    runs = [(T, p) for T in seq_lens for p in patterns]
    outer = tqdm(runs, desc="mqar sweep", disable=not (progress and sys.stderr.isatty()))
    for T, pattern in outer:
        cfg = sweep_config(config, pattern, T)
        spec = spec_from_config(cfg.mqar)
        label = pattern_label(pattern)
        outer.set_postfix(model=label, T=T)
        r = train_mqar(cfg, spec, progress=progress, desc=f"{label} T={T}")
        row = {"label": label, "pattern": pattern, "seq_len": T, "kv_pairs": spec.num_kv_pairs,
               "steps": int(cfg.train.steps), **r, "chance": spec.chance}
        rows.append(row)
        outer.write(f"{label:>8} ({pattern}) T={T:<5} pairs={spec.num_kv_pairs:<4} "
                    f"accuracy={r['accuracy']:.3f} loss={r['final_loss']:.3f} "
                    f"(chance {spec.chance:.3f}; {r['seconds']:.0f} s)")
        table = write_sweep_outputs(rows, config, out_dir)  # after every run: a partial sweep is kept
    print(table)
    return rows


def write_sweep_outputs(rows: list[dict], config, out_dir: str) -> str:
    """mqar_sweep.csv, mqar_sweep.md (returned) and mqar_sweep.png (accuracy against length,
    a dashed line at chance) in ``out_dir``."""

    with open(os.path.join(out_dir, "mqar_sweep.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    table = format_sweep_table(rows)
    with open(os.path.join(out_dir, "mqar_sweep.md"), "w") as f:
        f.write(table + "\n")
    series = {}
    for r in rows:
        key = f"{r['label']} ({r['pattern']})"
        series.setdefault(key, ([], []))
        series[key][0].append(r["seq_len"])
        series[key][1].append(r["accuracy"])
    n = int(config.mqar.num_kv_pairs)
    pairs = f"{n} pairs" if n else f"seq_len / {int(config.mqar.kv_pairs_divisor)} pairs"
    chance = rows[0].get("chance")
    hlines = {f"chance (1 / {round(1 / chance)} values)": chance} if chance else None
    by_len = sorted({(r["seq_len"], r["kv_pairs"]) for r in rows})
    guess = {"1 / pairs (values seen, keys unknown)": ([T for T, _ in by_len], [1 / n for _, n in by_len])}
    plots.line_plot(os.path.join(out_dir, "mqar_sweep.png"), series,
                    title=f"MQAR recall accuracy ({pairs}, {int(config.train.steps)} steps)",
                    xlabel="sequence length (tokens)", ylabel="answer accuracy", logx=True,
                    hlines=hlines, references=guess,
                    note="dashed: chance, a uniform guess among the values an answer is drawn "
                         "from; dotted: a guess among the values in the context. MLA has no "
                         "positional encoding: an all-MLA stack must learn which token follows "
                         "which from the causal mask alone (kimi_k3/mqar.py)")
    return table


def format_sweep_table(rows: list[dict]) -> str:
    """Markdown: one row per model, one column per sequence length (with its pair count), then
    the chance level when the rows carry it."""
    lengths = sorted({r["seq_len"] for r in rows})
    pairs = {r["seq_len"]: r["kv_pairs"] for r in rows}
    models = list(dict.fromkeys((r["label"], r["pattern"]) for r in rows))
    acc = {(r["label"], r["pattern"], r["seq_len"]): r["accuracy"] for r in rows}
    head = "| model | pattern | " + " | ".join(f"T={T} ({pairs[T]} pairs)" for T in lengths) + " |"
    lines = [head, "|---|---|" + "---|" * len(lengths)]
    for label, pattern in models:
        cells = [f"{acc[(label, pattern, T)]:.3f}" if (label, pattern, T) in acc else "-"
                 for T in lengths]
        lines.append(f"| {label} | {pattern} | " + " | ".join(cells) + " |")
    chance = rows[0].get("chance")
    if chance:
        guess = " / ".join(f"{1 / pairs[T]:.3f}" for T in lengths)
        lines += ["", f"Chance: {chance:.3f} (a uniform guess among the {round(1 / chance)} values "
                      f"an answer is drawn from); a guess among the values in the context, keys "
                      f"unknown: 1 / pairs = {guess}."]
    return "\n".join(lines)
