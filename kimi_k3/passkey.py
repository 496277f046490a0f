r"""Passkey retrieval: a number hidden at a chosen depth of filler text, asked for at the end.

One example at context length L and depth d (the format of Mohtashami & Jaggi, 2023):

    The grass is green. The sky is blue. ... The pass key is 71432. Remember it. 71432 is the
    pass key. ... There and back again. What is the pass key? The pass key is |71432
    \__________________________ the prompt: exactly L tokens ______________________/ \answer/

- filler: ``FILLER_SENTENCES`` over and over, cut at a token boundary to fill L exactly;
- the needle goes in at the sentence boundary nearest to d * F (F filler tokens): d = 0 puts it
  before all the filler, d = 1 right before the question;
- the pass key: ``digits`` random decimal digits (a leading 0 allowed), fresh per example and
  deterministic in the seed, the context length and the depth;
- text to ids: bytes by default, or the config's tokenizer (``config.data.tokenizer``). Each
  part (a filler sentence, the needle, the question, the answer) is tokenised on its own, so
  the answer starts on a token boundary; with bytes the answer tokens are the digits.

L counts the prompt; the cache holds L + (answer tokens). The shortest L is the needle plus
the question (no filler): ``PasskeyTask.min_context_length``.

Scoring, per (L, d) cell of ``trials`` examples (``--mode``):

- ``greedy``: the answer's length in tokens decoded greedily after the prompt
  (``kimi_k3.generate``: prefill, then one step per token);
- ``teacher_forced``: the argmax at each answer position, given the true answer before it.

- digit accuracy: the share of answer tokens right (with bytes, digits: chance 1/10);
- exact match: every answer token right (chance 10^-digits).

The chance levels (``chance_levels``) are in the report, the table's last line and the heat
maps' colour bars. Every trial is kept in passkey.json (``answers`` of each cell): its context
length, depth, the needle's actual depth, the key, the model's answer (decoded), the answer
tokens it got right and whether all were.

Exact match is the same in both modes (decoding and teacher forcing agree up to the first
wrong token); digit accuracy differs only after a first mistake.

Training (``train_passkey``): a model learns the format on short haystacks, L uniform in
[lo, hi] and d uniform in [0, 1], with the loss on the answer tokens only
(``mqar.masked_cross_entropy``). Rows are right-padded to one length, which causality keeps from
touching the real tokens, so one compilation serves every length. Nothing is saved.

``main`` is the body of ``benchmarks/passkey.py``; outputs: ``passkey.json``, ``passkey.csv``,
``passkey_exact.png`` and ``passkey_digits.png`` (heat maps: depth by context length).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from kimi_k3 import plots
from kimi_k3.checkpoint import load_model
from kimi_k3.data import TextTokenizer
from kimi_k3.eval_scoring import parse_context_lengths
from kimi_k3.generate import Decoder, describe_weights, generate, resolve_checkpoint
from kimi_k3.model import MAX_POSITIONS
from kimi_k3.mqar import train_on_answers
from kimi_k3.run_dir import check_workdir
from kimi_k3.runtime import quiet_library_logs

FILLER_SENTENCES = (
    " The grass is green.",
    " The sky is blue.",
    " The sun is yellow.",
    " Here we go.",
    " There and back again.",
)
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is "
MODES = ("greedy", "teacher_forced")
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
PAD = 0  # token id of the right padding of training rows (weight 0, after every real token)


# ---------------------------------------------------------------------------------------------
# Examples
# ---------------------------------------------------------------------------------------------


class Filler:
    """``FILLER_SENTENCES`` over and over through one tokenizer (each sentence tokenised on its
    own): the haystack of the passkey task and of ``kimi_k3.ruler``."""

    def __init__(self, tokenizer: TextTokenizer):
        sentences = [np.asarray(tokenizer.encode(s), np.int32) for s in FILLER_SENTENCES]
        self.cycle = np.concatenate(sentences)  # int32: one pass over the sentences
        self._starts = np.cumsum([0] + [len(s) for s in sentences[:-1]])

    def tokens(self, F: int) -> np.ndarray:
        """The first F filler tokens (cut at a token boundary)."""
        return np.tile(self.cycle, -(-F // len(self.cycle)))[:F]

    def boundaries(self, F: int, depths: Sequence[float]) -> list[int]:
        """Per depth d, the sentence boundary of the first F filler tokens nearest to d x F (0
        before all of them, F after)."""
        n = len(self.cycle)
        reps = -(-F // n)
        starts = (np.arange(reps)[:, None] * n + self._starts[None, :]).ravel()
        bounds = np.append(starts[starts < F], F)
        return [int(bounds[np.argmin(np.abs(bounds - d * F))]) for d in depths]


@dataclasses.dataclass(frozen=True)
class PasskeyExample:
    prompt_ids: np.ndarray  # int32 [L]: filler, needle, filler, question
    answer_ids: np.ndarray  # int32 [A]: the pass key's tokens
    key: str  # the pass key's digits
    needle_start: int  # token index of the needle's first token in the prompt
    filler_tokens: int  # F

    @property
    def needle_depth(self) -> float:
        """Where the needle went: filler tokens before it over all filler tokens (1 when F = 0)."""
        return self.needle_start / self.filler_tokens if self.filler_tokens else 1.0


class PasskeyTask:
    """Passkey examples through one tokenizer (module docstring). ``tokenizer``: a
    ``kimi_k3.data.TextTokenizer``; None for bytes."""

    def __init__(self, tokenizer: TextTokenizer | None = None, digits: int = 5):
        if not (isinstance(digits, int) and 1 <= digits <= 64):
            raise ValueError(f"--digits: {digits!r} must be an integer in [1, 64]")
        self.tokenizer = tokenizer if tokenizer is not None else TextTokenizer("")
        self.digits = digits
        self._filler = Filler(self.tokenizer)
        self._question = self.tokenizer.encode(QUESTION).astype(np.int32)

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.path or "bytes"

    def needle_ids(self, key: str) -> np.ndarray:
        return self.tokenizer.encode(NEEDLE.format(key=key)).astype(np.int32)

    def min_context_length(self) -> int:
        """Needle plus question, no filler (for a tokenizer: with a key of zeros; a key that
        tokenises longer needs more)."""
        return len(self.needle_ids("0" * self.digits)) + len(self._question)

    def max_token_id(self) -> int:
        """The largest id any example holds (filler, question, a needle and its digits)."""
        parts = [self._filler.cycle, self._question, self.needle_ids("0123456789")]
        return int(max(p.max() for p in parts))

    def random_key(self, rng: np.random.Generator) -> str:
        return "".join(str(d) for d in rng.integers(0, 10, self.digits))

    def example(self, context_length: int, depth: float, key: str) -> PasskeyExample:
        """The example of ``key`` hidden at ``depth`` in a prompt of ``context_length`` tokens.
        Raises ValueError naming ``--context_lengths`` when the needle and question do not fit."""
        L = int(context_length)
        needle = self.needle_ids(key)
        F = L - len(needle) - len(self._question)
        if F < 0:
            raise ValueError(
                f"--context_lengths: {L} tokens cannot hold the needle and the question "
                f"({len(needle) + len(self._question)} tokens with a {self.digits}-digit key, "
                f"{self.tokenizer_name}); the shortest allowed is {self.min_context_length()}")
        filler = self._filler.tokens(F)
        (at,) = self._filler.boundaries(F, [depth])
        prompt = np.concatenate([filler[:at], needle, filler[at:], self._question]).astype(np.int32)
        answer = self.tokenizer.encode(key).astype(np.int32)
        return PasskeyExample(prompt, answer, key, at, F)

    def examples(self, context_length: int, depth: float, trials: int, seed: int) -> list[PasskeyExample]:
        """``trials`` examples with keys from the stream (seed, context_length, depth)."""
        rng = np.random.default_rng([seed, int(context_length), int(round(depth * 1e6))])
        return [self.example(context_length, depth, self.random_key(rng)) for _ in range(trials)]

    def training_batch(self, batch_size: int, lengths: tuple[int, int],
                       rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Training rows: L uniform in [lo, hi], depth uniform in [0, 1], a fresh key each,
        right-padded with ``PAD`` to hi + digits - 1 tokens (the padding has weight 0).

        Returns inputs_NxT, targets_NxT (the next token) and weights_NxT (1 at each position
        whose next token is an answer token), as ``mqar.generate`` does.
        """
        lo, hi = lengths
        T = hi + self.digits - 1
        inputs = np.full((batch_size, T), PAD, np.int32)
        targets = np.full((batch_size, T), PAD, np.int32)
        weights = np.zeros((batch_size, T), np.float32)
        for i in range(batch_size):
            ex = self.example(int(rng.integers(lo, hi + 1)), float(rng.random()), self.random_key(rng))
            seq = np.concatenate([ex.prompt_ids, ex.answer_ids])
            if len(seq) - 1 > T:
                raise ValueError(f"passkey training: the answer {ex.key!r} tokenises into "
                                 f"{len(ex.answer_ids)} tokens, more than its {self.digits} digits")
            L, A = len(ex.prompt_ids), len(ex.answer_ids)
            inputs[i, : len(seq) - 1] = seq[:-1]
            targets[i, : len(seq) - 1] = seq[1:]
            weights[i, L - 1 : L - 1 + A] = 1.0
        return {"inputs_NxT": inputs, "targets_NxT": targets, "weights_NxT": weights}


