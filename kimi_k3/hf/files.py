r"""Safetensors folders: checked, read onto devices, written.

A folder holds ``config.json`` and one ``model.safetensors``, several ``*.safetensors`` files,
or shards named by ``model.safetensors.index.json``. Before any tensor is read every name and
shape is checked against the model config.json describes (``open_checked``, ``check_tensors``:
the headers only); a missing, extra or wrongly shaped tensor is a ValueError naming it as its
file names it. Each header is checked against its file's size first, so a truncated file (an
interrupted download) is named with the tensor that runs past its end, not found when that
tensor is read; a config.json or index that is not JSON is named with the line and column.

Memory: the safetensors files are memory-mapped and every parameter is built by
``jax.make_array_from_callback`` with its target sharding: each device's shard is sliced out of
the mapped file (one layer of one tensor at a time) and copied to that device, so no complete
host copy of the model exists. (The files are mapped with NumPy from the safetensors header
rather than through ``safe_open``, whose NumPy backend cannot return bfloat16, the released
checkpoints' dtype.) Export (``save_hf_checkpoint``) gathers one tensor at a time and writes
files of at most ``max_shard_bytes`` with a ``model.safetensors.index.json``, into a folder
that does not exist yet or is empty (``check_new_folder``: never mixed with old files), staged
so that the folder appears only once complete (``_new_folder``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import re
import shlex
import shutil
import tempfile

import jax
import ml_collections
import ml_dtypes
import numpy as np
import safetensors.numpy
from flax import nnx

from kimi_k3.config import ModelSpec, model_spec
from kimi_k3.hf.config_map import hf_config_from_model, model_config_from_hf
from kimi_k3.hf.layout import (
    DENSE_UNDER_MOE,
    Link,
    _empty_shared,
    _hf_tensors,
    _keys,
    _leaf_layers,
    _plan,
    detect_layout,
    model_from_params,
)
from kimi_k3.layers.moe import ExpertBias
from kimi_k3.model import HybridLM

# safetensors dtype names <-> NumPy dtypes (bfloat16 through ml_dtypes).
_ST_DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
              "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16)}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_MAX_HEADER = 100_000_000  # the safetensors library's own limit on a header's bytes


def read_json_file(file) -> dict:
    """A JSON object from ``file``; ValueError naming the file, and where it stops being JSON,
    for anything else."""
    file = pathlib.Path(file)
    try:
        value = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"file {str(file)!r} is not UTF-8 text (byte {e.start}); a JSON file was "
                         f"expected: copy it again from the checkpoint's source") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"file {str(file)!r} is not valid JSON: {e.msg} at line {e.lineno} column "
                         f"{e.colno}; fix the file, or copy it again from the checkpoint's "
                         f"source") from None
    if not isinstance(value, dict):
        raise ValueError(f"file {str(file)!r} holds a JSON {type(value).__name__}, not an object "
                         f"{{...}} of fields")
    return value


def _read_header(file: pathlib.Path) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """A safetensors file's tensors: name -> (dtype, shape, first byte, end byte), each checked
    to lie inside the file with the size its dtype and shape need (a truncated file is named
    here, not when a tensor is read)."""
    size = file.stat().st_size
    again = "copy or download the file again (an interrupted transfer leaves a short file)"
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 <= n <= min(size - 8, _MAX_HEADER):
            raise ValueError(f"file {str(file)!r} ({size} bytes) is truncated or not a safetensors "
                             f"file: its header length ({n if n >= 0 else 'missing'}) runs past "
                             f"the end; {again}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        raise ValueError(f"file {str(file)!r}: its safetensors header is not a JSON object "
                         f"({str(e).splitlines()[0]}); {again}") from None
    header.pop("__metadata__", None)
    out = {}
    for key, h in header.items():
        try:
            dt, shape, (lo, hi) = h["dtype"], tuple(int(d) for d in h["shape"]), h["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"file {str(file)!r}: tensor {key!r} has no dtype, shape and "
                             f"data_offsets in the header; {again}") from None
        if dt not in _ST_DTYPES:
            raise ValueError(f"tensor {key!r} in {file.name!r}: dtype {dt} is not one of "
                             f"{sorted(_ST_DTYPES)}")
        want = math.prod(shape) * _ST_DTYPES[dt].itemsize
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi
                and hi - lo == want):
            raise ValueError(f"file {str(file)!r}: tensor {key!r} ({dt} {list(shape)}, {want} bytes) "
                             f"has data_offsets {[lo, hi]} in the header; {again}")
        if 8 + n + hi > size:
            raise ValueError(f"file {str(file)!r} is truncated: it has {size} bytes, but tensor "
                             f"{key!r} ({dt} {list(shape)}) ends at byte {8 + n + hi}; {again}")
        out[key] = (dt, shape, 8 + n + lo, 8 + n + hi)
    return out


class SafetensorsFolder:
    """The tensors of a folder's ``*.safetensors`` (``model.safetensors.index.json`` when there
    is one), each a read-only NumPy view into the memory-mapped file: nothing is read until
    sliced."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json_file(index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(
                    isinstance(v, str) for v in weight_map.values()):
                raise ValueError(f"file {str(index)!r}: no \"weight_map\" of tensor names to file "
                                 f"names; copy the file again from the checkpoint's source")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"folder {str(self.path)!r}: no *.safetensors files")
        self.entries: dict[str, tuple[str, str, tuple[int, ...], int, int]] = {}
        self._file_names: dict[str, str] = {}  # our name -> the file's (after ``rename``)
        self._maps: dict[str, np.memmap] = {}
        for name in files:
            file = self.path / name
            if not file.is_file():
                raise FileNotFoundError(f"file {str(index)!r} names {name!r}, which does not exist")
            for key, entry in _read_header(file).items():
                if key in self.entries:
                    raise ValueError(f"tensor {key!r} is in both {self.entries[key][0]!r} and "
                                     f"{name!r}")
                self.entries[key] = (name, *entry)

    def names(self) -> set[str]:
        return set(self.entries)

    def rename(self, pattern: str, replacement: str) -> None:
        """Reads the tensors whose name matches ``pattern`` under ``re.sub``'s new name (errors
        still give the file's name, ``file_name``). Two tensors that become one name are a
        ValueError naming both."""
        entries, names = {}, {}
        for key, v in self.entries.items():
            new = re.sub(pattern, replacement, key)
            if new in entries:
                first, second = sorted((names[new], key))
                raise ValueError(f"folder {str(self.path)!r} holds the same weight twice: "
                                 f"{first!r} and {second!r}; keep one of them")
            entries[new], names[new] = v, self.file_name(key)
        self.entries, self._file_names = entries, names

    def file_name(self, key: str) -> str:
        """The name ``key`` has in its file (``rename`` may have read it under another)."""
        return self._file_names.get(key, key)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key][2]

    def __getitem__(self, key: str) -> np.ndarray:
        file, dt, shape, lo, hi = self.entries[key]
        if file not in self._maps:
            self._maps[file] = np.memmap(self.path / file, dtype=np.uint8, mode="r")
        dtype = _ST_DTYPES[dt]
        if math.prod(shape) == 0:
            return np.zeros(shape, dtype)
        return np.ndarray(shape, dtype, buffer=self._maps[file], offset=lo)


