"""A package's public names, loaded on first use (PEP 562 module `__getattr__`), so that importing one light
submodule of the package does not load its heavy siblings (torch, the model code)."""
from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, namespace: dict, exports: dict[str, str]) -> tuple[Callable, Callable]:
    """`__getattr__` and `__dir__` for `package`, whose `exports` map each public name to its submodule;
    a name, once loaded, is cached in the package's `namespace` (its globals)."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
