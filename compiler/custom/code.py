"""What the recipe records of a user's code: what it is, the source files that define
it, and its arguments, so that --resume refuses a compile whose code changed.

- ``module`` and ``qualname``: the Dataset's class, or the function.
- ``sources``: sha256 of each source file that defines it (the class and its base
  classes, or the function), those installed in site-packages or the standard
  library left out (their package's version is recorded instead). Code those files
  import from elsewhere is not hashed.
- ``state``: sha256 of the Dataset's attributes, or the function's bound arguments
  (functools.partial, defaults, closure), in a canonical form: plain data (numbers,
  str, bytes, arrays, tensors, paths, ranges, pandas DataFrames and Series, lists,
  dicts, sets, and objects holding those, 32 levels deep) by value (an array over
  64 MiB by 64 slices of 1 MiB spread over it: bounded time), anything else by its
  type. What the code reads from elsewhere (a file, a module-level setting) is
  not in it: a resume checks some items' samples for that (compiling.py).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np

from .samples import is_tensor

_INSTALLED = tuple(
    str(Path(p).resolve())
    for p in {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    if p
)


# A module loaded from a file whose name another module already holds in this process is
# loaded under this prefix (never shadowing the other); the recipe records the file's own
# name, so that what it records does not depend on what this process imported before.
LOADED_PREFIX = "dlop_user_"


def _recorded(name: str) -> str:
    return name.removeprefix(LOADED_PREFIX)


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
            sources[_recorded(name)] = _module_digest(name, owner)
    return {
        "module": _recorded(module),
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
        return target
    parts: list[Any] = []
    fn = target
    while isinstance(fn, functools.partial):
        parts.append([list(fn.args), fn.keywords])
        fn = fn.func
    if inspect.ismethod(fn):
        parts.append(fn.__self__)
        fn = fn.__func__
    elif not inspect.isfunction(fn):  # a callable object: its attributes are its arguments
        parts.append(fn)
        fn = type(fn).__call__
    parts.append(getattr(fn, "__defaults__", None))
    parts.append(getattr(fn, "__kwdefaults__", None))
    cells = getattr(fn, "__closure__", None) or ()
    parts.append([_cell(c) for c in cells])
    return parts


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


MAX_DEPTH = 32  # deeper than this, a value is recorded by its type


def _digest(state: Any) -> str:
    """sha256 of ``state`` in a canonical form (see the module docstring), fed as it is
    walked: memory does not grow with the data (a million metadata rows take seconds)."""
    h = hashlib.sha256()
    _feed(h, state, 0, set())
    return h.hexdigest()


def _tag(h: Any, tag: bytes, data: bytes = b"") -> None:
    h.update(tag + len(data).to_bytes(8, "little") + data)


def _feed(h: Any, value: Any, depth: int, seen: set[int]) -> None:
    """Plain data by value, anything else by type (see the module docstring)."""
    kind = type(value)
    if value is None:
        _tag(h, b"N")
    elif kind is str:
        _tag(h, b"s", value.encode("utf-8", "surrogatepass"))
    elif kind is bool:
        _tag(h, b"b", b"1" if value else b"0")
    elif kind is int or (isinstance(value, int) and not isinstance(value, bool)):
        _tag(h, b"i", str(int(value)).encode())
    elif isinstance(value, float):
        _tag(h, b"f", repr(float(value)).encode())
    elif isinstance(value, bytes | bytearray):
        _tag(h, b"y")
        _bytes(h, np.frombuffer(value, np.uint8))
    elif isinstance(value, os.PathLike):
        _tag(h, b"p", os.fsencode(value))
    elif isinstance(value, range):
        _tag(h, b"r", f"{value.start},{value.stop},{value.step}".encode())
    elif isinstance(value, np.ndarray | np.generic):
        array = np.ascontiguousarray(value)
        if array.dtype.hasobject:
            _tag(h, b"o", f"{list(array.shape)}".encode())
            _feed(h, array.reshape(-1).tolist(), depth + 1, seen)
        else:
            _tag(h, b"a", f"{array.dtype.str}{list(array.shape)}".encode())
            _bytes(h, array.reshape(-1).view(np.uint8))
    elif is_tensor(value):
        t = value.detach().cpu().contiguous()
        _tag(h, b"t", f"{t.dtype}{list(t.shape)}".encode())
        if t.numel():
            _bytes(h, t.reshape(-1).view(sys.modules["torch"].uint8).numpy())
    elif _pandas(value):
        pd: Any = sys.modules["pandas"]  # imported: the value is one of its objects
        _tag(h, b"P", _type_name(value).encode())
        _feed(h, [str(c) for c in getattr(value, "columns", [getattr(value, "name", "")])], 0, seen)
        h.update(pd.util.hash_pandas_object(value, index=True).to_numpy().data)
    elif depth >= MAX_DEPTH or id(value) in seen:
        _tag(h, b"T", _type_name(value).encode())
    elif isinstance(value, list | tuple):
        _tag(h, b"l", str(len(value)).encode())
        seen.add(id(value))
        for v in value:
            _feed(h, v, depth + 1, seen)
        seen.discard(id(value))
    elif isinstance(value, dict | set | frozenset):
        seen.add(id(value))
        pairs = value.items() if isinstance(value, dict) else ((v, None) for v in value)
        _tag(h, b"d" if isinstance(value, dict) else b"S", str(len(value)).encode())
        if all(type(k) is str for k in (value.keys() if isinstance(value, dict) else value)):
            for k, v in sorted(pairs, key=lambda kv: kv[0]):  # the common case: str keys
                _tag(h, b"s", k.encode("utf-8", "surrogatepass"))
                _feed(h, v, depth + 1, seen)
        else:  # any keys: each entry digested apart, the digests sorted
            entries = []
            for k, v in pairs:
                sub = hashlib.sha256()
                _feed(sub, k, depth + 1, seen)
                _feed(sub, v, depth + 1, seen)
                entries.append(sub.digest())
            for e in sorted(entries):
                h.update(e)
        seen.discard(id(value))
    elif inspect.isfunction(value) or inspect.isclass(value) or inspect.ismodule(value):
        code = _recorded(f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}")
        _tag(h, b"c", code.encode())
    else:
        state = getattr(value, "__dict__", None)
        _tag(h, b"T", _type_name(value).encode())
        if isinstance(state, dict) and type(value).__module__ != "builtins":
            seen.add(id(value))
            _feed(h, state, depth + 1, seen)
            seen.discard(id(value))


# A value's bytes are hashed whole up to this size; past it, SAMPLED_SLICES slices of
# SLICE_BYTES spread evenly over them (and their length): describing a Dataset that holds
# large arrays takes bounded time, the same slices on every run.
WHOLE_BYTES = 64 << 20
SAMPLED_SLICES, SLICE_BYTES = 64, 1 << 20


def _bytes(h: Any, data: np.ndarray) -> None:
    """Feeds ``data`` (1-D uint8): whole when small, else the same evenly spread slices."""
    size = len(data)
    h.update(size.to_bytes(8, "little"))
    if size <= WHOLE_BYTES:
        h.update(data.data)
        return
    step = (size - SLICE_BYTES) // (SAMPLED_SLICES - 1)
    for k in range(SAMPLED_SLICES):
        h.update(data[k * step : k * step + SLICE_BYTES].data)


def _pandas(value: Any) -> bool:
    """A pandas DataFrame, Series or Index: hashed by value (pandas' own row hash)."""
    pd = sys.modules.get("pandas")  # a value can be one only once pandas is loaded
    return pd is not None and isinstance(value, pd.DataFrame | pd.Series | pd.Index)


def _type_name(value: Any) -> str:
    return _recorded(f"{type(value).__module__}.{type(value).__qualname__}")
