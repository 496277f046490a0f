r"""Decoding: prompts in, continuations out (greedy, temperature, top-k or nucleus sampling),
and the body of the ``generate.py`` command.

    from kimi_k3.generate import Sampling, generate

    out = generate(model, [[72, 105], [68, 101, 102, 32]], max_new_tokens=32)     # greedy
    out = generate(model, prompts, 32, sampling=Sampling(temperature=0.8, top_p=0.95, top_k=50),
                   stop_ids=(10,), seed=1, num_samples=4)
    out.tokens[j]    # int32 [n_j]: continuation j's new tokens, its stop id last if it met one
    out.finish[j]    # "stop" (met a stop id) | "length" (max_new_tokens reached)
    out.prompt_index(j), out.sample_index(j)   # continuation j = sample n of prompt i:
                                               # j = i * num_samples + n

``model`` follows the ``HybridLM`` contract: ``init_cache(B, max_len)``,
``prefill(tokens_BxT, cache, last_only) -> (logits, cache)`` (logits [B, T, V], or [B, 1, V]
after the last token with ``last_only``), ``step(token_B, cache) -> (logits_BxV, cache)``.
A ``Decoder`` holds its jitted functions; pass one instead of the model to reuse them across
calls (an ``nnx.Module``'s are shared by every model of its architecture anyway).

The next token, from the float32 logits z [B, V] at the last position read:

    greedy (temperature = 0)   next = argmax_v z_v
    temperature t > 0          next ~ p = softmax(z / t)
    top-k, top_k = k > 0       keep the k most probable tokens (exactly k: a tie at the k-th is
                               broken by the lower id), first
    top-p, 0 < top_p < 1       then sort p (renormalised over what top-k kept) in decreasing
                               order and keep the shortest head whose mass reaches top_p (the
                               most probable token always; a token tied with the last one kept
                               stays too), renormalise, sample in it

Sample n of prompt i (``num_samples`` per prompt) draws its token at sequence position s with
the key ``fold_in(fold_in(fold_in(key(seed), i), n), s)``: a run is deterministic in (seed,
prompts), and a continuation depends neither on the other prompts of the batch nor on
``num_samples`` (sample 0 with ``num_samples=4`` is the one ``num_samples=1`` gives). Greedy
decoding has one continuation per prompt: ``num_samples > 1`` with it is refused.

One run, for B prompts of lengths L_i and N = ``max_new_tokens``:

    cache = init_cache(B, max_i L_i + N)       KDA state + conv tails (fixed size), MLA latents
    prefill of the prompts, in pieces of ``piece_len`` tokens     jitted, the cache donated
    decode: choose, record, step, in a loop on the device,         jitted, the cache donated
            DECODE_CALL_STEPS positions per call, until every row is done

A step (``HybridLM.step``) reads each weight once, in the compute dtype the ``Decoder`` holds
it in, each cache entry once, and copies no cache: its time is bounded below by those bytes
over the card's bandwidth (``benchmarks/decode_bench.py`` prints the floor and the multiple).

**Prompts of different lengths: lockstep.** The cache keeps one position counter for all rows
(MLA writes every row's latent at the same slot and masks the keys by it), and there is no
padding mask, so every row must hold a real token at every position the batch has passed.
The rows therefore advance together:

1. the common prefix, the first L_min = min_i L_i tokens of every prompt, is prefilled
   together;
2. then one ``step`` per position s = L_min, L_min + 1, ...: row i feeds its own prompt
   token s while s < L_i (what it would have sampled there is dropped), and from then on the
   tokens it samples;
3. until every row has N new tokens or has met a stop id (a finished row keeps stepping with
   the others; what it produces is dropped).

The tokens are chosen, recorded and fed to the next step on the device, in one while loop
(``Decoder.decode``: ``choose_and_record``, then ``HybridLM.step``): the host is not in the
loop, so a step costs the device's time, not the host's time to launch its kernels. The host
queues the next call before it reads how far the last one got (a call after the loop has
ended returns at once). A stop ends the loop after the step that reads the stopping token, so
that step's logits are dropped.

Row i's sequence is its prompt followed by its own samples, nothing in between, so it decodes
exactly as it would alone (tests/test_generate.py checks this against one prompt at a time).
The cost is max_i L_i - L_min single-token steps for the longer prompts' tails: give prompts
of very different lengths to separate calls (prefill is much faster than steps).

**The cache must fit.** Before anything is allocated, ``check_cache_fits`` sizes the cache for
B rows of max_i L_i + N positions (``jax.eval_shape``: the MLA latents grow with the positions,
the KDA state does not) and refuses, naming ``--max_new_tokens``, a cache that with the weights
exceeds the device's memory (``runtime.device_memory_bytes``; on a CPU, which reports none,
the host's physical memory), saying how many new tokens would fit. It is a necessary bound, not
a sufficient one: the attention over the cache needs working memory on top.

**Prompt text and bytes** (``encode_prompt``). A command line is bytes; Python hands them over
as text, each byte that is not UTF-8 kept as an escaped surrogate. A byte-level model (no
``data.tokenizer``) takes a prompt's bytes as they were given, UTF-8 or not; a tokenizer takes
text only, so a prompt that is not UTF-8 is refused naming ``--prompt``, the prompt and the
byte (give its ids with ``--prompt_ids`` instead).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from kimi_k3.checkpoint import INIT_CHECKPOINT, load_model, resolve_step_dir
from kimi_k3.data import TextTokenizer, first_bad_id
from kimi_k3.eval_scoring import align_cache
from kimi_k3.layers.fused import fuse_for_decoding
from kimi_k3.model import MAX_POSITIONS, HybridLM
from kimi_k3.model_state import empty_cache_fn
from kimi_k3.runtime import device_memory_bytes, quiet_library_logs

# ---------------------------------------------------------------------------------------------
# Choosing the next token
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen (module docstring). ``temperature = 0`` is greedy;
    ``top_k = 0`` and ``top_p = 1`` keep every token."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @classmethod
    def from_flags(cls, temperature: float | None, top_p: float | None,
                   top_k: int | None = None) -> Sampling:
        """The command line's rule: greedy unless ``--temperature``, ``--top_p`` or
        ``--top_k`` is given; ``--top_p`` or ``--top_k`` without ``--temperature`` samples at
        temperature 1."""
        if temperature is None:
            temperature = 0.0 if top_p is None and top_k is None else 1.0
        return cls(float(temperature), 1.0 if top_p is None else float(top_p),
                   0 if top_k is None else top_k).validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> Sampling:
        t, p, k = self.temperature, self.top_p, self.top_k
        if not (math.isfinite(t) and t >= 0):
            raise ValueError(f"--temperature: {t!r} must be a finite number >= 0 (0 = greedy)")
        if not (math.isfinite(p) and 0 < p <= 1):
            raise ValueError(f"--top_p: {p!r} must lie in (0, 1] (1 = the whole vocabulary)")
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 0:
            raise ValueError(f"--top_k: {k!r} must be an integer >= 0 (0 = the whole "
                             f"vocabulary)")
        for flag, value, off in (("--top_p", p, p == 1), ("--top_k", k, k == 0)):
            if t == 0 and not off:
                raise ValueError(f"{flag}: {value} has no effect with --temperature=0 (greedy); "
                                 f"give a temperature > 0, or leave --temperature out to sample "
                                 f"at 1")
        return self


GREEDY = Sampling()


def nucleus_mask(logits_BxV: jax.Array, top_p) -> jax.Array:
    """bool [B, V]: the tokens top-p keeps. With p = softmax(logits) sorted in decreasing order
    p_(1) >= p_(2) >= ..., token (j) is kept when the mass before it, sum_{i<j} p_(i), is below
    ``top_p``; a token whose logit equals the smallest kept one is kept too; ``top_p >= 1``
    keeps every token (float rounding of the sum never drops one)."""
    sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    n_keep_B = jnp.maximum(jnp.sum(before_BxV < top_p, axis=-1), 1)
    cutoff_B = jnp.take_along_axis(sorted_BxV, n_keep_B[:, None] - 1, axis=-1)
    return (logits_BxV >= cutoff_B) | (top_p >= 1.0)


@jax.jit
def _argmax(logits_BxV):
    return jnp.argmax(logits_BxV.astype(jnp.float32), axis=-1).astype(jnp.int32)


def top_k_mask(logits_BxV: jax.Array, k: int) -> jax.Array:
    """bool [B, V]: the ``k`` largest logits of each row, exactly k of them (``lax.top_k``: a
    tie at the k-th breaks toward the lower id); every token when k = 0 or k >= V."""
    B, V = logits_BxV.shape
    if k <= 0 or k >= V:
        return jnp.ones((B, V), bool)
    _, idx_Bxk = jax.lax.top_k(logits_BxV, k)
    return jnp.zeros((B, V), bool).at[jnp.arange(B)[:, None], idx_Bxk].set(True)


@functools.partial(jax.jit, static_argnames="top_k")
def _sample(logits_BxV, key, position, temperature, top_p, top_k=0):
    scaled_BxV = logits_BxV.astype(jnp.float32) / temperature
    scaled_BxV = jnp.where(top_k_mask(scaled_BxV, top_k), scaled_BxV, -jnp.inf)
    scaled_BxV = jnp.where(nucleus_mask(scaled_BxV, top_p), scaled_BxV, -jnp.inf)
    if key.ndim == 0:  # one key: the rows draw independently from it
        return jax.random.categorical(jax.random.fold_in(key, position),
                                      scaled_BxV).astype(jnp.int32)
    draw = lambda k, z: jax.random.categorical(jax.random.fold_in(k, position), z)
    return jax.vmap(draw)(key, scaled_BxV).astype(jnp.int32)


def sample_tokens(logits_BxV: jax.Array, key: jax.Array, position: int, sampling: Sampling) -> jax.Array:
    """int32 [B]: the next token of each row from its logits [B, V] (module docstring), with the
    randomness of sequence ``position``: ``fold_in(key, position)`` for one ``key`` (the rows
    draw independently from it), or row b's ``fold_in(key[b], position)`` for keys [B]. Jitted;
    the temperature and top_p are traced, so they share one compilation (one per top_k)."""
    if sampling.greedy:
        return _argmax(logits_BxV)
    return _sample(logits_BxV, key, position, jnp.float32(sampling.temperature),
                   jnp.float32(sampling.top_p), top_k=int(sampling.top_k))


# ---------------------------------------------------------------------------------------------
# The jitted model calls
# ---------------------------------------------------------------------------------------------


def choose_and_record(logits_BxV, book: dict, rows: dict, *, greedy: bool, top_k: int):
    """The token of every row at position s = ``book["s"]`` and the book after it (module
    docstring, "lockstep"): (token [B] int32, book).

    ``rows`` (``loop_rows``) holds what does not change: each row's prompt length, its prompt
    tokens from L_min on, the stop ids, the keys and sampling numbers, N. ``book`` is what
    does: s, the new tokens [B, N], how many each row has, whether it is done and whether it
    met a stop. Row i feeds its prompt token while s < L_i; after that its chosen token is
    recorded, unless it is done."""
    s = book["s"]
    if greedy:
        sampled_B = _argmax(logits_BxV)
    else:
        sampled_B = _sample(logits_BxV, rows["key"], s, rows["temperature"], rows["top_p"],
                            top_k=top_k)
    prompt_BxP = rows["prompt_BxP"]
    in_prompt_B = s < rows["lengths_B"]
    column = jnp.clip(s - rows["first"], 0, prompt_BxP.shape[1] - 1)
    token_B = jnp.where(in_prompt_B, prompt_BxP[:, column], sampled_B)
    active_B = ~in_prompt_B & ~book["done_B"]
    out_BxN, n_B = book["out_BxN"], book["n_B"]
    row_B, col_B = jnp.arange(out_BxN.shape[0]), jnp.minimum(n_B, out_BxN.shape[1] - 1)
    out_BxN = out_BxN.at[row_B, col_B].set(jnp.where(active_B, token_B, out_BxN[row_B, col_B]))
    n_B = n_B + active_B
    hit_B = active_B & jnp.isin(token_B, rows["stops"])
    return token_B, {"s": s + 1, "out_BxN": out_BxN, "n_B": n_B,
                     "stopped_B": book["stopped_B"] | hit_B,
                     "done_B": book["done_B"] | hit_B | (active_B & (n_B >= out_BxN.shape[1]))}


def _decoder_fns(get_model: Callable):
    """(prefill_piece, step, decode): jitted, each donating the cache it is given."""

    def prefill_piece(state, tokens_BxP, cache):
        # The head on the last position only: a long prompt piece never makes [B, P, V] logits.
        logits_Bx1xV, cache = get_model(state).prefill(tokens_BxP, cache, last_only=True)
        return logits_Bx1xV[:, 0], cache

    def step(state, token_B, cache):
        return get_model(state).step(token_B, cache)

    def decode(state, logits_BxV, cache, book, rows, max_steps, greedy, top_k):
        # One while loop on the device: choose, record, step, until max_steps steps are done,
        # the last position's token is to be chosen (it needs no step) or every row is done.
        stop_at = jnp.minimum(book["s"] + max_steps, rows["last"])

        def more(carry):
            return (carry[2]["s"] < stop_at) & ~jnp.all(carry[2]["done_B"])

        def one(carry):
            logits_BxV, cache, book = carry
            token_B, book = choose_and_record(logits_BxV, book, rows, greedy=greedy,
                                              top_k=top_k)
            # the model made inside the loop's body: a step may write its measurements (a
            # mixture's routing counts) into its variables, which must belong to this trace
            logits_BxV, cache = get_model(state).step(token_B, cache)
            return logits_BxV, cache, book

        return jax.lax.while_loop(more, one, (logits_BxV, cache, book))

    return (jax.jit(prefill_piece, donate_argnums=(2,)), jax.jit(step, donate_argnums=(2,)),
            jax.jit(decode, donate_argnums=(2,), static_argnames=("greedy", "top_k")))


@functools.lru_cache(maxsize=16)
def _nnx_decoder_fns(graphdef, treedef):
    """The jitted functions of one architecture (models of the same config share their
    compilations), taking the weights as the flat list of ``treedef``'s leaves: a list's
    arguments are flattened in C++ at each call, an ``nnx.State``'s Variables one by one in
    Python, which at batch 1 is a share of a step's time on the host."""
    return _decoder_fns(lambda leaves: nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves),
                                                 copy=True))