# ---------------------------------------------------------------------------------------------
# Training on short haystacks
# ---------------------------------------------------------------------------------------------


def train_passkey(model, task: PasskeyTask, opt_cfg, *, steps: int, batch_size: int,
                  lengths: tuple[int, int], seed: int = 0, progress: bool = False):
    """(the model trained ``steps`` steps on passkey rows, the last loss). ``opt_cfg``:
    ``config.opt`` (``kimi_k3.optim.make_optimizer``); batches come from the stream (seed, 0)."""
    lo, hi = lengths
    if not (1 <= lo <= hi):
        raise ValueError(f"--train_lengths: {lengths} must be lo,hi with 1 <= lo <= hi")
    if lo < task.min_context_length():
        raise ValueError(f"--train_lengths: {lo} is shorter than the needle and the question; "
                         f"the shortest allowed is {task.min_context_length()}")
    rng = np.random.default_rng([seed, 0])
    return train_on_answers(model, opt_cfg, lambda _: task.training_batch(batch_size, (lo, hi), rng),
                            steps=steps, desc="passkey training", progress=progress)


# ---------------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------------


def predict_answers(decoder: Decoder, prompts_BxL: np.ndarray, answers_BxA: np.ndarray, mode: str,
                    piece_len: int) -> np.ndarray:
    """int32 [B, A]: the model's answer tokens after each prompt (all prompts of one length), by
    greedy decoding or teacher-forced argmax (module docstring)."""
    B, L = prompts_BxL.shape
    A = answers_BxA.shape[1]
    if mode == "greedy":
        gen = generate(decoder, list(prompts_BxL), A, piece_len=piece_len)
        return np.stack(gen.tokens)
    if mode != "teacher_forced":
        raise ValueError(f"--mode: {mode!r} is not one of {MODES}")
    cache = decoder.init_cache(B, L + A)
    logits_BxV, cache = decoder.prefill(prompts_BxL, cache, piece_len)
    preds = [np.asarray(jnp.argmax(logits_BxV, axis=-1))]
    for j in range(A - 1):
        logits_BxV, cache = decoder.step(answers_BxA[:, j], cache)
        preds.append(np.asarray(jnp.argmax(logits_BxV, axis=-1)))
    return np.stack(preds, axis=1).astype(np.int32)


