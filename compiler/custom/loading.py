"""The command line's ``MODULE:NAME``: a module on PYTHONPATH (``pkg.module``) or a .py
file's path, and a name in it (dotted for a nested one)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import sys
from typing import Any

from ..errors import CompileError
from .code import LOADED_PREFIX
from .work import reason


def parse_arguments(text: str | None) -> Any:
    """--dataset-args: a JSON list (positional) or object (keywords), or None."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise CompileError(f"--dataset-args: not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, list | dict):
        raise CompileError("--dataset-args: expected a JSON list (positional) or object (keywords)")
    return value


def load_target(spec: str, arguments: Any = None, *, made: bool = False) -> Any:
    """The object ``spec`` names. With ``made`` (a --dataset), what calling it gives when it
    is a class or a function (with ``arguments``, a list or dict, when given); a Dataset
    object it names is taken as it is."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise CompileError(f"{spec}: expected MODULE:NAME (pkg.module:make or path/file.py:make)")
    module = _module(where)
    target: Any = module
    for part in name.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise CompileError(f"{spec}: {module.__name__} has no {name!r}") from None
    factory = inspect.isclass(target) or inspect.isfunction(target) or inspect.ismethod(target)
    if not made or (arguments is None and not factory):
        return target
    if not factory:
        raise CompileError(f"{spec}: --dataset-args given, but {name} is not a class or function")
    arguments = [] if arguments is None else arguments
    try:
        return target(**arguments) if isinstance(arguments, dict) else target(*arguments)
    except (Exception, SystemExit) as e:  # the user's factory: whatever it raises
        raise CompileError(
            f"{spec}: calling it with {arguments!r:.80} failed: {reason(e)}"
        ) from None


def _module(where: str) -> Any:
    if where.endswith(".py") or os.sep in where:
        path = os.path.abspath(where)
        if not os.path.isfile(path):
            raise CompileError(f"{where}: no such file")
        name = os.path.splitext(os.path.basename(path))[0]
        existing = getattr(sys.modules.get(name), "__file__", None)
        if existing is not None and os.path.abspath(existing) != path:
            name = LOADED_PREFIX + name  # never shadow another module (utils, datasets)
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise CompileError(f"{where}: cannot be imported as a module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its classes pickle (workers that fork find it)
        try:
            spec.loader.exec_module(module)
        except (Exception, SystemExit) as e:  # a syntax error, a raise or exit on import
            sys.modules.pop(name, None)
            raise CompileError(f"{where}: importing it failed: {reason(e)}") from None
        _by_value(module)
        return module
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: a module in the working folder
    try:
        return importlib.import_module(where)
    except ImportError as e:
        raise CompileError(f"{where}: cannot import it ({e}); is it on PYTHONPATH?") from None
    except (Exception, SystemExit) as e:  # a syntax error, a raise or exit on import
        raise CompileError(f"{where}: importing it failed: {reason(e)}") from None


def _by_value(module: Any) -> None:
    """A module loaded from a file path is not importable in a forkserver or Dask worker:
    its code travels by value."""
    try:
        import cloudpickle
    except ImportError:
        return
    cloudpickle.register_pickle_by_value(module)
