"""ROLL's ``GlobalDataset`` and ``GlobalDatasetManager``: one dataset shared by every env.

Env managers on many processes read prompts from one named Ray actor, so that
``sample`` mode gives every env the same item for the same seed (the envs of a
group roll out the same prompt), and ``traversal`` mode hands each item out
exactly once across all envs, then ``None`` (a validation pass). The manager
resets its registered datasets before each validation pass.

The classes are plain Python (usable and testable without Ray);
``global_dataset_actor`` / ``global_dataset_manager_actor`` create or find the
named actors (``get_if_exists``) in a namespace, as ROLL does.

On a prompt ledger, the ``EpisodeScheduler`` (``pipelines.env_manager``) records
the groups and names the dataset by ``identity()``; in ``sample`` mode the seed in
each prompt uid picks the item, so a resumed run rolls out the same prompt again.
``traversal`` mode does not resume from the ledger, and the scheduler refuses a
traversal dataset, because it does not fit:

- the dispatch is recorded before any env draws its item, and a traversal item is
  whatever index is next when an env asks (each env of a group gets a different one),
  so no dispatch names a dataset position to continue after, and a re-issued episode
  would get another item;
- traversal is ROLL's validation pass: the manager resets the index before every pass
  and a pass runs whole, so a pass cut by a crash is run again from its start at the
  next evaluation; continuing its index would skip items of that pass.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

from trajbus.pipelines.data_source import read_records
from trajbus.streams.wire.ledger import fingerprint

MODES = ("sample", "traversal")


class GlobalDataset:
    def __init__(self, path: str | Path, mode: str = "sample") -> None:
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        self.items: list[dict[str, Any]] = read_records(path)
        if not self.items:
            raise ValueError(f"prompt_data: {path} is empty")
        self.mode = mode
        self.index = 0
        self._lock = threading.Lock()

    def get_data_item(self, seed: int | None = None) -> dict[str, Any] | None:
        """``sample``: the item this seed picks (same seed, same item). ``traversal``: the next item, else None."""
        if self.mode == "sample":
            if seed is None:
                raise ValueError("seed: sample mode needs a seed")
            return self.items[random.Random(seed).randint(0, len(self.items) - 1)]
        with self._lock:
            if self.index >= len(self.items):
                return None
            item = self.items[self.index]
            self.index += 1
            return item

    def reset(self) -> None:
        with self._lock:
            self.index = 0

    def size(self) -> int:
        return len(self.items)

    def identity(self) -> str:
        """``<fingerprint>/<size>`` of the items: a ledger names its dataset so, and refuses another one."""
        return f"{fingerprint(self.items)}/{len(self.items)}"


class GlobalDatasetManager:
    """Registered datasets, reset together (before each validation pass)."""

    def __init__(self) -> None:
        self.datasets: dict[str, Any] = {}

    def register(self, dataset_name: str, dataset: Any) -> None:
        self.datasets[dataset_name] = dataset

    def reset(self) -> int:
        """Reset every registered dataset (local objects or actor handles); returns how many."""
        pending = []
        for dataset in self.datasets.values():
            if hasattr(dataset.reset, "remote"):
                pending.append(dataset.reset.remote())
            else:
                dataset.reset()
        if pending:
            import ray

            ray.get(pending)
        return len(self.datasets)


def global_dataset_actor(name: str, path: str | Path, mode: str = "sample", namespace: str | None = None):
    """The named ``GlobalDataset`` actor: created by the first caller, found by every other one."""
    import ray

    return ray.remote(GlobalDataset).options(name=name, namespace=namespace, get_if_exists=True,
                                             num_cpus=0).remote(str(path), mode)


def global_dataset_manager_actor(name: str = "val_dataset_manager", namespace: str | None = None):
    import ray

    return ray.remote(GlobalDatasetManager).options(name=name, namespace=namespace, get_if_exists=True,
                                                    num_cpus=0).remote()
