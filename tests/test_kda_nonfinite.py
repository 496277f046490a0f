"""KDA with a gate of -inf, and with a NaN or inf in an input: every implementation agrees with
the definition (the recurrence, ``tests/kda_numpy.py`` in float64).

- Without a lower bound, g = -inf is a valid gate, "forget everything": exact in the forward,
  the final state and every gradient, with and without packed documents, and with the gate in
  the op (a softplus gate of +inf logits). The chunked forms used to subtract -inf from -inf.
- With a lower bound, -inf breaks the promise g >= lower_bound: a bad value, like NaN.
- Without ``segment_ids``, a bad value at token t leaves every output before t exact (the
  chunked forms used to spread it over the whole chunk); from t on its value head is NaN (at
  least where the definition is non-finite), except for a bad q, which, as in the definition,
  spoils only its own output. Other rows and heads, and their gradients, stay exact.

Shapes are small and not multiples of the chunk (16); inputs are fresh per test (``rng``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_k3.ops import kda
from kimi_k3.ops.kda_guards import isolate_rows
from kimi_k3.ops.kda_recurrent import kda_recurrent
from pallas_kernels.kda_body import FORGET_GATE
from tests.helpers import fast_jit, make_inputs
from tests.kda_numpy import kda_numpy, rel_err

B, T, H, HV, K, V, C = 2, 45, 2, 4, 16, 8, 16
GRAD_NAMES = ("q", "k", "v", "g", "beta", "S0")


def _inputs(rng):
    q, k, v, g, beta = make_inputs(rng, B=B, T=T, H=H, HV=HV, K=K, V=V)
    S0 = jnp.asarray(rng.standard_normal((B, HV, K, V)).astype(np.float32))
    return q, k, v, g, beta, S0


def _forget(rng, g):
    """g with -inf at random places: one channel, a whole head at one token, the first and the
    last token, a chunk's first row, and twice in one channel of one chunk."""
    t1, t2 = sorted(rng.choice(np.arange(17, 31), 2, replace=False))
    d = int(rng.integers(K))
    places = [(0, int(rng.integers(1, T - 1)), int(rng.integers(HV)), d),
              (0, t1, 1, d), (0, t2, 1, d), (1, 0, 0, int(rng.integers(K))),
              (1, T - 1, 3, int(rng.integers(K))), (1, C, 2, int(rng.integers(K)))]
    for b, t, h, c in places:
        g = g.at[b, t, h, c].set(-jnp.inf)
    return g.at[1, int(rng.integers(1, T - 1)), 2, :].set(-jnp.inf)


def _numpy(q, k, v, g, beta, S0, seg=None):
    args = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and inf inputs, on purpose
        return kda_numpy(*args, initial_state=np.asarray(S0, np.float64), segment_ids=seg)


def _inside_a_chunk(rng, lo=C + 1, hi=T - 1):
    """A token in [lo, hi) that is neither the first nor the last row of its chunk: a bad value
    there has tokens of its own chunk before and after it."""
    return int(rng.choice([t for t in range(lo, hi) if 0 < t % C < C - 1]))


def _grads(fn, args, w_o, w_S):
    """Gradients of sum(o w_o) + sum(S w_S), the outputs that are not finite left out."""

    def loss(*a):
        o, S = fn(*a)
        o, S = (jnp.where(jnp.isfinite(x), x, 0.0) for x in (o.astype(jnp.float32), S))
        return jnp.sum(o * w_o) + jnp.sum(S * w_S)

    return fast_jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)


def _definition(seg=None):
    def fn(q, k, v, g, beta, S0):
        return kda_recurrent(q, k, v, g, beta, scale=K ** -0.5, initial_state_BxHVxKxV=S0,
                             segment_ids_BxT=seg)
    return fn


def _op(impl, seg=None, **kw):
    def fn(q, k, v, g, beta, S0):
        return kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, segment_ids=seg,
                   chunk_size=C, impl=impl, **kw)
    return fn

def _gate_params(rng):
    """A_log [HV] and dt_bias [HV, K] of the softplus gate, drawn fresh."""
    return (jnp.asarray(rng.uniform(0.0, 1.0, HV).astype(np.float32)),
            jnp.asarray(rng.uniform(-1.0, 1.0, (HV, K)).astype(np.float32)))


