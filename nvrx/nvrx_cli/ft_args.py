"""Argv splitting for `nvrx launch`: the ``--ft-...`` flags come out before click sees the rest.

click cannot declare one option per config field with several spellings each (``--ft-param-X``,
``--ft-X``, dashes or underscores), so they are taken out of the launcher's part of argv here.
"""

from __future__ import annotations

from typing import Collection

from nvrx.monitors.ft_config import SCHEMA, closest, ft_cli_flag_names, one_line_error

# `--ft-...` options that belong to the launcher itself (not config fields): extract_ft_args
# leaves them (and their value) in place instead of rejecting them as unknown.
DEFAULT_PASSTHROUGH_FLAGS: frozenset[str] = frozenset({"--ft-cfg-path"})


def extract_ft_args(
    argv: list[str],
    *,
    value_flags: Collection[str] | None = None,
    passthrough: Collection[str] = DEFAULT_PASSTHROUGH_FLAGS,
) -> tuple[dict[str, str], list[str]]:
    """Pull ``--ft-param-X VALUE`` / ``--ft-param-X=VALUE`` (and ``--ft-X`` forms) out of ``argv``.

    Returns ``(overrides keyed by field name, remaining argv in order)``.

    Contract: pass only the launcher's part of the command line, i.e. everything *before* the
    training script. As a safety net, scanning also stops at ``--`` and at the first positional
    argument that is not an option value; everything from there on is returned untouched. Which
    tokens are option values is only known if ``value_flags`` (the launcher options that take a
    value) is given; without it, a bare word right after any ``-x``/``--xyz`` option is assumed
    to be that option's value.

    ``--ft-...`` flags listed in ``passthrough`` belong to the launcher (e.g. ``--ft-cfg-path``)
    and are left in place. Any other unknown ``--ft-...`` flag, a flag with no value, or the same
    setting given twice raises ConfigError.
    """
    lookup = {flag: name for name, flags in ft_cli_flag_names().items() for flag in flags}
    overrides: dict[str, str] = {}
    used: dict[str, str] = {}
    rest: list[str] = []
    prev_takes_value = False
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            rest.extend(argv[i:])
            break
        if tok.startswith("--ft-"):
            flag, eq, value = tok.partition("=")
            if flag in passthrough:
                rest.append(tok)
                prev_takes_value = not eq
                i += 1
                continue
            name = lookup.get(flag)
            if name is None:
                guess = closest(flag, list(lookup) + list(passthrough), cutoff=0.5)
                tip = f"did you mean {guess}?" if guess else \
                    "valid options: " + ", ".join(s.flag for s in SCHEMA)
                raise one_line_error(f"unknown option {flag}; {tip}")
            if eq:
                if value == "":
                    raise one_line_error(f"{flag}= needs a value, e.g. {flag}=VALUE")
                i += 1
            else:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise one_line_error(f"{flag} needs a value, e.g. {flag} VALUE or {flag}=VALUE")
                value = argv[i + 1]
                i += 2
            if name in overrides:
                raise one_line_error(f"{flag} sets {name}, which {used[name]} already set; give it once")
            overrides[name] = value
            used[name] = flag
            prev_takes_value = False
            continue
        if tok.startswith("-") and tok != "-":
            rest.append(tok)
            opt, eq, _ = tok.partition("=")
            prev_takes_value = not eq and (value_flags is None or opt in value_flags)
            i += 1
            continue
        if prev_takes_value:  # the value of the preceding launcher option
            rest.append(tok)
            prev_takes_value = False
            i += 1
            continue
        rest.extend(argv[i:])  # first positional: the training script and its arguments
        break
    return overrides, rest
