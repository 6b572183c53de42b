"""Post-import hooks: run a callback right after a named module finishes importing.

The tracer must not import TensorFlow itself (a non-TF program would pay seconds for nothing), so
``boot/sitecustomize.py`` registers callbacks here and TensorFlow is patched only when the job
imports it. Standard library only: this module is imported by every traced Python process.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import ModuleType

_callbacks: dict[str, list[Callable[[ModuleType], None]]] = {}
_busy = threading.local()


class _HookedLoader:
    """Delegates to the real loader, then runs the callbacks; restores the real loader on the module.

    (Plain classes, not ``importlib.abc``'s: importing that costs ~20 ms in every traced process.)
    """

    def __init__(self, loader, name: str) -> None:  # noqa: ANN001 - an importlib loader
        self._loader = loader
        self._name = name

    def create_module(self, spec):  # noqa: ANN001, ANN201 - importlib protocol
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        for callback in _callbacks.get(self._name, ()):
            callback(module)

    def __getattr__(self, attr: str):  # noqa: ANN204 - resource readers, get_source, ...
        return getattr(self._loader, attr)


class _Finder:
    """Finds watched modules through the other finders and wraps their loader."""

    def find_spec(self, fullname, path, target=None):  # noqa: ANN001, ANN201 - importlib protocol
        if fullname not in _callbacks or getattr(_busy, "active", False):
            return None
        _busy.active = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _HookedLoader(spec.loader, fullname)
                    return spec
            return None
        finally:
            _busy.active = False


_finder = _Finder()


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once ``name`` is imported (now, if it already is)."""
    _callbacks.setdefault(name, []).append(callback)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
