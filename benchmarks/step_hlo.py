r"""The training step's program as text, with a fingerprint: two revisions (or two configs) that
print the same fingerprint run the same program, so one cannot cost more than the other.

    python benchmarks/step_hlo.py --config=configs/small.py                # fingerprint + op counts
    python benchmarks/step_hlo.py --config=configs/small.py --stage=lowered --out=step.mlir

The step is ``train.py``'s own (``train_lib.build``: model, loss, optimizer, sharding,
micro-batches), lowered for abstract inputs (nothing is allocated, so the 1B config compiles on
a CPU). ``--stage=compiled`` (the default) fingerprints the program XLA runs: the optimised,
partitioned HLO, with op metadata (source lines, names) removed — two steps whose sharding
annotations differ only by an axis of size 1 compile to the same program. ``--stage=lowered``
fingerprints the StableHLO before XLA (source locations removed).
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

# Tables of source files and stack frames that XLA prints ahead of the computations.
_SOURCE_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def _program_lines(hlo: str):
    """The computations of an HLO module's text: no module header (it holds the module's name)
    and no source tables (each runs to the next blank line)."""
    skipping = False
    for line in hlo.splitlines():
        if line.strip() in _SOURCE_TABLES:
            skipping = True
        elif skipping and not line.strip():
            skipping = False
        elif not skipping and not line.startswith("HloModule"):
            yield line


def step_text(config, stage: str = "lowered") -> str:
    """The training step's program: its StableHLO without locations (``stage="lowered"``), or
    XLA's optimised HLO without op metadata (``stage="compiled"``)."""
    spec = config_lib.run_spec(config)
    mesh = mesh_lib.make_mesh(spec.mesh)
    setup = train_lib.build(config, mesh)
    B, T = spec.data.global_batch_size, spec.data.seq_len
    batch = {k: jax.ShapeDtypeStruct((B, T), "int32", sharding=setup.batch_sharding)
             for k in ("tokens", "segment_ids")}
    with setup.context():
        lowered = setup.train_step.lower(setup.abstract_state, batch)
        if stage == "compiled":
            text = re.sub(r",? metadata=\{[^{}]*\}", "", lowered.compile().as_text())
            return "\n".join(_program_lines(text))
        text = lowered.as_text()
    text = re.sub(r"\s*loc\([^()]*(\([^()]*\)[^()]*)*\)", "", text)  # loc(...) annotations
    return "\n".join(line for line in text.splitlines() if not line.startswith("#loc"))


def fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def main(argv):
    del argv
    text = step_text(_CONFIG.value, _STAGE.value)
    ops = collections.Counter(re.findall(r"= (?:\"?)([a-z_]+\.[a-z_.]+)", text)
                              or re.findall(r"= \S+ ([a-z][a-z-]*)\(", text))
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
    _OUT = flags.DEFINE_string("out", None, "Also write the program's text here.")
    _STAGE = flags.DEFINE_enum("stage", "compiled", ["compiled", "lowered"],
                               "Fingerprint XLA's optimised program or the StableHLO before it.")
    app.run(main)
