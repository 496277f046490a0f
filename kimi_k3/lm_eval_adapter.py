r"""lm-evaluation-harness in process: a model of this repository as an ``lm_eval`` LM, and the
body of ``eval.py --lm_eval_tasks=...``.

    from kimi_k3.lm_eval_adapter import KimiLM, evaluate_tasks
    lm = KimiLM(model, TextTokenizer(config.data.tokenizer), prefix_id=10)
    results = evaluate_tasks(lm, ["my_task"], include_path="tests/fixtures/lm_eval", limit=8)

``KimiLM`` answers the harness's three kinds of request; text becomes ids through the config's
tokenizer (``kimi_k3.data.TextTokenizer``: bytes, a tokenizers JSON or Kimi's tiktoken file)
and the model sees ids only (``TokenEngine``):

- ``loglikelihood(context, continuation)`` -> (sum_t log p(cont_t | context, cont_<t), whether
  greedy decoding gives the continuation: every cont_t is the argmax). The ids are
  ``enc(context) + enc(continuation)``; an empty context is the prefix token alone
  (``prefix_id``: data.eos_id, else the tokenizer's BOS / EOS, else a newline). A request of n
  inputs (ids[:-1]) predicts n targets (ids[1:]); those with n <= ``row_len`` are *packed*:
  best-fit decreasing into rows of ``row_len`` tokens, each request a segment of its own
  (``segment_ids``: the model keeps documents of a row apart: KDA restarts its state, MLA and
  the short convolutions mask other segments), so the padding is only what no request fits,
  at the end of a row. A row batch [B, row_len] goes through one jitted full forward
  (``model(tokens, segment_ids)``), and only the target's log-softmax and the argmax check
  leave the device. A longer request goes through the decoder (``kimi_k3.generate.Decoder``):
  its context prefilled in pieces of ``piece_len``, then one step per continuation token;
- ``loglikelihood_rolling(text)`` -> sum of log p over every token of the text, the first
  predicted from the prefix token, with all the text before each token as its context (no
  window: the harness's "rolling windows" are a model with a short context; this one has
  none). A text of n <= ``row_len`` targets is packed as above; a longer one is scored in
  pieces of ``piece_len`` with the cache carried (``kimi_k3.eval_scoring.Scorer``, what
  eval.py's perplexity at 1M tokens runs), its length padded to a bucket
  (``padded_pieces``) so that texts of many lengths share few compilations;
- ``generate_until(context, gen_kwargs)`` -> text, through ``kimi_k3.generate.generate``
  (greedy unless ``do_sample`` / ``temperature`` say otherwise; ``max_gen_toks``, default
  256). The continuation ends at the first of ``until``'s strings (not included). Decoding
  stops early at the EOS id and at any token whose own text holds a stop string
  (``TextTokenizer.ids_containing``); a stop string that spans tokens is found in the text afterwards.
  Requests are sorted by length and decoded ``batch_size`` at a time.

Multi-host (``jax.process_count() > 1``): process 0 runs the harness; every other process
calls ``follow`` and waits. For each batch of requests the driver broadcasts the token work
(``Channel``); every process scores its share (item i on process i mod P) with its own copy of
the model, and the driver gathers the results. ``evaluate_tasks`` ends the followers' loop when
the harness is done, or fails.

Nothing is downloaded: ``kimi_k3.evaluation.HF_OFFLINE_ENV`` (set by eval.py before this
module, and the harness with it, is imported) keeps Hugging Face's libraries off the network;
tasks read local files (``dataset_path: json`` with ``dataset_kwargs: {data_files: ...}``)
from ``--lm_eval_include``.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import math
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

# The optional [eval] extra: eval.py imports this module only for --lm_eval_tasks.
from lm_eval import evaluator as lm_evaluator
from lm_eval.api.model import LM
from lm_eval.tasks import TaskManager
from tqdm.auto import tqdm

from kimi_k3.data import TextTokenizer
from kimi_k3.eval_scoring import Scorer
from kimi_k3.generate import Decoder, Sampling, generate

DEFAULT_MAX_GEN_TOKS = 256  # the harness's own default for generate_until


# ---------------------------------------------------------------------------------------------
# Packing requests into rows
# ---------------------------------------------------------------------------------------------


def pack_rows(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Item indices per row: best-fit decreasing (each item, longest first, into the fullest
    row it still fits, a new row when none). Every length must be in [1, row_len]."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (tokens left, row), sorted: the best fit by bisection
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = int(lengths[i])
        if not 1 <= n <= row_len:
            raise ValueError(f"pack_rows: item {i} has {n} tokens, outside [1, {row_len}]")
        at = bisect.bisect_left(free, (n, -1))
        if at == len(free):
            rows.append([i])
            left, row = row_len - n, len(rows) - 1
        else:
            left, row = free.pop(at)
            rows[row].append(i)
            left -= n
        if left:
            bisect.insort(free, (left, row))
    return rows


def padded_pieces(n_pieces: int) -> int:
    """The bucket a window of ``n_pieces`` pieces is padded to: the next of 1, 2, 3, 4, 6, 8,
    12, 16, ... (powers of two and 1.5 x them), so at most a third of a window is padding and
    windows of many lengths share a few compilations."""
    if n_pieces <= 2:
        return max(n_pieces, 1)
    p = 1 << (n_pieces - 1).bit_length()  # the next power of two
    return 3 * p // 4 if 3 * p // 4 >= n_pieces else p


@functools.lru_cache(maxsize=16)
def _packed_score_fn(graphdef):
    """(state, tokens [B, T], segment ids [B, T], targets [B, T]) -> (log p(target) [B, T]
    float32, target is the argmax [B, T]); one per architecture."""

    def score(state, tokens_BxT, segments_BxT, targets_BxT):
        logits_BxTxV = nnx.merge(graphdef, state)(tokens_BxT, segments_BxT)
        picked_BxT = jnp.take_along_axis(logits_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
        logp_BxT = picked_BxT - jax.nn.logsumexp(logits_BxTxV, axis=-1)
        return logp_BxT, jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT

    return jax.jit(score)


# ---------------------------------------------------------------------------------------------
# Processes: one drives, the others follow
# ---------------------------------------------------------------------------------------------

OPS = ("done", "loglikelihood", "rolling", "generate")


class Channel:
    """The driver's work, sent to every process, and the results, gathered back.

    ``send(op, meta, ids)``: process 0 passes its op, a JSON-able ``meta`` and a flat int32
    array of token ids; every process (the followers pass nothing) returns the same three.
    ``gather(part_NxK)``: each process's rows (zeros elsewhere) summed over the processes,
    bit for bit: float64 travels as its two 32-bit halves (JAX without x64 would round it to
    float32), and each element is non-zero on one process only. With one process both are the
    identity.
    """

    def __init__(self):
        self.rank, self.size = jax.process_index(), jax.process_count()

    def send(self, op: str = "done", meta=None, ids: np.ndarray | None = None):
        if self.size == 1:
            return op, meta, ids
        blob = json.dumps(meta).encode() if self.rank == 0 else b""
        ids = np.asarray(ids if ids is not None else [], np.int32)
        header = np.array([OPS.index(op), len(blob), ids.size] if self.rank == 0 else [0, 0, 0],
                          np.int32)
        header = np.asarray(multihost_utils.broadcast_one_to_all(header))
        n_blob, n_ids = int(header[1]), int(header[2])
        blob_u8 = np.frombuffer(blob, np.uint8) if self.rank == 0 else np.zeros(n_blob, np.uint8)
        blob_u8 = np.asarray(multihost_utils.broadcast_one_to_all(blob_u8))
        ids = ids if self.rank == 0 else np.zeros(n_ids, np.int32)
        ids = np.asarray(multihost_utils.broadcast_one_to_all(ids))
        return OPS[int(header[0])], json.loads(blob_u8.tobytes().decode()), ids

    def agree(self, ok: bool) -> bool:
        """Process 0's ``ok``, on every process."""
        if self.size == 1:
            return ok
        flag = np.array([int(ok) if self.rank == 0 else 0], np.int32)
        return bool(np.asarray(multihost_utils.broadcast_one_to_all(flag))[0])

    def mine(self, n: int) -> range:
        """The items of ``n`` this process does: i = rank, rank + P, ..."""
        return range(self.rank, n, self.size)

    def gather(self, part_NxK: np.ndarray) -> np.ndarray:
        if self.size == 1:
            return part_NxK
        bits = np.ascontiguousarray(part_NxK, np.float64).view(np.uint32)
        every = np.asarray(multihost_utils.process_allgather(bits))
        return every.sum(axis=0, dtype=np.uint64).astype(np.uint32).view(np.float64)


