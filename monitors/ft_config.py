"""Fault-tolerance (rank monitor) configuration: one typed schema, four layers.

:class:`FaultToleranceConfig` is the single source of the settings. Each dataclass field carries
its kind (how a raw value is parsed, validated and printed) and its help text in the field
metadata; :data:`SCHEMA` is derived from the dataclass, and everything user-facing is derived
from :data:`SCHEMA`: the YAML keys, the ``NVRX_FT_<FIELD>`` environment names, the
``--ft-param-<field>`` flags of ``nvrx launch`` and the README table
(:func:`config_table_markdown`, printed by ``scripts/gen_config_table.py``).

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

from nvrx_common.errors import ConfigError
from nvrx_common.signals import SIGNAL_HINT, parse_signal
from monitors.heartbeat import MAX_SECTIONS
from monitors.sections import validate_section_name
from monitors.timeouts import MAX_TIMEOUT_SECONDS

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

    label: str  # for the README table, e.g. "float > 0 or null"
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
    hint = "use DEBUG, INFO, WARNING, ERROR, CRITICAL or a number >= 0 like 20"
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


class SectionTimeouts(Mapping[str, "float | None"]):
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
        return f"SectionTimeouts({self._items!r})"

    def __getstate__(self) -> dict:
        return self._items

    def __setstate__(self, state: dict) -> None:
        self._items = dict(state)


def _parse_section_map(value: Any, where: str) -> SectionTimeouts:
    hint = "write it as step:30,checkpointing:600 or as a mapping like {\"step\": 30, \"checkpointing\": null}"
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in _NULL_WORDS or text == "":
            return SectionTimeouts()
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
        return SectionTimeouts()
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
    return SectionTimeouts(out)


def _show_section_map(value: Mapping[str, float | None]) -> str:
    if not value:
        return "{}"
    return "{" + ", ".join(f"{k}: {OPTIONAL_SECONDS.show(v)}" for k, v in value.items()) + "}"


SECTION_TIMEOUTS = ValueKind(label=f"mapping section -> float > 0 or null (s); at most {MAX_SECTIONS} sections, "
                              "names of 1-64 characters [A-Za-z0-9_.:-/]", parse=_parse_section_map,
                        dump=lambda m: dict(m), show=_show_section_map)


# ---------------------------------------------------------------- the config (single source)


def _setting(kind: ValueKind, help: str, default: Any = None, factory: Callable[[], Any] | None = None) -> Any:
    meta = {"kind": kind, "help": help}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class FaultToleranceConfig:
    """Settings of the rank monitors (hang detection). ``None`` timeouts are deduced at run time.

    Construction validates and normalizes every field (e.g. ``rank_termination_signal="TERM"``
    becomes ``signal.SIGTERM``); a bad value raises :class:`ConfigError`.
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
        "checkpointing; null = deduce at run time.", factory=SectionTimeouts)
    rank_out_of_section_timeout: float | None = _setting(
        OPTIONAL_SECONDS, "Sections API: timeout (seconds) for time spent outside any section. "
        "null = deduce at run time.", None)
    auto_heartbeat: bool = _setting(
        BOOL, "Heartbeat automatically while the rank's main thread keeps executing Python bytecode, so an "
        "unmodified script gets hang detection (a call that blocks the interpreter stops the beats).", False)

    def __post_init__(self) -> None:
        for f in fields(self):
            kind: ValueKind = f.metadata["kind"]
            object.__setattr__(self, f.name, kind.parse(getattr(self, f.name), f"FaultToleranceConfig.{f.name}"))

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in fields(self)))

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict: signal by name, log level by name (a number if it has no standard name)."""
        return {spec.name: spec.kind.dump(getattr(self, spec.name)) for spec in SCHEMA}

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


# ---------------------------------------------------------------- layers


def read_yaml_layer(path: str) -> dict[str, Any]:
    """The typed settings given in a YAML file (under ``fault_tolerance:`` or as bare fields)."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise one_line_error(f"FT config file {path!r} does not exist; check the path") from None
    except IsADirectoryError:
        raise one_line_error(f"FT config file {path!r} is a directory; give the path of a YAML file") from None
    except UnicodeDecodeError:
        raise one_line_error(f"FT config file {path!r} is not UTF-8 text; give a YAML file") from None
    except OSError as exc:
        raise one_line_error(f"cannot read FT config file {path!r}: {exc.strerror or exc}; check the path and permissions") from None
    try:
        doc = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        raise one_line_error(f"FT config file {path!r}: YAML syntax error at {_yaml_error_text(exc)}; fix the file") from None
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
    """Typed settings from raw CLI strings keyed by field name (see ``nvrx_cli.ft_args.extract_ft_args``)."""
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
    """README table of every setting, generated from :data:`SCHEMA`."""
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
