r"""A RULER-style synthetic long-context suite (Hsieh et al., 2024), generated here, no download:
needles in a haystack, variable tracking and word extraction, scored by generation.

    eval.py --checkpoint=runs/r3 --workdir=runs/r3_ruler --ruler_tasks=niah_single,vt \
        --ruler_lengths=4K,32K,128K --ruler_depths=0,0.5,1 --ruler_samples=4

Tasks (``TASKS``), each example a prompt of a given length L in tokens and the strings its
answer must hold:

- ``niah_single``: one needle "One of the special magic numbers for {key} is: {value}." in a
  haystack of filler sentences; asked for the key's number;
- ``niah_multikey``: ``NEEDLES`` needles of distinct keys (the others are distractors); asked
  for one key's number;
- ``niah_multivalue``: ``NEEDLES`` needles of one key with distinct numbers; asked for all;
- ``niah_multiquery``: ``NEEDLES`` needles of distinct keys; asked for ``QUERIES`` of them;
- ``vt`` (variable tracking): "VAR A = 12345." then ``HOPS`` assignments "VAR B = VAR A." ...
  spread through the haystack; asked for every variable that holds the number;
- ``cwe`` (common words): a numbered list of words, ``COMMON_WORDS`` of them repeated more
  often than the rest; asked for those;
- ``fwe`` (frequent words): words drawn from a Zipf law (exponent 2); asked for the three most
  frequent.

Keys and words are made-up words (syllables drawn at random), numbers ``value_digits``
random digits (a leading digit of 1-9); the haystack is RULER's "noise" filler (the passkey
sentences, ``kimi_k3.passkey.FILLER_SENTENCES``), cut to fill the prompt to exactly L tokens
(the word tasks: their list or text as long as fits, after as much filler as makes L), so
every prompt of a length shares one compilation.

Depth: in the needle tasks the needle asked about (niah_single, niah_multikey, the first of
niah_multivalue and niah_multiquery, the first assignment of vt) goes at the filler sentence
boundary nearest to depth d x F (F filler tokens: d = 0 before all the filler, 1 right before
the question); the other needles at boundaries drawn uniformly (vt: after the first, in
order). The word tasks have no needle: they are measured once per length (depth "-").

Text to ids: each part (the instructions, each filler sentence, each needle, the question) is
tokenised on its own and the parts are put together, so the lengths add up exactly, with bytes
(``configs/tiny.py``, vocabulary 256) or with a tokenizer. An example is deterministic in
(seed, task, L, d, its index).

Scoring (``score_answer``): the example's prompt is decoded greedily (``kimi_k3.generate``)
for at most the tokens of the longest reference answer of its length plus ``ANSWER_SLACK``,
stopping at a newline;
the answer is the text before the first newline. Recall: the share of the expected strings
that appear in the answer (case folded): RULER's "string match all". Exact match: all of them
appear (an example scores 1 or 0). Cells: (model, task, L, d) means over ``samples``
examples; the table averages each task over depths.

Outputs (``write_outputs``): ruler.json (every cell, every example's prompt length, expected
strings and answer), ruler.csv (one row per cell), ruler_heatmap.png: exact match of the needle
tasks, averaged over them, by depth x length, one panel per model side by side.

Training from the same generator (``python -m kimi_k3.ruler``): ``train`` trains a config's
model on generated examples, the loss on their answers only (as the passkey and MQAR tasks
train), and saves a run folder eval.py reads (configs/ruler_tiny.py); ``write`` writes
examples with their answers as text, or as a token file with an end-of-document id after each,
for ``train.py``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from kimi_k3 import checkpoint as ckpt_lib
from kimi_k3 import mesh as mesh_lib
from kimi_k3 import plots
from kimi_k3.checkpoint import load_model
from kimi_k3.config import run_spec
from kimi_k3.config_files import load_config
from kimi_k3.data import TextTokenizer
from kimi_k3.eval_scoring import parse_context_lengths
from kimi_k3.generate import Decoder, generate
from kimi_k3.model import MAX_POSITIONS
from kimi_k3.model_state import split_model
from kimi_k3.mqar import train_on_answers
from kimi_k3.passkey import FILLER_SENTENCES as FILLER_SENTENCES  # the haystack's, re-exported
from kimi_k3.passkey import Filler, padded_batches
from kimi_k3.passkey import parse_depths as passkey_depths
from kimi_k3.run_dir import check_workdir, write_config
from kimi_k3.runtime import quiet_library_logs
from kimi_k3.train_state import state_layout

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
NEEDLE_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt")
NEEDLES = 4  # needles of the multi-key / multi-value / multi-query tasks
QUERIES = 2  # keys asked for in niah_multiquery
HOPS = 4  # assignments after the first in vt: HOPS + 1 variables hold the number
COMMON_WORDS = 10  # cwe: words asked for
COMMON_REPEATS = 30  # cwe: each common word's count, at most (RULER's); fewer when L is short
RARE_REPEATS = 3  # cwe: each other word's count
FREQUENT_WORDS = 3  # fwe: words asked for
ANSWER_SLACK = 8  # tokens decoded beyond the reference answer's
STOP = "\n"
SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")

INSTRUCTIONS = {
    "niah": "Some special magic numbers are hidden within the following text. Make sure to "
            "memorize it. I will quiz you about the numbers afterwards.\n",
    "vt": "Memorize and track the chain(s) of variable assignment hidden in the following "
          "text.\n",
    "cwe": "Below is a numbered list of words. In these words, some appear more often than "
           "others. Memorize the ones that appear most often.\n",
    "fwe": "Read the following coded text and track the frequency of each coded word. Find "
           "the three most frequently appeared coded words.\n",
}
NEEDLE = " One of the special magic numbers for {key} is: {value}."


class TooShort(ValueError):
    """A prompt length that cannot hold an example's fixed parts."""


