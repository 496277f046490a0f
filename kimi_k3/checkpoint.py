"""Checkpoints with Orbax: asynchronous saves every N steps, keep the last K, a save on SIGTERM,
and resume from the newest readable checkpoint — onto any mesh.

Layout under ``<workdir>/checkpoints``: one folder per step (``<step>/state``: parameters,
optimizer state, step, RNG as a sharded PyTree; ``<step>/data``: the input position as JSON).
A save in flight lives in a temporary folder that Orbax renames only once complete, so a run
killed mid-save leaves no half-written step behind (the temporary folder is removed at the next
start). A step folder that exists but cannot be read (corrupt, truncated, files missing) is
reported, the previous step is tried, and once an older step restores, the unreadable newer
ones are moved aside to ``<step>.unreadable`` so that training can write that step again.
If no step can be read, the run stops with each step's error rather than start from scratch.

Before a step is read, its saved parameters are held against config.model's
(``check_params_match``, the one check for resuming and for evaluation): another model is an
error naming the parameters that differ, never a partial or silently reshaped load.
``restore_model_for_eval`` reads only the parameters of one step into a ``HybridLM`` (evaluation,
sampling); ``resolve_step_dir`` finds that step from a step, checkpoints or run folder;
``load_model`` takes either such a path or ``init`` (the config's untrained weights).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from kimi_k3.layers.moe import ExpertBias, MoeStat
from kimi_k3.model import HybridLM
from kimi_k3.model_state import init_model
from kimi_k3.run_dir import absolute_path
from kimi_k3.trees import path_str


class PreemptionFlag:
    """Set by SIGTERM (single process). Multi-host jobs ask the checkpoint manager instead:
    JAX's coordination service catches the signal and agrees on a step across hosts."""

    def __init__(self):
        self._event = threading.Event()
        self._previous = None
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        logging.warning("SIGTERM received: saving a checkpoint after this step, then stopping")
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def restore_handler(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def _first_line(e: BaseException, limit: int = 240) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters (TensorStore's errors
    run to pages of JSON). The innermost cause is the one that says what is wrong."""
    while e.__cause__ is not None:
        e = e.__cause__
    line = (str(e).strip().splitlines() or [""])[0]
    line = line if len(line) <= limit else line[: limit - 3] + "..."
    return f"{type(e).__name__}: {line}"


def _is_read_abort_noise(exc: BaseException | None) -> bool:
    """Errors from TensorStore reads still in flight when a failed restore has already given up
    (their asyncio loop is gone), and from their callbacks at interpreter shutdown."""
    text = str(exc)
    return (isinstance(exc, RuntimeError) and text == "Event loop is closed") or (
        isinstance(exc, ImportError) and "Python is likely shutting down" in text)


class _DropAbortedReads(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "exception was never retrieved" not in str(record.msg)


def silence_aborted_reads() -> None:
    """A restore that fails leaves TensorStore reads behind; each later reports "Event loop is
    closed" through ``sys.unraisablehook`` and asyncio's log, pages of it, burying the real
    error. Drop exactly those; anything else still reaches the previous hook."""
    previous = sys.unraisablehook
    if getattr(previous, "_kimi_k3", False):
        return

    def hook(unraisable):
        if not _is_read_abort_noise(unraisable.exc_value):
            previous(unraisable)

    hook._kimi_k3 = True
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_DropAbortedReads())


class Checkpointer:
    """The run's CheckpointManager; ``ckpt_cfg`` is ``config.checkpoint``."""

    def __init__(self, directory: str, ckpt_cfg):
        """``ckpt_cfg``: the checked ``config.checkpoint`` (a CkptSpec: every_steps, keep,
        async_save)."""
        self.directory = epath.Path(absolute_path(directory))
        silence_aborted_reads()
        self.every_steps = ckpt_cfg.every_steps
        options = ocp.CheckpointManagerOptions(
            max_to_keep=ckpt_cfg.keep,
            enable_async_checkpointing=bool(ckpt_cfg.async_save),
            cleanup_tmp_directories=True,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, item_names=("state", "data"),
                                             options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def should_save(self, step: int) -> bool:
        return step % self.every_steps == 0

    def reached_preemption(self, step: int) -> bool:
        return jax.process_count() > 1 and self.manager.reached_preemption(step)

    def save(self, step: int, state, data_state: dict) -> bool:
        """Start saving step ``step`` (asynchronously unless configured otherwise). The arrays
        are copied to host memory before this returns, so ``state`` may be donated after."""
        return self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                    data=ocp.args.JsonSave(data_state)),
            force=True,
        )

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def restore(self, abstract_state):
        """(step, state, data_state) from the newest readable step, or None if there is none.

        ``abstract_state`` holds ``jax.ShapeDtypeStruct``s with the target shardings, so a
        checkpoint written on one mesh restores onto another.
        """
        steps = sorted(self.manager.all_steps(), reverse=True)
        errors = []
        for step in steps:
            try:
                saved = saved_params_metadata(self.directory / str(step) / "state")
            except Exception:  # unreadable: the restore below reports it and falls back
                saved = None
            if saved is not None:
                check_params_match(saved, abstract_state["params"], self.directory / str(step),
                                   advice="Resume with the run's own config (its config.json), "
                                          "or start a new --workdir / checkpoint.dir")
            try:
                out = self.manager.restore(
                    step,
                    args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                            data=ocp.args.JsonRestore()),
                )
            except Exception as e:  # Orbax, TensorStore and the OS raise many kinds here
                logging.error("checkpoint %s is unreadable (%s); trying the previous one",
                              self.directory / str(step), _first_line(e))
                errors.append((step, e))
                continue
            if errors:
                self._set_aside([s for s, _ in errors])
            return step, out["state"], dict(out["data"] or {})
        if errors:
            detail = "; ".join(f"step {s}: {_first_line(e)}" for s, e in errors)
            raise RuntimeError(
                f"checkpoint.dir {str(self.directory)!r}: no step could be restored ({detail}). "
                f"Nothing was moved or deleted; to start afresh, use a new --workdir"
            )
        return None

    def _set_aside(self, steps) -> None:
        if jax.process_index() == 0:
            for s in steps:
                src = self.directory / str(s)
                dst = self.directory / f"{s}.unreadable"
                if src.exists():
                    n = 1
                    while dst.exists():
                        dst, n = self.directory / f"{s}.unreadable{n}", n + 1
                    os.rename(os.fspath(src), os.fspath(dst))
                    logging.warning("moved unreadable checkpoint %s to %s", src, dst)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("kimi_k3_checkpoint_set_aside")
        self.manager.reload()


