"""Fault-tolerance (rank monitor) configuration: one typed schema, four layers.

:class:`FaultToleranceConfig` is the single source of the settings. Each dataclass field carries
its kind (how a raw value is parsed, validated and printed) and its help text in the field
metadata; :data:`SCHEMA` is derived from the dataclass, and everything user-facing is derived
from :data:`SCHEMA`: the YAML keys, the ``NVRX_FT_<FIELD>`` environment names, the
``--ft-param-<field>`` flags of ``nvrx launch`` and the docs' table
(:func:`config_table_markdown`, written to docs/reference/config.md by ``scripts/gen_docs.py``).

:func:`load_ft_config` layers, lowest to highest::

    defaults  <  YAML file  <  environment (NVRX_FT_*)  <  CLI overrides (--ft-param-*)

Each layer replaces a field's whole value (a ``rank_section_timeouts`` mapping given on the CLI
replaces the YAML one; it is not merged). Every bad value is a :class:`ConfigError` whose
message is one line saying what is wrong and how to fix it. A broken, misspelled or non-mapping
YAML file is always an error, never a silent fall back to defaults.

``None`` for a timeout means "deduce it at run time from the observed heartbeat/section
intervals" (times ``safety_factor``). In YAML write ``null``; on the CLI or in the environment
write ``null`` or ``none``.
"""

from __future__ import annotations

import difflib
import logging
import math
import re
import signal
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Collection, Iterator, Mapping

import yaml

from nvrx.common.errors import ConfigError
from nvrx.common.files import FileTooLarge, NotRegularFile, read_regular
from nvrx.common.signals import SIGNAL_HINT, parse_signal
from nvrx.monitors.heartbeat import MAX_SECTIONS
from nvrx.monitors.sections import validate_section_name
from nvrx.monitors.auto_timeout import MODES as AUTO_TIMEOUT_MODES
from nvrx.monitors.auto_timeout import AutoTimeoutSettings
from nvrx.monitors.timeouts import MAX_TIMEOUT_SECONDS

log = logging.getLogger(__name__)

ENV_PREFIX = "NVRX_FT_"
YAML_SECTION = "fault_tolerance"

_NULL_WORDS = frozenset({"null", "none", "~"})

# Value ranges. Timeouts above ~10 years would never fire anyway; far larger ones (1e308) overflow the
# monitor's timers. The check interval is how often an idle monitor wakes: below 10 ms it burns a core,
# above a day it is a typo.
MIN_CHECK_INTERVAL = 0.01
MAX_CHECK_INTERVAL = 86400.0
MAX_SAFETY_FACTOR = 1000.0
# A config file is a few KB (a NeMo experiment config with a fault_tolerance section: tens of KB); PyYAML's
# pure-Python parser needs seconds per MB, so a bigger file is a wrong path, refused before parsing.
MAX_CONFIG_BYTES = 512 * 1024

# Signals whose default action does not end the process: a hung rank would survive them.
_NON_TERMINATING = frozenset(
    getattr(signal, n) for n in
    ("SIGSTOP", "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGCONT", "SIGCHLD", "SIGURG", "SIGWINCH")
    if hasattr(signal, n)
)
_LEVEL_NAMES: dict[str, int] = {
    "CRITICAL": logging.CRITICAL, "FATAL": logging.FATAL, "ERROR": logging.ERROR,
    "WARNING": logging.WARNING, "WARN": logging.WARNING, "INFO": logging.INFO,
    "DEBUG": logging.DEBUG, "NOTSET": logging.NOTSET,
}
_LEVEL_CANONICAL: dict[int, str] = {
    logging.CRITICAL: "CRITICAL", logging.ERROR: "ERROR", logging.WARNING: "WARNING",
    logging.INFO: "INFO", logging.DEBUG: "DEBUG", logging.NOTSET: "NOTSET",
}


def one_line_error(message: str) -> ConfigError:
    """A ConfigError whose message is guaranteed to be one line."""
    return ConfigError(" ".join(str(message).split()))


def closest(word: str, candidates: Collection[str], cutoff: float = 0.6) -> str | None:
    norm = word.strip().lower().replace("-", "_")
    for cand in candidates:  # same name, other spelling (dashes, case): the obvious suggestion
        if cand.lower().replace("-", "_") == norm:
            return cand
    found = difflib.get_close_matches(word, list(candidates), n=1, cutoff=cutoff)
    if not found:
        found = difflib.get_close_matches(norm, list(candidates), n=1, cutoff=cutoff)
    return found[0] if found else None


def _did_you_mean(word: str, candidates: Collection[str], cutoff: float = 0.6) -> str:
    best = closest(word, candidates, cutoff)
    if best is not None:
        return f"did you mean {best!r}?"
    return "valid names: " + ", ".join(sorted(candidates))