def _gate_in_the_op(impl):
    """(q, k, v, f, beta, S0, A_log, dt_bias) -> (o, S): the op with the gate inside it."""
    def op(q, k, v, f, beta, S0, A_log, dt_bias):
        return _op(impl, A_log=A_log, dt_bias=dt_bias)(q, k, v, f, beta, S0)
    return op


def _gate_in_the_definition(q, k, v, f, beta, S0, A_log, dt_bias):
    """The same from the definition: g = -exp(A_log) softplus(f + dt_bias), then the recurrence."""
    g = -jnp.exp(A_log)[:, None] * jax.nn.softplus(f + dt_bias)
    return _definition()(q, k, v, g, beta, S0)


def _softplus_gate64(f, A_log, dt_bias):
    """The softplus gate in float64 (NumPy), for the float64 reference."""
    return -np.exp(np.float64(A_log))[:, None] * np.logaddexp(0.0, np.float64(f + dt_bias))



def _weights(rng):
    return (jnp.asarray(rng.standard_normal((B, T, HV, V)).astype(np.float32)),
            jnp.asarray(rng.standard_normal((B, HV, K, V)).astype(np.float32)))


# ----------------------------------------------------------------------------- -inf gates


@pytest.mark.parametrize("impl", ["recurrent", "xla", "pallas"])
def test_neg_inf_gate_forgets_exactly(rng, impl):
    """No lower bound: forward, final state and every gradient are the definition's (all
    finite), without packed documents."""
    q, k, v, g, beta, S0 = _inputs(rng)
    g = _forget(rng, g)
    o, S = _op(impl)(q, k, v, g, beta, S0)
    o_ref, S_ref = _numpy(q, k, v, g, beta, S0)
    assert np.isfinite(o_ref).all()
    assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5
    w_o, w_S = _weights(rng)
    got = _grads(_op(impl), (q, k, v, g, beta, S0), w_o, w_S)
    want = _grads(_definition(), (q, k, v, g, beta, S0), w_o, w_S)
    for name, a, b in zip(GRAD_NAMES, got, want, strict=True):
        assert np.isfinite(b).all() and np.isfinite(a).all(), name
        assert rel_err(a, b) < 1e-4, (name, rel_err(a, b))
    if impl != "pallas":  # the gradient through a forgetting gate, exp(g) times S: 0
        assert np.all(np.asarray(got[3])[np.isneginf(np.asarray(g))] == 0.0)


@pytest.mark.parametrize("impl", ["recurrent", "xla", "pallas"])
def test_neg_inf_gate_forgets_exactly_in_packed_documents(rng, impl):
    """No lower bound, with segment_ids (the document guard's path): not a bad value."""
    q, k, v, g, beta, S0 = _inputs(rng)
    g = _forget(rng, g)
    seg = np.zeros((B, T), np.int32)
    seg[0, 12:33], seg[0, 33:], seg[1, 20:] = 1, 2, 1
    o, S = _op(impl, jnp.asarray(seg))(q, k, v, g, beta, S0)
    o_ref, S_ref = _numpy(q, k, v, g, beta, S0, seg)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5
    if impl == "xla":  # the guard's backward: nothing marked
        w_o, w_S = _weights(rng)
        got = _grads(_op(impl, jnp.asarray(seg)), (q, k, v, g, beta, S0), w_o, w_S)
        want = _grads(_definition(jnp.asarray(seg)), (q, k, v, g, beta, S0), w_o, w_S)
        for name, a, b in zip(GRAD_NAMES, got, want, strict=True):
            assert np.isfinite(a).all() and rel_err(a, b) < 1e-4, (name, rel_err(a, b))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_neg_inf_gate_from_the_gate_in_the_op(rng, impl):
    """The softplus gate of logits +inf is -inf: in the kernel's prologue (pallas) as in
    kda_gate (xla). Outputs, and the gradients the definition has finite (all but A_log's,
    0 * inf there), match it."""
    q, k, v, _, beta, S0 = _inputs(rng)
    f = jnp.asarray(rng.standard_normal((B, T, HV, K)).astype(np.float32))
    f = f.at[0, 7, 1, 2].set(jnp.inf).at[1, 30, 3, :].set(jnp.inf).at[1, 31, 0, 5].set(jnp.inf)
    A_log, dt_bias = _gate_params(rng)
    args = (q, k, v, f, beta, S0, A_log, dt_bias)

    op, definition = _gate_in_the_op(impl), _gate_in_the_definition
    g64 = _softplus_gate64(f, A_log, dt_bias)
    assert np.isneginf(g64).sum() == 3 + K - 1
    o, S = op(*args)
    o_ref, S_ref = _numpy(q, k, v, g64, beta, S0)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5
    w_o, w_S = _weights(rng)
    got, want = _grads(op, args, w_o, w_S), _grads(definition, args, w_o, w_S)
    for name, a, b in zip(("q", "k", "v", "f", "beta", "S0", "dt_bias"),
                          got[:6] + got[7:], want[:6] + want[7:], strict=True):
        assert np.isfinite(b).all() and np.isfinite(a).all(), name
        assert rel_err(a, b) < 1e-4, (name, rel_err(a, b))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("impl", ["recurrent", "xla", "pallas"])