def padded_batches(items: Sequence, batch_size: int):
    """(batch, n) per ``batch_size`` consecutive items: the last batch padded with copies of its
    first item, so every call sees one shape; its first n items are the real ones."""
    for start in range(0, len(items), batch_size):
        batch = list(items[start : start + batch_size])
        n = len(batch)
        yield batch + [batch[0]] * (batch_size - n), n


def score_examples(decoder: Decoder, examples: Sequence[PasskeyExample], mode: str,
                   batch_size: int, piece_len: int,
                   tokenizer: TextTokenizer | None = None) -> dict:
    """Digit accuracy and exact match over ``examples`` (all of one context length), in batches
    of ``batch_size`` (the last one padded with copies of its first row, not counted), and
    ``answers``: per example its key, the model's answer (decoded by ``tokenizer``; bytes by
    default), the answer tokens it got right and whether all were right."""
    tokenizer = tokenizer if tokenizer is not None else TextTokenizer("")
    A = max(len(e.answer_ids) for e in examples)
    right = total = exact = 0
    kept = []  # per example: key and answer
    for batch, n in padded_batches(examples, batch_size):
        prompts = np.stack([e.prompt_ids for e in batch])
        answers = np.zeros((batch_size, A), np.int32)
        mask = np.zeros((batch_size, A), bool)
        for i, e in enumerate(batch):
            answers[i, : len(e.answer_ids)] = e.answer_ids
            mask[i, : len(e.answer_ids)] = True
        preds = predict_answers(decoder, prompts, answers, mode, piece_len)[:n]
        hit = (preds == answers[:n]) | ~mask[:n]
        right += int((hit & mask[:n]).sum())
        total += int(mask[:n].sum())
        exact += int(hit.all(axis=1).sum())
        for i, e in enumerate(batch[:n]):
            A_i = len(e.answer_ids)
            kept.append({"key": e.key, "answer": tokenizer.decode(preds[i, :A_i]),
                            "needle_depth": e.needle_depth,
                            "digits_right": int((hit[i] & mask[i]).sum()),
                            "exact": bool(hit[i].all())})
    return {"digit_accuracy": right / total, "exact_match": exact / len(examples),
            "trials": len(examples), "answers": kept}


