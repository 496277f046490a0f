"""Decoding: greedy decoding is the argmax of the whole-sequence forward, a batch of prompts of
different lengths decodes each as it would alone, stop ids end a row, top-p and temperature
sample what they promise, the cache is donated to every call, and generate.py's body prints a
continuation. Refused before anything is allocated: a cache that cannot fit in memory, a prompt
that is not UTF-8 for a tokenizer (a byte-level model takes its bytes); a checkpoint of another
model advises the command that loads it, and that command works. (Other bad flags:
tests/test_bad_inputs.py.)"""

from __future__ import annotations

import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kimi_k3 import checkpoint as ckpt_lib
from kimi_k3 import cli, model_state, run_dir
from kimi_k3 import generate as gen_lib
from kimi_k3.config import model_spec
from kimi_k3.data import TextTokenizer
from kimi_k3.generate import Decoder, Sampling, generate, sample_tokens
from tests.helpers import REPO, build, env, tiny_config

# Lengths 8, 4 and 5 in pieces of 4: the batch shares a 4-token prefix; alone, the prompts
# prefill in pieces of 4 (and 1). Every test here uses these shapes, so each function
# compiles once for the whole module.
PROMPTS = [[72, 101, 108, 108, 111, 44, 32, 119], [100, 101, 102, 32], [105, 109, 112, 111, 114]]
PIECE = 4
NEW = 6


@pytest.fixture(scope="module")
def model():
    """A small byte-level HybridLM ("KKM": a scanned group and an unrolled tail layer)."""
    cfg = tiny_config("KKM", vocab=256)
    return build(cfg.model, 3)  # rbg keys, one jitted initialiser


@pytest.fixture(scope="module")
def greedy(model):
    return generate(model, PROMPTS, NEW, piece_len=PIECE)