# The parameters every use of which rounds them to the compute dtype first: Dense kernels (the
# MLA's absorbed W_uk and W_uv read theirs and round them too) and the embedding table (the
# lookup rounds its rows, the tied head its matrix). A router keeps its float32 kernel: it
# chooses experts in float32.
MATMUL_WEIGHTS = ("kernel", "embedding")
FULL_PRECISION = ("router",)


def matmul_weights_in(state, dtype):
    """``state`` (an ``nnx.State``) with each floating ``MATMUL_WEIGHTS`` leaf wider than
    ``dtype`` (outside ``FULL_PRECISION`` modules) rounded to ``dtype``: the weights as the
    model's matmuls read them, so decoding reads half the bytes of float32 master weights and
    computes the same numbers."""
    dtype = jnp.dtype(dtype)
    pure = nnx.to_pure_dict(state)

    def one(path, leaf):
        names = [str(getattr(k, "key", k)) for k in path]
        if (names and names[-1] in MATMUL_WEIGHTS and jnp.issubdtype(leaf.dtype, jnp.floating)
                and not set(names) & set(FULL_PRECISION)
                and jnp.dtype(leaf.dtype).itemsize > dtype.itemsize):
            return leaf.astype(dtype)
        return leaf

    state = jax.tree.map(lambda x: x, state)  # a copy of the structure: the model's stays
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(one, pure))
    return state


