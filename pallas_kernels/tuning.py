"""The KDA kernel's launch parameters: ``KernelTuning``, passed as ``kda_pallas(..., tuning=)``.

A light module: it imports no Pallas and no kernel module, so configuration code can build and
check a tuning (``KernelTuning.parse``) without loading the kernels.
"""

from __future__ import annotations

import dataclasses


def pow2_tile(size: int, want: int, least: int = 16) -> int | None:
    """The largest power of two <= ``want`` that divides ``size`` and is at least ``least``
    (Triton's dots take no smaller tile), or None when there is none."""
    t = want
    while t >= least:
        if size % t == 0:
            return t
        t //= 2
    return None


# The state passes aim for this many programs when KernelTuning.bv_seq is 0 (automatic).
TARGET_PROGRAMS = 256


@dataclasses.dataclass(frozen=True)
class KernelTuning:
    """Launch parameters of the compiled GPU kernels (frozen and hashable, like the
    ``BlockSizes`` of JAX's Pallas GPU attention): ``kda_pallas(..., tuning=)``.

    ``KernelTuning()`` is right for every card: what depends on the card (which kernels run on
    Mosaic GPU) is decided per call from ``pallas_kernels.device.probe`` (``hopper``). The tiles
    (bv_seq, bv_intra, bk, bk_fwd) also apply in interpret mode, so a tuning can be tested on
    CPU; the TPU modes choose their own tiles (Mosaic wants lane tiles of 128 or the whole
    dim), and warps and stages are Triton's only. Tiles larger than the padded K or V are cut
    to it. ``parse`` reads the ``--tune`` flag of the command-line tools;
    ``dataclasses.replace`` makes variants.
    """

    # V tile of the state passes (state_fwd, state_bwd). 0: the widest tile that still gives
    # them TARGET_PROGRAMS programs; they are the sequential part, and at small batch finer V
    # tiles are the only parallelism left.
    bv_seq: int = 0
    # V tile of the loops inside the intra-chunk kernels.
    bv_intra: int = 128
    # K slice of the backward's intra-chunk kernels, and the third grid axis of
    # intra_bwd_channels. Wider slices spill registers in that kernel (``python -m
    # pallas_kernels.triton_report --tune bk=64`` shows the spills).
    bk: int = 32
    # K slice of the forward's intra-chunk kernel (intra_fwd), cut to the padded K. Its loop
    # over slices runs the decayed scores' chain of dots once per slice: wider slices run it
    # less often (benchmarks/kda_kernel.py --sweep measures it).
    bk_fwd: int = 64
    warps_intra: int = 4  # Triton warps of intra_fwd
    warps_seq: int = 4  # Triton warps of state_fwd and state_bwd
    warps_grad: int = 4  # Triton warps of intra_bwd_scores
    warps_chan: int = 4  # Triton warps of intra_bwd_channels
    stages_seq: int = 2  # Triton pipeline stages of state_fwd and state_bwd
    # Triton pipeline stages of the intra-chunk kernels. Software pipelining multiplies the
    # shared memory of their slice loops (at 3 stages the backward's overflows what an sm_90
    # block may take), and they are not load-bound.
    stages_intra: int = 1
    # Which kernels run on Mosaic GPU (kda_mgpu_bwd.intra_bwd_scores and both state passes,
    # kda_mgpu_state) instead of Triton:
    #   -1 (automatic): the Mosaic GPU kernels in compiled "gpu" mode wherever
    #      ``device.probe("gpu").mosaic_gpu`` (a Hopper card) and the kernel implements the call
    #      (its ``unsupported_reason``); Triton everywhere else, "interpret" mode included (it
    #      stands in for a card without Mosaic GPU).
    #    0: the Triton kernels only (the portable path, to compare with).
    #    1: the Mosaic GPU kernels, which must run: compiled on a Hopper card, in the Mosaic GPU
    #      interpreter in "interpret" mode; a call they cannot take raises ValueError naming why.
    hopper: int = -1
    # The form of the Mosaic GPU state passes (kda_mgpu_state). 0: one warpgroup per CTA of 64
    # V columns, two CTAs per SM, each step of the chain issuing all of the chunk's products.
    # The others take one CTA per SM with every input double-buffered. 1: two warpgroups per
    # 64 columns, the products that do not depend on the state (the forward's output; the
    # backward's Aqk^T dO and dO^T QG) on the second, so each step of the chain is shorter:
    # what counts with few chains, where the chain's latency is the time. 2: all 128 columns
    # in one CTA (forward: two warpgroups as in 1; backward: one), each chunk's W, QG, Kg and
    # Aqk read once per value head instead of twice: what counts with many chains, where the
    # passes are bound by memory. 3: chosen by the number of chains (kda_mgpu_state.forms).
    mgpu_state: int = 3

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            allowed, ok = _RULES[field.name]
            # bool is an int subclass: True would pass as 1 and hide a mistaken argument
            if type(value) is not int or not ok(value):
                raise ValueError(f"KernelTuning.{field.name} must be {allowed}, got {value!r}")

    @classmethod
    def parse(cls, spec: str, base: KernelTuning | None = None,
              source: str = "--tune") -> KernelTuning:
        """``base`` (default: ``KernelTuning()``) with the overrides of ``spec``, a string
        "key=int,key=int" such as "bk=16,warps_grad=8" ("" gives ``base``). ``source`` names
        where the string came from in the ValueError raised for a bad item or value."""
        names = [field.name for field in dataclasses.fields(cls)]
        overrides = {}
        for item in filter(None, spec.split(",")):
            key, sep, val = item.partition("=")
            if not sep or key not in names or not val.lstrip("-").isdigit():
                raise ValueError(
                    f"{source}: expected key=int with key in {sorted(names)}, got {item!r}"
                )
            overrides[key] = int(val)
        try:
            return dataclasses.replace(cls() if base is None else base, **overrides)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None


def _power_of_two(x: int, lo: int) -> bool:
    return x >= lo and x & (x - 1) == 0


# KernelTuning field -> (what is allowed, check). Tiles are powers of two (the padded K and V
# are, and each must split into whole tiles) of at least 16 rows or columns (the least a dot
# takes); Triton takes a power of two of warps.
_TILE = ("a power of two >= 16", lambda x: _power_of_two(x, 16))
_WARPS = ("a power of two >= 1", lambda x: _power_of_two(x, 1))
_STAGES = ("an int >= 1", lambda x: x >= 1)
_RULES = {
    "bv_seq": ("0 (automatic) or a power of two >= 16", lambda x: x == 0 or _power_of_two(x, 16)),
    "bv_intra": _TILE, "bk": _TILE, "bk_fwd": _TILE,
    "warps_intra": _WARPS, "warps_seq": _WARPS, "warps_grad": _WARPS, "warps_chan": _WARPS,
    "stages_seq": _STAGES, "stages_intra": _STAGES,
    "hopper": ("-1 (automatic), 0 (Triton only) or 1 (Mosaic GPU)", lambda x: x in (-1, 0, 1)),
    "mgpu_state": ("0, 1, 2 or 3 (automatic)", lambda x: x in (0, 1, 2, 3)),
}
