"""Capture hooks: what a forward pass leaves behind for ``kimi_k3/internals.py`` to read.

A module whose class has ``capture_internals = False`` (KDALayer, GatedMLA, DecoderLayer,
HybridLM) checks that flag in its forward and, only when it is set on the instance
(``model.set_attributes(capture_internals=True)``, which internals.py does on a copy of the model
inside its own jitted function), stores arrays with ``keep``:

    if self.capture_internals:
        keep(self, "log_decay", g_BxTxHVxK)

Each array becomes a ``Captured`` variable of the module. Inside the scan over depth it is
stacked along the scanned layers, like any state a scanned layer writes; ``nnx.pop(model,
Captured)`` takes them all out after the forward, by state path (``model.layer_numbers`` maps a
path to its layers). The flag is a class attribute, so a model that never captures carries no
extra attribute: its graph, and every program built from it (the training step's included),
are those of a model without the hooks.

Not ``Module.sow``: flax deprecates it outside ``nnx.capture``, and ``nnx.capture`` cannot yet
pass through ``nnx.scan`` over a group holding an ``nnx.List`` (the model's scanned unit).
"""

from __future__ import annotations

import jax
from flax import nnx


class Captured(nnx.Intermediate):
    """An array a forward pass kept for the internals report (``keep``)."""


def keep(module: nnx.Module, name: str, value: jax.Array) -> None:
    """Stores ``value`` as ``module.<name>``, a ``Captured`` variable (replacing one kept by an
    earlier forward). A name the module uses for anything else is refused: a hook must never
    shadow a parameter or a submodule."""
    old = getattr(module, name, None)
    if old is not None and not isinstance(old, Captured):
        raise ValueError(f"capture: {type(module).__name__}.{name} is taken by a "
                         f"{type(old).__name__}; name the captured array otherwise")
    setattr(module, name, Captured(value))