def test_neg_inf_gate_under_a_lower_bound_is_a_bad_value(rng, impl, packed):
    """lower_bound promises g >= lower_bound: -inf breaks it. Eager calls do not raise (the gate
    check leaves non-finite gates to the guard); every implementation makes it a bad value:
    its value head NaN from the token on (to the document's end), all else exact."""
    q, k, v, g, beta, S0 = _inputs(rng)
    t, h = _inside_a_chunk(rng, hi=2 * C), int(rng.integers(HV))
    g = g.at[0, t, h, int(rng.integers(K))].set(-jnp.inf)
    seg = np.zeros((B, T), np.int32)
    end = T
    if packed:
        end = 2 * C + 4
        seg[0, end:] = 1
    o, S = _op(impl, jnp.asarray(seg) if packed else None, lower_bound=-5.0)(
        q, k, v, g, beta, S0)
    o, S = np.asarray(o), np.asarray(S)
    o_ref, S_ref = _numpy(q, k, v, g, beta, S0, seg if packed else None)
    hit = np.zeros(o.shape[:3], bool)
    hit[0, t:end, h] = True
    assert np.isnan(o[hit]).all()
    assert rel_err(o[~hit], o_ref[~hit]) < 1e-5
    S_hit = np.zeros(S.shape[:2], bool)
    S_hit[0, h] = not packed
    assert np.isnan(S[S_hit]).all() and rel_err(S[~S_hit], S_ref[~S_hit]) < 1e-5


# ----------------------------------------------------------------------------- bad values


