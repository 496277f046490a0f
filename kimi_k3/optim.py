"""Optimiser: AdamW (or Muon) with warmup then cosine / warmup-stable-decay / constant, global-norm
clipping, and decoupled weight decay masked off norms, biases, KDA gate parameters and the
Attention Residual pseudo-queries.

The chain, applied to the gradient g of parameter p at step s (lr(s) from the schedule):

    g <- clip_by_global_norm(g, opt.grad_clip)                 (skipped when grad_clip == 0)
    d <- AdamW direction m_hat / (sqrt(v_hat) + eps)           (opt.name = "adamw")
         or Muon direction: Newton-Schulz-orthogonalised Nesterov momentum, scaled by
         opt.muon_rms * sqrt(max(fan_in, fan_out)) so its RMS matches AdamW's and the same lr and
         weight decay apply; AdamW for embeddings, the output head, vectors and excluded names
    p <- p - lr(s) * (d + opt.weight_decay * p * mask(p))

mask(p) is True for weights with at least two axes besides stacked-layer axes whose path matches
none of ``opt.no_decay``.

``opt.moments_dtype = "bfloat16"`` stores AdamW's m and v (and Muon's momentum) in bfloat16,
half their memory: each step reads them, updates them in float32 and rounds the result once.
The rounding error is below 2^-9 of each moment, small next to the 1 - b1 and 1 - b2 of the
gradient each step adds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from kimi_k3.config import opt_spec
from kimi_k3.trees import path_str

# ---------------------------------------------------------------------------------------------
# Learning-rate schedules
# ---------------------------------------------------------------------------------------------


def lr_schedule(opt_cfg, total_steps: int) -> Callable[[jax.Array], jax.Array]:
    """lr(step) for step = 0, 1, ... (the update's index). ``opt_cfg``: an OptSpec or the
    ``config.opt`` ConfigDict (checked into one).

    warmup:   lr = peak * (step + 1) / warmup_steps           for step < warmup_steps
    cosine:   lr = end + (peak - end) * (1 + cos(pi * u)) / 2, u = (step - warmup) / (total - warmup)
    wsd:      lr = peak until the last decay_fraction * total steps, then linear down to end
    constant: lr = peak
    end = peak * min_lr_ratio; u is clipped to [0, 1].
    """
    opt = opt_spec(opt_cfg)
    peak, kind, warmup = opt.lr, opt.schedule, opt.warmup_steps
    end = peak * opt.min_lr_ratio
    frac = opt.decay_fraction
    decay_steps = max(1, round(frac * total_steps))
    decay_start = max(warmup, total_steps - decay_steps)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = peak * jnp.minimum(1.0, (step + 1.0) / max(warmup, 1))
        if kind == "constant":
            after = jnp.full_like(step, peak)
        elif kind == "cosine":
            u = jnp.clip((step - warmup) / max(total_steps - warmup, 1), 0.0, 1.0)
            after = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * u))
        else:
            u = jnp.clip((step - decay_start) / max(total_steps - decay_start, 1), 0.0, 1.0)
            after = peak + (end - peak) * u
        return jnp.where(step < warmup, warm, after)

    return schedule


# ---------------------------------------------------------------------------------------------
# Which parameters get weight decay, which get Muon
# ---------------------------------------------------------------------------------------------


def decay_mask(params, no_decay: Sequence[str], logical_axes=None,
               batch_axes: Sequence[str] = ("layers",)):
    """True where decoupled weight decay applies: the parameter has at least two axes besides
    its ``batch_axes`` (a stacked norm scale [layers, D] is still a vector), and no
    ``no_decay`` regex matches its path (case-insensitive)."""
    pats = [re.compile(p, re.IGNORECASE) for p in no_decay]
    if logical_axes is None:
        logical_axes = jax.tree.map(lambda x: None, params)

    def one(path, x, names):
        rank = x.ndim
        if names is not None and len(names) == x.ndim:
            rank = sum(n not in batch_axes for n in names)
        return rank >= 2 and not any(p.search(path_str(path)) for p in pats)

    return jax.tree_util.tree_map_with_path(
        one, params, logical_axes, is_leaf=lambda x: x is None or isinstance(x, tuple))


def muon_dimension_numbers(params, logical_axes, opt_cfg):
    """Per parameter: a ``MuonDimensionNumbers`` (Muon) or None (AdamW).

    AdamW for: paths matching ``opt.no_decay`` or ``opt.muon_exclude``, any axis named in
    ``opt.muon_adam_axes`` (the vocabulary: embeddings, output head), and fewer than two
    non-batch axes. Axes named in ``opt.muon_batch_axes`` (stacked layers, experts) are batch
    axes, orthogonalised independently. Of the rest, a weight whose last axis is ``embed`` (an
    output projection [..., embed]) reduces over all other axes; any other reduces over its
    first axis and outputs the rest ([embed, heads, head_dim] -> reduce embed).
    """
    # Optional: optax.contrib's Muon exists from optax 0.2.5 on (make_optimizer says so).
    from optax.contrib import MuonDimensionNumbers

    excl = [re.compile(p, re.IGNORECASE) for p in (*opt_cfg.no_decay, *opt_cfg.muon_exclude)]
    adam_axes, batch_axes = set(opt_cfg.muon_adam_axes), set(opt_cfg.muon_batch_axes)

    def one(path, x, names):
        names = tuple(names) if names is not None else (None,) * x.ndim
        if len(names) != x.ndim:
            names = (None,) * x.ndim
        if any(p.search(path_str(path)) for p in excl) or adam_axes & set(names):
            return None
        axes = [i for i, n in enumerate(names) if n not in batch_axes]
        if len(axes) < 2:
            return None
        if names[axes[-1]] == "embed":
            return MuonDimensionNumbers(tuple(axes[:-1]), (axes[-1],))
        return MuonDimensionNumbers((axes[0],), tuple(axes[1:]))

    if logical_axes is None:
        logical_axes = jax.tree.map(lambda x: None, params)
    return jax.tree_util.tree_map_with_path(
        one, params, logical_axes, is_leaf=lambda x: x is None or isinstance(x, tuple)
    )


def _is_dimnum(x) -> bool:
    from optax.contrib import MuonDimensionNumbers

    return isinstance(x, MuonDimensionNumbers)


def _scale_by_rms_match(dimnums, rms: float) -> optax.GradientTransformation:
    """Multiply each orthogonalised update by rms * sqrt(max(fan_in, fan_out)) (Moonlight's
    "consistent RMS"), so Muon updates have AdamW's RMS and share its lr and weight decay."""

    def update_fn(updates, state, params=None):
        del params

        def scale(u, dn):
            if isinstance(u, optax.MaskedNode) or dn is None:
                return u
            fan_in = math.prod(u.shape[a] for a in dn.reduction_axis)
            fan_out = math.prod(u.shape[a] for a in dn.output_axis)
            return u * (rms * math.sqrt(max(fan_in, fan_out)))

        return jax.tree.map(scale, updates, dimnums(updates),
                            is_leaf=lambda x: isinstance(x, optax.MaskedNode)), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def _muon_direction(params, logical_axes, opt_cfg) -> optax.GradientTransformation:
    from optax.contrib import scale_by_muon

    dims = muon_dimension_numbers(params, logical_axes, opt_cfg)
    labels = jax.tree.map(lambda d: "adam" if d is None else "muon", dims,
                          is_leaf=lambda x: x is None or _is_dimnum(x))

    def masked_dims(tree):
        # Inside optax.partition the AdamW leaves are MaskedNode; keep them so structures match.
        return jax.tree.map(lambda u, d: u if isinstance(u, optax.MaskedNode) else d, tree, dims,
                            is_leaf=lambda x: isinstance(x, optax.MaskedNode))

    muon = optax.chain(
        scale_by_muon(ns_steps=int(opt_cfg.muon_ns_steps), beta=float(opt_cfg.muon_beta),
                      nesterov=True, weight_dimension_numbers=masked_dims,
                      mu_dtype=_moments_dtype(opt_cfg)),
        _scale_by_rms_match(masked_dims, float(opt_cfg.muon_rms)),
    )
    adam = _adam(opt_cfg)
    return optax.partition({"muon": muon, "adam": adam}, labels)


def _moments_dtype(opt_cfg):
    """The stored moments' dtype; None (the parameters' own) for float32."""
    return jnp.bfloat16 if opt_cfg.moments_dtype == "bfloat16" else None


def _adam(opt_cfg) -> optax.GradientTransformation:
    """optax's Adam direction with its moments stored in ``opt.moments_dtype``: optax stores m
    in ``mu_dtype`` and v in the dtype v was created in, so v is created in it here."""
    dtype = _moments_dtype(opt_cfg)
    adam = optax.scale_by_adam(b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps, mu_dtype=dtype)
    if dtype is None:
        return adam

    def init_fn(params):
        state = adam.init(params)
        return state._replace(nu=optax.tree.cast(state.nu, dtype))

    return optax.GradientTransformation(init_fn, adam.update)


def make_optimizer(opt_cfg, total_steps: int, params, logical_axes=None):
    """(optax transformation, lr schedule) for ``config.opt`` (an OptSpec, or the ConfigDict,
    checked into one); ``params`` may be abstract (shapes only); ``logical_axes`` is a tree of
    per-parameter logical axis-name tuples (or None per parameter)."""
    opt_cfg = opt_spec(opt_cfg)
    schedule = lr_schedule(opt_cfg, total_steps)
    if opt_cfg.name == "adamw":
        direction = _adam(opt_cfg)
    else:
        if not hasattr(optax.contrib, "scale_by_muon"):
            raise ValueError(f"opt.name: 'muon' needs optax.contrib.scale_by_muon, which optax "
                             f"{optax.__version__} lacks; use 'adamw' or a newer optax")
        direction = _muon_direction(params, logical_axes, opt_cfg)
    parts = []
    if opt_cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(float(opt_cfg.grad_clip)))
    parts += [
        direction,
        optax.add_decayed_weights(
            float(opt_cfg.weight_decay),
            mask=decay_mask(params, opt_cfg.no_decay, logical_axes, opt_cfg.muon_batch_axes)),
        optax.scale_by_learning_rate(schedule),
    ]
    return optax.chain(*parts), schedule