def decoding_model(model: nnx.Module, fuse: bool = True) -> nnx.Module:
    """The model a ``Decoder`` runs: ``model``'s weights, those its matmuls read rounded to its
    compute dtype (``matmul_weights_in``) and with ``fuse`` each layer's fusable products as
    one weight (``kimi_k3.layers.fused``). A second model over the same arrays where nothing
    changes (``nnx.merge`` copies no weight): ``model`` itself keeps its separate projections."""
    graphdef, state = nnx.split(model)
    spec = getattr(model, "spec", None)
    if spec is not None:
        state = matmul_weights_in(state, spec.compute_dtype)
    decoding = nnx.merge(graphdef, state)
    if fuse:
        fuse_for_decoding(decoding)
    return decoding


def decode_function(graphdef, state):
    """The jitted decoding loop a ``Decoder`` runs for models of ``graphdef`` whose weights are
    ``state`` (an ``nnx.State``; abstract will do), and the weights as it takes them: (a function
    (weights, logits [B, V], cache, book, rows, max_steps, *, greedy, top_k) -> (logits, cache,
    book), the cache donated; the weights, the list of ``state``'s leaves). ``kimi_k3.aot``
    compiles it for a TPU topology."""
    leaves, treedef = jax.tree.flatten(state)
    return _nnx_decoder_fns(graphdef, treedef)[2], leaves