@dataclasses.dataclass(frozen=True)
class PasskeyOptions:
    """What ``evaluate`` measures; ``validate`` names the flag of a value out of range."""

    context_lengths: tuple[int, ...]
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    trials: int = 8  # examples per (context length, depth)
    mode: str = "greedy"  # "greedy" | "teacher_forced"
    batch_size: int = 8
    piece_len: int = 2048  # tokens per prefill call
    seed: int = 0

    def validate(self, task: PasskeyTask) -> PasskeyOptions:
        if not self.context_lengths:
            raise ValueError("--context_lengths: empty; give e.g. --context_lengths=1K,4K")
        shortest = task.min_context_length()
        for L in self.context_lengths:
            if not (isinstance(L, int) and L >= shortest):
                raise ValueError(
                    f"--context_lengths: {L!r} cannot hold the needle and the question "
                    f"({shortest} tokens with a {task.digits}-digit key, {task.tokenizer_name}); "
                    f"the shortest allowed is {shortest}")
            if L + task.digits > MAX_POSITIONS:
                raise ValueError(f"--context_lengths: {L} plus the answer exceeds the cache's "
                                 f"{MAX_POSITIONS} positions")
        if not self.depths:
            raise ValueError("--depths: empty; give e.g. --depths=0,0.5,1")
        for d in self.depths:
            if not (isinstance(d, float | int) and 0.0 <= d <= 1.0):
                raise ValueError(f"--depths: {d!r} must lie in [0, 1] (0 = the start of the "
                                 f"filler, 1 = right before the question)")
        for flag, v in (("--trials", self.trials), ("--batch_size", self.batch_size),
                        ("--piece_len", self.piece_len)):
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{flag}: {v!r} must be an integer >= 1")
        if self.mode not in MODES:
            raise ValueError(f"--mode: {self.mode!r} is not one of {MODES}")
        return self


def parse_depths(values: Sequence[str | float], flag: str = "--depths",
                 meaning: str = "0 = the start of the filler, 1 = right before the question",
                 ) -> tuple[float, ...]:
    """``["0", "0.5", "1"]`` -> (0.0, 0.5, 1.0). Raises ValueError naming ``flag`` and the item
    that is not a number in [0, 1] (and what the ends mean: ``meaning``)."""
    out = []
    for item in values:
        try:
            d = float(str(item).strip())
        except ValueError:
            d = math.nan
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"{flag}: {str(item).strip()!r} is not a number in [0, 1] ({meaning})")
        out.append(d)
    return tuple(out)


