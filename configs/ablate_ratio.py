"""KDA : MLA ratio ablation (Kimi Linear report: 16 layers, ratios 0, 1, 3, 7, 15).

    python train.py --config=configs/ablate_ratio.py:ratio=3,layers=16 --workdir=runs/ratio3
    python train.py --config=configs/ablate_ratio.py:ratio=0,layers=16,base=tiny --workdir=runs/r0

Arguments (all optional): ratio (KDA layers per MLA layer, default 3; 0 = all MLA),
layers (default 16), base ("small" for the GPU, default, or "tiny" for CPU: every other model
field comes from that config). The last layer is always MLA.
"""

import pathlib

from kimi_k3.config_files import load_config, parse_arg


def get_config(arg: str | None = None):
    args = {"ratio": 3, "layers": 16, "base": "small"}
    args.update(parse_arg(arg, {"ratio": int, "layers": int, "base": str}))
    if args["base"] not in ("small", "tiny"):
        raise ValueError(f"config argument base: must be 'small' or 'tiny', got {args['base']!r}")
    config = load_config(pathlib.Path(__file__).with_name(f"{args['base']}.py"))
    config.model.kda_per_mla = args["ratio"]
    config.model.num_layers = args["layers"]
    config.model.final_mla = True
    config.model.pattern = ""
    return config