class NoCheckpoints:
    """``checkpoint.enabled = False``: the Checkpointer's interface, saving and restoring nothing
    (benchmarks and throwaway runs, where writing the state would only cost time)."""

    def latest_step(self) -> None:
        return None

    def should_save(self, step: int) -> bool:
        return False

    def reached_preemption(self, step: int) -> bool:
        return False

    def save(self, step: int, state, data_state: dict) -> bool:
        return False

    def restore(self, abstract_state) -> None:
        return None

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# The saved parameters against a model's: one check for resuming a run and for reading a model
# ---------------------------------------------------------------------------------------------


def saved_params_metadata(state_dir):
    """The ``"params"`` subtree of the metadata saved in a step's ``state`` folder: the saved
    parameters' paths, shapes and dtypes, no array read. Raises what Orbax raises for a folder
    it cannot read, and KeyError when the state holds no "params"."""
    meta = ocp.PyTreeCheckpointer().metadata(epath.Path(state_dir))
    tree = getattr(meta, "item_metadata", meta)  # Orbax versions nest the tree differently
    return getattr(tree, "tree", tree)["params"]


def _shapes(tree) -> dict[str, tuple]:
    """'embed/embedding' -> shape, for every leaf of a parameter tree (arrays,
    ``jax.ShapeDtypeStruct``s or Orbax metadata alike)."""
    return {path_str(k): tuple(x.shape) for k, x in jax.tree_util.tree_leaves_with_path(tree)}