def check_tensors(folder: SafetensorsFolder, plans: list[dict], spec: ModelSpec,
                  layout: str) -> None:
    """Every tensor the plans read is in ``folder`` with its shape, and ``folder`` holds no
    other; else ValueError naming the tensors. Nothing is read but the headers."""
    want = {}
    for plan in plans:
        for _, links in plan.values():
            for link in links:
                want.update(dict(link.hf))
    have = folder.names()
    optional = {k: v for k, v in _empty_shared(spec, layout).items() if k in have}
    want.update(optional)
    missing = sorted(set(want) - have)
    extra = sorted(have - set(want))
    shapes = sorted(k for k in set(want) & have if tuple(folder.shape(k)) != tuple(want[k]))
    if missing or extra or shapes:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (the first: {missing[:3]})")
        if extra:
            parts.append(f"{len(extra)} not in the model config.json describes (the first: "
                         f"{[folder.file_name(k) for k in extra[:3]]})")
        if shapes:  # named as in the file, which may say block_sparse_moe. for our mlp.
            parts.append("wrong shapes: " + "; ".join(
                f"{folder.file_name(k)} (in {folder.entries[k][0]}) is "
                f"{list(folder.shape(k))}, expected {list(want[k])}" for k in shapes[:3]))
        raise ValueError(f"checkpoint {str(folder.path)!r} ({layout} layout) does not match its "
                         f"config.json: " + "; ".join(parts))


