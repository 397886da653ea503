"""Functions named by a spec string: "package.module:function" or "path/to/file.py:function".

Rewards, policy losses and other user code plug in this way; errors name the spec and what is wrong.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from tether.served import MODELS as SERVED_MODELS


def load_function(spec: str, kind: str, error: type[Exception] = ValueError,
                  args: dict[str, Any] | None = None) -> Callable:
    """Resolve ``spec`` (a ``module:function`` or ``file.py:function``) to a callable.

    ``kind`` names what is loaded in messages ("reward", "policy loss"); ``error`` is raised. ``args``:
    the run's ``args:`` section, given to a function that has a parameter named ``args``.
    """
    fn = _load(spec, kind, error)
    return with_args(fn, args)


def with_args(fn: Callable, args: dict[str, Any] | None) -> Callable:
    """``fn`` with ``args=`` bound when it takes a parameter of that name (a user function's own
    settings, from the config's ``args:``), and ``models=`` when it takes that one (the run's served
    models by name, tether/served.py); else ``fn``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn
    given = {"models": SERVED_MODELS, **({"args": args} if args is not None else {})}
    bound = {name: value for name, value in given.items()
             if name in params and params[name].kind is not inspect.Parameter.POSITIONAL_ONLY}
    return functools.partial(fn, **bound) if bound else fn


def _load(spec: str, kind: str, error: type[Exception]) -> Callable:
    spec = spec.strip()
    target, _, attr = spec.rpartition(":")  # the function name never contains ':', a file path might
    if not target or not attr:
        raise error(f"{kind} spec '{spec}': expected 'module:function' or 'file.py:function'")
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _load_file_module(spec, Path(target), kind, error)
    else:
        module = _import_module(spec, target, kind, error)
    if not hasattr(module, attr):
        raise error(f"{kind} spec '{spec}': '{target}' has no attribute '{attr}'")
    fn = getattr(module, attr)
    if not callable(fn):
        raise error(f"{kind} spec '{spec}': '{attr}' in '{target}' is not callable (got {type(fn).__name__})")
    return fn


def _import_module(spec: str, name: str, kind: str, error: type[Exception]) -> ModuleType:
    """Import a dotted module; a missing module becomes ``error``."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        # Only translate "this module does not exist"; a missing dependency inside
        # the user's module is a different problem and keeps its own message.
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            raise error(f"{kind} spec '{spec}': module '{name}' not found (is it installed or on PYTHONPATH?)") from exc
        raise


def _load_file_module(spec: str, path: Path, kind: str, error: type[Exception]) -> ModuleType:
    """Execute a Python file as a fresh module and return it.

    The module is deliberately not registered in sys.modules: the file is not
    importable by name elsewhere, so functions from it should be serialized by
    value (cloudpickle does that for unregistered modules), not by reference.
    """
    path = path.expanduser().resolve()
    if not path.is_file():
        raise error(f"{kind} spec '{spec}': file '{path}' not found")
    # A path-derived name keeps two files with the same stem apart in tracebacks.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    module_name = f"tether_user_{path.stem}_{digest}"
    mod_spec = importlib.util.spec_from_file_location(module_name, path)
    if mod_spec is None or mod_spec.loader is None:
        raise error(f"{kind} spec '{spec}': cannot load '{path}' as a module")
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module
