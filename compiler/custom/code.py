"""What the recipe records of a user's code: what it is, the source files that define
it, and its arguments, so that --resume refuses a compile whose code changed.

- ``module`` and ``qualname``: the Dataset's class, or the function.
- ``sources``: sha256 of each source file that defines it (the class and its base
  classes, or the function), those installed in site-packages or the standard
  library left out (their package's version is recorded instead). Code those files
  import from elsewhere is not hashed.
- ``state``: sha256 of the Dataset's attributes, or the function's bound arguments
  (functools.partial, defaults, closure), in a canonical form: plain data (numbers,
  str, bytes, arrays, paths, lists, dicts, and objects holding those) by value,
  anything else by its type.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import math
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np

_INSTALLED = tuple(
    str(Path(p).resolve())
    for p in {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    if p
)


def describe(target: Any, dataset: bool) -> dict[str, Any]:
    """The recipe's ``code`` entry for a Dataset (``dataset``) or a function."""
    fn = _unwrapped(target)
    what = type(target) if dataset else fn
    module = getattr(what, "__module__", None) or "?"
    qualname = getattr(what, "__qualname__", None) or type(what).__qualname__
    owners = [c for c in type(target).__mro__ if c is not object] if dataset else [fn]
    if not dataset and inspect.ismethod(target):
        owners.append(type(target.__self__))
    sources: dict[str, str] = {}
    for owner in owners:
        name = getattr(owner, "__module__", None)
        if name and name not in sources:
            sources[name] = _module_digest(name, owner)
    return {
        "module": module,
        "qualname": qualname,
        "sources": sources,
        "state": _digest(_state(target, dataset)),
    }


def changes(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between two ``describe`` results, in words."""
    out = []
    if (before.get("module"), before.get("qualname")) != (now.get("module"), now.get("qualname")):
        out.append(
            f"it compiled {before.get('module')}.{before.get('qualname')}, this is "
            f"{now.get('module')}.{now.get('qualname')}"
        )
    old, new = before.get("sources") or {}, now.get("sources") or {}
    for name in sorted(set(old) | set(new)):
        if old.get(name) != new.get(name):
            out.append(f"the source of {name} changed")
    if before.get("state") != now.get("state"):
        out.append(
            "its arguments (the dataset's attributes or the function's bound values) changed"
        )
    return out


def _unwrapped(target: Any) -> Any:
    while isinstance(target, functools.partial):
        target = target.func
    return getattr(target, "__func__", target)


def _module_digest(name: str, owner: Any) -> str:
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if path is None:  # defined in a notebook cell or at a prompt: its own source, if known
        try:
            return "source:" + hashlib.sha256(inspect.getsource(owner).encode()).hexdigest()
        except (OSError, TypeError):
            return "unknown"
    resolved = str(Path(path).resolve())
    if resolved.startswith(_INSTALLED):
        return _installed(name.partition(".")[0])
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return "unreadable"


@functools.cache
def _installed(top: str) -> str:
    """``installed:DIST==VERSION`` for an installed package's module (its files not hashed)."""
    try:
        from importlib.metadata import packages_distributions, version

        dists = packages_distributions().get(top) or [top]
        return f"installed:{dists[0]}=={version(dists[0])}"
    except Exception:
        return "installed"


def _state(target: Any, dataset: bool) -> Any:
    if dataset:
        return _canonical(target, 0)
    parts: list[Any] = []
    fn = target
    while isinstance(fn, functools.partial):
        parts.append([_canonical(list(fn.args), 1), _canonical(fn.keywords, 1)])
        fn = fn.func
    if inspect.ismethod(fn):
        parts.append(_canonical(fn.__self__, 1))
        fn = fn.__func__
    elif not inspect.isfunction(fn):  # a callable object: its attributes are its arguments
        parts.append(_canonical(fn, 1))
        fn = type(fn).__call__
    parts.append(_canonical(getattr(fn, "__defaults__", None), 1))
    parts.append(_canonical(getattr(fn, "__kwdefaults__", None), 1))
    cells = getattr(fn, "__closure__", None) or ()
    parts.append([_canonical(_cell(c), 1) for c in cells])
    return parts


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


MAX_DEPTH = 6


def _canonical(value: Any, depth: int) -> Any:
    """Plain data by value, anything else by type (see the module docstring)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, bytes | bytearray):
        return {"bytes": hashlib.sha256(value).hexdigest()}
    if isinstance(value, os.PathLike):
        return {"path": os.fspath(value)}
    if isinstance(value, np.ndarray | np.generic):
        array = np.ascontiguousarray(value)
        if array.dtype.hasobject:
            return {"type": "object array", "shape": list(array.shape)}
        return {
            "array": str(array.dtype),
            "shape": list(array.shape),
            "sha256": hashlib.sha256(array.view(np.uint8).reshape(-1).data).hexdigest(),
        }
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return {
            "tensor": str(t.dtype),
            "shape": list(t.shape),
            "sha256": hashlib.sha256(t.view(-1).view(torch.uint8).numpy().data).hexdigest()
            if t.numel()
            else "",
        }
    if depth >= MAX_DEPTH:
        return {"type": _type_name(value)}
    if isinstance(value, list | tuple):
        return [_canonical(v, depth + 1) for v in value]
    if isinstance(value, dict):
        items = [[_canonical(k, depth + 1), _canonical(v, depth + 1)] for k, v in value.items()]
        return {"dict": sorted(items, key=lambda kv: json.dumps(kv, sort_keys=True, default=str))}
    if isinstance(value, set | frozenset):
        members = [_canonical(v, depth + 1) for v in value]
        return {"set": sorted(members, key=lambda m: json.dumps(m, sort_keys=True, default=str))}
    if inspect.isfunction(value) or inspect.isclass(value) or inspect.ismodule(value):
        return {"code": f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"}
    state = getattr(value, "__dict__", None)
    if isinstance(state, dict) and type(value).__module__ not in ("builtins",):
        return {"type": _type_name(value), "state": _canonical(state, depth + 1)}
    return {"type": _type_name(value)}


def _type_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _digest(state: Any) -> str:
    text = json.dumps(state, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()
