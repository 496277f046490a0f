"""Config files, loaded by path: ``path/to/x.py[:arg]`` -> that file's ``get_config(arg)``.

    config = load_config("configs/ablate_ratio.py:ratio=3,layers=16")
    config = load_config("runs/r3")             # a run folder: the config it ran with
    args = parse_arg("ratio=3,layers=16", {"ratio": int, "layers": int})

The syntax is that of ml_collections' ``config_flags`` (``--config=configs/x.py:arg``), which
the entry points use; this is the same from Python (notebooks, tests, one config built on
another). A config file defines ``get_config(arg=None) -> ml_collections.ConfigDict`` and
imports only the config room (``kimi_k3.config``) and this module. A relative path is taken
from the working folder; a config that builds on another names it relative to itself:
``load_config(pathlib.Path(__file__).with_name("small.py"))``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib

import ml_collections

from kimi_k3.config import fill_defaults


def load_config(spec: str | os.PathLike) -> ml_collections.ConfigDict:
    """``"configs/ablate_ratio.py:ratio=3"`` -> that file's ``get_config("ratio=3")``; a run
    folder -> its ``config.py`` (the config it ran with); a ``.json`` file -> its ConfigDict.

    Raises ValueError naming the path when there is no such file (never another file in its
    place) or when it defines no ``get_config``.
    """
    path, _, arg = os.fspath(spec).partition(":")
    file = pathlib.Path(path).expanduser()
    record = file.is_dir()
    if record:  # a run folder: its config.py (kimi_k3.run_dir.write_config)
        file = file / "config.py"
    elif file.suffix == ".json" and file.is_file():  # a config as JSON, e.g. a run's record
        if arg:
            raise ValueError(f"config file {path!r} is JSON and takes no argument, got {arg!r}")
        return fill_defaults(ml_collections.ConfigDict(json.loads(file.read_text())))
    if not file.is_file():
        where = f" (from {os.getcwd()})" if not file.is_absolute() else ""
        raise ValueError(f"no config file {path!r}{where}: give the path of a Python file "
                         f"defining get_config(), e.g. configs/tiny.py")
    module_spec = importlib.util.spec_from_file_location(f"kimi_k3_config_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, "get_config", None)):
        raise ValueError(f"config file {path!r} defines no get_config(arg=None)")
    config = module.get_config(arg or None)
    # A run's record may predate fields added since: they take their defaults.
    return fill_defaults(config) if record else config


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