@pytest.mark.parametrize("impl", ["recurrent", "xla", "pallas"])
@pytest.mark.parametrize("where", ["q", "k", "v", "g", "beta"])
def test_a_bad_value_without_segments_spoils_nothing_before_it(rng, impl, where):
    """A NaN or inf in one input at token t of row 0: outputs before t exact; from t on, value
    heads it reaches are NaN wherever the definition is non-finite (a bad q: at t only, exact
    after it); every other row and head exact, and so is the final state where it is finite."""
    x = dict(zip(("q", "k", "v", "g", "beta", "S0"), _inputs(rng), strict=True))
    t = _inside_a_chunk(rng)
    # (a gate of -inf is a valid one, above; +inf breaks g <= 0 and is a bad value too)
    bad = float(rng.choice([np.nan, np.inf] + ([] if where == "g" else [-np.inf])))
    index = (0, t) + tuple(int(rng.integers(n)) for n in x[where].shape[2:])
    x[where] = x[where].at[index].set(bad)
    o, S = _op(impl)(*x.values())
    o, S = np.asarray(o), np.asarray(S)
    o_ref, S_ref = _numpy(*x.values())
    heads = np.zeros(HV, bool)
    if where in ("q", "k"):
        heads[index[2] * (HV // H):(index[2] + 1) * (HV // H)] = True
    else:
        heads[index[2]] = True
    reached = np.zeros(o.shape[:3], bool)
    reached[0, t:t + 1 if where == "q" else T, heads] = True
    # the definition is non-finite only where it is reached, and so are we, NaN
    assert not np.isfinite(o_ref[reached]).all() and np.isfinite(o_ref[~reached]).all()
    if where == "q":  # the implementation's own output at t: NaN or inf
        assert not np.isfinite(o[reached]).any()
    else:
        assert np.isnan(o[reached]).all()
    assert rel_err(o[~reached], o_ref[~reached]) < 1e-5  # before t too: exact
    assert not np.isfinite(S[0, heads]).any() if where != "q" else np.isfinite(S).all()
    assert rel_err(S[np.isfinite(S)], S_ref[np.isfinite(S)]) < 1e-5


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_a_bad_initial_state_without_segments(rng, impl):
    """A NaN in one head's initial state: that row's head NaN throughout, all else exact."""
    q, k, v, g, beta, S0 = _inputs(rng)
    h = int(rng.integers(HV))
    S0 = S0.at[1, h, int(rng.integers(K)), int(rng.integers(V))].set(jnp.nan)
    o, S = (np.asarray(x) for x in _op(impl)(q, k, v, g, beta, S0))
    o_ref, _ = _numpy(q, k, v, g, beta, S0)
    hit = np.zeros(o.shape[:3], bool)
    hit[1, :, h] = True
    assert np.isnan(o[hit]).all() and rel_err(o[~hit], o_ref[~hit]) < 1e-5
    assert np.isnan(S[1, h]).all() and np.isfinite(np.delete(S[1], h, axis=0)).all()


@pytest.mark.parametrize("impl", ["recurrent", "xla", "pallas"])
def test_gradients_without_segments_are_exact_outside_the_hit_row_and_head(rng, impl):
    """A NaN in v (row 0, one head) and in q (row 1, one q/k head): the gradients of every other
    row and head are the definition's; those of a hit row and head (dq, dk: of the q/k head
    serving it) are NaN, as are A_log-like shared ones (none here)."""
    q, k, v, g, beta, S0 = _inputs(rng)
    hv, hq = int(rng.integers(HV)), int(rng.integers(H))
    v = v.at[0, _inside_a_chunk(rng), hv, int(rng.integers(V))].set(jnp.nan)
    q = q.at[1, _inside_a_chunk(rng), hq, int(rng.integers(K))].set(jnp.nan)
    args = (q, k, v, g, beta, S0)
    w_o, w_S = _weights(rng)
    got = _grads(_op(impl), args, w_o, w_S)
    want = _grads(_definition(), args, w_o, w_S)
    G = HV // H
    hit_v = np.zeros((B, HV), bool)
    hit_v[0, hv] = True
    hit_v[1, hq * G:(hq + 1) * G] = True
    hit_qk = hit_v.reshape(B, H, G).any(-1)
    for name, a, b in zip(GRAD_NAMES, got, want, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        hit = hit_qk if name in ("q", "k") else hit_v
        if name == "S0":
            a, b = a[~hit], b[~hit]
            assert np.isnan(np.asarray(got[5])[hit]).all()
        else:
            a, b = np.moveaxis(a, 2, 1), np.moveaxis(b, 2, 1)  # [B, heads, T, ...]
            assert np.isnan(a[hit]).all(), name
            a, b = a[~hit], b[~hit]
        assert np.isfinite(a).all() and rel_err(a, b) < 1e-4, (name, rel_err(a, b))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_a_bad_value_with_the_gate_in_the_op_without_segments(rng, impl):
    """The gate in the op (the kernel's prologue for pallas) and a NaN in v of row 0: row 1's
    outputs and its per-token gradients (df too) are exact; A_log's and dt_bias's, shared by
    the rows, are NaN."""
    q, k, v, _, beta, S0 = _inputs(rng)
    f = jnp.asarray(rng.standard_normal((B, T, HV, K)).astype(np.float32))
    A_log, dt_bias = _gate_params(rng)
    v = v.at[0, _inside_a_chunk(rng), int(rng.integers(HV)), 0].set(jnp.nan)
    args = (q, k, v, f, beta, S0, A_log, dt_bias)

    op, definition = _gate_in_the_op(impl), _gate_in_the_definition
    o, S = op(*args)
    g64 = _softplus_gate64(f, A_log, dt_bias)
    o_ref, S_ref = _numpy(q, k, v, g64, beta, S0)
    assert rel_err(o[1], o_ref[1]) < 1e-5 and rel_err(S[1], S_ref[1]) < 1e-5
    w_o, w_S = _weights(rng)
    got, want = _grads(op, args, w_o, w_S), _grads(definition, args, w_o, w_S)
    for name, a, b in zip(("q", "k", "v", "f", "beta", "S0"), got[:6], want[:6], strict=True):
        assert np.isfinite(a[1]).all() and rel_err(a[1], b[1]) < 1e-4, (name, rel_err(a[1], b[1]))
    assert np.isnan(got[6]).all() and np.isnan(got[7]).all()


@pytest.mark.parametrize("impl", ["recurrent", "xla"])
def test_a_bad_query_in_a_packed_document_spoils_only_its_own_output(rng, impl):
    """With segment_ids too: q is read, never written into the state, so a NaN in it makes its
    own token's outputs NaN and nothing else (the definition's); its document's gradients are
    NaN (the guard's contract), the other documents' exact."""
    q, k, v, g, beta, S0 = _inputs(rng)
    seg = np.zeros((B, T), np.int32)
    seg[:, 30:] = 1
    t, h = _inside_a_chunk(rng, C + 1, 30), int(rng.integers(H))
    q = q.at[0, t, h, int(rng.integers(K))].set(jnp.nan)
    o, S = (np.asarray(x) for x in _op(impl, jnp.asarray(seg))(q, k, v, g, beta, S0))
    o_ref, S_ref = _numpy(q, k, v, g, beta, S0, seg)
    G = HV // H
    hit = np.zeros(o.shape[:3], bool)
    hit[0, t, h * G:(h + 1) * G] = True
    assert np.isnan(o[hit]).all() and not np.isfinite(o_ref[hit]).any()
    assert rel_err(o[~hit], o_ref[~hit]) < 1e-5 and rel_err(S, S_ref) < 1e-5


def test_rows_guard_reruns_only_when_the_final_state_is_not_finite(rng):
    """isolate_rows runs the implementation once on finite inputs: the guarded rerun (its passes
    over the inputs) is a branch of a lax.cond taken only when the final state is non-finite,
    in the forward and the backward pass alike."""
    q, k, v, g, beta, S0 = _inputs(rng)
    reruns = []

    def run(q, k, v, g, beta, S0, params):
        return kda_recurrent(q, k, v, g, beta, scale=0.25, initial_state_BxHVxKxV=S0,
                             segment_ids_BxT=None)

    def rerun(*args):
        jax.debug.callback(lambda: reruns.append(1))
        return run(*args)

    def loss(*args):
        o, S = isolate_rows(run, rerun, *args, ())
        return jnp.sum(jnp.where(jnp.isfinite(o), o, 0.0)) + jnp.sum(S)

    fwd, grad = jax.jit(run), jax.jit(jax.grad(loss, argnums=range(6)))
    good = (q, k, v, g, beta, S0)
    jax.block_until_ready((fwd(*good, ()), grad(*good)))
    jax.effects_barrier()
    assert reruns == []
    bad = (q, k, v.at[0, 3, 0, 0].set(jnp.nan), g, beta, S0)
    jax.block_until_ready(grad(*bad))
    jax.effects_barrier()
    assert reruns == [1]


def test_forget_gate_decays_to_exactly_zero():
    """FORGET_GATE stands for -inf: its exp is 0 in float32, also after a gate of 0 before it,
    and it is the least such magnitude's binade (|G| keeps the precision of |G| < 128)."""
    assert float(jnp.exp(jnp.float32(FORGET_GATE))) == 0.0
    assert float(jnp.exp(jnp.float32(FORGET_GATE) + jnp.float32(-1e-3))) == 0.0
    assert -128.0 < FORGET_GATE < -104.0