class Decoder:
    """A model's jitted ``prefill`` (in pieces) and ``step``, the cache donated to each call, so
    the KDA state and the MLA latent cache are updated in place (``HybridLM.step``: no cache
    is copied; tests/test_generate.py counts the compiled step's buffers).

    An ``nnx.Module`` is split once into (graphdef, state), so the jitted functions take the
    weights as an argument (the list of the state's arrays: ``_nnx_decoder_fns``) and are
    shared by every model of that graphdef; any other object
    with the ``HybridLM`` methods is traced as it is (test doubles). The weights the model
    multiplies in its compute dtype (``matmul_weights_in``) are held in that dtype, rounded
    once here: a step then reads each weight once, in the dtype its matmul takes, and the
    numbers are those of the model as given. With ``fuse`` (the default) each layer's
    products that read one input are held as one weight, and KDA's two low-rank ups as one
    batched weight (``kimi_k3.layers.fused``): the same sums in fewer, larger kernels, which
    is what a batch-1 step's time goes to. The model given is left as it is.
    """

    def __init__(self, model, fuse: bool = True):
        self.model = model
        self._init_cache = empty_cache_fn(model)
        spec = getattr(model, "spec", None)
        self.vocab_size = None if spec is None else int(spec.vocab_size)
        if isinstance(model, nnx.Module):
            self._graphdef, state = nnx.split(decoding_model(model, fuse))
            self._state, self._treedef = jax.tree.flatten(state)  # weights: a list of arrays
            self._prefill, self._step, self._decode = _nnx_decoder_fns(self._graphdef,
                                                                       self._treedef)
        else:
            self._graphdef = self._state = self._treedef = None
            self._prefill, self._step, self._decode = _decoder_fns(lambda state: model)

    def init_cache(self, batch_size: int, max_len: int):
        return self._init_cache(batch_size, max_len)

    @property
    def state(self):
        """The weights as this decoder holds them, as an ``nnx.State`` (None for a model that
        is not an ``nnx.Module``)."""
        return None if self._treedef is None else jax.tree.unflatten(self._treedef, self._state)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights as this decoder holds them (what a step reads of them; 0 for
        a model that is not an ``nnx.Module``)."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self._state))

    def prefill(self, tokens_BxT: np.ndarray, cache, piece_len: int,
                on_piece: Callable[[], None] | None = None):
        """(logits [B, V] after the last of the T tokens, the cache after them). T >= 1 tokens
        go in pieces of ``piece_len`` (the last piece may be shorter: one more compilation)."""
        tokens_BxT = np.asarray(tokens_BxT, np.int32)
        T = tokens_BxT.shape[1]
        if T < 1:
            raise ValueError("Decoder.prefill: needs at least one token per row")
        P = min(piece_len, T)
        first = jnp.asarray(tokens_BxT[:, :P])
        cache = align_cache(cache, jax.eval_shape(self._prefill, self._state, first, cache)[1])
        logits_BxV = None
        for start in range(0, T, P):
            piece = jnp.asarray(tokens_BxT[:, start : start + P])
            logits_BxV, cache = self._prefill(self._state, piece, cache)
            if on_piece is not None:
                on_piece()
        return logits_BxV, cache

    def step(self, token_B, cache):
        """(logits [B, V] after ``token_B``, the cache after it)."""
        return self._step(self._state, jnp.asarray(token_B, jnp.int32), cache)

    def decode(self, logits_BxV, cache, book: dict, rows: dict, max_steps: int,
               sampling: Sampling):
        """Up to ``max_steps`` steps in one call, a while loop on the device: choose each
        row's token from ``logits_BxV`` (``choose_and_record``), step, repeat; it stops early
        at the last position (``rows["last"]``: its token needs no step) or when every row is
        done. (logits [B, V] after the last step, the cache, the book.) A call after the loop
        has ended does nothing. The host is not in the loop, so a step costs the device's time
        alone."""
        return self._decode(self._state, logits_BxV, cache, book, rows, jnp.int32(max_steps),
                            greedy=sampling.greedy, top_k=int(sampling.top_k))

    def compiled_step(self, token_B, cache):
        """``step`` compiled ahead for these shapes: (a function (token_B, cache) -> (logits,
        cache) that runs this very program, its compiled HLO text), so that a profile's kernels
        can be matched to the program's instructions by name."""
        token_B = jnp.asarray(token_B, jnp.int32)
        program = self._step.lower(self._state, token_B, cache).compile()
        return (lambda tok, c: program(self._state, jnp.asarray(tok, jnp.int32), c),
                program.as_text())

    def pieces(self, T: int, piece_len: int) -> int:
        """The prefill calls ``prefill`` makes for T tokens."""
        return -(-T // min(piece_len, T))


# ---------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Generation:
    """What ``generate`` returns: per continuation j (sample n of prompt i, j = i x
    ``num_samples`` + n), its new tokens and why it stopped."""

    tokens: list[np.ndarray]  # int32 [n_j], n_j <= max_new_tokens; a stop id is the last token
    finish: list[str]  # "stop" | "length"
    prompt_lengths: list[int]  # per prompt
    prefill_seconds: float  # the common prefix, compilation included
    decode_seconds: float  # the steps, compilation included
    steps: int  # steps (one position of every row each; after a stop, one unused)
    num_samples: int = 1  # continuations per prompt

    def prompt_index(self, j: int) -> int:
        return j // self.num_samples

    def sample_index(self, j: int) -> int:
        return j % self.num_samples

    def summary(self) -> str:
        new = sum(len(t) for t in self.tokens)
        rate = new / self.decode_seconds if self.decode_seconds > 0 else math.nan
        samples = f" x {self.num_samples} samples" if self.num_samples > 1 else ""
        return (f"{len(self.prompt_lengths)} prompt(s){samples} of {min(self.prompt_lengths)}-"
                f"{max(self.prompt_lengths)} tokens; {new} new tokens in {self.steps} steps; "
                f"prefill {self.prefill_seconds:.2f} s, decoding {self.decode_seconds:.2f} s "
                f"({rate:.1f} new tokens/s, compilation included)")


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int | None,
                  name: str = "prompts") -> list[np.ndarray]:
    """The prompts as int32 arrays. Raises ValueError naming ``name`` (the argument or flag the
    prompts came from) for no prompt, an empty prompt, or a token id outside [0, vocab_size)
    (the first bad id, its prompt and its position)."""
    if len(prompts) == 0:
        raise ValueError(f"{name}: no prompt given")
    out = []
    for i, p in enumerate(prompts):
        arr = np.asarray(p)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError(f"{name}: prompt {i} is empty or not a flat list of token ids "
                             f"(shape {arr.shape}); every prompt needs at least one token")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{name}: prompt {i} holds {arr.dtype} values, not integer token ids")
        if vocab_size is not None:
            bad = first_bad_id(arr, vocab_size)
            if bad is not None:
                (position,), tok = bad
                raise ValueError(f"{name}: token id {tok} (prompt {i}, position {position}) is "
                                 f"outside [0, {vocab_size}) = model.vocab_size")
        out.append(arr.astype(np.int32))
    return out