def test_greedy_tokens_are_the_argmax_of_the_whole_sequence_forward(model, greedy):
    assert greedy.finish == ["length"] * 3 and [len(t) for t in greedy.tokens] == [NEW] * 3
    # One forward over every prompt + its tokens, right-padded to one length: a row's padding
    # comes after all of its tokens, so causality keeps it from changing their logits.
    T = max(len(p) for p in PROMPTS) + NEW
    seq_BxT = np.zeros((3, T), np.int32)
    for i, (p, t) in enumerate(zip(PROMPTS, greedy.tokens, strict=True)):
        seq_BxT[i, : len(p) + NEW] = np.concatenate([p, t])
    logits_BxTxV = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(seq_BxT)))
    for i, (p, t) in enumerate(zip(PROMPTS, greedy.tokens, strict=True)):
        # Token j was chosen from the logits at position len(p) - 1 + j.
        pred_NxV = logits_BxTxV[i, len(p) - 1 : len(p) - 1 + NEW]
        top2 = np.sort(pred_NxV, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 1e-4  # where two logits tie, either is the argmax
        assert clear.any()
        np.testing.assert_array_equal(np.argmax(pred_NxV, -1)[clear], t[clear])
        np.testing.assert_allclose(pred_NxV[np.arange(NEW), t], pred_NxV.max(-1), atol=1e-4)


def test_a_batch_of_different_lengths_decodes_each_prompt_as_alone(model, greedy):
    for p, t in zip(PROMPTS, greedy.tokens, strict=True):
        alone = generate(model, [p], NEW, piece_len=PIECE)
        np.testing.assert_array_equal(alone.tokens[0], t)
    # Lockstep: the 4-token common prefix in one prefill call, then one step per position up to
    # the longest prompt's last new token but one.
    assert greedy.steps == max(map(len, PROMPTS)) + NEW - 1 - min(map(len, PROMPTS))


def test_stop_ids_end_their_row_and_the_others_go_on(model, greedy):
    stop = int(greedy.tokens[1][2])
    out = generate(model, PROMPTS, NEW, stop_ids=[stop], piece_len=PIECE)
    for t, got, why in zip(greedy.tokens, out.tokens, out.finish, strict=True):
        hits = np.nonzero(t == stop)[0]
        cut = hits[0] + 1 if len(hits) else NEW
        np.testing.assert_array_equal(got, t[:cut])  # the stop id is the last token
        assert why == ("stop" if len(hits) else "length")
    assert out.finish[1] == "stop"


def _steps_on_the_host(model, prompts, n_new, sampling, stop_ids=(), seed=0):
    """The lockstep rule (kimi_k3/generate.py's docstring) as the host's loop of one
    ``sample_tokens`` and one ``Decoder.step`` call per position: the reference of the loop on
    the device."""
    dec = Decoder(model)
    B, lengths = len(prompts), np.array([len(p) for p in prompts])
    L_min, L_max = int(lengths.min()), int(lengths.max())
    prompt_BxL = np.zeros((B, L_max), np.int32)
    for i, p in enumerate(prompts):
        prompt_BxL[i, : len(p)] = p
    key = None if sampling.greedy else gen_lib.row_keys(seed, B, 1)
    cache = dec.init_cache(B, L_max + n_new)
    logits_BxV, cache = dec.prefill(prompt_BxL[:, :L_min], cache, PIECE)
    out, finish = [[] for _ in range(B)], [None] * B
    for s in range(L_min, L_max + n_new):
        sampled_B = np.asarray(sample_tokens(logits_BxV, key, s, sampling))
        token_B = np.where(s < lengths, prompt_BxL[:, min(s, L_max - 1)], sampled_B)
        for i in range(B):
            if s >= lengths[i] and finish[i] is None:
                out[i].append(int(token_B[i]))
                if token_B[i] in stop_ids:
                    finish[i] = "stop"
                elif len(out[i]) == n_new:
                    finish[i] = "length"
        if all(f is not None for f in finish):
            return out, finish
        logits_BxV, cache = dec.step(token_B, cache)
    raise AssertionError("every row ends by its last position")


@pytest.mark.parametrize("per_call", [1, 4, 64])
def test_the_loop_on_the_device_is_the_hosts_loop_of_steps(model, greedy, per_call, monkeypatch):
    """generate's loop on the device (Decoder.decode, ``per_call`` positions a call: the calls
    end inside the prompts' tails, between new tokens, or not at all) gives the tokens and
    endings of the host's loop of steps: greedy, and sampled with a stop id that ends one row
    early (the positions and keys of the draws, the prompt tokens fed, the stop)."""
    monkeypatch.setattr(gen_lib, "DECODE_CALL_STEPS", per_call)
    hot = Sampling(temperature=4.0, top_p=0.95, top_k=50)
    want_greedy, _ = _steps_on_the_host(model, PROMPTS, NEW, gen_lib.GREEDY)
    assert [list(t) for t in greedy.tokens] == want_greedy  # the fixture: one call per run
    got = generate(model, PROMPTS, NEW, piece_len=PIECE)
    assert [list(t) for t in got.tokens] == want_greedy
    drawn = generate(model, PROMPTS, NEW, sampling=hot, seed=3, piece_len=PIECE)
    stop = int(drawn.tokens[2][1])
    want, finish = _steps_on_the_host(model, PROMPTS, NEW, hot, stop_ids=(stop,), seed=3)
    out = generate(model, PROMPTS, NEW, sampling=hot, stop_ids=[stop], seed=3, piece_len=PIECE)
    assert [list(t) for t in out.tokens] == want and out.finish == finish
    assert finish[2] == "stop"


def test_sampling_is_deterministic_in_its_seed(model):
    hot = Sampling(temperature=4.0, top_p=0.95)
    a = generate(model, PROMPTS, NEW, sampling=hot, seed=1, piece_len=PIECE)
    b = generate(model, PROMPTS, NEW, sampling=hot, seed=1, piece_len=PIECE)
    c = generate(model, PROMPTS, NEW, sampling=hot, seed=2, piece_len=PIECE)
    assert all(np.array_equal(x, y) for x, y in zip(a.tokens, b.tokens, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a.tokens, c.tokens, strict=True))


def test_num_samples_draws_distinct_continuations_each_with_its_own_key(model):
    """Three samples of one prompt differ; with the same seed the first is the one the prompt
    gets as prompt 0 of another batch (its key is (seed, prompt 0, sample 0)), and a rerun
    repeats them. Greedy decoding has one continuation: more are refused."""
    hot = Sampling(temperature=4.0, top_p=0.95)
    three = generate(model, [PROMPTS[0]], NEW, sampling=hot, seed=1, piece_len=PIECE,
                     num_samples=3)
    assert len(three.tokens) == 3 and three.num_samples == 3 and three.prompt_lengths == [8]
    assert [three.prompt_index(j) for j in range(3)] == [0, 0, 0]
    assert [three.sample_index(j) for j in range(3)] == [0, 1, 2]
    drawn = {tuple(t) for t in three.tokens}
    assert len(drawn) == 3, three.tokens
    batch = generate(model, PROMPTS, NEW, sampling=hot, seed=1, piece_len=PIECE)
    np.testing.assert_array_equal(three.tokens[0], batch.tokens[0])
    again = generate(model, [PROMPTS[0]], NEW, sampling=hot, seed=1, piece_len=PIECE,
                     num_samples=3)
    assert {tuple(t) for t in again.tokens} == drawn
    with pytest.raises(ValueError, match=r"--num_samples: 2 continuations of greedy decoding "
                                         r"would all be the same one"):
        generate(model, PROMPTS, NEW, num_samples=2)
    with pytest.raises(ValueError, match=r"--num_samples: 0 must be an integer >= 1"):
        generate(model, PROMPTS, NEW, sampling=hot, num_samples=0)


def test_the_cache_is_donated_to_every_call(model):
    dec = Decoder(model)
    cache = dec.init_cache(3, max(map(len, PROMPTS)) + NEW)
    _, cache = dec.prefill(np.asarray([p[:PIECE] for p in PROMPTS]), cache, PIECE)
    before = jax.tree.leaves(cache)
    _, after = dec.step(np.zeros(3, np.int32), cache)
    assert all(x.is_deleted() for x in before)  # updated in place, not copied
    assert int(after["pos"]) == PIECE + 1


# ---------------------------------------------------------------------------------------------
# The decoding step: the prefill of one token, in the form that reads each byte once
# ---------------------------------------------------------------------------------------------


def _decoding_model(pattern: str, scan: bool, decode_impl: str, dtype: str = "float32"):
    cfg = tiny_config(pattern, vocab=256)
    cfg.model.scan_layers, cfg.model.mla.decode_impl, cfg.model.dtype = scan, decode_impl, dtype
    return build(cfg.model, 5)


def test_the_step_is_the_prefill_of_one_token_greedy_token_for_token():
    """``HybridLM.step`` (every layer in turn, one-token KDA, the latent cache read in one
    kernel pass, in interpret mode here) against ``prefill`` of one token, the path it
    replaced: from a prefilled random prompt, greedy tokens each way are the same tokens, with
    the same logits and caches (a cache longer than the kernel's blocks, with positions past
    its last whole block). The scanned model's step (stacked caches, the "xla" read) is held
    to the whole-sequence forward by the greedy test above."""
    model = _decoding_model("KM", False, "pallas")
    rng = np.random.default_rng()
    B, L, N = 2, 37, 4
    prompt_BxL = jnp.asarray(rng.integers(0, 256, (B, L)), jnp.int32)
    cache = model.init_cache(B, L + N)
    logits_BxV, cache = nnx.jit(lambda m, t, c: m.prefill(t, c, last_only=True))(
        model, prompt_BxL, cache)
    slow = nnx.jit(lambda m, t, c: m.prefill(t[:, None], c))
    fast = nnx.jit(lambda m, t, c: m.step(t, c))
    slow_logits, slow_cache = logits_BxV[:, 0], cache
    fast_logits, fast_cache = slow_logits, cache
    for _ in range(N):
        token_B = jnp.argmax(fast_logits, -1).astype(jnp.int32)
        np.testing.assert_array_equal(token_B, jnp.argmax(slow_logits, -1))
        slow_logits, slow_cache = slow(model, token_B, slow_cache)
        slow_logits = slow_logits[:, 0]
        fast_logits, fast_cache = fast(model, token_B, fast_cache)
        np.testing.assert_allclose(fast_logits, slow_logits, rtol=1e-4, atol=1e-4)
        assert jax.tree.structure(fast_cache) == jax.tree.structure(slow_cache)
        for a, b in zip(jax.tree.leaves(fast_cache), jax.tree.leaves(slow_cache), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert int(fast_cache["pos"]) == L + N


def test_the_compiled_step_copies_no_cache():
    """The jitted decoding step (``Decoder``: the cache donated) of an unrolled model updates
    every cache array where it lies: its outputs alias the donated cache, no copy of a cache
    array is made, and the temporaries stay a few percent of the cache (the scores of one
    layer)."""
    model = _decoding_model("KMKM", False, "auto")
    B, S = 2, 16384
    cache = jax.eval_shape(lambda: model.init_cache(B, S))
    token_B = jax.ShapeDtypeStruct((B,), jnp.int32)
    latent_shapes = {x.shape for x in jax.tree.leaves(cache) if S in x.shape}
    cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    dec = Decoder(model)

    def measure(fn):
        compiled = fn.lower(dec._state, token_B, cache).compile()
        # every computation: a loop's body is one of its own
        copies = [line for line in compiled.as_text().splitlines() if " copy(" in line
                  and any("[" + ",".join(map(str, s)) + "]" in line for s in latent_shapes)]
        mem = compiled.memory_analysis()
        return copies, mem.temp_size_in_bytes, mem.alias_size_in_bytes

    copies, temp, alias = measure(dec._step)
    assert not copies, copies[:2]
    latent_bytes = min(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache) if S in x.shape)
    assert temp < 0.5 * latent_bytes, (temp, latent_bytes)  # a copy would take at least one
    assert alias == cache_bytes  # every cache array is an output written in place
    # generate's loop of steps on the device carries the cache through its iterations in place
    rows = gen_lib.loop_rows(np.zeros((B, 4), np.int32), np.full(B, 4), 4, 8,
                                  np.array([3]), None, gen_lib.GREEDY)
    book = gen_lib.start_book(B, 8, 4)
    logits_BxV = jax.ShapeDtypeStruct((B, model.spec.vocab_size), jnp.float32)
    loop = lambda fn: types.SimpleNamespace(lower=lambda state, _, c: fn.lower(
        state, logits_BxV, c, book, rows, jnp.int32(4), greedy=True, top_k=0))
    copies, temp, alias = measure(loop(dec._decode))
    assert not copies, copies[:2]
    assert temp < 0.5 * latent_bytes, (temp, latent_bytes)
    assert alias == cache_bytes
    # The measure sees a copy: the same step with the cache kept (not donated) must copy each
    # latent array into its output.
    kept = jax.jit(lambda leaves, t, c: nnx.merge(
        dec._graphdef, jax.tree.unflatten(dec._treedef, leaves)).step(t, c))
    copies, _, alias = measure(kept)
    assert len(copies) == model.pattern.count("M") and alias == 0, (copies, alias)


@pytest.mark.parametrize("pattern,scan,q_lora_rank", [("KKM", True, 0), ("KMK", False, 16)])
def test_the_fused_decoder_computes_the_separate_products_numbers(pattern, scan, q_lora_rank):
    """``Decoder(fuse=True)`` (each layer's products of one input as one weight, KDA's low-rank
    ups as one batched weight; kimi_k3/layers/fused.py) against ``fuse=False``, in bf16: the
    same logits after a prefill in pieces and after each greedy step, the same caches, the
    same bytes of weights (none held twice), every group fused, and the model given untouched.
    A scanned model fuses its stacked weights; an MLA layer with and without a query
    bottleneck."""
    cfg = tiny_config(pattern, vocab=256)
    cfg.model.scan_layers, cfg.model.dtype = scan, "bfloat16"
    cfg.model.mla.q_lora_rank = q_lora_rank
    model = build(cfg.model, 7)
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
    fused, plain = Decoder(model, fuse=True), Decoder(model, fuse=False)
    paths = ["/".join(map(str, p)) for p, _ in
             jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(fused.state))[0]]
    paths = [p.replace("'", "").replace("[", "").replace("]", "") for p in paths]
    kda_layers, mla_layers = pattern.count("K") - (1 if scan else 0), pattern.count("M")
    assert sum(p.endswith("x_in/kernel") for p in paths) == kda_layers + mla_layers, paths
    assert sum(p.endswith("ups/kernel") for p in paths) == kda_layers, paths
    assert not any(p.endswith(("q_proj/kernel", "kv_down/kernel", "f_up/kernel")) for p in paths)
    assert fused.weight_bytes == plain.weight_bytes

    rng = np.random.default_rng()
    prompt_BxL = rng.integers(0, 256, (2, 13))
    runs = []
    for dec in (fused, plain):
        cache = dec.init_cache(2, 20)
        logits_BxV, cache = dec.prefill(prompt_BxL, cache, 4)  # pieces of 4 and a last of 1
        seen = [np.asarray(logits_BxV)]
        for _ in range(4):
            logits_BxV, cache = dec.step(np.asarray(jnp.argmax(logits_BxV, -1)), cache)
            seen.append(np.asarray(logits_BxV))
        runs.append((seen, cache))
    (got, got_cache), (want, want_cache) = runs
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)
        np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1))
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-3, atol=1e-3)
    after = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
    assert jax.tree.structure(after) == jax.tree.structure(before)
    assert all(np.array_equal(a, b) for a, b in
               zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True))