def evaluate(model, task: PasskeyTask, opts: PasskeyOptions, *, progress: bool = False) -> list[dict]:
    """One row per (context length, depth): digit accuracy, exact match, trials, the needle's
    mean actual depth, seconds, and ``answers``: per trial its context length, depth, the
    needle's actual depth, key, the model's answer, digits right and exact match. ``model``: a
    HybridLM (or its ``Decoder``)."""
    opts.validate(task)
    decoder = model if isinstance(model, Decoder) else Decoder(model)
    if decoder.vocab_size is not None and task.max_token_id() >= decoder.vocab_size:
        raise ValueError(f"passkey: {task.tokenizer_name} gives token id {task.max_token_id()}, "
                         f"outside [0, {decoder.vocab_size}) = model.vocab_size")
    cells = [(L, d) for L in opts.context_lengths for d in opts.depths]
    rows = []
    with tqdm(cells, desc="passkey", disable=not (progress and sys.stderr.isatty())) as bar:
        for L, d in bar:
            bar.set_postfix(L=L, depth=d)
            t0 = time.perf_counter()
            examples = task.examples(L, d, opts.trials, opts.seed)
            r = score_examples(decoder, examples, opts.mode, opts.batch_size, opts.piece_len,
                               task.tokenizer)
            answers = [{"context_length": L, "depth": d, **a} for a in r.pop("answers")]
            rows.append({"context_length": L, "depth": d,
                         "needle_depth": float(np.mean([e.needle_depth for e in examples])),
                         **r, "seconds": time.perf_counter() - t0, "answers": answers})
    return rows


# ---------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------