def _read_array(folder: SafetensorsFolder, stacked: bool, links: list[Link], abstract, sharding):
    """One parameter on ``sharding``, each device's block built from the mapped tensors: one
    layer of one tensor at a time (of routed experts, only the device's experts)."""
    dtype = abstract.dtype

    def layer_block(link, index):
        if link.experts is None:
            return np.asarray(link.build(*(folder[name] for name, _ in link.hf)))[index]
        num = abstract.shape[1 if stacked else 0]
        es = range(*index[0].indices(num))
        return np.asarray(link.experts(es, folder.__getitem__))[(slice(None), *index[1:])]

    def block(index):
        if not stacked:
            return np.asarray(layer_block(links[0], index), dtype=dtype)
        rows = range(*index[0].indices(len(links)))
        return np.stack([np.asarray(layer_block(links[r], index[1:]), dtype=dtype) for r in rows])

    return jax.make_array_from_callback(abstract.shape, sharding, block)


def _fill(folder, plan: dict, abstract_tree: dict, shardings) -> dict:
    """``abstract_tree``'s arrays read from ``folder`` onto ``shardings`` (a matching tree;
    None: the first device)."""
    flat_sh = dict(_flat(shardings)) if shardings is not None else None
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def one(path, x):
        keys = _keys(path)
        stacked, links = plan[keys]
        return _read_array(folder, stacked, links, x, flat_sh[keys] if flat_sh else default)

    return jax.tree_util.tree_map_with_path(one, abstract_tree)


def _flat(tree):
    for path, x in jax.tree_util.tree_leaves_with_path(
            tree, is_leaf=lambda v: isinstance(v, jax.sharding.Sharding)):
        yield _keys(path), x


def read_hf_config(path) -> dict:
    """``path``/config.json as a dict; errors name the file (and where it is not JSON)."""
    file = pathlib.Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"folder {str(path)!r}: no config.json (a Kimi Linear folder holds "
                                f"config.json and *.safetensors)")
    return read_json_file(file)


def load_hf_params(path, model_config, shardings=None) -> tuple[dict, dict]:
    """(parameters, routing biases) as pure dicts in ``HybridLM(model_config)``'s layout, read
    from the safetensors in ``path`` (either layout). ``shardings``: {"params": tree,
    "model_state": tree} of shardings (the trainer's ``state_shardings``); default: the first
    device. Every tensor is checked (names, shapes) before any is read."""
    folder, trees, plans = open_checked(path, model_config)
    out = {k: _fill(folder, plans[k], t, shardings.get(k) if shardings else None)
           for k, t in trees.items()}
    return out["params"], out["model_state"]