# ---------------------------------------------------------------------------------------------
# Examples
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RulerExample:
    task: str
    length: int  # L asked for
    depth: float | None  # None: a word task
    prompt_ids: np.ndarray  # int32 [L]
    expected: tuple[str, ...]  # strings the answer must hold
    answer: str  # the reference answer's text (what training data continues with)
    needle_depth: float | None  # where the needle asked about went: filler before it / F
    answer_tokens: int  # the reference answer's tokens

    @property
    def max_new_tokens(self) -> int:
        return self.answer_tokens + ANSWER_SLACK


class RulerSuite:
    """RULER examples through one tokenizer (module docstring). ``tokenizer``: a
    ``kimi_k3.data.TextTokenizer`` (bytes by default); ``value_digits``: digits of a number."""

    def __init__(self, tokenizer: TextTokenizer | None = None, value_digits: int = 7):
        if not (isinstance(value_digits, int) and 2 <= value_digits <= 18):
            raise ValueError(f"--ruler_value_digits: {value_digits!r} must be an integer in "
                             f"[2, 18]")
        self.tokenizer = tokenizer if tokenizer is not None else TextTokenizer("")
        self.value_digits = value_digits
        self._filler = Filler(self.tokenizer)

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.path or "bytes"

    def enc(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text), np.int32)

    # -- random material ---------------------------------------------------------------------

    def word(self, rng: np.random.Generator) -> str:
        return "".join(rng.choice(SYLLABLES, int(rng.integers(2, 4))))

    def words(self, rng: np.random.Generator, n: int) -> list[str]:
        """``n`` distinct made-up words."""
        out: dict[str, None] = {}
        while len(out) < n:
            out[self.word(rng)] = None
        return list(out)

    def value(self, rng: np.random.Generator) -> str:
        return str(int(rng.integers(1, 10))) + "".join(
            str(d) for d in rng.integers(0, 10, self.value_digits - 1))

    # -- the haystack ------------------------------------------------------------------------

    def _haystack(self, F: int, needles: Sequence[np.ndarray], depths: Sequence[float]):
        """(filler of F tokens with each needle at the sentence boundary nearest to its depth x F,
        in order of depth; where each needle went as a share of F)."""
        filler = self._filler.tokens(F)
        at = self._filler.boundaries(F, depths)
        order = sorted(range(len(needles)), key=lambda i: (at[i], i))
        parts, last = [], 0
        for i in order:
            parts += [filler[last : at[i]], needles[i]]
            last = at[i]
        parts.append(filler[last:])
        return np.concatenate(parts).astype(np.int32), [a / F if F else 1.0 for a in at]

    def _needle_example(self, task, L, depth, rng, needles_txt, first, question, expected,
                        answer, head="niah", spread_after=False):
        """Instructions, a haystack holding ``needles_txt`` (needle ``first`` at ``depth``, the
        others at random boundaries, after it with ``spread_after``), then ``question``."""
        head_ids, q_ids = self.enc(INSTRUCTIONS[head]), self.enc(question)
        needles = [self.enc(t) for t in needles_txt]
        F = L - len(head_ids) - len(q_ids) - sum(len(x) for x in needles)
        if F < 0:
            raise TooShort(f"{task}'s instructions, needles and question take {L - F} tokens")
        k = len(needles)
        if spread_after:
            depths = [depth] + sorted(rng.uniform(depth, 1.0, k - 1).tolist())
        else:
            depths = [depth if i == first else float(rng.random()) for i in range(k)]
        hay, where = self._haystack(F, needles, depths)
        prompt = np.concatenate([head_ids, hay, q_ids]).astype(np.int32)
        return RulerExample(task, L, depth, prompt, tuple(expected), answer, where[first],
                            len(self.enc(answer)))

    def example(self, task: str, L: int, depth: float | None, rng: np.random.Generator) -> RulerExample:
        """One example of ``task`` in a prompt of ``L`` tokens. An L too short for it is a
        ValueError naming ``--ruler_lengths`` and the shortest allowed."""
        try:
            return self._example(task, L, depth, rng)
        except TooShort as e:
            raise ValueError(f"--ruler_lengths: {L} tokens are too few for {task} ({e}, "
                             f"{self.tokenizer_name}); the shortest allowed is about "
                             f"{self.min_length(task)}") from None

    def _example(self, task: str, L: int, depth: float | None, rng: np.random.Generator) -> RulerExample:
        if task == "niah_single":
            key, value = "-".join(self.words(rng, 2)), self.value(rng)
            return self._needle_example(
                task, L, depth, rng, [NEEDLE.format(key=key, value=value)], 0,
                f" What is the special magic number for {key} mentioned in the provided text? "
                f"The special magic number for {key} mentioned in the provided text is",
                [value], f" {value}.")
        if task in ("niah_multikey", "niah_multiquery"):
            keys = ["-".join(self.words(rng, 2)) for _ in range(NEEDLES)]
            values = [self.value(rng) for _ in range(NEEDLES)]
            needles = [NEEDLE.format(key=k, value=v) for k, v in zip(keys, values, strict=True)]
            if task == "niah_multikey":
                return self._needle_example(
                    task, L, depth, rng, needles, 0,
                    f" What is the special magic number for {keys[0]} mentioned in the provided "
                    f"text? The special magic number for {keys[0]} mentioned in the provided "
                    f"text is", [values[0]], f" {values[0]}.")
            asked = ", ".join(keys[:QUERIES])
            return self._needle_example(
                task, L, depth, rng, needles, 0,
                f" What are all the special magic numbers for {asked} mentioned in the provided "
                f"text? The special magic numbers for {asked} mentioned in the provided text "
                f"are", values[:QUERIES], " " + ", ".join(values[:QUERIES]) + ".")
        if task == "niah_multivalue":
            key = "-".join(self.words(rng, 2))
            values = list(dict.fromkeys(self.value(rng) for _ in range(NEEDLES)))
            return self._needle_example(
                task, L, depth, rng, [NEEDLE.format(key=key, value=v) for v in values], 0,
                f" What are all the special magic numbers for {key} mentioned in the provided "
                f"text? The special magic numbers for {key} mentioned in the provided text are",
                values, " " + ", ".join(values) + ".")
        if task == "vt":
            names = ["".join(rng.choice(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"), 5))
                     for _ in range(HOPS + 1)]
            names = list(dict.fromkeys(names))
            value = self.value(rng)
            chain = [f" VAR {names[0]} = {value}."] + [
                f" VAR {b} = VAR {a}." for a, b in zip(names, names[1:], strict=False)]
            return self._needle_example(
                task, L, depth, rng, chain, 0,
                f" Question: Find all variables that are assigned the value {value} in the text "
                f"above. Answer: According to the chain(s) of variable assignment in the text "
                f"above, {len(names)} variables are assigned the value {value}, they are:",
                names, " " + ", ".join(names) + ".", head="vt", spread_after=True)
        if task == "cwe":
            return self._cwe(L, rng)
        if task == "fwe":
            return self._fwe(L, rng)
        raise ValueError(f"--ruler_tasks: {task!r} is not one of {', '.join(TASKS)}")

    def _fill_front(self, parts: Sequence[np.ndarray], L: int) -> np.ndarray:
        """``parts`` after as much filler as makes exactly L tokens (the word tasks: every
        prompt of a length is as long, so they share the needle tasks' compilations)."""
        F = L - sum(len(x) for x in parts)
        return np.concatenate([self._filler.tokens(F), *parts]).astype(np.int32)

    def _cwe(self, L: int, rng: np.random.Generator) -> RulerExample:
        head = self.enc(INSTRUCTIONS["cwe"])
        question = (f" Question: What are the {COMMON_WORDS} most common words in the above "
                    f"list? Answer: The top {COMMON_WORDS} words that appear most often in the "
                    f"list are:")
        q = self.enc(question)
        budget = L - len(head) - len(q)
        sample = self.words(rng, 50)
        per_item = np.mean([len(self.enc(f" {i}. {w}")) for i, w in enumerate(sample, 100)])
        vocab = self.words(rng, COMMON_WORDS + int(budget / per_item / RARE_REPEATS) + 1)
        common, rare = vocab[:COMMON_WORDS], vocab[COMMON_WORDS:]
        # the common words take about half the list (up to COMMON_REPEATS each), rare ones the
        # rest, RARE_REPEATS times each
        items = budget / per_item
        top = int(min(COMMON_REPEATS, max(RARE_REPEATS + 1, items // (2 * COMMON_WORDS))))
        for repeats in range(top, RARE_REPEATS, -1):
            n_rare = int((items - COMMON_WORDS * repeats) // RARE_REPEATS)
            while n_rare >= 1:
                words = common * repeats + rare[:n_rare] * RARE_REPEATS
                order = rng.permutation(len(words))
                items = [self.enc(f" {i + 1}. {words[j]}") for i, j in enumerate(order)]
                if sum(len(x) for x in items) <= budget:
                    prompt = self._fill_front([head, *items, q], L)
                    answer = " " + ", ".join(common) + "."
                    return RulerExample("cwe", L, None, prompt, tuple(common), answer, None,
                                        len(self.enc(answer)))
                n_rare -= max(1, n_rare // 8)
        raise TooShort(f"cwe's list needs {COMMON_WORDS} words {RARE_REPEATS + 1} times each "
                       f"and rarer ones")

    def _fwe(self, L: int, rng: np.random.Generator) -> RulerExample:
        head = self.enc(INSTRUCTIONS["fwe"])
        question = (" Question: What are the three most frequently appeared coded words in the "
                    "above coded text? Answer: According to the coded text above, the three "
                    "most frequently appeared words are:")
        q = self.enc(question)
        budget = L - len(head) - len(q)
        vocab = self.words(rng, 64)
        per_word = np.mean([len(self.enc(" " + w)) for w in vocab])
        n = int(budget / per_word)
        while n > 0:
            # counts by rank r: n x r^-2 / H (a Zipf law of exponent 2 over the vocabulary),
            # the top FREQUENT_WORDS + 1 kept strictly apart so the answer is one
            weights = 1.0 / np.arange(1, len(vocab) + 1) ** 2
            counts = np.floor(n * weights / weights.sum()).astype(int)
            if np.all(np.diff(counts[: FREQUENT_WORDS + 1]) < 0) and counts[FREQUENT_WORDS] >= 1:
                words = [w for w, c in zip(vocab, counts, strict=True) for _ in range(c)]
                words = [words[j] for j in rng.permutation(len(words))]
                items = [self.enc(" " + w) for w in words]
                if sum(len(x) for x in items) <= budget:
                    prompt = self._fill_front([head, *items, q], L)
                    top = vocab[:FREQUENT_WORDS]
                    answer = " " + ", ".join(top) + "."
                    return RulerExample("fwe", L, None, prompt, tuple(top), answer, None,
                                        len(self.enc(answer)))
            n -= max(1, n // 16)
        raise TooShort("fwe's coded text needs its three most frequent words apart")

    def min_length(self, task: str) -> int:
        """About the shortest L ``task`` fits in (its fixed parts, with some room)."""
        rng = np.random.default_rng(0)
        for L in (2 ** k for k in range(5, 31)):
            try:
                self._example(task, L, 0.5 if task in NEEDLE_TASKS else None, rng)
                return L
            except TooShort:
                continue
        return MAX_POSITIONS

    def examples(self, task: str, L: int, depth: float | None, n: int, seed: int) -> list[RulerExample]:
        """``n`` examples, deterministic in (seed, task, L, depth)."""
        d = -1 if depth is None else int(round(depth * 1e6))
        rng = np.random.default_rng([seed, TASKS.index(task), int(L), d + 1])
        return [self.example(task, L, depth, rng) for _ in range(n)]

    def max_token_id(self) -> int:
        """The largest id an example can hold: its text is ASCII (the vocabulary's bytes)."""
        return int(max(self.enc(chr(c)).max() for c in range(32, 127)) if self.tokenizer.path
                   else max(self._filler.cycle.max(), ord("z"), ord("Z"), ord("\n")))


# ---------------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------------


def score_answer(answer: str, expected: Sequence[str]) -> tuple[float, bool]:
    """(recall: the share of ``expected`` in ``answer``, case folded; exact match: all of them)."""
    text = answer.lower()
    hits = [e.lower() in text for e in expected]
    return (sum(hits) / len(hits) if hits else 0.0), all(hits)


@dataclasses.dataclass(frozen=True)
class RulerOptions:
    """What ``evaluate`` measures; ``validate`` names the flag of a value out of range."""

    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    samples: int = 4  # examples per cell
    batch_size: int = 1  # examples decoded together
    piece_len: int = 2048  # prompt tokens per prefill call
    seed: int = 0
    value_digits: int = 7

    def validate(self) -> RulerOptions:
        if not self.tasks:
            raise ValueError(f"--ruler_tasks: empty; give some of {', '.join(TASKS)} (or all)")
        for t in self.tasks:
            if t not in TASKS:
                raise ValueError(f"--ruler_tasks: {t!r} is not one of {', '.join(TASKS)} (or all)")
        if not self.lengths:
            raise ValueError("--ruler_lengths: empty; give e.g. --ruler_lengths=4K,32K,128K")
        if any(self.tasks.count(t) > 1 for t in self.tasks) or len(set(self.lengths)) < len(self.lengths):
            raise ValueError("--ruler_tasks / --ruler_lengths: each task and each length once")
        if not self.depths:
            raise ValueError("--ruler_depths: empty; give e.g. --ruler_depths=0,0.5,1")
        for flag, v in (("--ruler_samples", self.samples), ("--batch_size", self.batch_size),
                        ("--piece_len", self.piece_len)):
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{flag}: {v!r} must be an integer >= 1")
        return self

    def cells(self) -> list[tuple[str, int, float | None]]:
        """(task, L, depth) of every cell: the word tasks at depth None only."""
        return [(t, L, d) for t in self.tasks for L in self.lengths
                for d in (self.depths if t in NEEDLE_TASKS else (None,))]


def parse_tasks(values: Sequence[str]) -> tuple[str, ...]:
    """``["niah_single", "vt"]`` or ``["all"]`` -> the tasks; a name not in ``TASKS`` is a
    ValueError naming ``--ruler_tasks``."""
    names = [str(v).strip() for v in values if str(v).strip()]
    if names == ["all"]:
        return TASKS
    for n in names:
        if n not in TASKS:
            raise ValueError(f"--ruler_tasks: {n!r} is not one of {', '.join(TASKS)} (or all)")
    return tuple(names)


def parse_depths(values: Sequence[str]) -> tuple[float, ...]:
    """``["0", "0.5", "1"]`` -> (0.0, 0.5, 1.0); an item that is not a number in [0, 1] is a
    ValueError naming ``--ruler_depths``."""
    return passkey_depths(values, "--ruler_depths",
                          "0 = before all the filler, 1 = right before the question")


def parse_options(tasks: Sequence[str], lengths: Sequence[str], depths: Sequence[str], *,
                  samples: int = 4, batch_size: int = 1, piece_len: int = 2048, seed: int = 0,
                  value_digits: int = 7) -> RulerOptions:
    """The command line's values as checked ``RulerOptions`` (each error names its flag)."""
    return RulerOptions(parse_tasks(tasks), parse_context_lengths(lengths, "--ruler_lengths"),
                        parse_depths(depths) if depths else RulerOptions.depths, samples,
                        batch_size, piece_len, seed, value_digits).validate()


def evaluate(model, suite: RulerSuite, opts: RulerOptions, *, progress: bool = False,
             label: str = "") -> list[dict]:
    """One row per cell (task, L, depth): exact match, recall, samples, the needle's mean actual
    depth, the prompt's mean length, seconds, and ``answers`` (per example: its prompt length,
    expected strings, the model's answer, recall and exact match). ``model``: a HybridLM (or its
    ``Decoder``)."""
    opts.validate()
    decoder = model if isinstance(model, Decoder) else Decoder(model)
    if decoder.vocab_size is not None and suite.max_token_id() >= decoder.vocab_size:
        raise ValueError(f"ruler: {suite.tokenizer_name} gives token id {suite.max_token_id()}, "
                         f"outside [0, {decoder.vocab_size}) = model.vocab_size")
    stops = suite.tokenizer.ids_containing([STOP])
    if decoder.vocab_size is not None:
        stops = [i for i in stops if i < decoder.vocab_size]
    cells = opts.cells()
    examples = {c: suite.examples(*c, opts.samples, opts.seed) for c in cells}
    # One budget of new tokens per length, the most any of its examples needs: with every
    # prompt of a length L tokens long, all its cells share the prefill and step compilations
    # (decoding stops at the newline anyway).
    budget = {L: max(e.max_new_tokens for c in cells if c[1] == L for e in examples[c])
              for L in opts.lengths}
    rows = []
    with tqdm(cells, desc=f"ruler {label}".strip(), unit="cell",
              disable=not (progress and sys.stderr.isatty())) as bar:
        for task, L, d in bar:
            bar.set_postfix(task=task, L=L, depth="-" if d is None else d)
            t0 = time.perf_counter()
            answers = []
            cell = examples[(task, L, d)]
            for batch, n in padded_batches(cell, opts.batch_size):  # the copies not counted
                gen = generate(decoder, [e.prompt_ids for e in batch], budget[L], stop_ids=stops,
                               piece_len=opts.piece_len)
                for e, toks in zip(batch[:n], gen.tokens[:n], strict=True):
                    text = suite.tokenizer.decode(toks).split(STOP)[0]
                    recall, exact = score_answer(text, e.expected)
                    answers.append({"prompt_tokens": len(e.prompt_ids), "expected": list(e.expected),
                                    "answer": text, "recall": recall, "exact": exact,
                                    "needle_depth": e.needle_depth})
            rows.append({
                "task": task, "length": L, "depth": d,
                "exact_match": float(np.mean([a["exact"] for a in answers])),
                "recall": float(np.mean([a["recall"] for a in answers])),
                "samples": len(answers),
                "needle_depth": (None if d is None else
                                 float(np.mean([a["needle_depth"] for a in answers]))),
                "prompt_tokens": float(np.mean([a["prompt_tokens"] for a in answers])),
                "seconds": time.perf_counter() - t0, "answers": answers})
    return rows


# ---------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------


def task_table(rows: Sequence[dict], key: str = "exact_match") -> tuple[list[int], dict]:
    """(lengths, {task: [mean over depths of ``key`` per length]}), and an "average" task."""
    lengths = sorted({r["length"] for r in rows})
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    out = {}
    for t in tasks:
        out[t] = [float(np.mean([r[key] for r in rows if r["task"] == t and r["length"] == L]))
                  for L in lengths]
    out["average"] = [float(np.mean([out[t][i] for t in tasks])) for i in range(len(lengths))]
    return lengths, out


def depth_grid(rows: Sequence[dict]) -> tuple[list[float], list[int], list[list[float | None]]]:
    """(depths, lengths, exact match [depth][length] averaged over the needle tasks)."""
    needle = [r for r in rows if r["depth"] is not None]
    depths = sorted({r["depth"] for r in needle})
    lengths = sorted({r["length"] for r in needle})
    grid = []
    for d in depths:
        line = []
        for L in lengths:
            v = [r["exact_match"] for r in needle if r["depth"] == d and r["length"] == L]
            line.append(float(np.mean(v)) if v else None)
        grid.append(line)
    return depths, lengths, grid


def format_table(report: dict) -> str:
    """Per model: exact match by task x length (mean over depths), then the average."""
    lines = []
    for m in report["models"]:
        lengths, table = task_table(m["rows"])
        head = ["task"] + [f"L={plots.tokens_label(L)}" for L in lengths]
        body = [[t] + [f"{v:.2f}" for v in vals] for t, vals in table.items()]
        widths = [max(len(c) for c in col) for col in zip(head, *body, strict=True)]
        lines += [f"RULER exact match, {m['label']} ({report['samples']} samples per cell, "
                  f"mean over depths)"]
        lines += ["  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))
                  for cells in [head, *body]] + [""]
    return "\n".join(lines).rstrip()


def heatmap_figure(report: dict) -> Figure | None:
    """Exact match of the needle tasks (averaged over them) by depth x length, one panel per
    model side by side; None when no needle task was run."""
    panels = [(m["label"], *depth_grid(m["rows"])) for m in report["models"]]
    panels = [p for p in panels if p[1]]
    if not panels:
        return None
    n = len(panels)
    from matplotlib.figure import Figure  # imported when a figure is made (kimi_k3/plots.py)

    fig = Figure(figsize=(1.2 + 3.0 * n, 3.8), dpi=110)
    grid = fig.add_gridspec(1, n + 1, width_ratios=[1.0] * n + [0.06])
    image = None
    for i, (label, depths, lengths, values) in enumerate(panels):
        ax = fig.add_subplot(grid[0, i])
        cells = np.array([[np.nan if v is None else v for v in row] for row in values])
        ax.set_facecolor("0.85")  # cells with no value
        image = ax.imshow(np.ma.masked_invalid(cells), vmin=0, vmax=1, cmap="viridis",
                          aspect="auto", interpolation="nearest")
        for r in range(cells.shape[0]):
            for c in range(cells.shape[1]):
                if math.isfinite(cells[r, c]):
                    ax.text(c, r, f"{cells[r, c]:.2f}", ha="center", va="center", fontsize=7,
                            color="black" if cells[r, c] > 0.5 else "white")
        ax.set_xticks(range(len(lengths)), [plots.tokens_label(L) for L in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("context length (tokens)")
        if i == 0:
            ax.set_ylabel("needle depth")
    fig.colorbar(image, cax=fig.add_subplot(grid[0, n]), label="exact match")
    tasks = ", ".join(t for t in report["tasks"] if t in NEEDLE_TASKS)
    plots.finish(fig, f"RULER needle tasks ({tasks}), exact match averaged over them; "
                      f"{report['samples']} samples per cell; {report['tokenizer']}")
    return fig


def write_outputs(report: dict, workdir: str) -> dict[str, str]:
    """ruler.json, ruler.csv and (with a needle task) ruler_heatmap.png in ``workdir``."""
    os.makedirs(workdir, exist_ok=True)
    paths = {"json": os.path.join(workdir, "ruler.json"),
             "csv": os.path.join(workdir, "ruler.csv")}
    with open(paths["json"], "w") as f:
        json.dump(report, f, indent=1)
    fields = ["model", "task", "length", "depth", "exact_match", "recall", "samples",
              "needle_depth", "prompt_tokens", "seconds"]
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for m in report["models"]:
            w.writerows({"model": m["label"], **r} for r in m["rows"])
    fig = heatmap_figure(report)
    if fig is not None:
        paths["heatmap_png"] = plots.save(fig, os.path.join(workdir, "ruler_heatmap.png"))
    return paths


def new_report(suite: RulerSuite, opts: RulerOptions) -> dict:
    """The report's header; ``evaluate``'s rows go into ``models`` per model."""
    return {"tasks": list(opts.tasks), "lengths": list(opts.lengths), "depths": list(opts.depths),
            "samples": opts.samples, "seed": opts.seed, "value_digits": opts.value_digits,
            "tokenizer": suite.tokenizer_name, "scoring": "greedy decoding to the first "
            "newline; exact match: every expected string in the answer (case folded); recall: "
            "the share of them", "models": []}


# ---------------------------------------------------------------------------------------------
# Training text from the same generator
# ---------------------------------------------------------------------------------------------


def write_training_data(path: str, suite: RulerSuite, tasks: Sequence[str],
                        lengths: tuple[int, int], examples: int, seed: int = 0,
                        eos_id: int = -1) -> int:
    """``examples`` examples (task drawn uniformly from ``tasks``, L uniform in [lo, hi],
    depth uniform in [0, 1]), each its prompt, the reference answer and a newline. With
    ``eos_id`` < 0 a text file (the prompt's ids decoded), for ``data.source='text'``; else a
    token file of uint16 ids with ``eos_id`` after each example, for ``data.source='tokens'``
    with ``data.eos_id``: each example is then a document of its own (``segment_ids``), so no
    row shows the model another example's needle. Returns the tokens (or bytes) written."""
    lo, hi = lengths
    rng = np.random.default_rng([seed, 1])
    stop = suite.enc(STOP)
    if eos_id >= 0 and max(eos_id, suite.max_token_id()) > np.iinfo(np.uint16).max:
        raise ValueError(f"--eos_id: {eos_id} or the tokenizer's ids do not fit uint16")
    with open(path, "wb" if eos_id >= 0 else "w") as f:
        total = 0
        for _ in range(examples):
            task = tasks[int(rng.integers(len(tasks)))]
            depth = float(rng.random()) if task in NEEDLE_TASKS else None
            ex = suite.example(task, int(rng.integers(lo, hi + 1)), depth, rng)
            if eos_id < 0:
                total += f.write(suite.tokenizer.decode(ex.prompt_ids) + ex.answer + STOP)
                continue
            ids = np.concatenate([ex.prompt_ids, suite.enc(ex.answer), stop, [eos_id]])
            f.write(ids.astype(np.uint16).tobytes())
            total += len(ids)
    return total


def training_batch(suite: RulerSuite, tasks: Sequence[str], lengths: tuple[int, int],
                   batch_size: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Rows for ``train``: task uniform among ``tasks``, L uniform in [lo, hi], depth uniform in
    [0, 1]; each row its prompt, the reference answer and a newline, right-padded with 0 to
    one length (causality keeps the padding from the real tokens). Returns inputs_NxT,
    targets_NxT (the next token) and weights_NxT: 1 where the next token is the answer's or the
    newline after it, as ``kimi_k3.mqar.generate`` gives them."""
    lo, hi = lengths
    rows = []
    for _ in range(batch_size):
        task = tasks[int(rng.integers(len(tasks)))]
        depth = float(rng.random()) if task in NEEDLE_TASKS else None
        ex = suite.example(task, int(rng.integers(lo, hi + 1)), depth, rng)
        rows.append((ex.prompt_ids, np.concatenate([suite.enc(ex.answer), suite.enc(STOP)])))
    T = max(len(p) + len(a) for p, a in rows) - 1
    out = {"inputs_NxT": np.zeros((batch_size, T), np.int32),
           "targets_NxT": np.zeros((batch_size, T), np.int32),
           "weights_NxT": np.zeros((batch_size, T), np.float32)}
    for i, (prompt, answer) in enumerate(rows):
        seq = np.concatenate([prompt, answer])
        out["inputs_NxT"][i, : len(seq) - 1] = seq[:-1]
        out["targets_NxT"][i, : len(seq) - 1] = seq[1:]
        out["weights_NxT"][i, len(prompt) - 1 : len(seq) - 1] = 1.0
    return out


def train(model, suite: RulerSuite, opt_cfg, *, steps: int, batch_size: int,
          lengths: tuple[int, int], tasks: Sequence[str], seed: int = 0,
          progress: bool = False):
    """(the model trained ``steps`` steps on ``training_batch`` rows, the last loss): the loss on
    the answers only (``kimi_k3.mqar.masked_cross_entropy``), as ``kimi_k3.passkey`` trains.
    ``opt_cfg``: ``config.opt``."""
    rng = np.random.default_rng([seed, 2])
    return train_on_answers(model, opt_cfg,
                            lambda _: training_batch(suite, tasks, lengths, batch_size, rng),
                            steps=steps, desc="ruler training", progress=progress)


def save_run(config, model, workdir: str, step: int) -> str:
    """A run folder eval.py, generate.py and train.py read: ``workdir/config.py`` and a
    checkpoint at ``step`` holding ``model``'s parameters and a fresh optimizer state, in the
    trainer's layout (as ``python -m kimi_k3.hf import`` writes one). Returns the step folder."""
    spec = run_spec(config)
    layout = state_layout(spec, mesh_lib.make_mesh(spec.mesh))
    shardings = layout.state_shardings
    params = jax.device_put(split_model(model)[1], shardings["params"])
    with layout.context():
        opt_state = jax.jit(layout.tx.init, out_shardings=shardings["opt_state"])(params)
    state = {"params": params, "opt_state": opt_state,
             "step": jax.device_put(jnp.asarray(step, jnp.int32), shardings["step"]),
             "rng": jax.device_put(jax.random.PRNGKey(spec.seed + 1), shardings["rng"])}
    ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), spec.checkpoint)
    try:
        ckpt.save(step, state, {"position": 0})
    finally:
        ckpt.close()
    write_config(config, workdir, step)
    return os.path.join(workdir, "checkpoints", str(step))


def build_parser() -> argparse.ArgumentParser:
    """``python -m kimi_k3.ruler write|train``."""
    p = argparse.ArgumentParser(prog="python -m kimi_k3.ruler",
                                description="RULER-style examples for training.")
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--tasks", default="niah_single",
                        help=f"comma-separated, of {', '.join(TASKS)}")
    common.add_argument("--lengths", default="384,512",
                        help="prompt tokens: L, or lo,hi (uniform)")
    common.add_argument("--value_digits", type=int, default=7)
    common.add_argument("--seed", type=int, default=1)
    w = sub.add_parser("write", parents=[common],
                       help="examples and their answers as a file for train.py")
    w.add_argument("--out", required=True, help="the file to write")
    w.add_argument("--examples", type=int, default=20_000)
    w.add_argument("--tokenizer", default="", help="as data.tokenizer; default: bytes")
    w.add_argument("--eos_id", type=int, default=-1,
                   help="write uint16 token ids with this id after each example (for "
                        "data.source='tokens', data.eos_id); default: text")
    t = sub.add_parser("train", parents=[common],
                       help="train a config's model on the answers, save a run folder")
    t.add_argument("--config", required=True, help="a config file, path[:arg]")
    t.add_argument("--workdir", required=True, help="the run folder to write (a new one)")
    t.add_argument("--steps", type=int, default=0, help="default: the config's train.steps")
    t.add_argument("--checkpoint", default="init",
                   help="the weights to start from: init, or a run or step folder of this config")
    t.add_argument("--batch_size", type=int, default=16)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    """``write``: training data for train.py. ``train``: a config's model (fresh weights, or
    ``--checkpoint``'s) trained on the answers of generated examples (``train``), saved as a
    run folder (``save_run``) that ``eval.py --checkpoint=WORKDIR --ruler_tasks=...`` reads."""
    a = build_parser().parse_args(argv)
    lengths = parse_context_lengths(a.lengths.split(","), "--lengths")
    tasks = parse_tasks(a.tasks.split(","))
    if a.command == "write":
        suite = RulerSuite(TextTokenizer(a.tokenizer), a.value_digits)
        n = write_training_data(a.out, suite, tasks, (lengths[0], lengths[-1]), a.examples,
                                a.seed, a.eos_id)
        unit = "tokens, uint16" if a.eos_id >= 0 else "characters"
        print(f"wrote {a.examples} examples ({n:,} {unit}) to {a.out}")
        return
    config = load_config(a.config)
    steps = a.steps or int(config.train.steps)
    if os.path.isdir(os.path.join(a.workdir, "checkpoints")):
        raise SystemExit(f"--workdir: {a.workdir!r} already holds checkpoints; train into a new "
                         f"folder")
    suite = RulerSuite(TextTokenizer(config.data.get("tokenizer", "")), a.value_digits)
    quiet_library_logs()
    model, start = load_model(config, a.checkpoint)
    start = start or 0
    t0 = time.perf_counter()
    model, loss = train(model, suite, config.opt, steps=steps, batch_size=a.batch_size,
                        lengths=(lengths[0], lengths[-1]), tasks=tasks, seed=a.seed,
                        progress=True)
    step_dir = save_run(config, model, check_workdir(a.workdir), start + steps)
    print(f"trained {steps} steps in {time.perf_counter() - t0:.0f} s (answer loss "
          f"{loss:.3f} nats per token); saved {step_dir}")


if __name__ == "__main__":
    main()