def cache_bytes(init_cache: Callable, batch_size: int, max_len: int) -> int:
    """The bytes of ``init_cache(batch_size, max_len)``, from its shapes (nothing allocated)."""
    shapes = jax.eval_shape(lambda: init_cache(batch_size, max_len))
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(shapes))


def memory_limit() -> tuple[int | None, str]:
    """(bytes, what they are): the device's memory, or on a backend that reports none (CPU) the
    host's physical memory; (None, ...) where neither is known."""
    limit = device_memory_bytes()
    if limit:
        return int(limit), "the device's memory"
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the host's memory"
    except (ValueError, OSError, AttributeError):
        return None, "unknown"


def _size(n: int) -> str:
    """Bytes in the unit that reads best: "96 GB", "183 kB"."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"


def check_cache_fits(init_cache: Callable, weight_bytes: int, batch_size: int, prompt_len: int,
                     max_new_tokens: int, flag: str = "--max_new_tokens") -> None:
    """Raises ValueError naming ``flag`` when the cache for ``batch_size`` rows of ``prompt_len``
    + ``max_new_tokens`` positions, with ``weight_bytes`` of weights, exceeds ``memory_limit()``:
    the bytes needed, the memory, and the most new tokens that fit (the cache grows linearly in
    the positions: measured at two lengths)."""
    limit, where = memory_limit()
    if limit is None:
        return
    B, L, N = batch_size, prompt_len, max_new_tokens
    need = cache_bytes(init_cache, B, L + N)
    if need + weight_bytes <= limit:
        return
    per_position = cache_bytes(init_cache, B, L + 2) - cache_bytes(init_cache, B, L + 1)
    if per_position > 0:
        fixed = cache_bytes(init_cache, B, L + 1) - per_position * (L + 1)
        most = (limit - weight_bytes - fixed) // per_position - L
        allowed = (f"at most {most} new tokens fit: give {flag}={most} or less" if most >= 1
                   else "not one new token fits: give fewer or shorter prompts")
    else:  # a cache of fixed size (no MLA layer): no number of new tokens changes it
        allowed = "the cache does not grow with the positions: give fewer prompts"
    weights = f" beside {_size(weight_bytes)} of weights" if weight_bytes else ""
    raise ValueError(f"{flag}: {N} new tokens after the longest prompt ({L} tokens) need a cache "
                     f"of {_size(need)} ({B} prompt{'s' if B > 1 else ''} of up to {L + N} "
                     f"positions){weights}, more than {where} ({_size(limit)}); {allowed}")


def _weight_bytes(model) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(nnx.state(model))) if isinstance(model, nnx.Module) else 0


# Steps per ``Decoder.decode`` call in ``generate``: the progress bar's grain, and what a stop
# can leave queued (the calls after the loop has ended return at once).
DECODE_CALL_STEPS = 64
_choose_last = jax.jit(choose_and_record, static_argnames=("greedy", "top_k"))


def loop_rows(prompts_BxL: np.ndarray, lengths_B: np.ndarray, first: int, max_new_tokens: int,
              stop_ids: np.ndarray, key, sampling: Sampling) -> dict:
    """What ``choose_and_record`` reads and the loop does not change, as device arrays: the
    prompts from position ``first`` (= L_min, prefilled before) on, their lengths, the stop
    ids (-1, which no token is, for none), the sampling keys and numbers, and ``last`` = L_max
    + N - 1, the position of the last token chosen."""
    B, L_max = prompts_BxL.shape
    tail_BxP = prompts_BxL[:, first:] if L_max > first else np.zeros((B, 1), np.int32)
    stops = np.asarray(stop_ids, np.int32) if len(stop_ids) else np.full(1, -1, np.int32)
    return {"prompt_BxP": jnp.asarray(tail_BxP, jnp.int32),
            "lengths_B": jnp.asarray(lengths_B, jnp.int32), "first": jnp.int32(first),
            "last": jnp.int32(L_max + max_new_tokens - 1), "stops": jnp.asarray(stops),
            "key": jnp.zeros((), jnp.uint32) if key is None else key,
            "temperature": jnp.float32(sampling.temperature),
            "top_p": jnp.float32(sampling.top_p)}


def start_book(batch_size: int, max_new_tokens: int, first: int) -> dict:
    """``choose_and_record``'s book before position ``first``: no token chosen yet."""
    B, N = batch_size, max_new_tokens
    return {"s": jnp.int32(first), "out_BxN": jnp.zeros((B, N), jnp.int32),
            "n_B": jnp.zeros((B,), jnp.int32), "stopped_B": jnp.zeros((B,), bool),
            "done_B": jnp.zeros((B,), bool)}


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    sampling: Sampling = GREEDY,
    stop_ids: Sequence[int] = (),
    seed: int = 0,
    piece_len: int = 2048,
    progress: bool = False,
    num_samples: int = 1,
) -> Generation:
    """Continue each prompt (token ids) by up to ``max_new_tokens`` tokens; module docstring.

    ``model``: a ``HybridLM`` (or anything with its methods), or a ``Decoder`` of one.
    ``stop_ids``: a row is done after it emits any of them (kept as its last token).
    ``piece_len``: tokens per prefill call (bounds the memory of the logits and activations).
    ``progress``: a bar on stderr, shown only when stderr is a terminal.
    ``num_samples``: continuations per prompt, each drawn with its own key (module docstring),
    decoded together as rows of one batch; more than 1 needs sampling (greedy's are one).
    """
    dec = model if isinstance(model, Decoder) else Decoder(model)
    sampling = sampling.validate()
    check_num_samples(num_samples, sampling)
    prompt_rows = check_prompts(prompts, dec.vocab_size)
    rows = [r for r in prompt_rows for _ in range(num_samples)]
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise ValueError(f"--max_new_tokens: {max_new_tokens!r} must be an integer >= 1")
    if not (isinstance(piece_len, int) and piece_len >= 1):
        raise ValueError(f"--piece_len: {piece_len!r} must be an integer >= 1")
    lengths = np.array([len(r) for r in rows], np.int64)
    B, N = len(rows), max_new_tokens
    L_min, L_max = int(lengths.min()), int(lengths.max())
    if L_max + N > MAX_POSITIONS:
        raise ValueError(f"--max_new_tokens: the longest prompt ({L_max} tokens) plus {N} new "
                         f"tokens exceeds the cache's {MAX_POSITIONS} positions")
    check_cache_fits(dec.init_cache, _weight_bytes(dec.model), B, L_max, N)
    stops = np.asarray(sorted({int(s) for s in stop_ids}), np.int64)

    prompt_BxL = np.zeros((B, L_max), np.int32)
    for i, r in enumerate(rows):
        prompt_BxL[i, : len(r)] = r
    key = None if sampling.greedy else row_keys(seed, len(prompt_rows), num_samples)
    rows_on_device = loop_rows(prompt_BxL, lengths, L_min, N, stops, key, sampling)
    last = L_max + N - 1

    with tqdm(total=dec.pieces(L_min, piece_len) + last - L_min, desc="generate", unit="call",
              disable=not (progress and sys.stderr.isatty())) as bar:
        t0 = time.perf_counter()
        cache = dec.init_cache(B, L_max + N)
        bar.set_postfix(phase="prefill")
        logits_BxV, cache = dec.prefill(prompt_BxL[:, :L_min], cache, piece_len,
                                        on_piece=lambda: bar.update(1))
        jax.block_until_ready(logits_BxV)
        t1 = time.perf_counter()
        bar.set_postfix(phase="decode")
        decode = functools.partial(dec.decode, rows=rows_on_device, max_steps=DECODE_CALL_STEPS,
                                   sampling=sampling)
        logits_BxV, cache, book = decode(logits_BxV, cache, start_book(B, N, L_min))
        seen = L_min
        while True:
            # The next call is queued before this one's end is read, so the device never waits
            # for the host; after the loop has ended it returns at once.
            queued = decode(logits_BxV, cache, book)
            s, done_B = jax.device_get((book["s"], book["done_B"]))
            bar.update(int(s) - seen)
            seen = int(s)
            logits_BxV, cache, book = queued
            if done_B.all() or s >= last:
                break
        s, done_B = jax.device_get((book["s"], book["done_B"]))
        steps = int(s) - L_min
        if not done_B.all():  # the last position: its token needs no step
            _, book = _choose_last(logits_BxV, book, rows_on_device, greedy=sampling.greedy,
                                   top_k=int(sampling.top_k))
        out_BxN, n_new, stopped = jax.device_get((book["out_BxN"], book["n_B"],
                                                  book["stopped_B"]))
        del cache
        t2 = time.perf_counter()
    return Generation(
        tokens=[out_BxN[i, : n_new[i]].copy() for i in range(B)],
        finish=["stop" if stopped[i] else "length" for i in range(B)],
        prompt_lengths=[len(r) for r in prompt_rows],
        prefill_seconds=t1 - t0,
        decode_seconds=t2 - t1,
        steps=steps,
        num_samples=num_samples,
    )