def open_checked(path, model_config):
    """(the folder, our abstract {"params", "model_state"} trees, their plans) after checking
    every tensor's name and shape against ``model_config`` (headers only; nothing is read)."""
    spec = model_spec(model_config)
    folder = SafetensorsFolder(path)
    layout = detect_layout(folder.names())
    if layout == "released":
        # A dense FFN is "mlp." in the published checkpoints and "block_sparse_moe." in what
        # save_pretrained writes (it renames every "mlp." back); transformers reads both.
        folder.rename(DENSE_UNDER_MOE, r"\1mlp.\2")
    abstract = nnx.eval_shape(lambda: HybridLM(spec, rngs=nnx.Rngs(0)))
    _, abs_params, abs_biases, _ = nnx.split(abstract, nnx.Param, ExpertBias, ...)
    trees = {"params": nnx.to_pure_dict(abs_params), "model_state": nnx.to_pure_dict(abs_biases)}
    plans = {k: _plan(spec, t, layout) for k, t in trees.items()}
    check_tensors(folder, list(plans.values()), spec, layout)
    return folder, trees, plans


def load_hf_checkpoint(path, dtype: str = "float32") -> tuple[ml_collections.ConfigDict, HybridLM]:
    """(config.model, a HybridLM holding the weights) from a local Kimi Linear folder:
    ``config.json`` and ``*.safetensors`` (one file, several, or sharded with
    ``model.safetensors.index.json``), in either weight layout.

    ``model(tokens_BxT)`` gives float32 logits [B, T, V]; parameters and compute are in
    ``dtype`` ("float32" | "bfloat16" | "float16"). The weights go to the first device; for a
    mesh, ``load_hf_params`` takes the trainer's shardings.
    """
    model_config = model_config_from_hf(read_hf_config(path), dtype)
    params, biases = load_hf_params(path, model_config)
    return model_config, model_from_params(model_config, params, biases)


def _write_safetensors(tensors: dict[str, np.ndarray], file: pathlib.Path) -> None:
    """One safetensors file (bfloat16 too: safetensors takes ml_dtypes' bfloat16 arrays)."""
    for name, x in tensors.items():
        if x.dtype not in _ST_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {x.dtype} cannot be written")
    safetensors.numpy.save_file({k: np.ascontiguousarray(x) for k, x in tensors.items()},
                                str(file), metadata={"format": "pt"})


def _umask() -> int:
    """This process's umask (Linux reports it; elsewhere it is read by setting it back)."""
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def unused_sibling(path) -> pathlib.Path:
    """``path-2`` (or -3, ...): the first such name beside ``path`` that does not exist."""
    path, n = pathlib.Path(path), 2
    while path.with_name(f"{path.name}-{n}").exists():
        n += 1
    return path.with_name(f"{path.name}-{n}")


def check_new_folder(path, flag: str = "path") -> pathlib.Path:
    """``path`` as a Path when it is a folder export may write: one that does not exist yet, or
    an empty one. Else ValueError naming ``flag``, what is there and what to do instead: export
    never mixes its files with a folder's old ones (a stale shard, or a config.json of the
    user's, would be read with them)."""
    path = pathlib.Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag}: {str(path)!r} is a file, not a folder; give a folder that "
                         f"does not exist yet")
    held = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if held:
        free = unused_sibling(path)
        instead = f"{flag}={free}" if flag.startswith("--") else repr(str(free))
        shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        raise ValueError(f"{flag}: {str(path)!r} is not empty (it holds {shown}); export writes "
                         f"a new folder and never mixes with old files: give one that does not "
                         f"exist yet, e.g. {instead}, or remove this one first "
                         f"(rm -r {shlex.quote(str(path))})")
    return path


