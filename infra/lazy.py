"""A package's public names, imported when first used: ``import trajbus`` stays cheap (no torch, no Faust)."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str],
                 own: Callable[[], dict[str, Any]]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: each name of ``exports`` (name -> module) is
    imported from its module at first use; ``own`` gives the package's own globals for ``dir()``."""

    def getattr_(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    def dir_() -> list[str]:
        return sorted(set(own()) | set(exports))

    return getattr_, dir_