def check_params_match(saved_params, model_params, step_dir: str | os.PathLike, advice: str) -> None:
    """Raise ValueError unless ``saved_params`` (a checkpoint's, e.g. from
    ``saved_params_metadata``) and ``model_params`` (config.model's, abstract or real) have the
    same paths with the same shapes.

    The message names ``step_dir`` and the first few parameters of each kind of difference
    (another shape, missing from the checkpoint, not in config.model), then ``advice``: what
    the caller's user should do about it.
    """
    saved, model = _shapes(saved_params), _shapes(model_params)
    shapes = [k for k in model if k in saved and saved[k] != model[k]]
    missing = [k for k in model if k not in saved]
    extra = [k for k in saved if k not in model]
    if not (shapes or missing or extra):
        return
    shown = 3  # of each kind: enough to see the pattern (a width, a layer kind) without pages
    items = [f"{k}: checkpoint {saved[k]} vs config {model[k]}" for k in shapes[:shown]]
    items += [f"{k} {model[k]}: in config.model, not in the checkpoint" for k in missing[:shown]]
    items += [f"{k} {saved[k]}: in the checkpoint, not in config.model" for k in extra[:shown]]
    more = len(shapes) + len(missing) + len(extra) - len(items)
    # The first shape difference also in the trainer's older "checkpoint S, config E" wording,
    # which scripts and tests match, beside eval's "checkpoint S vs config E".
    first = f" (the first: checkpoint {saved[shapes[0]]}, config {model[shapes[0]]})" if shapes else ""
    counts = (f"{len(shapes)} parameters differ in shape{first}, {len(missing)} are missing from "
              f"the checkpoint, {len(extra)} are not in config.model")
    raise ValueError(
        f"checkpoint {str(step_dir)!r} does not match config.model: {counts}: "
        + "; ".join(items) + (f"; and {more} more" if more else "") + f". {advice}"
    )


# ---------------------------------------------------------------------------------------------
# Reading a checkpoint's parameters outside training (evaluation, sampling)
# ---------------------------------------------------------------------------------------------


def _step_folders(directory: epath.Path) -> list[epath.Path]:
    """The step folders (named by their step, holding ``state/``) in ``directory``, newest first."""
    if not directory.is_dir():
        return []
    steps = [d for d in directory.iterdir() if d.name.isdigit() and (d / "state").is_dir()]
    return sorted(steps, key=lambda d: int(d.name), reverse=True)


def resolve_step_dir(path: str) -> tuple[str, int]:
    """(step folder, step) for a step folder (``<run>/checkpoints/<step>``, with ``state/``
    inside), a checkpoints folder (its newest step) or a run folder (the newest step of its
    ``checkpoints/``).

    Errors name ``--checkpoint``, the flag eval.py reads the path from: FileNotFoundError when
    ``path`` does not exist or holds no step, ValueError for a step folder not named by its step.
    """
    p = epath.Path(path)  # local or a URL (gs://...), as the trainer writes them
    if not p.exists():
        raise FileNotFoundError(f"--checkpoint: {path!r} does not exist")
    if (p / "state").is_dir():
        if not p.name.isdigit():
            raise ValueError(f"--checkpoint: {path!r} holds a state/ folder but is not named by its step")
        return path, int(p.name)
    for directory in (p, p / "checkpoints"):
        found = _step_folders(directory)
        if found:
            return os.fspath(found[0]), int(found[0].name)
    raise FileNotFoundError(
        f"--checkpoint: {path!r} is not a checkpoint step folder (<run>/checkpoints/<step> with a "
        f"state/ inside), a checkpoints folder or a run folder holding one"
    )