@contextlib.contextmanager
def _new_folder(path: pathlib.Path, config_name: str = "config.json"):
    """Yields an empty staging folder whose files become ``path``'s when the block ends without
    an error, else are removed: a failed or interrupted export leaves no folder that looks
    complete. A new ``path`` is the staging folder (``.<name>.export-partial-*`` beside it)
    renamed in one step; an existing empty one gets the staged files moved in, ``config_name``
    (what ``from_pretrained`` reads first) last. Files and folders get ordinary permissions
    (0666 / 0777 less the umask, as ``open`` and ``mkdir`` give), not a temporary file's 0600."""
    path = check_new_folder(path)
    fresh = not path.exists()
    if fresh:
        path.parent.mkdir(parents=True, exist_ok=True)
        stage = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.export-partial-",
                                              dir=path.parent))
    else:
        stage = pathlib.Path(tempfile.mkdtemp(prefix=".export-partial-", dir=path))
    moved = []
    try:
        yield stage
        mask = _umask()
        names = sorted(p.name for p in stage.iterdir())
        for name in names:
            os.chmod(stage / name, 0o666 & ~mask)
        if fresh:
            os.chmod(stage, 0o777 & ~mask)
            os.rename(stage, path)
            return
        for name in sorted(names, key=lambda n: n == config_name):
            os.replace(stage / name, path / name)
            moved.append(path / name)
        stage.rmdir()
    except BaseException:
        for f in moved:
            f.unlink(missing_ok=True)
        shutil.rmtree(stage, ignore_errors=True)
        raise


def save_hf_checkpoint(model: HybridLM, model_config, path, *, extra_config: dict | None = None,
                       max_shard_bytes: int = 5 * 2**30,
                       extra_files: dict[str, str] | None = None) -> list[str]:
    """Writes ``config.json`` and the weights of ``model`` (a HybridLM for ``model_config``) to
    the folder ``path`` in the released layout, as ``save_pretrained`` does: one
    ``model.safetensors``, or shards of at most ``max_shard_bytes`` with
    ``model.safetensors.index.json``. Tensors keep the parameters' dtype. ``extra_config``:
    further config.json fields (token ids). ``extra_files``: {name in the folder: a file to copy
    there} (the tokenizer). Returns the files written.

    ``path`` must not exist or be empty (``check_new_folder``); the folder appears complete or
    not at all (``_new_folder``)."""
    spec = model_spec(model_config)
    config = hf_config_from_model(model_config, extra_config)
    check_new_folder(path)
    _, params, biases, _ = nnx.split(model, nnx.Param, ExpertBias, ...)
    flat = {}
    for tree in (nnx.to_pure_dict(params), nnx.to_pure_dict(biases)):
        for path_, x in jax.tree_util.tree_leaves_with_path(tree):
            keys = _keys(path_)
            layers, rel = _leaf_layers(spec, keys)
            if layers is None:
                flat[(rel, None)] = (x, None)
            else:
                for r, layer in enumerate(layers):
                    flat[(rel, layer)] = (x, r if keys[0] == "groups" else None)

    def get(rel, layer):
        if (rel, layer) not in flat:
            raise ValueError(f"save_hf_checkpoint: the model has no parameter {rel} for layer "
                             f"{layer}; is it the HybridLM of model_config?")
        x, r = flat[(rel, layer)]
        return np.asarray(jax.device_get(x if r is None else x[r]))

    with _new_folder(pathlib.Path(path)) as out:
        # Shards as the tensors come (one gathered at a time), named once their count is known.
        parts, pending, pending_bytes, owner, total = [], {}, 0, {}, 0

        def flush():
            part = out / f".part-{len(parts):05d}.safetensors"
            _write_safetensors(pending, part)
            parts.append((part, list(pending)))

        for name, x in _hf_tensors(spec, get):
            if pending and pending_bytes + x.nbytes > max_shard_bytes:
                flush()
                pending, pending_bytes = {}, 0
            pending[name] = x
            pending_bytes += x.nbytes
            total += x.nbytes
        flush()
        files = (["model.safetensors"] if len(parts) == 1 else
                 [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))])
        for (part, names), file in zip(parts, files, strict=True):
            part.replace(out / file)
            owner.update({name: file for name in names})
        if len(files) > 1:
            files.append("model.safetensors.index.json")
            (out / files[-1]).write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": owner}, indent=2) + "\n")
        for name, source in (extra_files or {}).items():
            shutil.copyfile(source, out / name)
            files.append(name)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ["config.json", *files]