def test_fp8_products_are_not_fused():
    """An FP8 product quantises each operand with its own scale, so a group with one is left as
    separate products; KDA's low-rank ups (never FP8) are fused."""
    cfg = tiny_config("KM", vocab=256)
    cfg.model.scan_layers, cfg.model.matmul_format = False, "fp8"
    dec = Decoder(build(cfg.model, 7))
    names = str(nnx.to_pure_dict(dec.state).keys()) + str(nnx.to_pure_dict(dec.state))
    assert "x_in" not in names and "q_proj" in names and "ups" in names


@pytest.mark.parametrize("gate,num_v_heads,dtype,scan", [("bounded", 0, "float32", False),
                                                         ("softplus", 4, "float32", True),
                                                         ("bounded", 4, "bfloat16", False)])
def test_the_step_kernel_is_the_xla_step(gate, num_v_heads, dtype, scan):
    """``model.kda.step_impl = "pallas"`` (a KDA layer's step after its projections as one kernel,
    pallas_kernels/kda_decode.py, interpret mode) against "xla", on the same weights: from a
    prefilled random prompt, four steps (the XLA step's greedy tokens fed to both) give the same
    logits and caches (both gates; value heads grouped two per query head; a scanned model's
    stacked caches; bf16 compute within its rounding)."""
    models = []
    for impl in ("xla", "pallas"):
        cfg = tiny_config("KKM", vocab=256)
        cfg.model.scan_layers, cfg.model.dtype = scan, dtype
        cfg.model.kda.gate, cfg.model.kda.num_v_heads = gate, num_v_heads
        cfg.model.kda.step_impl = impl
        models.append(build(cfg.model, 11))
    rng = np.random.default_rng()
    prompt_BxL = rng.integers(0, 256, (2, 9))
    decs = [Decoder(model) for model in models]
    caches = [dec.init_cache(2, 16) for dec in decs]
    pairs = [dec.prefill(prompt_BxL, c, 4) for dec, c in zip(decs, caches, strict=True)]
    logits, caches = [p[0] for p in pairs], [p[1] for p in pairs]
    tol = 1e-4 if dtype == "float32" else 3e-2
    for _ in range(4):
        token_B = np.asarray(jnp.argmax(logits[0], -1))  # the XLA step's choice, fed to both
        pairs = [dec.step(token_B, c) for dec, c in zip(decs, caches, strict=True)]
        logits, caches = [p[0] for p in pairs], [p[1] for p in pairs]
        want, got = (np.asarray(x, np.float32) for x in logits)
        # bf16: a few of its roundings (2^-8 each) of the largest logit, where the two forms
        # round their intermediates in different places
        np.testing.assert_allclose(got, want, rtol=tol,
                                   atol=tol if dtype == "float32" else 2**-6 * np.abs(want).max())
        if dtype == "float32":
            np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    for a, b in zip(jax.tree.leaves(caches[1]), jax.tree.leaves(caches[0]), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol if dtype == "float32"
                                   else 2**-5 * max(np.abs(b).max(), 1.0))