# ---------------------------------------------------------------- strict YAML loading


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate mapping keys (PyYAML silently keeps the last one)."""


def _construct_unique_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            dup = key in seen
        except TypeError:
            dup = False  # unhashable: the base constructor reports it
        if dup:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (each setting may appear once)", key_node.start_mark)
        try:
            seen.add(key)
        except TypeError:
            pass
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def _yaml_error_text(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None) or str(exc)
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "unknown line"
    return f"{where}: {problem}"


# ---------------------------------------------------------------- kinds: parse / dump / show


@dataclass(frozen=True)
class ValueKind:
    """How values of one type are parsed from raw input, validated, serialized and shown."""

    label: str  # for the docs table (docs/reference/config.md), e.g. "float > 0 or null"
    parse: Callable[[Any, str], Any]  # (raw or typed value, where) -> typed value; raises ConfigError
    dump: Callable[[Any], Any]  # typed value -> JSON-safe value
    show: Callable[[Any], str]  # typed value -> short human text (describe / table)


def _num(value: float) -> str:
    """A bound for messages: 315360000 rather than 3.1536e+08."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _float_kind(optional: bool, unit: str, low: float = 0.0, high: float = MAX_TIMEOUT_SECONDS,
                low_inclusive: bool = False, example: str | None = None) -> ValueKind:
    """A float in (LOW, HIGH] (or [LOW, HIGH] with LOW_INCLUSIVE), or None when OPTIONAL.

    The upper bound is not cosmetic: the monitor sleeps and computes deadlines with these values, and
    a value like 1e308 overflows the OS timer (the monitor would crash at run time, after the job
    already started), so such values are refused here, where the user can still fix them.
    """
    example = example or ("30" if unit == "seconds" else "5")
    lo_text = f"at least {_num(low)}" if low_inclusive else f"greater than {_num(low)}"
    unit_text = f" {unit}" if unit == "seconds" else ""
    hint = (f"give a positive number of {unit} like {example} ({lo_text} and at most {_num(high)}{unit_text})"
            + (" (or null to deduce it at run time)" if optional else ""))

    def parse(value: Any, where: str) -> float | None:
        if value is None or (isinstance(value, str) and value.strip().lower() in _NULL_WORDS):
            if optional:
                return None
            raise one_line_error(f"{where}: null is not allowed here; {hint}")
        if isinstance(value, bool):
            raise one_line_error(f"{where}: {value!r} is not a number; {hint}")
        try:
            num = float(value.strip() if isinstance(value, str) else value)
        except (TypeError, ValueError, OverflowError):
            raise one_line_error(f"{where}: {value!r} is not a number; {hint}") from None
        if not math.isfinite(num):
            raise one_line_error(f"{where}: {value!r} is not a finite number; {hint}")
        if num < low or (num == low and not low_inclusive):
            raise one_line_error(f"{where}: {value!r} must be {lo_text}; {hint}")
        if num > high:
            raise one_line_error(f"{where}: {value!r} is too large; {hint}")
        return num

    def show(value: float | None) -> str:
        if value is None:
            return "auto"
        return f"{value:g}s" if unit == "seconds" else f"{value:g}"

    lo_label = f">= {_num(low)}" if low_inclusive else f"> {_num(low)}"
    return ValueKind(
        label=f"float {lo_label} and <= {_num(high)}" + (", or null" if optional else "")
        + (" (s)" if unit == "seconds" else ""),
        parse=parse,
        dump=lambda v: v,
        show=show,
    )


CHECK_INTERVAL = _float_kind(optional=False, unit="seconds", low=MIN_CHECK_INTERVAL, high=MAX_CHECK_INTERVAL,
                             low_inclusive=True, example="5")
OPTIONAL_SECONDS = _float_kind(optional=True, unit="seconds")
POSITIVE_FACTOR = _float_kind(optional=False, unit="times", high=MAX_SAFETY_FACTOR)


def _parse_signal(value: Any, where: str) -> signal.Signals:
    if isinstance(value, signal.Signals):
        sig = value
    elif isinstance(value, bool) or not isinstance(value, (int, str)):
        raise one_line_error(f"{where}: {value!r} is not a signal; {SIGNAL_HINT}")
    else:
        sig = parse_signal(value, where)
    if sig in _NON_TERMINATING:
        raise one_line_error(f"{where}: {sig.name} does not terminate a process; use SIGKILL or SIGTERM")
    return sig


SIGNAL = ValueKind(label="signal name or number", parse=_parse_signal, dump=lambda s: s.name, show=lambda s: s.name)


def _parse_log_level(value: Any, where: str) -> int:
    hint = f"use DEBUG, INFO, WARNING, ERROR, CRITICAL or a number from 0 to {logging.CRITICAL} like 20"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise one_line_error(f"{where}: {value!r} is not a log level; {hint}")
    if isinstance(value, int):
        level = value
    else:
        text = value.strip()
        if re.fullmatch(r"\d+", text):
            level = int(text)
        elif text.upper() in _LEVEL_NAMES:
            return _LEVEL_NAMES[text.upper()]
        else:
            guess = closest(text.upper(), list(_LEVEL_NAMES))
            tip = f"did you mean {guess}? " if guess else ""
            raise one_line_error(f"{where}: unknown log level {value!r}; {tip}{hint}")
    if level < 0:
        raise one_line_error(f"{where}: log level {value!r} is negative; {hint}")
    if level > logging.CRITICAL:  # above CRITICAL nothing is ever logged: a typo, not a choice
        raise one_line_error(f"{where}: log level {value!r} is above CRITICAL ({logging.CRITICAL}) and would "
                             f"silence every message; {hint}")
    return level


def _dump_log_level(level: int) -> str | int:
    return _LEVEL_CANONICAL.get(level, level)


LOG_LEVEL = ValueKind(label="log level name or number", parse=_parse_log_level, dump=_dump_log_level,
                 show=lambda v: str(_dump_log_level(v)))


_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def _parse_bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE_WORDS | _FALSE_WORDS:
        return value.strip().lower() in _TRUE_WORDS
    raise one_line_error(f"{where}: {value!r} is not a boolean; use true or false")


BOOL = ValueKind(label="true or false", parse=_parse_bool, dump=lambda v: v, show=lambda v: "on" if v else "off")