def row_keys(seed: int, num_prompts: int, num_samples: int) -> jax.Array:
    """Keys [num_prompts x num_samples]: row j = sample n of prompt i (j = i x num_samples + n)
    gets ``fold_in(fold_in(key(seed), i), n)`` (module docstring)."""
    j = jnp.arange(num_prompts * num_samples)
    fold = lambda i, n: jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), i), n)
    return jax.vmap(fold)(j // num_samples, j % num_samples)


def check_num_samples(num_samples, sampling: Sampling) -> None:
    """Raises ValueError naming ``--num_samples`` unless it is an integer >= 1, and > 1 only
    with sampling: greedy decoding has one continuation per prompt."""
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"--num_samples: {num_samples!r} must be an integer >= 1")
    if num_samples > 1 and sampling.greedy:
        raise ValueError(f"--num_samples: {num_samples} continuations of greedy decoding would "
                         f"all be the same one; sample with --temperature, --top_p or --top_k")


# ---------------------------------------------------------------------------------------------
# The generate.py command
# ---------------------------------------------------------------------------------------------


def parse_id_list(text: str, flag: str) -> list[int]:
    """``"1, 2,3"`` -> [1, 2, 3]. Raises ValueError naming ``flag`` and the item that is not an
    integer."""
    out = []
    for item in text.split(","):
        item = item.strip()
        try:
            out.append(int(item))
        except ValueError:
            raise ValueError(f"{flag}: {item!r} in {text!r} is not an integer token id; give "
                             f"comma-separated ids, e.g. {flag}=72,105") from None
    return out


