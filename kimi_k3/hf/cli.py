r"""``python -m kimi_k3.hf import|export``: a Kimi Linear folder -> a run folder, and back.

    python -m kimi_k3.hf import --hf_dir=DIR --workdir=RUN [--dtype=...] [--param_dtype=...]
    python -m kimi_k3.hf export --workdir=RUN --hf_dir=OUT [--checkpoint=STEP] [--config=FILE]

import (``import_to_workdir``) writes the run folder the trainer, eval.py and generate.py read:
RUN/config.py (its model section from RUN/hf_config.json, a copy of config.json, through
``run_config_from_hf``), the folder's tokenizer when it has one (``tokenizer_files``: a
tokenizers JSON, or Kimi's tiktoken.model with its tokenizer_config.json), and an Orbax checkpoint
at step 0 in the trainer's layout: the weights, the routing biases and a fresh optimizer state,
on the trainer's mesh and shardings (``kimi_k3.train_state.state_layout``; the trainer itself,
kimi_k3.train_lib, is not imported). Every field and tensor is checked before anything is
written, and a workdir that already holds checkpoints is refused.

export (``export_from_workdir``) loads the run's config file with
``kimi_k3.config_files.load_config`` (``path[:arg]``; default RUN/config.py), restores a step
as eval.py does (default the newest) and writes it in the released layout
(``save_hf_checkpoint``) with the token ids of RUN/hf_config.json (else ``data.eos_id``) and the
run's tokenizer. OUT must not exist yet or be empty (export never mixes its files with old
ones); the files are written into a staging folder that becomes OUT only once complete, so a
failed or interrupted export leaves no folder that looks like a checkpoint.

``main`` ends every error in one line (``kimi_k3.cli.guarded``): a bad file, tensor or folder
exits 1 naming it, a bad argument exits 2 (argparse's usage line); ``--debug`` (or
``KIMI_K3_DEBUG=1``) shows the traceback.

``build_parser()`` returns the argparse parser, so documented commands can be parsed without
running them.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import shutil

import jax
import jax.numpy as jnp

from kimi_k3 import checkpoint as ckpt_lib
from kimi_k3 import cli
from kimi_k3 import mesh as mesh_lib
from kimi_k3.config import DTYPES, ConfigError, run_spec
from kimi_k3.config_files import load_config
from kimi_k3.data import NO_TOKENIZER, TIKTOKEN_CONFIG, TextTokenizer
from kimi_k3.hf.config_map import hf_config_from_model, run_config_from_hf
from kimi_k3.hf.files import (
    check_new_folder,
    load_hf_params,
    open_checked,
    read_hf_config,
    read_json_file,
    save_hf_checkpoint,
    unused_sibling,
)
from kimi_k3.run_dir import check_workdir
from kimi_k3.runtime import quiet_library_logs
from kimi_k3.train_state import state_layout

_RUN_CONFIG = '''"""Kimi Linear imported from {hf_dir} by ``python -m kimi_k3.hf import``.

    python train.py --config={workdir}/config.py --workdir={workdir}    # fine-tunes from step 0
    python eval.py --config={workdir}/config.py --workdir={workdir}/eval --checkpoint={workdir}
    python generate.py --config={workdir}/config.py --workdir={workdir} --prompt_ids=1,2,3
    python -m kimi_k3.hf export --workdir={workdir} --hf_dir=OUT

