"""Which ``Sample`` class a data source hands out, and how its samples are kept as JSON.

trajbus's ``Sample`` (``consumers.slime.sample``) and slime's ``slime.utils.types.Sample`` share their
field names, so one rule serves both: a prompt of either class becomes a new sample of the data
source's class field by field; a sample becomes a JSON record (the prompt ledger's buffer entries,
the saved state) with its status as its value, its counters as dicts, tensors and arrays as lists,
and any attribute code set on it beyond the fields (``prompt_uid`` on slime's); the record comes back
through the class's own ``from_dict``. A value JSON cannot hold is refused, naming the field:
nothing is dropped on the way to the ledger.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any

import orjson

from trajbus.consumers.slime.sample import Sample

__all__ = ["SampleKind", "TRAJBUS_SAMPLES"]


def _plain(value: Any) -> Any:
    """``value`` as JSON holds it: enums by value, counters as dicts, tensors and arrays as lists."""
    if isinstance(value, Enum):
        return value.value
    if hasattr(value, "to_dict") and dataclasses.is_dataclass(value):
        return value.to_dict()
    if hasattr(value, "tolist"):  # torch tensors, numpy arrays and scalars
        return value.tolist()
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


@dataclass(frozen=True)
class SampleKind:
    """The ``Sample`` class a data source builds, with its JSON record and back."""

    cls: type

    @property
    def name(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"

    @property
    def status(self) -> type[Enum]:
        return self.cls.Status

    def is_sample(self, value: Any) -> bool:
        return isinstance(value, self.cls)

    def new(self, prompt: Any = None) -> Any:
        """A new sample of this class: a deep copy of ``prompt`` (of either class), or an empty one."""
        if prompt is None:
            return self.cls()
        if isinstance(prompt, self.cls):
            return copy.deepcopy(prompt)
        names = {f.name for f in dataclasses.fields(self.cls)}
        values = {f.name: copy.deepcopy(getattr(prompt, f.name)) for f in dataclasses.fields(prompt)
                  if f.name in names and f.name not in ("status", "spec_info", "prefix_cache_info")}
        tools = getattr(prompt, "tools", None)
        if tools is not None and "tools" not in names:  # slime keeps a prompt's tools in its metadata
            values["metadata"] = {**values.get("metadata", {}), "tools": copy.deepcopy(tools)}
        sample = self.cls(**values)
        sample.status = self.status(prompt.status.value)
        for extra in ("prompt_uid",):
            if extra not in names and getattr(prompt, extra, None) is not None:
                setattr(sample, extra, getattr(prompt, extra))
        return sample

    def record(self, sample: Any) -> dict[str, Any]:
        """The sample as a JSON-safe dict; ``ValueError`` naming a field JSON cannot hold."""
        data = {key: _plain(value) for key, value in vars(sample).items()}
        for key, value in data.items():
            try:
                orjson.dumps(value)
            except TypeError:
                raise ValueError(f"Sample.{key}: holds {type(getattr(sample, key)).__name__}, which the prompt "
                                 f"ledger and the saved state (JSON) cannot keep") from None
        return data

    def restore(self, record: dict[str, Any]) -> Any:
        """A sample from its record (or from a record of the other class)."""
        names = {f.name for f in dataclasses.fields(self.cls)}
        data = dict(record)
        data.setdefault("status", "pending")
        if "tools" in data and "tools" not in names:
            tools = data.pop("tools")
            if tools is not None:
                data["metadata"] = {**(data.get("metadata") or {}), "tools": tools}
        sample = self.cls.from_dict(data)
        for key, value in data.items():  # trajbus's from_dict leaves out what is no field; slime's sets it
            if key not in names and not hasattr(sample, key):
                setattr(sample, key, value)
        return sample


TRAJBUS_SAMPLES = SampleKind(Sample)
"""trajbus's own ``Sample``."""