def _flatten(seqs: Sequence[Sequence[int]]) -> tuple[np.ndarray, list[int]]:
    lengths = [len(s) for s in seqs]
    flat = np.concatenate([np.asarray(s, np.int32) for s in seqs]) if seqs else np.zeros(0, np.int32)
    return flat.astype(np.int32), lengths


def _split(flat: np.ndarray, lengths: Sequence[int]) -> list[np.ndarray]:
    return np.split(np.asarray(flat, np.int32), np.cumsum(lengths)[:-1]) if lengths else []


# ---------------------------------------------------------------------------------------------
# The token-level work
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class TokenEngine:
    """The model's side of the three requests, on token ids (module docstring). ``model``: a
    ``HybridLM``. ``row_len``: tokens per packed row (and the longest request packed);
    ``batch_size``: rows per call, and prompts decoded together; ``piece_len``: tokens per
    prefill call on the long paths."""

    model: object
    row_len: int = 2048
    batch_size: int = 1
    piece_len: int = 2048
    progress: bool = False
    channel: Channel = dataclasses.field(default_factory=Channel)

    def __post_init__(self):
        for name in ("row_len", "batch_size", "piece_len"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"TokenEngine.{name}: {v!r} must be an integer >= 1")
        graphdef, self._state = nnx.split(self.model)
        self._score = _packed_score_fn(graphdef)
        self._decoder = Decoder(self.model)
        self._scorer = Scorer(self.model)

    def _bar(self, total: int, desc: str):
        return tqdm(total=total, desc=desc, unit="call",
                    disable=not (self.progress and sys.stderr.isatty()))

    # -- scoring targets of token sequences ------------------------------------------------

    def score(self, seqs: Sequence[np.ndarray], n_scored: Sequence[int]) -> np.ndarray:
        """float64 [N, 2]: per sequence (its ids, the prefix token included), the summed
        log-probability of its last ``n_scored`` tokens, each given all before it, and 1.0
        when every one of them is the argmax. This process's share only (``Channel.mine``;
        zeros elsewhere)."""
        N = len(seqs)
        out = np.zeros((N, 2))
        short = [i for i in range(N) if len(seqs[i]) - 1 <= self.row_len]
        longer = [i for i in range(N) if len(seqs[i]) - 1 > self.row_len]
        rows = pack_rows([len(seqs[i]) - 1 for i in short], self.row_len)
        batches = [rows[b : b + self.batch_size] for b in range(0, len(rows), self.batch_size)]
        mine_b = [batches[b] for b in self.channel.mine(len(batches))]
        mine_l = [longer[j] for j in self.channel.mine(len(longer))]
        with self._bar(len(mine_b) + len(mine_l), "lm-eval scoring") as bar:
            for batch in mine_b:
                self._score_rows([[short[k] for k in row] for row in batch], seqs, n_scored, out)
                bar.update(1)
            for i in mine_l:
                out[i] = self._score_long(seqs[i], n_scored[i])
                bar.update(1)
        return out

    def _score_rows(self, rows: list[list[int]], seqs, n_scored, out: np.ndarray) -> None:
        B, T = self.batch_size, self.row_len
        tokens = np.zeros((B, T), np.int32)
        targets = np.zeros((B, T), np.int32)
        segments = np.zeros((B, T), np.int32)  # 0: the padding at a row's end
        where = []  # (item, row, start, n)
        for r, row in enumerate(rows):
            at = 0
            for s, i in enumerate(row, 1):
                seq = np.asarray(seqs[i], np.int32)
                n = len(seq) - 1
                tokens[r, at : at + n], targets[r, at : at + n] = seq[:-1], seq[1:]
                segments[r, at : at + n] = s
                where.append((i, r, at, n))
                at += n
        logp_BxT, greedy_BxT = self._score(self._state, jnp.asarray(tokens), jnp.asarray(segments),
                                           jnp.asarray(targets))
        logp_BxT, greedy_BxT = np.asarray(logp_BxT, np.float64), np.asarray(greedy_BxT)
        for i, r, at, n in where:
            k = int(n_scored[i])
            span = slice(at + n - k, at + n)
            out[i] = (logp_BxT[r, span].sum(), float(greedy_BxT[r, span].all()))

    def _score_long(self, seq: np.ndarray, k: int) -> tuple[float, float]:
        """A sequence longer than a row: the context through the decoder's prefill, then one
        step per scored token (log-softmax and argmax of each step's logits)."""
        seq = np.asarray(seq, np.int32)
        T = len(seq)
        # the cache sized to a bucket of pieces: requests of many lengths share its compilations
        P = self.piece_len
        cache = self._decoder.init_cache(1, padded_pieces(-(-T // P)) * P)
        logits_1xV, cache = self._decoder.prefill(seq[None, : T - k], cache, self.piece_len)
        logp, greedy = 0.0, True
        for j in range(T - k, T):
            z = np.asarray(logits_1xV[0], np.float64)
            logp += float(z[seq[j]] - (z.max() + np.log(np.exp(z - z.max()).sum())))
            greedy &= int(np.argmax(z)) == int(seq[j])
            if j + 1 < T:
                logits_1xV, cache = self._decoder.step(seq[j : j + 1], cache)
        return logp, float(greedy)

    def rolling(self, seqs: Sequence[np.ndarray]) -> np.ndarray:
        """float64 [N, 1]: per sequence (the prefix token, then the text), the summed
        log-probability of every token after the first. Up to ``row_len`` targets: packed
        (``score``); longer: the Scorer's pieces, the window padded to ``padded_pieces``."""
        N = len(seqs)
        short = [i for i in range(N) if len(seqs[i]) - 1 <= self.row_len]
        out = np.zeros((N, 1))
        part = self.score([seqs[i] for i in short], [len(seqs[i]) - 1 for i in short])
        out[short, 0] = part[:, 0]
        longer = [i for i in range(N) if len(seqs[i]) - 1 > self.row_len]
        for j in self.channel.mine(len(longer)):
            seq = np.asarray(seqs[longer[j]], np.int32)
            n, P = len(seq) - 1, self.piece_len
            L = padded_pieces(-(-n // P)) * P
            window = np.zeros((1, L + 1), np.int32)
            window[0, : n + 1] = seq  # the padding after the text: causality keeps it out
            nll_1xL = self._scorer.piecewise_nll(window, P)
            out[longer[j], 0] = -float(np.sum(nll_1xL[0, :n], dtype=np.float64))
        return out

    # -- generation ----------------------------------------------------------------------------

    def generate(self, prompts: Sequence[np.ndarray], max_new: int, stop_ids: Sequence[int],
                 sampling: Sampling, seed: int) -> np.ndarray:
        """float64 [N, 1 + max_new]: per prompt, the number of new tokens, then the tokens
        (``kimi_k3.generate.generate``, ``batch_size`` prompts of similar length at a time)."""
        N = len(prompts)
        out = np.zeros((N, 1 + max_new))
        order = sorted(range(N), key=lambda i: (len(prompts[i]), i))
        batches = [order[b : b + self.batch_size] for b in range(0, N, self.batch_size)]
        mine = [batches[b] for b in self.channel.mine(len(batches))]
        with self._bar(len(mine), "lm-eval generating") as bar:
            for batch in mine:
                gen = generate(self._decoder, [prompts[i] for i in batch], max_new,
                               sampling=sampling, stop_ids=stop_ids, seed=seed,
                               piece_len=self.piece_len)
                for i, toks in zip(batch, gen.tokens, strict=True):
                    out[i, 0] = len(toks)
                    out[i, 1 : 1 + len(toks)] = toks
                bar.update(1)
        return out

    # -- the same work on every process ----------------------------------------------------------

    def run(self, op: str, meta, ids: np.ndarray) -> np.ndarray:
        """What every process does for one message of the driver (``Channel.send``), gathered."""
        seqs = _split(ids, meta["lengths"])
        if op == "loglikelihood":
            part = self.score(seqs, meta["n_scored"])
        elif op == "rolling":
            part = self.rolling(seqs)
        elif op == "generate":
            part = self.generate(seqs, meta["max_new"], meta["stop_ids"],
                                 Sampling(**meta["sampling"]), meta["seed"])
        else:
            raise ValueError(f"lm-eval: unknown message {op!r}")
        return self.channel.gather(part)

    def request(self, op: str, meta: dict, seqs: Sequence[Sequence[int]]) -> np.ndarray:
        """The driver's side: send the work to every process, do this process's share, and
        return everyone's results."""
        flat, lengths = _flatten(seqs)
        op, meta, flat = self.channel.send(op, {**meta, "lengths": lengths}, flat)
        return self.run(op, meta, flat)

    def follow(self) -> None:
        """A follower's loop: do each message's share until the driver says it is done."""
        while True:
            op, meta, flat = self.channel.send()
            if op == "done":
                return
            self.run(op, meta, flat)

    def finish(self) -> None:
        """The driver's last message: the followers' loop ends."""
        if self.channel.size > 1:
            self.channel.send("done", {}, np.zeros(0, np.int32))


# ---------------------------------------------------------------------------------------------
# The harness's LM
# ---------------------------------------------------------------------------------------------


def cut_at_stop(text: str, until: Sequence[str]) -> str:
    """``text`` up to the first occurrence of any stop string (not included)."""
    cuts = [text.find(u) for u in until if u and u in text]
    return text[: min(cuts)] if cuts else text


def sampling_from(gen_kwargs: dict) -> Sampling:
    """The harness's generation arguments as a ``Sampling``: greedy unless ``do_sample`` or a
    temperature > 0 asks for sampling (``temperature`` default 1 then, ``top_p``, ``top_k``)."""
    temperature = float(gen_kwargs.get("temperature", 0.0) or 0.0)
    if not gen_kwargs.get("do_sample", False) and temperature == 0.0:
        return Sampling()
    return Sampling(temperature or 1.0, float(gen_kwargs.get("top_p", 1.0) or 1.0),
                    int(gen_kwargs.get("top_k", 0) or 0)).validate()


class KimiLM(LM):
    """A ``HybridLM`` as the harness sees it (module docstring). ``tokenizer``: the config's
    ``TextTokenizer``; ``prefix_id``: the token before an empty context and before a rolling
    text; ``stop_id``: the end-of-text id that ends generation (None: none);
    ``engine``: a ``TokenEngine`` of the model (its ``row_len``, ``batch_size``, ``piece_len``)."""

    def __init__(self, engine: TokenEngine, tokenizer: TextTokenizer, prefix_id: int,
                 stop_id: int | None = None, seed: int = 0):
        super().__init__()
        self.engine, self.tokenizer = engine, tokenizer
        self.prefix_id, self.stop_id, self.seed = int(prefix_id), stop_id, seed
        self.vocab_size = int(engine.model.spec.vocab_size)

    def _encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text).tolist()
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"lm-eval: the tokenizer ({self.tokenizer.path or 'bytes'}) gives "
                             f"id {bad[0]} for {text[:60]!r}, outside [0, {self.vocab_size}) = "
                             f"model.vocab_size")
        return ids

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        seqs, scored = [], []
        for req in requests:
            context, continuation = req.args
            ctx, cont = self._encode(context), self._encode(continuation)
            if not cont:
                raise ValueError(f"lm-eval: an empty continuation for context {context[-60:]!r}")
            seqs.append((ctx or [self.prefix_id]) + cont)
            scored.append(len(cont))
        out = self.engine.request("loglikelihood", {"n_scored": scored}, seqs) if seqs else []
        return [(float(lp), bool(g)) for lp, g in out]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        seqs = [[self.prefix_id] + self._encode(req.args[0]) for req in requests]
        out = self.engine.request("rolling", {}, seqs) if seqs else np.zeros((0, 1))
        return [float(x) for x in out[:, 0]]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for j, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(j)
        for key, members in groups.items():
            kwargs = dict(json.loads(key))
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            sampling = sampling_from(kwargs)
            stops = [i for i in self.tokenizer.ids_containing(until) if i < self.vocab_size]
            if self.stop_id is not None:
                stops.append(int(self.stop_id))
            prompts = [self._encode(requests[j].args[0]) or [self.prefix_id] for j in members]
            meta = {"max_new": max_new, "stop_ids": stops, "seed": self.seed,
                    "sampling": dataclasses.asdict(sampling)}
            out = self.engine.request("generate", meta, prompts)
            for j, row in zip(members, out, strict=True):
                toks = row[1 : 1 + int(row[0])].astype(np.int64).tolist()
                if toks and self.stop_id is not None and toks[-1] == self.stop_id:
                    toks = toks[:-1]
                results[j] = cut_at_stop(self.tokenizer.decode(toks), until)
        return [str(r) for r in results]


# ---------------------------------------------------------------------------------------------
# Running the harness
# ---------------------------------------------------------------------------------------------


def evaluate_tasks(lm: KimiLM, tasks: Sequence[str], include_path: str | None = None, *,
                   limit: float | None = None, num_fewshot: int | None = None,
                   seed: int = 0, manager: TaskManager | None = None) -> dict | None:
    """``lm_eval.simple_evaluate`` of ``tasks`` (names, from the harness's own tasks and the
    YAML files under ``include_path``; ``manager``: their index, made by ``task_manager`` when
    not given) on process 0; the other processes follow until it ends.
    Returns the harness's results dict on process 0, None elsewhere. A task name the harness
    does not know is a ValueError naming ``--lm_eval_tasks`` and what it knows nearby."""
    engine = lm.engine
    if engine.channel.rank != 0:
        engine.follow()
        return None
    try:
        if limit is not None and limit >= 1:
            limit = int(limit)  # a count of documents; below 1 the harness takes a share
        return lm_evaluator.simple_evaluate(
            model=lm, tasks=list(tasks), task_manager=manager or task_manager(tasks, include_path),
            limit=limit, num_fewshot=num_fewshot, bootstrap_iters=0, log_samples=False,
            random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
            fewshot_random_seed=seed)
    finally:
        engine.finish()


def task_manager(tasks: Sequence[str], include_path: str | None) -> TaskManager:
    """The harness's task index for ``tasks``: the YAML files under ``include_path`` alone when
    they hold every task (indexing the harness's own thousands of tasks takes seconds), else
    those and the harness's own. A task found in neither is a ValueError naming
    ``--lm_eval_tasks`` and the tasks under ``include_path``."""
    local = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if local is not None and set(tasks) <= set(local.all_tasks):
        return local
    manager = TaskManager(include_path=include_path)
    missing = [t for t in tasks if t not in set(manager.all_tasks)]
    if missing:
        there = f" (which holds: {', '.join(local.all_tasks[:20])})" if local else ""
        raise ValueError(f"--lm_eval_tasks: {', '.join(missing)} not found among the harness's "
                         f"tasks or under --lm_eval_include={include_path!r}{there}")
    return manager


def summary(results: dict) -> dict:
    """The JSON-able part of the harness's results: per task its metrics, the versions, the
    number of shots, the task configs, the sample counts."""
    keep = ("results", "groups", "versions", "n-shot", "higher_is_better", "n-samples", "configs")
    return json.loads(json.dumps({k: results[k] for k in keep if k in results},
                                 default=lambda o: o if isinstance(o, str | int | float) else str(o)))


def table(results: dict) -> str:
    """One line per (task, metric): its value, NaN-safe."""
    lines = []
    for task, metrics in sorted(results.get("results", {}).items()):
        for name, value in sorted(metrics.items()):
            if name in ("alias", "sample_len") or "_stderr" in name or \
                    not isinstance(value, int | float):
                continue
            shown = f"{value:.4f}" if math.isfinite(value) else str(value)
            lines.append(f"{task:30s} {name:30s} {shown}")
    return "\n".join(lines)