def test_the_step_kernel_lowers_for_cuda():
    """The compiled kernel (not interpret mode) lowers to Triton for CUDA at the 1B shapes, both
    gates, and refuses head dims that are not powers of two."""
    from pallas_kernels import kda_decode

    B, H, K, W = 1, 16, 128, 4
    bf, f32 = jnp.bfloat16, jnp.float32
    S = jax.ShapeDtypeStruct
    args = (S((B, H, K), bf), S((B, H, K), bf), S((B, H, K), bf),
            tuple(S((B, W - 1, H, K), bf) for _ in range(3)),
            tuple(S((W, H, K), f32) for _ in range(3)), S((B, H, K), bf), S((B, H), bf),
            S((B, H, K), bf), S((H,), f32), S((H, K), f32), S((B, H, K, K), f32), S((K,), f32))
    for bound in (-5.0, None):
        step = jax.jit(lambda *a, bound=bound: kda_decode.kda_decode_step(
            *a, lower_bound=bound, norm_eps=1e-6, l2_eps=1e-6, out_dtype=bf, interpret=False))
        text = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "xla.gpu.triton" in text and "kda_decode_step" in text
    assert kda_decode.unsupported(128, 128) is None
    assert "K = 96" in kda_decode.unsupported(96, 128)
    cfg = tiny_config("KM")
    cfg.model.kda.step_impl = "triton"
    with pytest.raises(ValueError, match=r"model\.kda\.step_impl.*triton.*xla.*pallas"):
        model_spec(cfg.model)
    cfg.model.kda.step_impl, cfg.model.kda.head_dim = "pallas", 24
    with pytest.raises(ValueError, match=r"model\.kda\.step_impl.*K = 24.*use \"xla\""):
        model_spec(cfg.model, backend="gpu")
    assert model_spec(cfg.model, backend="cpu").kda.step_impl == "pallas"  # interpret mode


