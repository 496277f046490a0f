"""Experiment configs: one ``get_config(arg=None)`` per file, model fields under ``config.model``.

Files are addressed as ``configs/<name>.py[:<arg>]``, the syntax of ml_collections' config_flags
(``--config=configs/ablate_ratio.py:ratio=3,layers=16``). :func:`load_config` does the same from
Python, e.g. in tests and notebooks.
"""

from __future__ import annotations

import importlib.util
import pathlib

import ml_collections

CONFIG_DIR = pathlib.Path(__file__).parent


def load_config(spec: str) -> ml_collections.ConfigDict:
    """``"ablate_ratio.py:ratio=3"`` or ``"configs/k3.py"`` -> that file's ``get_config(arg)``."""
    path, _, arg = spec.partition(":")
    file = pathlib.Path(path)
    if not file.suffix:
        file = file.with_suffix(".py")
    if not file.is_file():
        file = CONFIG_DIR / file.name
    if not file.is_file():
        raise ValueError(f"load_config: no config file {path!r} (looked in {CONFIG_DIR})")
    module_spec = importlib.util.spec_from_file_location(f"configs._loaded_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg or None)


def parse_arg(arg: str | None, allowed: dict[str, type]) -> dict:
    """``"ratio=3,layers=16"`` -> {"ratio": 3, "layers": 16}, typed by ``allowed``.

    Raises ValueError naming a key that is not in ``allowed`` or a value that does not parse.
    """
    out = {}
    for item in filter(None, (arg or "").split(",")):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"config argument {item!r}: expected key=value")
        if key not in allowed:
            raise ValueError(f"config argument {key!r}: unknown key, allowed: {sorted(allowed)}")
        try:
            out[key] = allowed[key](value.strip())
        except ValueError as err:
            raise ValueError(f"config argument {key}={value!r}: not a {allowed[key].__name__}") from err
    return out