def _int_kind(low: int, high: int, optional: bool = False) -> ValueKind:
    """A whole number in [LOW, HIGH] (or None when OPTIONAL); "3" and 3.0 are accepted, 3.5 is not."""
    hint = f"give a whole number from {low} to {high}" + (" (or null)" if optional else "")

    def parse(value: Any, where: str) -> int | None:
        if value is None or (isinstance(value, str) and value.strip().lower() in _NULL_WORDS | {""}):
            if optional:
                return None
            raise one_line_error(f"{where}: null is not allowed here; {hint}")
        if isinstance(value, bool):
            raise one_line_error(f"{where}: {value!r} is not a whole number; {hint}")
        try:
            num = float(value.strip() if isinstance(value, str) else value)
        except (TypeError, ValueError, OverflowError):
            raise one_line_error(f"{where}: {value!r} is not a whole number; {hint}") from None
        if not math.isfinite(num) or not num.is_integer():
            raise one_line_error(f"{where}: {value!r} is not a whole number; {hint}")
        if not low <= num <= high:
            raise one_line_error(f"{where}: {value!r} is out of range; {hint}")
        return int(num)

    return ValueKind(label=f"integer {low}..{high}" + (", or null" if optional else ""), parse=parse,
                     dump=lambda v: v, show=lambda v: "unset" if v is None else str(v))


def _parse_text(value: Any, where: str) -> str | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in _NULL_WORDS | {""}):
        return None
    if not isinstance(value, str) or "\n" in value or "\x00" in value:
        raise one_line_error(f"{where}: {value!r} is not a one-line text or path; give a string (or null)")
    return value


def _choice_kind(choices: tuple[str, ...]) -> ValueKind:
    """One of CHOICES (case-insensitive)."""
    hint = "use " + ", ".join(choices[:-1]) + f" or {choices[-1]}"

    def parse(value: Any, where: str) -> str:
        text = value.strip().lower() if isinstance(value, str) else None
        if text not in choices:
            guess = closest(str(value), choices) if isinstance(value, str) else None
            tip = f"did you mean {guess}? " if guess else ""
            raise one_line_error(f"{where}: {value!r} is not a valid choice; {tip}{hint}")
        return text

    return ValueKind(label="one of " + ", ".join(choices), parse=parse, dump=lambda v: v, show=lambda v: v)


OPTIONAL_TEXT = ValueKind(label="text or path, or null", parse=_parse_text, dump=lambda v: v,
                          show=lambda v: "unset" if v is None else v)
COUNT = _int_kind(0, 1_000_000)
OPTIONAL_SEGMENT = _int_kind(1, 1_000_000, optional=True)
MEBIBYTES = _float_kind(optional=False, unit="MiB", low=0.0, high=1e9, low_inclusive=True, example="512")
SECONDS = _float_kind(optional=False, unit="seconds", example="50")


