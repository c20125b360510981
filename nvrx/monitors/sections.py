"""Section names <-> small slot ids, and the observed section durations of a rank.

A section is a named code region (``setup``, ``step``, ``checkpointing``...) that the rank opens and
closes; the monitor gives every name a fixed id (an index into the heartbeat slot's section arrays)
when the rank connects or registers new names. Ids never change while the monitor lives, so a
restarted rank sees the same mapping.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

from nvrx.monitors.heartbeat import MAX_SECTIONS

_NAME_RE = re.compile(r"^[A-Za-z0-9_.:\-/]{1,64}$")


def validate_section_name(name: object) -> str:
    """Return NAME if it is a usable section name, else raise ValueError."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"invalid section name {name!r}: use 1-64 characters of [A-Za-z0-9_.:-/]")
    return name


class SectionRegistry:
    """Name -> id mapping, at most MAX_SECTIONS names."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._ids: dict[str, int] = {}
        for name in names:
            self.register(name)

    def register(self, name: str) -> int:
        validate_section_name(name)
        sid = self._ids.get(name)
        if sid is None:
            if len(self._ids) >= MAX_SECTIONS:
                raise ValueError(f"too many sections (at most {MAX_SECTIONS}); cannot add {name!r}")
            sid = self._ids[name] = len(self._ids)
        return sid

    def id_of(self, name: str) -> int | None:
        return self._ids.get(name)

    def name_of(self, sid: int) -> str:
        for name, i in self._ids.items():
            if i == sid:
                return name
        return f"#{sid}"

    def mapping(self) -> dict[str, int]:
        return dict(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


def _max_opt(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


class SectionStats:
    """Longest observed duration per section, and the longest time spent outside all sections."""

    def __init__(self) -> None:
        self.max_duration: dict[str, float] = {}
        self.out_of_section_max: float | None = None

    def observe_section(self, name: str, duration: float) -> None:
        if duration > 0:
            self.max_duration[name] = max(self.max_duration.get(name, 0.0), duration)

    def observe_out_of_section(self, duration: float) -> None:
        if duration > 0:
            self.out_of_section_max = _max_opt(self.out_of_section_max, duration)

    def merge(self, other: "SectionStats") -> "SectionStats":
        """A new SectionStats holding the larger value of each field."""
        out = SectionStats()
        for name in set(self.max_duration) | set(other.max_duration):
            out.max_duration[name] = max(self.max_duration.get(name, 0.0), other.max_duration.get(name, 0.0))
        out.out_of_section_max = _max_opt(self.out_of_section_max, other.out_of_section_max)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"max_duration": dict(self.max_duration), "out_of_section_max": self.out_of_section_max}

    @classmethod
    def from_state_dict(cls, d: Mapping[str, Any]) -> "SectionStats":
        out = cls()
        for name, value in dict(d.get("max_duration") or {}).items():
            out.observe_section(validate_section_name(name), float(value))
        if d.get("out_of_section_max") is not None:
            out.observe_out_of_section(float(d["out_of_section_max"]))
        return out
