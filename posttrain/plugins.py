"""Plugins named by a spec string: `path/to/file.py:name` or `package.module:name` (reward
functions, tools, environments). A file is imported once per process under a name derived from
its path; a failure names the spec."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path

from posttrain.errors import UserError


def _load_file(path: str, attr: str):
    p = Path(path).expanduser().resolve()
    if not p.is_file():
        raise UserError(f"reward {path}:{attr}: no such file {p}")
    mod_name = "posttrain_reward_" + hashlib.sha1(str(p).encode()).hexdigest()[:12]
    mod = sys.modules.get(mod_name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(mod_name, p)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = mod
        try:
            spec.loader.exec_module(mod)
        except Exception as e:
            del sys.modules[mod_name]
            raise UserError(f"reward {path}: importing the file failed: {type(e).__name__}: {e}") from None
    if not hasattr(mod, attr):
        raise UserError(f"reward {path}:{attr}: the file defines no {attr!r}")
    return getattr(mod, attr)


def _load_module(module: str, attr: str):
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise UserError(f"reward {module}:{attr}: cannot import {module}: {e}") from None
    if not hasattr(mod, attr):
        raise UserError(f"reward {module}:{attr}: module {module} has no {attr!r}")
    return getattr(mod, attr)


def load_object(spec: str):
    """`path/to/file.py:name` or `package.module:name` (the caller checked the colon)."""
    target, attr = spec.rsplit(":", 1)
    return _load_file(target, attr) if target.endswith(".py") else _load_module(target, attr)