def test_the_one_token_kda_step_is_the_recurrence():
    """``kda_step`` against ``kda_recurrent`` on a sequence of one token, float32: the same
    output and state, with value heads grouped over the q/k heads (HV = 2 H)."""
    from kimi_k3.ops.kda_recurrent import kda_recurrent, kda_step

    rng = np.random.default_rng()
    B, H, HV, K = 3, 2, 4, 16
    q, k = (rng.standard_normal((B, 1, H, K)).astype(np.float32) for _ in range(2))
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    v = rng.standard_normal((B, 1, HV, K)).astype(np.float32)
    g = -5.0 * rng.random((B, 1, HV, K)).astype(np.float32)
    beta = rng.random((B, 1, HV)).astype(np.float32)
    S0 = rng.standard_normal((B, HV, K, K)).astype(np.float32)
    want_o, want_S = kda_recurrent(q, k, v, g, beta, scale=0.25, initial_state_BxHVxKxV=S0,
                                   segment_ids_BxT=None)
    o, S = jax.jit(lambda *a: kda_step(*a, scale=0.25))(q[:, 0], k[:, 0], v[:, 0], g[:, 0],
                                                         beta[:, 0], S0)
    np.testing.assert_allclose(o, want_o[:, 0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(S, want_S, rtol=1e-5, atol=1e-5)


def test_the_latent_decode_kernel_reads_the_cache_as_the_definition():
    """``latent_decode_attention`` ("pallas" in interpret mode: the kernel's splits, the few
    positions past its last whole block in XLA, the merge; and "xla") against the softmax
    in float64: random bf16-valued entries, a cache longer than the visible positions, heads
    padded to the kernel's 16, a stacked cache read at one layer. The kernel also lowers for
    CUDA at the 1B model's shapes (16 heads, latent 512 + 64, a 131,077-entry cache)."""
    from kimi_k3.layers.attention import latent_decode_attention
    from pallas_kernels import latent_decode

    rng = np.random.default_rng()
    B, H, R, D, S, n = 2, 3, 32, 16, 1061, 1000
    q_BxHxL = rng.standard_normal((B, H, R + D)).astype(np.float32)
    kv_NxBxSxL = rng.standard_normal((2, B, S, R + D)).astype(jnp.bfloat16).astype(np.float32)
    s = np.einsum("bhl,bsl->bhs", q_BxHxL.astype(np.float64), kv_NxBxSxL[1]) * 0.2
    s[:, :, n:] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bhs,bsr->bhr", p / p.sum(-1, keepdims=True), kv_NxBxSxL[1, :, :, :R])
    for impl in ("pallas", "xla"):
        got = latent_decode_attention(jnp.asarray(q_BxHxL), jnp.asarray(kv_NxBxSxL), jnp.int32(n),
                                      scale=0.2, value_dim=R, impl=impl, layer=1)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=impl)
    S_main, C, P = latent_decode.split_plan(S, B, latent_decode.DEFAULT_TILES)
    assert S_main == S // 32 * 32 < S and P > 1 and C * P >= S_main

    shapes = [jax.ShapeDtypeStruct(x, jnp.bfloat16) for x in ((1, 16, 512), (1, 16, 64),
                                                              (1, 131077, 576))]
    fn = lambda *a: latent_decode.latent_decode_partials(*a, scale=0.1, interpret=False)[:3]
    text = jax.jit(fn).trace(*shapes, jax.ShapeDtypeStruct((), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "latent_decode_attention" in text


# ---------------------------------------------------------------------------------------------
# Choosing the next token
# ---------------------------------------------------------------------------------------------


def test_top_p_keeps_the_nucleus_and_temperature_flattens_the_softmax():
    p = np.array([0.5, 0.3, 0.15, 0.05])
    n = 4000
    logits_BxV = jnp.asarray(np.tile(np.log(p), (n, 1)), jnp.float32)
    key = jax.random.key(0)

    def freqs(sampling):
        tokens = np.asarray(sample_tokens(logits_BxV, key, 7, sampling))
        return np.bincount(tokens, minlength=4) / n

    np.testing.assert_array_equal(freqs(Sampling()), [1, 0, 0, 0])  # greedy
    np.testing.assert_allclose(freqs(Sampling(1.0)), p, atol=0.04)
    flat = np.sqrt(p) / np.sqrt(p).sum()  # softmax(log p / 2)
    np.testing.assert_allclose(freqs(Sampling(2.0)), flat, atol=0.04)
    # top_p = 0.7: 0.5 alone is short of it, 0.5 + 0.3 reaches it: tokens 0 and 1, renormalised.
    np.testing.assert_allclose(freqs(Sampling(1.0, 0.7)), [0.625, 0.375, 0, 0], atol=0.04)
    np.testing.assert_array_equal(freqs(Sampling(1.0, 0.5)), [1, 0, 0, 0])  # 0.5 reaches 0.5
    # Ties with the last token kept stay in.
    mask = gen_lib.nucleus_mask(jnp.asarray([[2.0, 1.0, 1.0, 0.0]]), 0.6)
    np.testing.assert_array_equal(mask, [[True, True, True, False]])
    # top_k = 2: the two most probable, renormalised; then top_p over what top_k kept.
    np.testing.assert_allclose(freqs(Sampling(1.0, top_k=2)), [0.625, 0.375, 0, 0], atol=0.04)
    # top_k = 3 keeps 0.95; top_p = 0.5 of that: 0.5 / 0.95 reaches it alone.
    np.testing.assert_array_equal(freqs(Sampling(1.0, 0.5, top_k=3)), [1, 0, 0, 0])


def test_top_k_keeps_exactly_k_candidates_even_when_tied():
    """Eight tokens of equal probability: top_k keeps exactly k of them (a tie breaks toward
    the lower id), and sampling draws from those k, each about equally often."""
    logits_BxV = jnp.zeros((3000, 8), jnp.float32)
    for k in (1, 3, 7):
        mask = np.asarray(gen_lib.top_k_mask(logits_BxV[:1], k))
        np.testing.assert_array_equal(mask[0], np.arange(8) < k)
    k = 3
    tokens = np.asarray(sample_tokens(logits_BxV, jax.random.key(0), 0, Sampling(1.0, top_k=k)))
    counts = np.bincount(tokens, minlength=8)
    assert set(np.nonzero(counts)[0]) == set(range(k))
    np.testing.assert_allclose(counts[:k] / len(tokens), 1 / k, atol=0.04)
    assert gen_lib.top_k_mask(logits_BxV[:1], 0).all() and gen_lib.top_k_mask(
        logits_BxV[:1], 8).all()  # 0 = off, k >= V = everything


def test_sampling_from_flags():
    assert Sampling.from_flags(None, None) == Sampling(0.0, 1.0)  # greedy
    assert Sampling.from_flags(None, 0.9) == Sampling(1.0, 0.9)  # --top_p alone samples at 1
    assert Sampling.from_flags(0.7, None) == Sampling(0.7, 1.0)
    assert Sampling.from_flags(None, None, 40) == Sampling(1.0, 1.0, 40)  # --top_k alone too
    assert Sampling.from_flags(0.7, 0.9, 0) == Sampling(0.7, 0.9, 0)  # 0: off
    with pytest.raises(ValueError, match=r"--top_k: 5 has no effect with --temperature=0"):
        Sampling.from_flags(0.0, None, 5)
    with pytest.raises(ValueError, match=r"--top_k: -1 must be an integer >= 0"):
        Sampling.from_flags(1.0, None, -1)


def test_bytes_decode_and_encode_round_trip():
    tok = TextTokenizer("")
    ids = tok.encode("naïve déjà")
    assert ids.dtype == np.int32 and tok.decode(ids) == "naïve déjà"
    assert tok.decode([104, 105, 300, 33]) == "hi\ufffd!"  # an id past the bytes


# ---------------------------------------------------------------------------------------------
# generate.py's body
# ---------------------------------------------------------------------------------------------


def test_generate_command_prints_the_continuation(model, capsys, monkeypatch):
    # The fixture's model stands in for --checkpoint=init's (building one is test_eval's job).
    monkeypatch.setattr(gen_lib, "load_model", lambda config, path, config_name: (model, None))
    config = tiny_config("KKM", vocab=256)
    config.data.eos_id = 10  # a newline ends a continuation, as --stop_ids=10 would
    out = gen_lib.main(config, prompts=["def "], checkpoint="init", max_new_tokens=NEW,
                       piece_len=PIECE, progress=False)
    printed = capsys.readouterr()
    # The prompt echoed as given, then the continuation under its own header.
    assert len(out) == 1 and re.fullmatch(
        r"--- prompt 0 \(4 tokens\) ---\ndef \n--- continuation \((stop|length), \d new "
        r"tokens\) ---\n" + re.escape(out[0]) + r"\n", printed.out), printed.out
    assert "untrained" in printed.err and "new tokens" in printed.err
    assert gen_lib.main(config, prompts=["def "], checkpoint="init", max_new_tokens=NEW,
                        piece_len=PIECE, progress=False, echo=False) == out
    assert capsys.readouterr().out == out[0] + "\n"  # --noecho: the continuation alone
    ids = gen_lib.main(config, prompt_ids=[",".join(map(str, p)) for p in PROMPTS],
                       checkpoint="init", max_new_tokens=NEW, piece_len=PIECE, progress=False)
    printed = capsys.readouterr().out  # ids echoed as ids
    assert "--- prompt 2 (5 tokens) ---\n105,109,112,111,114\n--- continuation (" in printed
    first = [int(i) for i in ids[1].split(",")]  # "def ": ids keep the stop id, text does not
    assert 1 <= len(first) <= NEW and 10 not in first[:-1]
    assert TextTokenizer("").decode(first[:-1] if first[-1] == 10 else first) == out[0]
    three = gen_lib.main(config, prompt_ids=[",".join(map(str, PROMPTS[0]))], checkpoint="init",
                         max_new_tokens=NEW, piece_len=PIECE, progress=False, temperature=4.0,
                         top_k=50, num_samples=3, seed=1)
    printed = capsys.readouterr().out
    assert len(three) == 3 and printed.count("--- prompt 0 (8 tokens) ---\n") == 1
    for n in (1, 2, 3):
        assert f"--- continuation {n} of 3 (" in printed
    with pytest.raises(ValueError, match="--num_samples: 3 continuations of greedy"):
        gen_lib.main(config, prompts=["def "], checkpoint="init", num_samples=3)


def _no_weights(*args, **kwargs):
    raise AssertionError("a refused command must not read any weights")


def test_a_cache_that_cannot_fit_is_refused_with_what_fits(model, greedy, monkeypatch):
    """--max_new_tokens=1000000000 once allocated 320 GB and ran out of memory: the cache is
    sized from shapes first and refused, naming the flag, the value, the bytes, the memory and
    the most that fits, which then runs."""
    config = tiny_config("KKM", vocab=256)
    monkeypatch.setattr(gen_lib, "load_model", _no_weights)
    # A CPU reports no device memory: the host's bounds it (64 rows of 10^9 positions: TBs).
    with pytest.raises(ValueError, match=r"--max_new_tokens: 1000000000 new tokens after the longest "
                                         r"prompt \(1 tokens\) need a cache of [\d.]+ TB \(64 prompts "
                                         r"of up to 1000000001 positions\).* more than the host's "
                                         r"memory"):
        gen_lib.main(config, prompts=["a"] * 64, checkpoint="init", max_new_tokens=10**9,
                     progress=False)
    # A device whose memory holds the weights and a cache of exactly NEW new tokens.
    weights = gen_lib._weight_bytes(model)
    L = max(map(len, PROMPTS))
    fits = weights + gen_lib.cache_bytes(model.init_cache, len(PROMPTS), L + NEW)
    monkeypatch.setattr(gen_lib, "device_memory_bytes", lambda: fits)
    message = (rf"--max_new_tokens: {NEW + 1} new tokens after the longest prompt \({L} tokens\) "
               rf"need a cache of .* more than the device's memory \(.*\); at most {NEW} new tokens "
               rf"fit: give --max_new_tokens={NEW} or less")
    with pytest.raises(ValueError, match=message):
        generate(model, PROMPTS, NEW + 1, piece_len=PIECE)
    with pytest.raises(ValueError, match=message):  # the command: before any weight is read
        gen_lib.main(config, prompt_ids=[",".join(map(str, p)) for p in PROMPTS],
                     checkpoint="init", max_new_tokens=NEW + 1, progress=False)
    with pytest.raises(ValueError, match=r"cache does not grow with the positions: give fewer "
                                         r"prompts"):  # a model without MLA: no N helps
        gen_lib.check_cache_fits(lambda B, T: jnp.zeros((B, 8)), fits + 1, 3, L, 1)
    out = generate(model, PROMPTS, NEW, piece_len=PIECE)  # what the message allows runs
    assert all(np.array_equal(a, b) for a, b in zip(out.tokens, greedy.tokens, strict=True))


def test_a_prompt_that_is_not_utf8(model, tmp_path, monkeypatch):
    """A command line's bytes that are not UTF-8 reach Python as escaped surrogates: a
    byte-level model takes the bytes themselves; a tokenizer, which takes text, is refused
    naming --prompt, the prompt and the byte (it was a codec error naming nothing)."""
    from tokenizers import Tokenizer, models

    monkeypatch.setattr(gen_lib, "load_model", lambda config, path, config_name: (model, None))
    config = tiny_config("KKM", vocab=256)
    raw = b"de\xff "  # as os.fsdecode gives argv: "de\udcff "
    got = gen_lib.main(config, prompts=[raw.decode("utf-8", "surrogateescape")],
                       checkpoint="init", max_new_tokens=NEW, piece_len=PIECE, progress=False)
    want = generate(model, [list(raw)], NEW, piece_len=PIECE).tokens[0]
    assert got == [TextTokenizer("").decode(want)]
    with pytest.raises(ValueError, match=r"--prompt: prompt 0 holds '\\ud800' at character 1, "
                                         r"which is neither a Unicode character nor a byte"):
        gen_lib.main(config, prompts=["a\ud800"], checkpoint="init", progress=False)

    path = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(path))
    config.data.tokenizer = str(path)
    monkeypatch.setattr(gen_lib, "load_model", _no_weights)
    with pytest.raises(ValueError, match=rf"--prompt: prompt 1 is not UTF-8 text \(byte 0xff at "
                                         rf"byte 2\), and the tokenizer '{path}' takes text only; "
                                         rf"give the prompt as UTF-8 text, or its token ids with "
                                         rf"--prompt_ids"):
        gen_lib.main(config, prompts=["a", raw.decode("utf-8", "surrogateescape")],
                     checkpoint="init", progress=False)


def test_a_checkpoint_of_another_model_advises_a_command_that_works(tmp_path, jax_cache, capsys):
    """The mismatch error once advised --checkpoint=PATH@CONFIG, which generate.py does not
    take. It now names the run's own config as generate.py's flag (--config=RUN); that command,
    run as advised (with a prompt of raw bytes that are not UTF-8), generates."""
    run = tmp_path / "run"
    config = tiny_config("KKM", vocab=256)
    run_dir.write_config(config, str(run), 0)  # what train.py writes: config.json + config.py
    _, params, _ = model_state.split_model(build(config.model, 0))
    ck = ckpt_lib.Checkpointer(str(run / "checkpoints"), config.checkpoint)
    ck.save(2, {"params": params, "step": jnp.int32(2)}, {"position": 0})
    ck.close()
    other = tiny_config("KKM", vocab=256)
    other.model.d_model = 64
    with pytest.raises(SystemExit) as info:  # as generate.py ends it: one line, exit 1
        cli.guarded(gen_lib.main, debug=lambda: False)(
            other, prompt_ids=["1,2"], checkpoint=str(run), config_name="other.py", progress=False)
    err = capsys.readouterr().err
    assert info.value.code == 1 and len(err.strip().splitlines()) == 1, err
    assert "config.model came from other.py" in err and "embed/embedding" in err, err
    advised = f"--config={run}"  # the run's own config, in generate.py's flag
    assert re.search(rf"{re.escape(advised)}(?=[\s;.,)]|$)", err), err
    cmd = [sys.executable, str(REPO / "generate.py"), advised, f"--checkpoint={run}",
           b"--prompt=de\xff ", "--max_new_tokens=3", "--seed=0"]
    p = subprocess.run(cmd, cwd=tmp_path, env=env(jax_cache), capture_output=True, timeout=300)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    assert b"weights: step 2 from" in p.stderr and b"3 new tokens" in p.stderr, p.stderr
