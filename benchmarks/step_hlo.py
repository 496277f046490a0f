r"""The training step's program as text, with a fingerprint: two revisions (or two configs) that
print the same fingerprint run the same program, so one cannot cost more than the other.

    python benchmarks/step_hlo.py --config=configs/small.py                # fingerprint + op counts
    python benchmarks/step_hlo.py --config=configs/small.py --out=step.mlir

The step is ``train.py``'s own (``train_lib.build``: model, loss, optimizer, sharding,
micro-batches), lowered for abstract inputs (nothing is allocated, so the 1B config lowers on a
CPU); the fingerprint is the SHA-256 of its StableHLO with source locations removed.
"""

from __future__ import annotations

import collections
import hashlib
import re
import sys

import jax
from absl import app, flags
from ml_collections import config_flags

from kimi_k3 import config as config_lib
from kimi_k3 import mesh as mesh_lib
from kimi_k3 import train_lib


def step_text(config) -> str:
    """The lowered training step's StableHLO, without locations."""
    spec = config_lib.run_spec(config)
    mesh = mesh_lib.make_mesh(spec.mesh)
    setup = train_lib.build(config, mesh)
    B, T = spec.data.global_batch_size, spec.data.seq_len
    batch = {k: jax.ShapeDtypeStruct((B, T), "int32", sharding=setup.batch_sharding)
             for k in ("tokens", "segment_ids")}
    with setup.context():
        text = setup.train_step.lower(setup.abstract_state, batch).as_text()
    text = re.sub(r"\s*loc\([^()]*(\([^()]*\)[^()]*)*\)", "", text)  # loc(...) annotations
    return "\n".join(line for line in text.splitlines() if not line.startswith("#loc"))


def fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def main(argv):
    del argv
    text = step_text(_CONFIG.value)
    ops = collections.Counter(re.findall(r"= (?:\"?)([a-z_]+\.[a-z_.]+)", text))
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            f.write(text)
    print(f"fingerprint {fingerprint(text)}  "
          f"({len(text.splitlines())} lines)")
    for op, n in ops.most_common(12):
        print(f"  {n:6d}  {op}")
    sys.stdout.flush()


if __name__ == "__main__":  # flags only for the command, so tests can import the module
    _CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
    flags.mark_flag_as_required("config")
    _OUT = flags.DEFINE_string("out", None, "Also write the StableHLO text here.")
    app.run(main)
