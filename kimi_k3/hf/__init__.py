r"""Kimi Linear checkpoints (transformers' ``KimiLinearForCausalLM``): import and export.

    from kimi_k3.hf import load_hf_checkpoint, save_hf_checkpoint
    model_config, model = load_hf_checkpoint("Kimi-Linear-48B-A3B-Instruct/")   # a local folder
    logits_BxTxV = model(tokens_BxT)                     # float32, transformers' logits
    save_hf_checkpoint(model, model_config, "out/")      # KimiLinearForCausalLM.from_pretrained("out/")

    python -m kimi_k3.hf import --hf_dir=DIR --workdir=RUN  # RUN/config.py + Orbax step 0
    python -m kimi_k3.hf export --workdir=RUN --hf_dir=DIR  # RUN's newest step as a HF folder

``model_config`` is the ``config.model`` section (an ml_collections ConfigDict, as configs/*.py
give it); ``model`` is a ``HybridLM`` that holds its weights (an NNX module: no separate params).

Every field of config.json either maps onto one of ours, is checked to hold the only value we
compute, or is one that does not change the logits; any other field is an error naming it, as
is a missing, extra or wrongly shaped tensor. The modules, by job:

    config_map  config.json <-> config.model: model_config_from_hf, hf_config_from_model, the
                tables HF_DEFAULTS / HF_ALIASES / HF_FIXED / NO_EFFECT; run_config_from_hf
    layout      which tensor is which parameter, reshaped how (Link, LAYOUTS, detect_layout,
                the plan for import, _hf_tensors for export); model_from_params
    files       safetensors folders: checked (open_checked, check_tensors; a truncated file
                or a config.json that is not JSON named, read_json_file), memory-mapped and
                read onto devices (SafetensorsFolder, load_hf_params, load_hf_checkpoint),
                written into a new folder that appears only when complete
                (save_hf_checkpoint, check_new_folder)
    cli         ``python -m kimi_k3.hf import|export``: import_to_workdir, export_from_workdir,
                build_parser, main
"""

from kimi_k3.hf.cli import build_parser, export_from_workdir, import_to_workdir, main
from kimi_k3.hf.config_map import (
    FINETUNE_LR,
    HF_ALIASES,
    HF_DEFAULTS,
    HF_FIXED,
    NO_EFFECT,
    hf_config_from_model,
    model_config_from_hf,
    run_config_from_hf,
)
from kimi_k3.hf.files import (
    SafetensorsFolder,
    check_new_folder,
    check_tensors,
    load_hf_checkpoint,
    load_hf_params,
    open_checked,
    read_hf_config,
    read_json_file,
    save_hf_checkpoint,
)
from kimi_k3.hf.layout import DENSE_UNDER_MOE, LAYOUTS, Link, detect_layout, model_from_params

__all__ = [
    "DENSE_UNDER_MOE", "FINETUNE_LR", "HF_ALIASES", "HF_DEFAULTS", "HF_FIXED", "LAYOUTS",
    "NO_EFFECT", "Link", "SafetensorsFolder", "build_parser", "check_new_folder", "check_tensors",
    "detect_layout", "export_from_workdir", "hf_config_from_model", "import_to_workdir",
    "load_hf_checkpoint", "load_hf_params", "main", "model_config_from_hf", "model_from_params",
    "open_checked", "read_hf_config", "read_json_file", "run_config_from_hf",
    "save_hf_checkpoint",
]