def resolve_checkpoint(checkpoint: str | None, workdir: str | None) -> str:
    """``init``, or the step folder to restore: ``checkpoint`` (a step, checkpoints or run
    folder), else the newest step under ``workdir/checkpoints``. Errors name the flags."""
    if checkpoint == INIT_CHECKPOINT:
        return checkpoint
    if checkpoint:
        return resolve_step_dir(checkpoint)[0]
    if not workdir:
        raise ValueError("--checkpoint: none given, and no --workdir to find one in; pass "
                         "--checkpoint=PATH, --workdir=RUN or --checkpoint=init (untrained weights)")
    own = os.path.join(workdir, "checkpoints")
    try:
        return resolve_step_dir(own)[0]
    except (FileNotFoundError, ValueError) as e:
        raise FileNotFoundError(
            f"--checkpoint: none given and no checkpoint under --workdir's {own!r}; pass "
            f"--checkpoint=PATH (or --checkpoint=init for untrained weights)") from e


def encode_prompt(tokenizer: TextTokenizer, text: str, index: int) -> np.ndarray:
    """``--prompt`` number ``index`` as token ids (module docstring, "Prompt text and bytes"):
    for a byte-level model its bytes as the command line gave them (UTF-8 or not); for a
    tokenizer its text, refusing a prompt that is not UTF-8 with the flag, prompt and byte."""
    try:
        raw = text.encode("utf-8", "surrogateescape")  # argv's undecodable bytes, back as bytes
    except UnicodeEncodeError as e:  # a lone surrogate that stands for no byte
        raise ValueError(f"--prompt: prompt {index} holds {text[e.start]!r} at character "
                         f"{e.start}, which is neither a Unicode character nor a byte; give "
                         f"UTF-8 text, or token ids with --prompt_ids") from None
    if not tokenizer.path:
        return np.frombuffer(raw, np.uint8).astype(np.int32)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompt: prompt {index} is not UTF-8 text (byte 0x{raw[e.start]:02x} "
                         f"at byte {e.start}), and the tokenizer {tokenizer.path!r} takes text "
                         f"only; give the prompt as UTF-8 text, or its token ids with "
                         f"--prompt_ids") from None
    return tokenizer.encode(text)


def describe_weights(path: str, step: int | None) -> str:
    if path == INIT_CHECKPOINT:
        return "weights: untrained (--checkpoint=init, from config.seed)"
    return f"weights: step {step} from {path}"


