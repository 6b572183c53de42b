"""A package's public names, imported on first use (PEP 562).

A contract package exports its gRPC client beside plain names and topics; a transport-free core
or a traced job that needs only the names must not pay for (or be coupled to) grpc, pydantic or
scikit-learn because the package's ``__init__`` imported the client.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package`` that imports each name of ``exports`` (name -> submodule)
    from its submodule the first time it is read, and keeps it in the package's namespace.

    Usage, in the package's ``__init__``::

        _EXPORTS = {"JobClient": "client", "JOBS": "topics"}
        __all__ = sorted(_EXPORTS)
        __getattr__ = lazy_exports(__name__, _EXPORTS)
    """

    def __getattr__(name: str) -> Any:
        submodule = exports.get(name)
        if submodule is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{submodule}"), name)
        setattr(importlib.import_module(package), name, value)
        return value

    return __getattr__