def restore_model_for_eval(config, path: str, config_name: str = "--config") -> tuple[HybridLM, int]:
    """(a ``HybridLM`` for ``config.model`` holding the parameters saved at ``path``, its step),
    on the first device.

    ``path``: anything ``resolve_step_dir`` takes (a step, checkpoints or run folder). Only the
    parameters are read (an Orbax partial restore of ``<step>/state``'s "params"); the optimizer
    state never is. They are checked against config.model first (``check_params_match``); the
    error names ``config_name``, where ``config`` came from, and the run's own config.json when
    the run folder has one. A mixture of experts' routing biases are read with them; the rest
    of the model's non-parameter state comes from ``config.seed``, as in training.
    """
    step_dir, step = resolve_step_dir(path)
    state_dir = os.path.join(absolute_path(step_dir), "state")  # Orbax refuses relative paths
    seed = int(config.get("seed", 0))
    make = lambda: HybridLM(config.model, rngs=nnx.Rngs(seed))
    graphdef, abs_params, abs_biases, abs_rest = nnx.split(nnx.eval_shape(make), nnx.Param,
                                                           ExpertBias, ...)
    want = nnx.to_pure_dict(abs_params)

    try:
        saved = saved_params_metadata(state_dir)
    except Exception as e:  # Orbax raises several kinds for a folder it cannot read
        raise ValueError(f"--checkpoint {path!r}: cannot read parameters from {state_dir!r} "
                         f"({_first_line(e, 300)})") from e
    run_config = os.path.join(os.path.dirname(os.path.dirname(os.path.normpath(step_dir))),
                              "config.json")
    hint = f"; the run's own config is in {run_config}" if os.path.isfile(run_config) else ""
    check_params_match(saved, want, step_dir, advice=(
        f"config.model came from {config_name}; pass the config the checkpoint was trained with "
        f"(--checkpoint=PATH@CONFIG){hint}"))

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    on_device = lambda tree: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)
    item = {"params": on_device(want)}
    if jax.tree.leaves(abs_biases):  # a mixture of experts routes with its trained biases
        item["model_state"] = on_device(nnx.to_pure_dict(abs_biases))
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=device, dtype=x.dtype), item)
    out = ocp.PyTreeCheckpointer().restore(state_dir, args=ocp.args.PyTreeRestore(
        item=item, restore_args=restore_args, partial_restore=True))
    nnx.replace_by_pure_dict(abs_params, out["params"])
    if "model_state" in item:
        nnx.replace_by_pure_dict(abs_biases, out["model_state"])
    # The rest: measurements a forward pass overwrites (zeros will do), anything else as the
    # initialiser makes it.
    abs_stats, abs_other = nnx.split_state(abs_rest, MoeStat, ...)
    stats = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype, device=device), abs_stats)
    other = (jax.jit(lambda: nnx.split(make(), nnx.Param, ExpertBias, MoeStat, ...)[4])()
             if jax.tree.leaves(abs_other) else abs_other)
    return nnx.merge(graphdef, abs_params, abs_biases, stats, other), step


INIT_CHECKPOINT = "init"  # --checkpoint=init: the config's freshly initialised weights


def load_model(config, checkpoint: str, config_name: str = "--config") -> tuple[HybridLM, int | None]:
    """(a ``HybridLM`` for ``config.model``, its step) with the weights of ``checkpoint``: a step,
    checkpoints or run folder (``restore_model_for_eval``), or ``init`` for the weights
    ``config.seed`` initialises (step None).

    Raises FileNotFoundError naming a missing path, ValueError naming the parameters where
    ``config`` (from ``config_name``) and the checkpoint disagree.
    """
    if checkpoint == INIT_CHECKPOINT:
        return init_model(config.model, int(config.get("seed", 0))), None
    return restore_model_for_eval(config, checkpoint, config_name=config_name)
