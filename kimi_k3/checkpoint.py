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
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

import jax
import orbax.checkpoint as ocp
from etils import epath


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


def absolute_path(path: str) -> str:
    """``path`` made absolute against the current directory; URLs (``gs://...``) unchanged.
    Orbax refuses relative checkpoint paths, and a path that is absolute once stays right if
    the process changes its directory later."""
    path = os.fspath(path)
    if "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


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
            problems = param_mismatches(self.directory / str(step) / "state",
                                        abstract_state["params"])
            if problems:
                raise ValueError(
                    f"checkpoint {str(self.directory / str(step))!r} holds another model than "
                    f"config.model: {problems}. Resume with the run's own config (its "
                    f"config.json), or start a new --workdir / checkpoint.dir")
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
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("kimi_k3_checkpoint_set_aside")
        self.manager.reload()


# ---------------------------------------------------------------------------------------------
# Reading a checkpoint's parameters outside training (evaluation, sampling)
# ---------------------------------------------------------------------------------------------


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


def resolve_step_dir(path: str) -> tuple[epath.Path, int | None]:
    """A step folder (``.../checkpoints/2000``) as given, or the newest step folder inside a
    run's checkpoint folder. Raises FileNotFoundError naming the path."""
    p = epath.Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint: {path!r} does not exist")
    if (p / "state").exists():
        return p, int(p.name) if p.name.isdigit() else None
    steps = sorted(int(d.name) for d in p.iterdir() if d.name.isdigit() and (d / "state").exists())
    if not steps:
        raise FileNotFoundError(
            f"checkpoint: {path!r} is neither a step folder (with state/) nor a folder of them"
        )
    return p / str(steps[-1]), steps[-1]


def _flat_shapes(tree) -> dict[str, tuple]:
    from kimi_k3.optim import path_str

    return {path_str(k): tuple(x.shape) for k, x in jax.tree_util.tree_leaves_with_path(tree)}


def param_mismatches(state_dir, abstract_params) -> str:
    """'' when the parameters saved under ``state_dir`` have the paths and shapes of
    ``abstract_params``; else a description of the first differences. A folder whose metadata
    cannot be read gives '' (the restore itself then reports it)."""
    try:
        meta = ocp.PyTreeCheckpointer().metadata(epath.Path(state_dir))
        tree = getattr(meta, "item_metadata", meta)
        saved = getattr(tree, "tree", tree)["params"]
    except Exception:  # unreadable: left to the restore, which reports and falls back
        return ""
    have, need = _flat_shapes(saved), _flat_shapes(abstract_params)
    problems = [f"{k}: checkpoint {have[k]}, config {s}" for k, s in need.items()
                if k in have and have[k] != s]
    problems += [f"{k} {s} not in the checkpoint" for k, s in need.items() if k not in have]
    problems += [f"{k} {s} not in the config's model" for k, s in have.items() if k not in need]
    if not problems:
        return ""
    more = f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""
    return "; ".join(problems[:6]) + more


def restore_model_for_eval(config, path: str):
    """(HybridLM with the checkpoint's parameters, step) on the default device.

    ``path``: a step folder or a run's checkpoint folder (its newest step). Only the
    parameters are read (no optimizer state). Raises ValueError naming the parameters where
    ``config.model`` and the checkpoint disagree (missing, unexpected, other shape).
    """
    from flax import nnx

    from kimi_k3 import train_lib

    step_dir, step = resolve_step_dir(path)
    seed = int(config.get("seed", 0))
    abstract = nnx.eval_shape(lambda: train_lib.make_model(config.model, seed))
    graphdef, abs_params_state, abs_rest = nnx.split(abstract, nnx.Param, ...)
    want = nnx.to_pure_dict(abs_params_state)

    handler = ocp.PyTreeCheckpointer()
    saved = handler.metadata(step_dir / "state").item_metadata
    if "params" not in saved:
        raise ValueError(f"checkpoint {str(step_dir)!r}: no 'params' in its state")
    have, need = _flat_shapes(saved["params"]), _flat_shapes(want)
    problems = [f"missing {k} {s}" for k, s in need.items() if k not in have]
    problems += [f"unexpected {k} {s}" for k, s in have.items() if k not in need]
    problems += [f"{k}: checkpoint {have[k]} vs config {s}" for k, s in need.items()
                 if k in have and have[k] != s]
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise ValueError(
            f"checkpoint {str(step_dir)!r} does not match config.model: "
            f"{'; '.join(problems[:10])}{more}"
        )

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {"params": jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), want)}
    params = handler.restore(
        step_dir / "state",
        args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True),
    )["params"]
    rest = abs_rest
    if jax.tree.leaves(abs_rest):
        rest = nnx.split(train_lib.make_model(config.model, seed), nnx.Param, ...)[2]
    return nnx.merge(graphdef, nnx.State(params), rest), step
