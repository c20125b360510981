"""Timeouts in force for a rank, the observations they are learned from, and their persistence.

A timeout starts as the configured value (``FaultToleranceConfig``; ``None`` = not checked). After
``calculate_and_set_timeouts`` it becomes ``observed maximum * safety_factor`` (at least MIN_LEARNED_TIMEOUT,
at most MAX_TIMEOUT_SECONDS) for every quantity that
was observed at least once: the first-heartbeat delay, the heartbeat interval, each section's duration
and the time spent outside sections. Observations merge (max) with those loaded from the previous run,
so a rerun never learns a tighter timeout than what an earlier run needed.

The state is a JSON-safe dict (``state_dict`` / ``load_state_dict``), persisted by the monitor at
``<timeouts-dir>/rank<GLOBAL_RANK>.timeouts.json`` with ``nvrx.common.files.save_json_atomic``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from nvrx.monitors.sections import SectionStats, validate_section_name

STATE_VERSION = 1
# Learned timeouts never go below this: a few fast samples (e.g. microseconds between two sections)
# times safety_factor would otherwise kill a healthy rank at its first slower moment.
MIN_LEARNED_TIMEOUT = 1.0
# The longest timeout the configuration accepts (and learning produces): ~10 years never fires anyway,
# while far larger values overflow the monitor's timers.
MAX_TIMEOUT_SECONDS = 10 * 365 * 86400.0


def _positive(value: Any, what: str) -> float | None:
    if value is None:
        return None
    out = float(value)
    if not math.isfinite(out) or out <= 0:
        raise ValueError(f"{what} must be a positive number or None, got {value!r}")
    return out


@dataclass(frozen=True)
class Timeouts:
    """The timeouts a monitor enforces (seconds; None = not checked)."""

    initial_heartbeat: float | None = None
    heartbeat: float | None = None
    sections: Mapping[str, float | None] = field(default_factory=dict)
    out_of_section: float | None = None

    def section(self, name: str) -> float | None:
        return self.sections.get(name)

    def smallest(self) -> float | None:
        """The shortest timeout in force (None if nothing is checked)."""
        values = [v for v in (self.initial_heartbeat, self.heartbeat, self.out_of_section, *self.sections.values())
                  if v is not None]
        return min(values) if values else None

    def to_dict(self) -> dict[str, Any]:
        return {"initial_heartbeat": self.initial_heartbeat, "heartbeat": self.heartbeat,
                "sections": dict(self.sections), "out_of_section": self.out_of_section}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Timeouts":
        sections = {validate_section_name(k): _positive(v, f"section timeout {k!r}")
                    for k, v in dict(d.get("sections") or {}).items()}
        return cls(_positive(d.get("initial_heartbeat"), "initial_heartbeat"),
                   _positive(d.get("heartbeat"), "heartbeat"), sections,
                   _positive(d.get("out_of_section"), "out_of_section"))


@dataclass
class HeartbeatStats:
    """Longest first-heartbeat delay and longest interval between heartbeats."""

    first_delay_max: float | None = None
    interval_max: float | None = None

    def merge(self, other: "HeartbeatStats") -> "HeartbeatStats":
        return HeartbeatStats(_max_opt(self.first_delay_max, other.first_delay_max),
                              _max_opt(self.interval_max, other.interval_max))

    def state_dict(self) -> dict[str, Any]:
        return {"first_delay_max": self.first_delay_max, "interval_max": self.interval_max}

    @classmethod
    def from_state_dict(cls, d: Mapping[str, Any]) -> "HeartbeatStats":
        return cls(_positive(d.get("first_delay_max"), "first_delay_max"),
                   _positive(d.get("interval_max"), "interval_max"))


def _max_opt(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return b if a is None else a
    return max(a, b)


class TimeoutTracker:
    """Configured timeouts + learned overrides + observations (previous runs and the current run)."""

    def __init__(self, configured: Timeouts, safety_factor: float,
                 min_timeout: float = MIN_LEARNED_TIMEOUT) -> None:
        if not safety_factor > 0:
            raise ValueError(f"safety_factor must be > 0, got {safety_factor!r}")
        self.configured = configured
        self.safety_factor = float(safety_factor)
        self.min_timeout = float(min_timeout)
        self.computed: dict[str, Any] = {"sections": {}}
        self.previous_hb = HeartbeatStats()
        self.previous_sections = SectionStats()
        self.run_hb = HeartbeatStats()
        self.run_sections = SectionStats()

    # ---- observations
    def reset_run(self) -> None:
        self.run_hb = HeartbeatStats()
        self.run_sections = SectionStats()

    def set_run_observations(self, hb: HeartbeatStats, sections: SectionStats) -> None:
        """Replace the current run's observations (the slot holds running maxima)."""
        self.run_hb = hb
        self.run_sections = sections

    def observed(self) -> tuple[HeartbeatStats, SectionStats]:
        return self.previous_hb.merge(self.run_hb), self.previous_sections.merge(self.run_sections)

    # ---- timeouts
    def in_force(self) -> Timeouts:
        c, base = self.computed, self.configured
        sections = dict(base.sections)
        sections.update(c["sections"])
        return Timeouts(c.get("initial_heartbeat", base.initial_heartbeat), c.get("heartbeat", base.heartbeat),
                        sections, c.get("out_of_section", base.out_of_section))

    def _scale(self, value: float) -> float:
        return min(max(value * self.safety_factor, self.min_timeout), MAX_TIMEOUT_SECONDS)

    def calculated(self) -> dict[str, Any]:
        """Which timeouts in force were learned (the rest are configured): NVRx's ``were_calculated`` marks."""
        c = self.computed
        return {"initial_heartbeat": "initial_heartbeat" in c, "heartbeat": "heartbeat" in c,
                "sections": sorted(c["sections"]), "out_of_section": "out_of_section" in c}

    def observed_values(self) -> dict[str, Any]:
        """The observed maxima (this run merged with earlier runs), JSON-safe, keyed like Timeouts.to_dict()."""
        hb, sections = self.observed()
        return {"initial_heartbeat": hb.first_delay_max, "heartbeat": hb.interval_max,
                "sections": dict(sections.max_duration), "out_of_section": sections.out_of_section_max}

    def set_calculated(self, values: Mapping[str, Any]) -> None:
        """Learn the timeouts of the quantities in VALUES (observed maxima, e.g. agreed by all ranks).

        Only the keys present are set (``calculate_and_set_hb_timeouts`` sets the heartbeat pair,
        ``calculate_and_set_section_timeouts`` the sections it selects). The values also become the
        earlier-run observations, so a later learning never goes below them.
        """
        hb = HeartbeatStats(_positive(values.get("initial_heartbeat"), "initial_heartbeat"),
                            _positive(values.get("heartbeat"), "heartbeat"))
        sections = SectionStats()
        for name, value in dict(values.get("sections") or {}).items():
            sections.observe_section(validate_section_name(name), float(_positive(value, f"section {name!r}") or 0))
        if values.get("out_of_section") is not None:
            sections.observe_out_of_section(float(_positive(values["out_of_section"], "out_of_section")))
        for key, value in (("initial_heartbeat", hb.first_delay_max), ("heartbeat", hb.interval_max),
                           ("out_of_section", sections.out_of_section_max)):
            if value is not None:
                self.computed[key] = self._scale(value)
        for name, value in sections.max_duration.items():
            self.computed["sections"][name] = self._scale(value)
        self.previous_hb = self.previous_hb.merge(hb)
        self.previous_sections = self.previous_sections.merge(sections)

    def calculate_and_set(self) -> bool:
        """Learn timeouts (max(observed max * safety_factor, min_timeout)); True if any was set."""
        hb, sections = self.observed()
        scale = self._scale

        learned: dict[str, Any] = {"sections": {n: scale(v) for n, v in sections.max_duration.items()}}
        if hb.first_delay_max is not None:
            learned["initial_heartbeat"] = scale(hb.first_delay_max)
        if hb.interval_max is not None:
            learned["heartbeat"] = scale(hb.interval_max)
        if sections.out_of_section_max is not None:
            learned["out_of_section"] = scale(sections.out_of_section_max)
        self.computed.update({k: v for k, v in learned.items() if k != "sections"})
        self.computed["sections"].update(learned["sections"])
        self.previous_hb, self.previous_sections = hb, sections
        return len(learned) > 1 or bool(learned["sections"])

    # ---- state
    def state_dict(self) -> dict[str, Any]:
        hb, sections = self.observed()
        return {"version": STATE_VERSION, "safety_factor": self.safety_factor,
                "observed": {"heartbeat": hb.state_dict(), "sections": sections.state_dict()},
                "computed": json.loads(json.dumps(self.computed))}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Adopt learned timeouts and observations from a previous run (validated; ValueError if bad)."""
        if not isinstance(d, Mapping) or d.get("version") != STATE_VERSION:
            raise ValueError(f"not a rank-monitor state (version {STATE_VERSION} expected)")
        observed = d.get("observed") or {}
        previous_hb = HeartbeatStats.from_state_dict(observed.get("heartbeat") or {})
        previous_sections = SectionStats.from_state_dict(observed.get("sections") or {})
        raw = dict(d.get("computed") or {})
        computed: dict[str, Any] = {"sections": {}}
        for key in ("initial_heartbeat", "heartbeat", "out_of_section"):
            if raw.get(key) is not None:
                computed[key] = _positive(raw[key], key)
        for name, value in dict(raw.get("sections") or {}).items():
            computed["sections"][validate_section_name(name)] = _positive(value, f"section {name!r}")
        self.previous_hb, self.previous_sections, self.computed = previous_hb, previous_sections, computed


def tracker_state_from_nvrx(current: Mapping[str, Any]) -> dict[str, Any]:
    """A tracker state from NVRx's ``state_dict()["current_timeouts"]`` (its calculated timeouts only).

    NVRx keeps no observations, so none are carried; the calculated timeouts become learned ones.
    """
    if not isinstance(current, Mapping):
        raise ValueError("current_timeouts must be a mapping")
    computed: dict[str, Any] = {"sections": {}}
    hb = current.get("heartbeat") or {}
    if hb.get("were_calculated"):
        for ours, theirs in (("initial_heartbeat", "initial"), ("heartbeat", "subsequent")):
            if hb.get(theirs) is not None:
                computed[ours] = hb[theirs]
    sec = current.get("section") or {}
    values = dict(sec.get("section") or {})
    for name in sec.get("calculated_sections") or ():
        if values.get(name) is not None:
            computed["sections"][name] = values[name]
    if sec.get("is_out_of_section_calculated") and sec.get("out_of_section") is not None:
        computed["out_of_section"] = sec["out_of_section"]
    return {"version": STATE_VERSION, "observed": {}, "computed": computed}


def state_file(state_dir: Path, rank: int) -> Path:
    return Path(state_dir) / f"rank{rank}.timeouts.json"
