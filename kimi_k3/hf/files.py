r"""Safetensors folders: checked, read onto devices, written.

A folder holds ``config.json`` and one ``model.safetensors``, several ``*.safetensors`` files,
or shards named by ``model.safetensors.index.json``. Before any tensor is read every name and
shape is checked against the model config.json describes (``open_checked``, ``check_tensors``:
the headers only); a missing, extra or wrongly shaped tensor is a ValueError naming it.

Memory: the safetensors files are memory-mapped and every parameter is built by
``jax.make_array_from_callback`` with its target sharding: each device's shard is sliced out of
the mapped file (one layer of one tensor at a time) and copied to that device, so no complete
host copy of the model exists. (The files are mapped with NumPy from the safetensors header
rather than through ``safe_open``, whose NumPy backend cannot return bfloat16, the released
checkpoints' dtype.) Export (``save_hf_checkpoint``) gathers one tensor at a time and writes
files of at most ``max_shard_bytes`` with a ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re

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


class SafetensorsFolder:
    """The tensors of a folder's ``*.safetensors`` (``model.safetensors.index.json`` when there
    is one), each a read-only NumPy view into the memory-mapped file: nothing is read until
    sliced."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{str(self.path)!r}: no *.safetensors files")
        self.entries: dict[str, tuple[str, str, tuple[int, ...], int, int]] = {}
        self._maps: dict[str, np.memmap] = {}
        for name in files:
            file = self.path / name
            if not file.is_file():
                raise FileNotFoundError(f"{str(index)!r} names {name!r}, which does not exist")
            with open(file, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            for key, h in header.items():
                if key in self.entries:
                    raise ValueError(f"tensor {key!r} is in both {self.entries[key][0]!r} and "
                                     f"{name!r}")
                if h["dtype"] not in _ST_DTYPES:
                    raise ValueError(f"tensor {key!r} in {name!r}: dtype {h['dtype']} is not one "
                                     f"of {sorted(_ST_DTYPES)}")
                lo, hi = h["data_offsets"]
                self.entries[key] = (name, h["dtype"], tuple(h["shape"]), 8 + n + lo, 8 + n + hi)

    def names(self) -> set[str]:
        return set(self.entries)

    def rename(self, pattern: str, replacement: str) -> None:
        """Reads the tensors whose name matches ``pattern`` under ``re.sub``'s new name."""
        self.entries = {re.sub(pattern, replacement, k): v for k, v in self.entries.items()}

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
                         f"{extra[:3]})")
        if shapes:
            parts.append("wrong shapes: " + "; ".join(
                f"{k} is {list(folder.shape(k))}, expected {list(want[k])}" for k in shapes[:3]))
        raise ValueError(f"{str(folder.path)!r} ({layout} layout) does not match its "
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
    file = pathlib.Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{str(path)!r}: no config.json")
    return json.loads(file.read_text())


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


def save_hf_checkpoint(model: HybridLM, model_config, path, *, extra_config: dict | None = None,
                       max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Writes ``config.json`` and the weights of ``model`` (a HybridLM for ``model_config``) to
    the folder ``path`` in the released layout, as ``save_pretrained`` does: one
    ``model.safetensors``, or shards of at most ``max_shard_bytes`` with
    ``model.safetensors.index.json``. Tensors keep the parameters' dtype. ``extra_config``:
    further config.json fields (token ids). Returns the files written."""
    spec = model_spec(model_config)
    config = hf_config_from_model(model_config, extra_config)
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

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
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
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": owner}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ["config.json", *files] + (["model.safetensors.index.json"] if len(files) > 1 else [])