def main(
    config,
    *,
    prompts: Sequence[str] = (),
    prompt_ids: Sequence[str] = (),
    workdir: str | None = None,
    checkpoint: str | None = None,
    max_new_tokens: int = 64,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    num_samples: int = 1,
    stop_ids: Sequence[str] = (),
    seed: int = 0,
    piece_len: int = 2048,
    progress: bool = True,
    echo: bool = True,
    config_name: str = "--config",
) -> list[str]:
    """generate.py's body: check every flag, restore the model, generate, print.

    ``prompts`` are text (through ``config.data.tokenizer``, bytes without one); ``prompt_ids``
    are comma-separated token ids, one string per prompt. Returns one output per continuation
    (``num_samples`` per prompt, prompt by prompt): its text (a stop id left out) or its ids
    (a stop id included). Prints them on stdout (``format_outputs``): with ``echo`` each
    prompt first, as text or ids as it was given. Everything is checked before the model is
    built, each error naming its flag.
    """
    if config is None:
        raise ValueError("--config: required (the model, and its tokenizer for text prompts)")
    if bool(prompts) == bool(prompt_ids):
        raise ValueError("--prompt / --prompt_ids: give exactly one of them (text, or "
                         "comma-separated token ids); repeat it for a batch of prompts")
    sampling = Sampling.from_flags(temperature, top_p, top_k)
    check_num_samples(num_samples, sampling)
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise ValueError(f"--max_new_tokens: {max_new_tokens!r} must be an integer >= 1")
    if not (isinstance(piece_len, int) and piece_len >= 1):
        raise ValueError(f"--piece_len: {piece_len!r} must be an integer >= 1")
    vocab = int(config.model.vocab_size)
    stops = [i for text in stop_ids if str(text).strip() for i in parse_id_list(str(text), "--stop_ids")]
    for s in stops:
        if not 0 <= s < vocab:
            raise ValueError(f"--stop_ids: {s} is outside [0, {vocab}) = model.vocab_size")
    eos = int(config.data.get("eos_id", -1)) if "data" in config else -1
    if eos >= 0:
        stops.append(eos)

    tokenizer = None
    if prompt_ids:
        rows = check_prompts([parse_id_list(p, "--prompt_ids") for p in prompt_ids], vocab,
                             "--prompt_ids")
    else:
        tokenizer = TextTokenizer(config.data.tokenizer if "data" in config else "")
        tok_name = tokenizer.path or "bytes"
        encoded = [encode_prompt(tokenizer, p, i) for i, p in enumerate(prompts)]
        rows = check_prompts(encoded, vocab, f"--prompt (tokenised by {tok_name})")
    longest = max(len(r) for r in rows)
    if longest + max_new_tokens > MAX_POSITIONS:
        raise ValueError(f"--max_new_tokens: the longest prompt ({longest} tokens) plus "
                         f"{max_new_tokens} exceeds the cache's {MAX_POSITIONS} positions")
    path = resolve_checkpoint(checkpoint, workdir)
    # The cache sized from the model's shapes (nothing built), before any weight is read.
    abstract = nnx.eval_shape(lambda: HybridLM(config.model, rngs=nnx.Rngs(0)))
    check_cache_fits(abstract.init_cache, _weight_bytes(abstract), len(rows) * num_samples,
                     longest, max_new_tokens)

    quiet_library_logs()
    model, step = load_model(config, path, config_name=config_name)
    print(describe_weights(path, step), file=sys.stderr)
    gen = generate(model, rows, max_new_tokens, sampling=sampling, stop_ids=stops, seed=seed,
                   piece_len=piece_len, progress=progress, num_samples=num_samples)
    outputs = []
    for tokens, why in zip(gen.tokens, gen.finish, strict=True):
        if prompt_ids:
            outputs.append(ids_text(tokens))
        else:
            body = tokens[:-1] if why == "stop" else tokens
            outputs.append(tokenizer.decode(body))
    if prompt_ids:
        shown = [ids_text(r) for r in rows]
    else:  # as given; bytes that are not UTF-8 shown as U+FFFD, as in a continuation
        shown = [p.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
                 for p in prompts]
    print(format_outputs(gen, shown, outputs, echo), end="")
    print(gen.summary(), file=sys.stderr)
    return outputs


def ids_text(ids) -> str:
    """Token ids as ``--prompt_ids`` takes them: ``"72,105"``."""
    return ",".join(str(int(t)) for t in ids)


def format_outputs(gen: Generation, prompts: Sequence[str], outputs: Sequence[str],
                   echo: bool = True) -> str:
    """What generate.py prints on stdout. With ``echo``, per prompt:

        --- prompt 0 (4 tokens) ---
        def
        --- continuation (length, 64 new tokens) ---
        fib(n):

    (``--- continuation 2 of 3 (...) ---`` with ``--num_samples=3``). Without, the outputs
    alone, with a header ``--- prompt 0, continuation 2 of 3 (...) ---`` when there are
    several. Each text ends with a newline."""
    lines = []
    n_samples = gen.num_samples
    for j, (text, why) in enumerate(zip(outputs, gen.finish, strict=True)):
        i, n = gen.prompt_index(j), gen.sample_index(j)
        which = "continuation" if n_samples == 1 else f"continuation {n + 1} of {n_samples}"
        about = f"({why}, {len(gen.tokens[j])} new tokens)"
        if echo:
            if n == 0:
                lines += [f"--- prompt {i} ({gen.prompt_lengths[i]} tokens) ---", prompts[i]]
            lines.append(f"--- {which} {about} ---")
        elif len(outputs) > 1:
            lines.append(f"--- prompt {i}" + (f", {which}" if n_samples > 1 else "") +
                         f" {about} ---")
        lines.append(text)
    return "".join(line + "\n" for line in lines)