def _grid(rows: Sequence[dict], key: str):
    lengths = sorted({r["context_length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    at = {(r["depth"], r["context_length"]): r[key] for r in rows}
    return lengths, depths, [[at.get((d, L)) for L in lengths] for d in depths]


def chance_levels(digits: int) -> dict[str, float]:
    """What guessing scores: each digit uniform among 10 (with bytes an answer token is a digit),
    so 1/10 per digit and 10^-digits for the whole key."""
    return {"digit_accuracy": 0.1, "exact_match": 10.0 ** -digits}


def format_table(rows: Sequence[dict], digits: int | None = None) -> str:
    """Exact match (digit accuracy): one line per depth, one column per context length; with
    ``digits``, a last line with the chance levels."""
    lengths, depths, exact = _grid(rows, "exact_match")
    _, _, digit = _grid(rows, "digit_accuracy")
    head = ["depth"] + [f"L={L}" for L in lengths]
    body = [[f"{d:g}"] + ["-" if e is None else f"{e:.2f} ({g:.2f})"
                          for e, g in zip(exact[i], digit[i], strict=True)]
            for i, d in enumerate(depths)]
    widths = [max(len(c) for c in col) for col in zip(head, *body, strict=True)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))
    lines = ["passkey exact match (digit accuracy)", fmt(head)] + [fmt(b) for b in body]
    if digits is not None:
        chance = chance_levels(digits)
        lines.append(f"chance: exact match {chance['exact_match']:.0e}, digit accuracy "
                     f"{chance['digit_accuracy']:.2f}")
    return "\n".join(lines)


def write_outputs(report: dict, workdir: str) -> dict[str, str]:
    """passkey.json (the whole report, every trial's key and answer included), passkey.csv (one
    row per cell), passkey_exact.png and passkey_digits.png (depth x context length, chance
    marked on the colour bar) in ``workdir``; returns {kind: path}."""
    os.makedirs(workdir, exist_ok=True)
    paths = {"json": os.path.join(workdir, "passkey.json"),
             "csv": os.path.join(workdir, "passkey.csv"),
             "exact_png": os.path.join(workdir, "passkey_exact.png"),
             "digits_png": os.path.join(workdir, "passkey_digits.png")}
    with open(paths["json"], "w") as f:
        json.dump(report, f, indent=1)
    rows = report["rows"]
    with open(paths["csv"], "w", newline="") as f:  # one row per cell; the answers are in the JSON
        w = csv.DictWriter(f, fieldnames=[k for k in rows[0] if k != "answers"],
                           extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    chance = report.get("chance") or chance_levels(report["digits"])
    note = (f"{report['label']}, {report['mode']}, {report['digits']} digits, "
            f"{report['trials']} trials per cell, {report['tokenizer']}; chance: "
            f"{chance['digit_accuracy']:g} per digit, {chance['exact_match']:.0e} exact")
    for key, kind, what in (("exact_match", "exact_png", "exact match"),
                            ("digit_accuracy", "digits_png", "digit accuracy")):
        lengths, depths, grid = _grid(rows, key)
        plots.heatmap(paths[kind], grid, row_labels=[f"{d:g}" for d in depths],
                      col_labels=[plots.tokens_label(L) for L in lengths],
                      title=f"Passkey retrieval: {what}", xlabel="context length (tokens)",
                      ylabel="needle depth", colorbar_label=what, note=note, chance=chance[key])
    return paths


# ---------------------------------------------------------------------------------------------
# The benchmarks/passkey.py command
# ---------------------------------------------------------------------------------------------


def main(
    config,
    workdir: str,
    *,
    checkpoint: str | None = None,
    context_lengths: Sequence[str | int] = ("1K",),
    depths: Sequence[str | float] = DEFAULT_DEPTHS,
    digits: int = 5,
    trials: int = 8,
    mode: str = "greedy",
    batch_size: int = 8,
    piece_len: int = 2048,
    seed: int = 0,
    train_steps: int = 0,
    train_lengths: Sequence[str | int] = (),
    train_batch_size: int = 16,
    progress: bool = True,
    config_name: str = "--config",
) -> dict:
    """benchmarks/passkey.py's body: check every flag, build the model (``--checkpoint``, the
    newest under ``workdir/checkpoints``, or ``init``), optionally train it on short haystacks,
    score every (context length, depth), write the outputs to ``workdir``. Returns the report."""
    if config is None:
        raise ValueError("--config: required (the model, and its tokenizer if it has one)")
    task = PasskeyTask(TextTokenizer(config.data.get("tokenizer", "")), digits)
    opts = PasskeyOptions(parse_context_lengths(context_lengths), parse_depths(depths), trials,
                          mode, batch_size, piece_len, seed).validate(task)
    vocab = int(config.model.vocab_size)
    if task.max_token_id() >= vocab:
        raise ValueError(f"config.data.tokenizer: {task.tokenizer_name} gives token id "
                         f"{task.max_token_id()}, outside [0, {vocab}) = model.vocab_size")
    if not (isinstance(train_steps, int) and train_steps >= 0):
        raise ValueError(f"--train_steps: {train_steps!r} must be an integer >= 0 (0 = no training)")
    lengths = None
    if train_steps:
        lengths = parse_context_lengths(train_lengths, "--train_lengths") if train_lengths else ()
        if len(lengths) not in (1, 2):
            raise ValueError(f"--train_lengths: {list(train_lengths)} must be one length or lo,hi")
        lengths = (lengths[0], lengths[-1])
        if not lengths[0] <= lengths[1]:
            raise ValueError(f"--train_lengths: {lengths[0]} > {lengths[1]}; give lo,hi")
        if lengths[0] < task.min_context_length():
            raise ValueError(f"--train_lengths: {lengths[0]} is shorter than the needle and the "
                             f"question; the shortest allowed is {task.min_context_length()}")
        if not (isinstance(train_batch_size, int) and train_batch_size >= 1):
            raise ValueError(f"--train_batch_size: {train_batch_size!r} must be an integer >= 1")
    path = resolve_checkpoint(checkpoint, workdir)
    workdir = check_workdir(workdir)

    quiet_library_logs()
    model, step = load_model(config, path, config_name=config_name)
    print(describe_weights(path, step))
    report = {"label": describe_weights(path, step).removeprefix("weights: "),
              "checkpoint": path, "step": step, "config": config_name,
              "tokenizer": task.tokenizer_name, "digits": digits, "mode": mode, "trials": trials,
              "min_context_length": task.min_context_length(), "chance": chance_levels(digits),
              "train": None}
    if train_steps:
        t0 = time.perf_counter()
        model, loss = train_passkey(model, task, config.opt, steps=train_steps,
                                    batch_size=train_batch_size, lengths=lengths, seed=seed,
                                    progress=progress)
        report["train"] = {"steps": train_steps, "lengths": list(lengths),
                           "batch_size": train_batch_size, "final_loss": loss,
                           "seconds": time.perf_counter() - t0}
        print(f"trained {train_steps} steps on L in [{lengths[0]}, {lengths[1]}]: answer loss "
              f"{loss:.3f} nats")
        report["label"] += f" + {train_steps} passkey steps"
    report["rows"] = evaluate(model, task, opts, progress=progress)
    paths = write_outputs(report, workdir)
    print(format_table(report["rows"], digits))
    print(f"wrote {', '.join(os.path.basename(p) for p in paths.values())} to {workdir}")
    return report