class SectionTimeoutMap(Mapping[str, "float | None"]):
    """Read-only, hashable, picklable mapping of section name -> timeout (None = deduce)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, float | None] | None = None) -> None:
        self._items = dict(items or {})

    def __getitem__(self, key: str) -> float | None:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._items.items(), key=lambda kv: kv[0])))

    def __repr__(self) -> str:
        return f"SectionTimeoutMap({self._items!r})"

    def __getstate__(self) -> dict:
        return self._items

    def __setstate__(self, state: dict) -> None:
        self._items = dict(state)


def _parse_section_map(value: Any, where: str) -> SectionTimeoutMap:
    hint = "write it as step:30,checkpointing:600 or as a mapping like {\"step\": 30, \"checkpointing\": null}"
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in _NULL_WORDS or text == "":
            return SectionTimeoutMap()
        if text.startswith("{"):
            try:
                value = yaml.load(text, Loader=_StrictLoader)
            except yaml.YAMLError as exc:
                raise one_line_error(f"{where}: {value!r} is not a valid inline mapping ({_yaml_error_text(exc)}); {hint}") from None
        else:
            pairs: dict[str, str] = {}
            for item in text.split(","):
                if not item.strip():
                    continue
                sep = re.search(r"[:=]", item)
                key = item[:sep.start()].strip() if sep else ""
                raw = item[sep.end():].strip() if sep else ""
                if not key or not raw:
                    raise one_line_error(f"{where}: item {item.strip()!r} is not SECTION:SECONDS; {hint}")
                if key in pairs:
                    raise one_line_error(f"{where}: section {key!r} is given twice; keep one")
                pairs[key] = raw
            value = pairs
    if value is None:
        return SectionTimeoutMap()
    if not isinstance(value, Mapping):
        raise one_line_error(f"{where}: {value!r} is not a mapping of section names to seconds; {hint}")
    if len(value) > MAX_SECTIONS:
        raise one_line_error(f"{where}: {len(value)} sections given, but a rank monitor tracks at most {MAX_SECTIONS}; "
                     "merge or drop some sections")
    out: dict[str, float | None] = {}
    for key, raw in value.items():
        try:
            validate_section_name(key)  # the monitor's own rule: a name it accepts here it accepts at run time
        except ValueError as exc:
            raise one_line_error(f"{where}: {exc}") from None
        out[key] = OPTIONAL_SECONDS.parse(raw, f"{where} section {key!r}")
    return SectionTimeoutMap(out)


def _show_section_map(value: Mapping[str, float | None]) -> str:
    if not value:
        return "{}"
    return "{" + ", ".join(f"{k}: {OPTIONAL_SECONDS.show(v)}" for k, v in value.items()) + "}"


SECTION_TIMEOUTS = ValueKind(label=f"mapping section -> float > 0 or null (s); at most {MAX_SECTIONS} sections, "
                              "names of 1-64 characters [A-Za-z0-9_.:-/]", parse=_parse_section_map,
                        dump=lambda m: dict(m), show=_show_section_map)


# ---------------------------------------------------------------- the config (single source)


def _setting(kind: ValueKind, help: str, default: Any = None, factory: Callable[[], Any] | None = None,
             active: bool = True) -> Any:
    """A config field: its kind and help, and ACTIVE (False: an NVRx setting nvrx accepts but does not act on,
    named once on the agent's stderr when a config sets it; see :func:`inactive_settings_warning`)."""
    meta = {"kind": kind, "help": help, "active": active}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class FaultToleranceConfig:
    """Settings of the rank monitors (hang detection). ``None`` timeouts are deduced at run time.

    Mutable, as NVRx's is (``cfg.rank_heartbeat_timeout = 10.0`` is ordinary NVRx code), but never invalid:
    construction and every assignment validate and normalize the value (e.g. ``rank_termination_signal="TERM"``
    becomes ``signal.SIGTERM``); a bad value raises :class:`ConfigError` and leaves the field as it was. An
    unknown setting name raises AttributeError (with the closest name) instead of creating a stray attribute.
    """

    workload_check_interval: float = _setting(
        CHECK_INTERVAL, "How often (seconds) a rank monitor checks its rank.", 5.0)
    initial_rank_heartbeat_timeout: float | None = _setting(
        OPTIONAL_SECONDS, "Timeout (seconds) for the first heartbeat of a rank; covers initialization. "
        "null = deduce at run time.", 3600.0)
    rank_heartbeat_timeout: float | None = _setting(
        OPTIONAL_SECONDS, "Timeout (seconds) between later heartbeats; at least the longest step "
        "(heartbeats pause during checkpointing). null = deduce at run time.", 2700.0)
    safety_factor: float = _setting(
        POSITIVE_FACTOR, "When timeouts are deduced, observed intervals are multiplied by this factor.", 5.0)
    rank_termination_signal: signal.Signals = _setting(
        SIGNAL, "Signal sent to a rank detected as hung.", signal.SIGKILL)
    log_level: int = _setting(LOG_LEVEL, "Log level of the fault tolerance components.", logging.INFO)
    rank_section_timeouts: Mapping[str, float | None] = _setting(
        SECTION_TIMEOUTS, "Sections API: timeout (seconds) per named section, e.g. setup, step, "
        "checkpointing; null = deduce at run time.", factory=SectionTimeoutMap)
    rank_out_of_section_timeout: float | None = _setting(
        OPTIONAL_SECONDS, "Sections API: timeout (seconds) for time spent outside any section. "
        "null = deduce at run time.", None)
    # ---- NVRx's further settings. nvrx accepts and validates all of them, so an NVRx config or call
    # works unchanged; the ones nvrx does not act on are marked active=False (NOT_ACTIVE): a config that sets
    # one is told so once on the agent's stderr, and the monitor logs them.
    node_health_check_interval: float = _setting(
        CHECK_INTERVAL, "NVRx: how often (seconds) the GPUs of the node are health-checked. Not active in nvrx "
        "(no GPU health check; the monitor logs this at start).", 5.0, active=False)
    restart_check_interval: float = _setting(
        CHECK_INTERVAL, "NVRx: how often (seconds) its launcher checks for a requested restart. Not active in "
        "nvrx (the agent is woken at once by rank exits and stop records).", 60.0, active=False)
    enable_nic_monitor: bool = _setting(
        BOOL, "NVRx: watch the InfiniBand NIC link state. Not active in nvrx (GPU clusters only).", False,
        active=False)
    enable_nic_healthcheck: bool = _setting(
        BOOL, "Check that every InfiniBand link (sysfs port state, or link_state_path_template) is ACTIVE "
        "before each rendezvous round; a failing node leaves the job with exit 16 (the other nodes go on if --nnodes allows; nvrx resume avoids it).", False)
    enable_dist_storage_healthcheck: bool = _setting(
        BOOL, "Check before each rendezvous round that storage_healthcheck_path takes a write + fsync + read "
        "within node_health_check_timeout; a failure stops the job with exit 18 (shared storage, not a node's "
        "fault: no node is excluded).", False)
    storage_healthcheck_path: str | None = _setting(
        OPTIONAL_TEXT, "The directory the storage health check writes its probe file to.", None)
    pci_topo_file: str | None = _setting(
        OPTIONAL_TEXT, "NVRx: PCI topology file used to pair GPUs with NICs. Not active in nvrx.", None, active=False)
    link_down_path_template: str | None = _setting(
        OPTIONAL_TEXT, "NVRx: sysfs path template of a NIC's link-down counter. Not active in nvrx.", None, active=False)
    link_state_path_template: str | None = _setting(
        OPTIONAL_TEXT, "sysfs path of a NIC port's link state for the NIC health check ({} = every device; "
        "default /sys/class/infiniband/*/ports/*/state).", None)
    skip_section_response: bool = _setting(
        BOOL, "NVRx: section calls do not wait for the monitor's reply. nvrx section calls never wait "
        "(they write shared memory), and misuse raises at once either way.", True)
    segment: int | None = _setting(
        OPTIONAL_SEGMENT, "NVRx: nodes per segment for segment-aware rank placement. Not active in nvrx.", None, active=False)
    numa_bind_strict: bool = _setting(
        BOOL, "NVRx: bind each rank strictly to its GPU's NUMA node. Not active in nvrx (GPU clusters only).",
        False, active=False)
    gpu_memory_reclaim_timeout: float = _setting(
        SECONDS, "NVRx: seconds to wait for GPU memory to be freed before a restart. Not active in nvrx "
        "(GPU only).", 50.0, active=False)
    gpu_memory_tolerance_mb: float = _setting(
        MEBIBYTES, "NVRx: GPU memory (MiB) still in use that counts as freed. Not active in nvrx (GPU only).",
        512.0, active=False)
    gpu_memory_poll_interval: float = _setting(
        CHECK_INTERVAL, "NVRx: seconds between GPU memory checks while waiting. Not active in nvrx (GPU only).",
        2.0, active=False)
    check_remaining_processes: bool = _setting(
        BOOL, "NVRx: look for leftover processes of a stopped rank. Not active in nvrx (its agent stops "
        "each rank's whole process group).", False, active=False)
    max_no_progress_cycles: int = _setting(
        COUNT, "NVRx: stop restarting after this many restarts without training progress (0 = off). Not active "
        "in nvrx; nvrx resume stops a chain that makes no progress.", 3, active=False)
    min_progress_iterations: int = _setting(
        COUNT, "NVRx: iterations a restart must gain to count as progress. Not active in nvrx.", 1, active=False)
    checkpoint_iteration_file: str | None = _setting(
        OPTIONAL_TEXT, "NVRx: file holding the last checkpointed iteration, read for progress tracking. Not "
        "active in nvrx (nvrx resume reads --progress-file).", None, active=False)
    install_exception_hook: bool = _setting(
        BOOL, "An uncaught exception in the rank is logged with the rank number and the rank's open sections "
        "are closed before the process exits (set by RankMonitorClient.init_workload_monitoring).", False)
    num_warmup_iterations: int = _setting(
        COUNT, "NVRx: iterations after a restart that progress tracking ignores. Not active in nvrx.", 5, active=False)
    attribution_endpoint: str | None = _setting(
        OPTIONAL_TEXT, "NVRx: failure-attribution service address. Not active in nvrx.", None, active=False)
    attribution_stop_action: str | None = _setting(
        OPTIONAL_TEXT, "NVRx: what to do when the attribution service says stop. Not active in nvrx.", None, active=False)
    attribution_export_url: str | None = _setting(
        OPTIONAL_TEXT, "NVRx: where attribution results are exported. Not active in nvrx.", None, active=False)
    cycle_info_dir: str | None = _setting(
        OPTIONAL_TEXT, "NVRx: directory for per-restart cycle info files. Not active in nvrx (nvrx inspect "
        "reads the event files instead).", None, active=False)
    segment_health_check_dir: str | None = _setting(
        OPTIONAL_TEXT, "NVRx: directory of segment health check results. Not active in nvrx.", None, active=False)
    node_health_check_hook: str | None = _setting(
        OPTIONAL_TEXT, "nvrx: the user's node health check, run by the agent before each rendezvous round: a "
        "command (exit 0 = healthy) or module:function (returns None or True = healthy). A failing node leaves "
        "the job with exit 16 (the other nodes go on if --nnodes allows; nvrx resume avoids it).", None)
    node_health_check_timeout: float = _setting(
        SECONDS, "nvrx: time bound of each node health check (a check that takes longer counts as failed).", 10.0)
    node_health_min_free_memory_mb: float = _setting(
        MEBIBYTES, "nvrx: node health check: at least this much memory available (MiB).", 64.0)
    node_health_min_free_disk_mb: float = _setting(
        MEBIBYTES, "nvrx: node health check: warn (one line, never a failure) below this much free disk (MiB) where the "
        "run's logs go.", 64.0)
    auto_heartbeat: bool = _setting(
        BOOL, "nvrx: heartbeat automatically while the rank's main thread keeps executing Python bytecode, so an "
        "unmodified script gets hang detection (a call that blocks the interpreter stops the beats).", False)
    straggler_report_interval: float = _setting(
        CHECK_INTERVAL, "nvrx: straggler detection: how often (seconds) each rank monitor summarises its rank's section "
        "and heartbeat timings and the agents compare the ranks (a rank flagged as a straggler is logged and shown "
        "in nvrx inspect).", 10.0)
    straggler_threshold: float = _setting(
        _float_kind(optional=False, unit="times", low=1.0, high=100.0, example="1.2"),
        "nvrx: straggler detection: a rank is slow when its median section time (or heartbeat interval) is this "
        "many times the median of the other ranks (a rank without peers: of its own history).", 1.2)
    straggler_sustain_reports: int = _setting(
        _int_kind(1, 1000), "nvrx: straggler detection: consecutive slow reports before a rank is flagged.", 2)
    straggler_exclude_after_reports: int = _setting(
        COUNT, "nvrx: a node with a rank flagged as a straggler for this many consecutive reports leaves the job before "
        "the next rendezvous round with exit 16, like a failed health check (nvrx resume excludes it). 0 = off.", 0)
    heartbeat_timeout_auto: str = _setting(
        _choice_kind(AUTO_TIMEOUT_MODES), "nvrx: automatic heartbeat timeout derived from the rank's own gaps "
        "between heartbeats after warm-up: multiple x a high percentile of the steady gaps, at least "
        "heartbeat_timeout_auto_min, never above rank_heartbeat_timeout, widened as the rank slows. A rank that "
        "passes it is killed only if stopped, or asleep while no local peer works; a busy one is looked at again "
        "(rank_heartbeat_timeout stays the bound). suggest = derive and report it (nvrx inspect), enforce "
        "rank_heartbeat_timeout; set = enforce it; off.", "suggest")
    heartbeat_timeout_auto_multiple: float = _setting(
        _float_kind(optional=False, unit="times", low=1.0, high=1000.0, example="4"),
        "nvrx: the automatic heartbeat timeout is this many times heartbeat_timeout_auto_percentile of the steady "
        "gaps between heartbeats.", 4.0)
    heartbeat_timeout_auto_percentile: float = _setting(
        _float_kind(optional=False, unit="percent", low=50.0, high=100.0, low_inclusive=True, example="99"),
        "nvrx: the percentile of the steady gaps between heartbeats the automatic timeout is a multiple of "
        "(100 = the longest gap).", 99.0)
    heartbeat_timeout_auto_min: float = _setting(
        _float_kind(optional=False, unit="seconds", low=0.01, low_inclusive=True, example="0.25"),
        "nvrx: the automatic heartbeat timeout is never below this (seconds).", 0.25)
    heartbeat_timeout_auto_warmup_beats: int = _setting(
        _int_kind(1, 1_000_000), "nvrx: steady gaps between heartbeats observed before the automatic timeout is "
        "derived (and heartbeat_timeout_auto_warmup_seconds; a percentile needs a few hundred).", 300)
    heartbeat_timeout_auto_warmup_seconds: float = _setting(
        _float_kind(optional=False, unit="seconds", low=0.0, low_inclusive=True, example="20"),
        "nvrx: seconds of steady heartbeats observed before the automatic timeout is derived (over the rank's "
        "restarts; cover the rare regular pauses, e.g. one checkpoint interval).", 20.0)
    heartbeat_timeout_auto_settle_seconds: float = _setting(
        _float_kind(optional=False, unit="seconds", low=0.0, low_inclusive=True, example="5"),
        "nvrx: after each (re)start of a rank, seconds from its first heartbeat during which the configured "
        "timeout applies and gaps are not counted (process-group set-up, checkpoint load, first steps).", 5.0)

    def __setattr__(self, name: str, value: Any) -> None:
        kind = _FIELD_KINDS.get(name)
        if kind is not None:
            value = kind.parse(value, f"FaultToleranceConfig.{name}")
        elif not name.startswith("_"):
            raise AttributeError(f"FaultToleranceConfig has no setting {name!r}; "
                                 f"{_did_you_mean(name, list(_FIELD_KINDS))}")
        object.__setattr__(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict: signal by name, log level by name (a number if it has no standard name)."""
        return {spec.name: spec.kind.dump(getattr(self, spec.name)) for spec in SCHEMA}

    @property
    def auto_timeout(self) -> AutoTimeoutSettings:
        """The heartbeat_timeout_auto* settings as one value (nvrx.monitors.auto_timeout)."""
        return AutoTimeoutSettings(self.heartbeat_timeout_auto, self.heartbeat_timeout_auto_multiple,
                                   self.heartbeat_timeout_auto_min, self.heartbeat_timeout_auto_percentile,
                                   self.heartbeat_timeout_auto_warmup_beats,
                                   self.heartbeat_timeout_auto_warmup_seconds,
                                   self.heartbeat_timeout_auto_settle_seconds)

    @property
    def is_progress_tracking_enabled(self) -> bool:
        """NVRx's test for progress tracking (max_no_progress_cycles > 0); nvrx does not track it here."""
        return self.max_no_progress_cycles > 0

    # ---- NVRx's constructors (ValueError on bad input: ConfigError is one)
    @staticmethod
    def from_kwargs(ignore_not_recognized: bool = True, **kwargs: Any) -> FaultToleranceConfig:
        """A config from keyword arguments; unknown names are ignored unless IGNORE_NOT_RECOGNIZED is False."""
        unknown = sorted(k for k in kwargs if k not in _BY_NAME)
        if unknown and not ignore_not_recognized:
            hints = "; ".join(f"{k!r}: {_did_you_mean(k, list(_BY_NAME))}" for k in unknown)
            raise one_line_error(f"Not recognized args: {hints}")
        if unknown:
            log.warning("FaultToleranceConfig.from_kwargs: ignoring unknown settings %s", ", ".join(unknown))
        return FaultToleranceConfig(**{k: v for k, v in kwargs.items() if k in _BY_NAME})

    @staticmethod
    def from_yaml_file(cfg_path: str, ignore_not_recognized: bool = True) -> FaultToleranceConfig:
        """The first ``fault_tolerance:`` mapping found at any depth of the YAML file (NVRx's rule)."""
        doc = _load_yaml_doc(str(cfg_path))
        section = _find_section(doc)
        if section is None:
            raise one_line_error(f"FT config file {str(cfg_path)!r} has no '{YAML_SECTION}:' mapping; put the "
                                 f"settings under '{YAML_SECTION}:'")
        return FaultToleranceConfig.from_kwargs(ignore_not_recognized, **_parse_known(section, cfg_path))

    @staticmethod
    def from_args(args: Any) -> FaultToleranceConfig:
        """A config from parsed launcher arguments, as NVRx's launcher builds it.

        ``args.ft_cfg_path`` (if set) is read first; then every ``args.ft_<field>`` (or
        ``args.ft_param_<field>``) that is not None overrides it. Values may be strings as typed on a
        command line: ``rank_section_timeouts`` as ``step:30,ckpt:600``, a timeout as ``none``/``null``/``''``.
        """
        values: dict[str, Any] = {}
        path = getattr(args, "ft_cfg_path", None) or getattr(args, "fault_tol_cfg_path", None)
        if path:
            doc = _load_yaml_doc(str(path))
            section = _find_section(doc)
            if section is None:
                log.warning("FT config file %s has no '%s:' mapping; using defaults and flags", path, YAML_SECTION)
            else:
                values.update((k, v) for k, v in _parse_known(section, path).items() if k in _BY_NAME)
        for spec in SCHEMA:
            for dest in (f"ft_{spec.name}", f"ft_param_{spec.name}"):
                raw = getattr(args, dest, None)
                if raw is not None:
                    raw = None if isinstance(raw, str) and not raw.strip() else raw  # NVRx: '' means None
                    values[spec.name] = spec.kind.parse(raw, f"--ft-{spec.name.replace('_', '-')}")
        return FaultToleranceConfig(**values)

    def to_yaml_file(self, cfg_path: str) -> None:
        """Write ``{fault_tolerance: {...}}``, readable by from_yaml_file and by nvrx launch --ft-cfg-path."""
        with open(cfg_path, "w", encoding="utf-8") as fh:
            yaml.safe_dump({YAML_SECTION: self.to_dict()}, fh, sort_keys=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "config") -> FaultToleranceConfig:
        """Strict inverse of :meth:`to_dict`: unknown keys and bad values raise ConfigError.

        Missing keys keep their defaults. Values may be typed or raw strings.
        """
        if not isinstance(data, Mapping):
            raise one_line_error(f"{source}: expected a mapping of fault tolerance settings, got {type(data).__name__}")
        return cls(**_parse_mapping(data, source))


@dataclass(frozen=True)
class FieldSpec:
    """One setting, with every user-facing name derived from its field name."""

    name: str
    kind: ValueKind
    default: Any
    help: str

    @property
    def yaml_key(self) -> str:
        return self.name

    @property
    def env_name(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flags(self) -> tuple[str, ...]:
        dashed = self.name.replace("_", "-")
        return tuple(dict.fromkeys(
            (f"--ft-param-{self.name}", f"--ft-param-{dashed}", f"--ft-{self.name}", f"--ft-{dashed}")))

    @property
    def flag(self) -> str:
        """The canonical spelling (used in messages and the table)."""
        return self.flags[0]


_FIELD_KINDS: dict[str, ValueKind] = {f.name: f.metadata["kind"] for f in fields(FaultToleranceConfig)}


def _derive_schema() -> tuple[FieldSpec, ...]:
    specs = []
    for f in fields(FaultToleranceConfig):
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        specs.append(FieldSpec(f.name, f.metadata["kind"], default, f.metadata["help"]))
    return tuple(specs)


SCHEMA: tuple[FieldSpec, ...] = _derive_schema()
_BY_NAME: dict[str, FieldSpec] = {s.name: s for s in SCHEMA}


def _parse_mapping(data: Mapping[Any, Any], source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        spec = _BY_NAME.get(key) if isinstance(key, str) else None
        if spec is None:
            raise one_line_error(f"{source}: unknown key {key!r}; {_did_you_mean(str(key), list(_BY_NAME))}")
        out[spec.name] = spec.kind.parse(value, f"{source} key {spec.name}")
    return out


def _parse_known(section: Any, path: Any) -> dict[str, Any]:
    """SECTION's values, parsed (bad values raise); unknown keys are left for from_kwargs to judge."""
    source = f"FT config file {str(path)!r}"
    if not isinstance(section, Mapping):
        raise one_line_error(f"{source}: '{YAML_SECTION}:' does not hold a mapping of settings")
    known = {k: v for k, v in section.items() if isinstance(k, str) and k in _BY_NAME}
    out = _parse_mapping(known, source)
    out.update({str(k): v for k, v in section.items() if not (isinstance(k, str) and k in _BY_NAME)})
    return out


def _find_section(doc: Any, seen: set[int] | None = None) -> Any:
    """The first value under a ``fault_tolerance`` key, searching mappings and lists depth first.

    Each node is visited once: YAML aliases can make a small file a graph with exponentially many paths.
    """
    seen = set() if seen is None else seen
    if id(doc) in seen:
        return None
    seen.add(id(doc))
    if isinstance(doc, Mapping):
        if YAML_SECTION in doc:
            return doc[YAML_SECTION]
        children = list(doc.values())
    elif isinstance(doc, list):
        children = doc
    else:
        return None
    for child in children:
        found = _find_section(child, seen)
        if found is not None:
            return found
    return None


# ---------------------------------------------------------------- NVRx settings nvrx does not act on


NOT_ACTIVE: tuple[str, ...] = tuple(f.name for f in fields(FaultToleranceConfig) if not f.metadata["active"])


def gpu_visible() -> bool:
    """An NVIDIA GPU device node exists (a seam: tests of GPU-only messages replace it)."""
    import glob

    return bool(glob.glob("/dev/nvidia[0-9]*"))


def inactive_settings_line(cfg: FaultToleranceConfig) -> str:
    """One log line naming what this config asks for that nvrx does not do (GPU health, NICs, progress...).

    GPU health checks run in NVRx on every node, so they are always named; the other settings only when
    they differ from their defaults.
    """
    gpu = "a GPU is visible" if gpu_visible() else "no GPU on this node"
    parts = [f"GPU health checks every {cfg.node_health_check_interval:g}s ({gpu}; nvrx has no GPU health check)"]
    changed = [name for name in NOT_ACTIVE if name != "node_health_check_interval"
               and getattr(cfg, name) != _BY_NAME[name].default]
    if changed:
        parts.append("settings accepted but not acted on: " + ", ".join(changed))
    return "not active in nvrx: " + "; ".join(parts)


def inactive_settings_warning(cfg: FaultToleranceConfig) -> str | None:
    """One line for the agent's stderr naming the settings this config gives (other than their defaults) that
    nvrx accepts but does not act on, or None when it gives none. Said once, by the agent: a user who set
    them expects an effect, and the monitors' own logs are not where anybody looks."""
    changed = [name for name in NOT_ACTIVE if getattr(cfg, name) != _BY_NAME[name].default]
    if not changed:
        return None
    return (f"{len(changed)} fault tolerance setting(s) accepted but not acted on by nvrx: {', '.join(changed)} "
            "(NVRx features nvrx does not have; docs/reference/config.md)")


# ---------------------------------------------------------------- layers


def _load_yaml_doc(path: str) -> Any:
    """The parsed YAML document at PATH (duplicate keys refused); ConfigError with one line if unusable.

    Only a regular file of at most MAX_CONFIG_BYTES is read: a fifo would block the launch with no output,
    /dev/zero would never end, and a 50 MB file takes minutes to parse.
    """
    try:
        text = read_regular(path, MAX_CONFIG_BYTES).decode("utf-8")
    except FileNotFoundError:
        raise one_line_error(f"FT config file {path!r} does not exist; check the path") from None
    except NotRegularFile as exc:
        raise one_line_error(f"FT config file {path!r} {exc.strerror}; give the path of a YAML file") from None
    except FileTooLarge:
        raise one_line_error(f"FT config file {path!r} is larger than {MAX_CONFIG_BYTES // 1024} KiB, too large for "
                             "a config; give the path of the YAML file with the fault_tolerance settings") from None
    except UnicodeDecodeError:
        raise one_line_error(f"FT config file {path!r} is not UTF-8 text; give a YAML file") from None
    except OSError as exc:
        raise one_line_error(f"cannot read FT config file {path!r}: {exc.strerror or exc}; check the path and permissions") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        raise one_line_error(f"FT config file {path!r}: YAML syntax error at {_yaml_error_text(exc)}; fix the file") from None
    except RecursionError:
        raise one_line_error(f"FT config file {path!r}: nested too deeply to be a config; fix the file") from None


def read_yaml_layer(path: str) -> dict[str, Any]:
    """The typed settings given in a YAML file (under ``fault_tolerance:`` or as bare fields)."""
    doc = _load_yaml_doc(path)
    example = f"e.g. '{YAML_SECTION}:' followed by indented 'rank_heartbeat_timeout: 600'"
    if doc is None:
        raise one_line_error(f"FT config file {path!r} is empty; put the settings in it ({example})")
    if not isinstance(doc, dict):
        raise one_line_error(f"FT config file {path!r} holds a {type(doc).__name__}, not a mapping of settings; {example}")
    if YAML_SECTION in doc:
        others = [k for k in doc if k != YAML_SECTION]
        if others:
            raise one_line_error(f"FT config file {path!r}: top-level key {others[0]!r} next to '{YAML_SECTION}:'; "
                         f"move it under '{YAML_SECTION}:' or remove it")
        section = doc[YAML_SECTION]
        if not isinstance(section, dict):
            got = "nothing" if section is None else f"a {type(section).__name__}"
            raise one_line_error(f"FT config file {path!r}: '{YAML_SECTION}:' holds {got}, not a mapping of settings; {example}")
        return _parse_mapping(section, f"FT config file {path!r}")
    for key in doc:
        if key not in _BY_NAME:
            hint = _did_you_mean(str(key), [*_BY_NAME, YAML_SECTION])
            raise one_line_error(f"FT config file {path!r}: unknown key {key!r}; {hint}")
    return _parse_mapping(doc, f"FT config file {path!r}")


def read_env_layer(env: Mapping[str, str]) -> dict[str, Any]:
    """Typed settings from ``NVRX_FT_<FIELD>`` variables; empty variables count as unset.

    Other ``NVRX_FT_*`` names are not errors (other components may share the prefix), but a name
    that looks like a misspelled setting is logged as a warning.
    """
    out: dict[str, Any] = {}
    known = {s.env_name: s for s in SCHEMA}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        spec = known.get(name)
        if spec is None:
            guess = closest(name, list(known), cutoff=0.85)
            if guess is not None:
                log.warning("environment variable %s is not a fault tolerance setting; did you mean %s?", name, guess)
            continue
        if str(raw).strip() == "":
            continue
        out[spec.name] = spec.kind.parse(raw, f"environment variable {name}")
    return out


def read_cli_layer(cli_overrides: Mapping[str, str]) -> dict[str, Any]:
    """Typed settings from raw CLI strings keyed by field name (see ``nvrx.nvrx_cli.ft_args.extract_ft_args``)."""
    out: dict[str, Any] = {}
    for key, raw in cli_overrides.items():
        spec = _BY_NAME.get(key)
        if spec is None:
            flags = [s.flag for s in SCHEMA]
            guess = closest(f"--ft-param-{key}", flags)
            tip = f"did you mean {guess}?" if guess else "valid options: " + ", ".join(flags)
            raise one_line_error(f"unknown fault tolerance option --ft-param-{key}; {tip}")
        out[spec.name] = spec.kind.parse(raw, spec.flag)
    return out


def load_ft_config(yaml_path: str | None, env: Mapping[str, str], cli_overrides: Mapping[str, str]) -> FaultToleranceConfig:
    """defaults < YAML file (if ``yaml_path``) < environment < CLI overrides, validated."""
    values: dict[str, Any] = {s.name: s.default for s in SCHEMA}
    if yaml_path is not None:
        values.update(read_yaml_layer(yaml_path))
    values.update(read_env_layer(env))
    values.update(read_cli_layer(cli_overrides))
    return FaultToleranceConfig(**values)


# ---------------------------------------------------------------- CLI flags


def ft_cli_flag_names() -> dict[str, tuple[str, ...]]:
    """Field name -> its accepted flags: --ft-param-<field>, --ft-param-<field-dashed>, --ft-<field>, --ft-<field-dashed>."""
    return {s.name: s.flags for s in SCHEMA}


# ---------------------------------------------------------------- output


def describe(cfg: FaultToleranceConfig) -> str:
    """The effective config as one log line ('auto' = deduced at run time)."""
    parts = [f"{s.name}={s.kind.show(getattr(cfg, s.name))}" for s in SCHEMA]
    return "fault tolerance: " + " ".join(parts)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def config_table_markdown() -> str:
    """The table of every setting (docs/reference/config.md), generated from :data:`SCHEMA`."""
    lines = [
        "| Field | YAML key | Flag | Env var | Default | Meaning |",
        "|---|---|---|---|---|---|",
    ]
    for s in SCHEMA:
        default = s.kind.dump(s.default)
        default_text = "null" if default is None else ("{}" if default == {} else str(default))
        meaning = f"{s.help} ({s.kind.label})"
        lines.append("| " + " | ".join(_cell(c) for c in (
            f"`{s.name}`", f"`{YAML_SECTION}.{s.yaml_key}`", f"`{s.flag}`", f"`{s.env_name}`",
            f"`{default_text}`", meaning)) + " |")
    lines.append("")
    lines.append("Flags also accept `--ft-param-<field-with-dashes>`, `--ft-<field>` and `--ft-<field-with-dashes>`, "
                 "as `--flag VALUE` or `--flag=VALUE`. Precedence: defaults < YAML < environment < flags. "
                 "`null` (or `none`) for a timeout means it is deduced at run time.")
    return "\n".join(lines) + "\n"
