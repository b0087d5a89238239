"""verl's plugin entry point (``verl.plugins``): with ``TRAJBUS_VERL_QUEUE`` set, verl's fully-async
trainer gets trajbus's ``MessageQueue``.

verl imports every ``verl.plugins`` entry point when ``verl`` itself is imported, in every process,
its Ray workers included. ``fully_async_main`` takes ``MessageQueue`` from
``verl.experimental.fully_async_policy.message_queue`` by name, at import; so this module, kept light
(it runs inside ``import verl``), arranges that the moment that module is loaded its ``MessageQueue``
is trajbus's (verl's own stays there as ``InMemoryMessageQueue``). Nothing changes without the variable.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
from types import ModuleType

log = logging.getLogger(__name__)

SWITCH = "TRAJBUS_VERL_QUEUE"
TARGET = "verl.experimental.fully_async_policy.message_queue"


def swap(module: ModuleType) -> None:
    """Make ``module.MessageQueue`` trajbus's (once)."""
    from trajbus.consumers.verl.actor import MessageQueue

    if module.MessageQueue is not MessageQueue:
        module.InMemoryMessageQueue = module.MessageQueue
        module.MessageQueue = MessageQueue
        log.info("verl's MessageQueue is trajbus's durable queue (%s=%s)", SWITCH, os.environ.get(SWITCH))


class _SwapAfterLoad(importlib.abc.Loader):
    """The module's own loader, then ``swap``."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        swap(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds verl's message_queue module as the other finders do, with ``_SwapAfterLoad`` as its loader."""

    def find_spec(self, name: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _SwapAfterLoad(spec.loader)
                return spec
        return None


def install() -> None:
    """Arrange the swap when ``TRAJBUS_VERL_QUEUE`` is set (verl calls this through the entry point)."""
    if not os.environ.get(SWITCH, "").strip():
        return
    logging.getLogger("trajbus.consumers.verl").setLevel(logging.INFO)
    if TARGET in sys.modules:
        swap(sys.modules[TARGET])
    elif not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
