"""KDA : MLA ratio ablation (Kimi Linear report: 16 layers, ratios 0, 1, 3, 7, 15).

    python train.py --config=configs/ablate_ratio.py:ratio=3,layers=16 --workdir=runs/ratio3
    python train.py --config=configs/ablate_ratio.py:ratio=0,layers=16,base=tiny --workdir=runs/r0
    python train.py --config=configs/ablate_ratio.py:ratio=all,layers=4,base=tiny --workdir=runs/rk

Arguments (all optional): ratio (KDA layers per MLA layer, default 3; 0 = all MLA; ``all`` =
all KDA, no MLA layer), layers (default 16), base ("small" for the GPU, default, or "tiny" for
CPU: every other model field comes from that config). With a number, the last layer is always
MLA; with ``all`` every layer is KDA. ``python -m kimi_k3.sweep --ratios=0,1,3,all`` trains and
compares a set of them (docs/ablation.md).
"""

import pathlib

from kimi_k3.config_files import load_config, parse_arg

ALL_KDA = "all"  # ratio=all: every layer KDA


def ratio_arg(value: str) -> int | str:
    """``ratio``'s value: ``all`` or an integer (a negative one is refused by the config room,
    naming config.model.kda_per_mla)."""
    if value == ALL_KDA:
        return ALL_KDA
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"config argument ratio={value!r}: not an integer, nor {ALL_KDA!r} "
                         f"(every layer KDA)") from None


def get_config(arg: str | None = None):
    args = {"ratio": 3, "layers": 16, "base": "small"}
    args.update(parse_arg(arg, {"ratio": str, "layers": int, "base": str}))
    args["ratio"] = ratio_arg(str(args["ratio"]))
    if args["base"] not in ("small", "tiny"):
        raise ValueError(f"config argument base: must be 'small' or 'tiny', got {args['base']!r}")
    config = load_config(pathlib.Path(__file__).with_name(f"{args['base']}.py"))
    config.model.num_layers = args["layers"]
    config.model.pattern = ""
    if args["ratio"] == ALL_KDA:  # a unit of `layers` KDA layers (and its MLA cut off): all KDA
        config.model.kda_per_mla = args["layers"]
        config.model.final_mla = False
    else:
        config.model.kda_per_mla = args["ratio"]
        config.model.final_mla = True
    return config