The model section comes from hf_config.json beside this file (kimi_k3.hf.model_config_from_hf),
the rest from the trainer's defaults (kimi_k3.hf.run_config_from_hf); override fields with
--config.<section>.<field>=... . Step 0 holds a fresh optimizer state for the opt section as
it was at import: changing opt.name afterwards makes that step unreadable.
"""

import json
import pathlib

from kimi_k3.hf import run_config_from_hf


def get_config(arg=None):
    if arg:
        raise ValueError(f"this config takes no argument, got {{arg!r}}")
    hf = json.loads((pathlib.Path(__file__).parent / "hf_config.json").read_text())
    return run_config_from_hf(hf, dtype={dtype!r}, tokenizer={tokenizer!r},
                              param_dtype={param_dtype!r})
'''


TIKTOKEN_FILE = "tiktoken.model"  # Kimi's checkpoints ship their BPE under this name


def tokenizer_files(hf_dir) -> list[str]:
    """The tokenizer files of a Kimi Linear folder, the one ``data.tokenizer`` names first:
    ``tokenizer.json`` (a tokenizers JSON) when there is one, else ``tiktoken.model`` and, when
    there, the ``tokenizer_config.json`` holding its special tokens (what the published
    checkpoints ship); [] for none. The tokenizer is read here, so a damaged file is refused
    (naming it) before anything is written."""
    hf_dir = pathlib.Path(hf_dir)
    if (hf_dir / "tokenizer.json").is_file():
        return ["tokenizer.json"]
    if not (hf_dir / TIKTOKEN_FILE).is_file():
        return []
    TextTokenizer(os.fspath(hf_dir / TIKTOKEN_FILE))  # reads the ranks and the special tokens
    return [TIKTOKEN_FILE] + ([TIKTOKEN_CONFIG] if (hf_dir / TIKTOKEN_CONFIG).is_file() else [])


def import_to_workdir(hf_dir, workdir, dtype: str = "float32",
                      param_dtype: str = "float32") -> str:
    """``hf_dir`` (a Kimi Linear folder) -> ``workdir``: ``config.py`` (with ``hf_config.json``
    and, when the folder has one, ``tokenizer.json``) and an Orbax checkpoint at step 0 in the
    trainer's layout (parameters in ``param_dtype``, routing biases, a fresh optimizer state,
    on the trainer's mesh and shardings); the run computes in ``dtype``. Refuses a workdir that
    already holds checkpoints. Returns the step folder."""
    hf_dir = pathlib.Path(hf_dir)
    hf = read_hf_config(hf_dir)
    # Every field and tensor checked before anything is written.
    try:
        model_config = run_config_from_hf(hf, dtype, "", param_dtype).model
    except ValueError as e:  # "config.json: <field> ...": named with its folder
        text = str(e)
        if text.startswith("config.json: "):
            raise ValueError(f"file {os.fspath(hf_dir / 'config.json')!r}: "
                             f"{text[len('config.json: '):]}") from e
        raise
    open_checked(hf_dir, model_config)
    tok_files = tokenizer_files(hf_dir)
    workdir = pathlib.Path(check_workdir(os.fspath(workdir)))
    ckpt_dir = workdir / "checkpoints"
    # Finished steps only: what an interrupted import leaves (Orbax's temporary folder) is
    # removed by the next save, so the same command runs again.
    if ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir()):
        raise ValueError(f"--workdir: {str(workdir)!r} already holds checkpoints; import into "
                         f"a new folder, e.g. --workdir={unused_sibling(workdir)}")
    # Without a tokenizer the model's ids are no text we can read: "none" makes eval.py and
    # generate.py refuse text (naming what to give) rather than read bytes as its ids.
    tokenizer = NO_TOKENIZER
    for name in tok_files:
        shutil.copy(hf_dir / name, workdir / name)
    if tok_files:
        tokenizer = os.fspath(workdir / tok_files[0])
    config = run_config_from_hf(hf, dtype, tokenizer, param_dtype)
    spec = run_spec(config)
    layout = state_layout(spec, mesh_lib.make_mesh(spec.mesh))
    shardings = layout.state_shardings
    params, biases = load_hf_params(hf_dir, config.model, shardings)
    with layout.context():
        opt_state = jax.jit(layout.tx.init, out_shardings=shardings["opt_state"])(params)
    state = {"params": params, "opt_state": opt_state,
             "step": jax.device_put(jnp.zeros((), jnp.int32), shardings["step"]),
             "rng": jax.device_put(jax.random.PRNGKey(spec.seed + 1), shardings["rng"])}
    if "model_state" in shardings:
        state["model_state"] = biases
    ckpt = ckpt_lib.Checkpointer(os.fspath(ckpt_dir), spec.checkpoint)
    try:
        ckpt.save(0, state, {"position": 0})
    finally:
        ckpt.close()
    shutil.copy(hf_dir / "config.json", workdir / "hf_config.json")
    (workdir / "config.py").write_text(_RUN_CONFIG.format(
        hf_dir=os.fspath(hf_dir), workdir=os.fspath(workdir), dtype=dtype, tokenizer=tokenizer,
        param_dtype=param_dtype))
    return os.fspath(ckpt_dir / "0")


def export_from_workdir(workdir, hf_dir, checkpoint: str | None = None,
                        config_path: str | None = None) -> list[str]:
    """A run's checkpoint (``checkpoint``, default the newest under ``workdir``) -> a Kimi
    Linear folder ``hf_dir``. The config: ``config_path`` (``path[:arg]``, loaded by
    ``kimi_k3.config_files.load_config``; a run folder means its ``config.py``), default
    ``workdir/config.py`` (what ``import`` and ``train.py`` write). Token ids come from
    ``workdir/hf_config.json`` when there is one, else ``data.eos_id``. Returns the files written."""
    workdir = pathlib.Path(workdir)
    check_new_folder(hf_dir, "--hf_dir")  # before anything is read
    if config_path:  # a config file, or a run folder (its config.py), as --config takes anywhere
        config_spec = cli.resolve_config_path(os.fspath(config_path))
    else:
        config_spec = os.fspath(workdir / "config.py")
        if not os.path.isfile(config_spec):
            raise FileNotFoundError(f"--workdir: {str(workdir)!r} holds no config.py (import and "
                                    f"train.py write one); give the run's config file with "
                                    f"--config=FILE")
    try:
        config = load_config(config_spec)
    except ConfigError:
        raise
    except Exception as e:  # the config file's own error, named with its flag
        raise ConfigError(f"--config={config_spec}: {cli.one_line(e)}") from e
    hf_config_from_model(config.model)  # a model transformers cannot run fails before reading
    model, _ = ckpt_lib.restore_model_for_eval(config, checkpoint or os.fspath(workdir),
                                               config_name=config_spec)
    extra = {}
    original = workdir / "hf_config.json"
    if original.is_file():
        hf = read_json_file(original)
        extra = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf}
    elif "data" in config and config.data.eos_id >= 0:
        extra = {"eos_token_id": config.data.eos_id}
    tok = config.data.tokenizer if "data" in config else ""
    tokenizer = {}
    if tok and os.path.isfile(tok):
        own = pathlib.Path(tok)
        if TextTokenizer(tok).kind == "tiktoken":  # with its special tokens, when it has them
            tokenizer = {TIKTOKEN_FILE: tok}
            if (own.parent / TIKTOKEN_CONFIG).is_file():
                tokenizer[TIKTOKEN_CONFIG] = os.fspath(own.parent / TIKTOKEN_CONFIG)
        else:
            tokenizer = {"tokenizer.json": tok}
    return save_hf_checkpoint(model, config.model, hf_dir, extra_config=extra,
                              extra_files=tokenizer)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m kimi_k3.hf``: subcommands ``import`` and ``export``."""
    parser = argparse.ArgumentParser(prog="python -m kimi_k3.hf",
                                     description="Kimi Linear checkpoints: import and export.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (also KIMI_K3_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", parents=[common],
                         help="a transformers folder -> a workdir (config.py + step 0)")
    imp.add_argument("--hf_dir", required=True, help="config.json + *.safetensors")
    imp.add_argument("--workdir", required=True, help="the run folder to create")
    imp.add_argument("--dtype", default="float32", choices=tuple(DTYPES),
                     help="the run's compute dtype (model.dtype)")
    imp.add_argument("--param_dtype", default="float32", choices=tuple(DTYPES),
                     help="the parameters' dtype in the checkpoint and in training")
    exp = sub.add_parser("export", parents=[common],
                         help="a workdir's checkpoint -> a transformers folder")
    exp.add_argument("--workdir", required=True)
    exp.add_argument("--hf_dir", required=True,
                     help="the folder to write: one that does not exist yet, or an empty one")
    exp.add_argument("--checkpoint", default=None, help="a step folder (default: the newest)")
    exp.add_argument("--config", default=None, help="the run's config file, path[:arg], or "
                                                    "a run folder (default: WORKDIR/config.py)")
    return parser


def main(argv=None, process: bool = False) -> None:
    """``python -m kimi_k3.hf``: argparse's errors exit 2 with its usage line; the command's own
    (a missing or damaged file, a tensor, a non-empty --hf_dir) end in one line and exit 1.
    ``process``: this is the whole process (``__main__``; see ``kimi_k3.cli.guarded``)."""
    args = build_parser().parse_args(argv)
    cli.guarded(_run, debug=lambda: args.debug or cli.debug_requested(()), process=process)(args)


def next_commands(workdir: str) -> list[str]:
    """What to run on an imported run folder, as commands that work as printed (each uses the
    run's own config, tokenizer included): generate and evaluate; without a tokenizer, token
    ids for generate and what eval.py needs instead of a command that would fail."""
    config = load_config(workdir)
    has_text = config.data.tokenizer != NO_TOKENIZER
    run = shlex.quote(workdir)
    prompt = "--prompt='Hello'" if has_text else "--prompt_ids=1,2,3"
    lines = ["next:",
             f"  python generate.py --checkpoint={run} {prompt} --max_new_tokens=16"]
    if has_text:
        lines.append(f"  python eval.py --checkpoint={run} --workdir={run}/eval "
                     f"--context_lengths=512 --max_windows=4")
    else:
        lines.append("  eval.py and training need text in this model's tokens, and no "
                     "tokenizer.json came with the checkpoint: give token files "
                     "(--config.data.source=tokens --config.data.paths=FILE) or its tokenizer "
                     "(--config.data.tokenizer=PATH)")
    return lines


def _run(args: argparse.Namespace) -> None:
    quiet_library_logs()  # Orbax's INFO lines and its harmless metadata warning
    if args.command == "import":
        step = import_to_workdir(args.hf_dir, args.workdir, args.dtype, args.param_dtype)
        print(f"imported {args.hf_dir} -> {step}; config: {args.workdir}/config.py")
        print("\n".join(next_commands(args.workdir)))
    else:
        files = export_from_workdir(args.workdir, args.hf_dir, args.checkpoint, args.config)
        print(f"exported to {args.hf_dir}: {', '.join(files)}")
