"""`nvrx inspect LOG_DIR`: what happened in a run or a resume chain, from its JSON-lines event logs.

Rich tables on a terminal, plain text when piped, ``--json`` for scripts, ``--follow`` for a live run.
The analysis lives in ``nvrx.inspection`` (data only); this module parses flags and renders, with the
sentences of structured timeline entries and the wording of durations from ``nvrx.nvrx_cli.inspect_text``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import stat
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import click

from nvrx.common.files import file_kind
from nvrx.events import SCHEMA_VERSION, FtConfigInfo, HeartbeatTimeoutAuto, TimeoutsInfo
from nvrx.inspection.event_files import NotARun, discover
from nvrx.inspection.run_report import Report, build_report, make_report
from nvrx.inspection.timeline import CKPT_SECTION, Filters, Timeline
from nvrx.nvrx_cli.inspect_text import entry_dict, entry_text, report_dict
from nvrx.nvrx_cli.inspect_view import folds, timeline_rows

_REL = re.compile(r"^\s*(?:(\d+(?:\.\d+)?)\s*d)?\s*(?:(\d+(?:\.\d+)?)\s*h)?\s*(?:(\d+(?:\.\d+)?)\s*m)?"
                  r"\s*(?:(\d+(?:\.\d+)?)\s*s)?\s*(?:ago)?\s*$", re.I)
_LEVEL_STYLE = {"error": "red", "warn": "yellow", "ok": "green", "info": ""}
_LEVEL_MARK = {"error": "!!", "warn": "! ", "ok": "ok", "info": "  "}
log = logging.getLogger("nvrx.inspect")
FOLLOW_BUDGET = 4 << 20  # bytes folded per file per --follow poll: a poll stays short on a huge backlog


def parse_since(value: str | None, now: float | None = None) -> float | None:
    """--since: an ISO date/time (local unless it says otherwise), HH:MM[:SS] today, or 90s/10m/2h/1d/1h30m ago."""
    if value is None:
        return None
    now = time.time() if now is None else now
    text = value.strip()
    m = _REL.match(text)
    if text and m and any(m.groups()):
        d, h, mi, s = (float(g) if g else 0.0 for g in m.groups())
        return now - (d * 86400 + h * 3600 + mi * 60 + s)
    try:
        if re.fullmatch(r"\d{1,2}:\d{2}(:\d{2}(\.\d+)?)?", text):
            day = datetime.fromtimestamp(now).date().isoformat()
            return datetime.fromisoformat(f"{day}T{text}").timestamp()
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise click.BadParameter(f"{value!r}: use an ISO time (2024-05-01T12:30:00), HH:MM[:SS] for today, "
                                 "or a duration ago like 90s, 10m, 2h, 1d", param_hint="--since") from None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("log_dir", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (with --follow: one JSON line per new entry).")
@click.option("-f", "--follow", is_flag=True, help="Keep watching a live run: print new entries until Ctrl-C.")
@click.option("--rank", type=click.IntRange(min=0), default=None,
              help="Only this global rank's faults and statistics; the goodput is this rank's.")
@click.option("--node", default=None,
              help="Only this node's entries, faults, ranks and timeouts; the goodput is its ranks' (its name as the "
                   "report shows it, e.g. gpu001, or its rendezvous id).")
@click.option("--html", "html_path", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Also write the report as one self-contained HTML file (a timeline per node; no network needed). "
                   "With --follow it is rewritten at every poll.")
@click.option("--since", default=None, help="Only from this time: ISO time, HH:MM[:SS] today, or 10m / 2h / 1d ago.")
@click.option("--step-section", default=None,
              help="The section whose time counts as training progress for goodput [default: step, else iteration].")
@click.option("--ckpt-section", default=CKPT_SECTION, show_default=True,
              help="The section that saves a checkpoint: progress after the last one of a failed round is redone.")
@click.option("--tail", "tail_lines", type=click.IntRange(min=0), default=10, show_default=True,
              help="Last output lines of a failing rank to show.")
@click.option("--interval", type=click.FloatRange(min=0.05, max=60), default=1.0, show_default=True,
              help="Seconds between polls with --follow.")
@click.option("-v", "--verbose", is_flag=True,
              help="Every timeline entry (the default view folds per-node entries and routine rounds to fit a "
                   "screen), every output line, and the faults table.")
def inspect(log_dir: tuple[Path, ...], as_json: bool, follow: bool, rank: int | None, node: str | None,
            html_path: Path | None, since: str | None, step_section: str | None, ckpt_section: str, tail_lines: int,
            interval: float, verbose: bool) -> int:
    """Tell what happened in a run: jobs, rounds, restarts and their causes, time lost, uptime,
    goodput, heartbeats, sections and timeouts.

    LOG_DIR is a run's dir (<log-dir>/<run-id>), a --log-dir holding several runs (a resume chain),
    or event files; several may be given (e.g. also the resume state dir).
    """
    filters = Filters(rank=rank, since=parse_since(since), step_section=step_section, ckpt_section=ckpt_section,
                      node=node)
    paths = list(log_dir)
    if html_path is not None:
        check_html_target(html_path)
    try:
        if follow:
            return _follow(paths, filters, as_json, tail_lines, interval, html_path)
        try:
            report = build_report(paths, filters)
        except NotARun as err:
            raise click.UsageError(str(err)) from None
        if node is not None:
            check_node(report, node)
        try:
            if html_path is not None:
                _write_html(report, html_path)
            if as_json:
                click.echo(json.dumps(report_dict(report), indent=2, default=str))
            elif sys.stdout.isatty():
                _render_rich(report, tail_lines, verbose)
            else:
                click.echo(render_text(report, tail_lines, verbose), nl=False)
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:
            # The readers skip malformed records; a value that still slips through must not end in a traceback.
            log.debug("rendering the report failed", exc_info=True)
            raise click.ClickException(f"cannot show the report of {', '.join(map(str, paths))}: "
                                       f"{type(exc).__name__}: {exc} (a bug in nvrx inspect; please report it "
                                       "with the log dir)") from None
        return 0
    except BrokenPipeError:  # `nvrx inspect ... | head`: the reader is gone; that is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


# ------------------------------------------------------------------ follow


def check_node(report: Report, node: str) -> None:
    """--node naming no node of the run is a usage error: an empty report would look like a quiet node."""
    names = sorted({n for job in report.jobs for n in job["nodes"]})
    ids = {str(i) for job in report.jobs for rd in job["rounds"] for i in rd["node_ids"] or []}
    if node in names or node in ids or node in {i.rpartition("-")[0] for i in ids}:  # a name, id or <host>-<pid>
        return
    shown = ", ".join(names[:5]) + (f", ... ({len(names)} nodes)" if len(names) > 5 else "")
    raise click.UsageError(f"--node {node}: no such node in this run; its nodes: {shown or 'none logged'}")


def check_html_target(path: Path) -> None:
    """A --html target that cannot be written is a usage error, said before any work is done."""
    parent = path.parent if str(path.parent) else Path(".")
    try:
        mode: int | None = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):  # not there yet (the usual case), or no such dir (below)
        mode = None
    except OSError as exc:  # a name too long, a symlink loop, ...
        raise click.UsageError(f"--html {path}: {exc.strerror or exc}; pick another path") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise click.UsageError(f"--html {path}: is a directory; give a file name, e.g. {path / 'report.html'}")
    if mode is not None and not stat.S_ISREG(mode):  # the report replaces its target: never a device or a fifo
        raise click.UsageError(f"--html {path}: {file_kind(mode)}, not a regular file; give a file name, "
                               "e.g. report.html")
    if not parent.is_dir():
        raise click.UsageError(f"--html {path}: directory {parent} does not exist; create it or pick another path")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise click.UsageError(f"--html {path}: not writable (permission denied); pick a path you can write")


def _write_html(report: Report, path: Path) -> None:
    """Write the HTML report atomically (a reader, or a browser reloading it under --follow, never sees half)."""
    from nvrx.inspection.html_report import render_html

    data = render_html(report, entry_text).encode()
    tmp = _tmp_for(path)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except OSError as exc:
        _discard(tmp)
        raise click.ClickException(f"--html {path}: cannot write it: {exc.strerror or exc}") from None
    click.echo(f"nvrx inspect: HTML report written to {path} ({len(data) / 1e6:.2f} MB)", err=True)


def _follow(paths: list[Path], filters: Filters, as_json: bool, tail_lines: int, interval: float,
            html_path: Path | None = None) -> int:
    """Print entries as they appear; Ctrl-C (or SIGTERM) ends it with exit code 0."""
    for p in paths:
        if not p.exists():
            raise click.UsageError(f"{p}: no such file or directory (give a run's log dir, e.g. nvrx_logs/<run-id>)")
    stop = {"now": False}
    old = signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    tl = Timeline(filters)
    tl.live = True
    shown: set[tuple] = set()
    emit = _json_line if as_json else _text_line(sys.stdout.isatty(), tail_lines)
    waiting_said = False
    caught_up = False  # the first pass reads everything there is, so the backlog prints in time order
    try:
        while not stop["now"]:
            try:
                tl.add_files(discover(paths))
            except NotARun as err:
                if not tl.files and not waiting_said:
                    click.echo(f"nvrx inspect: waiting for event files ({err})", err=True)
                    waiting_said = True
            for ef in list(tl.files):
                tl.consume(ef, final=False, budget=FOLLOW_BUDGET if caught_up else None)
            caught_up = caught_up or bool(tl.files)
            if tl.files:
                report = make_report(tl)
                if html_path is not None:
                    _write_html_quiet(report, html_path)
                for it in report.items:
                    if it.key not in shown and it.kind != "job_open":
                        shown.add(it.key)
                        emit(it)
                sys.stdout.flush()
            if not any(ef.offset < ef.size for ef in tl.files):  # behind on a big burst: read on at once
                _sleep(interval, stop)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, old)
    if tl.files and not as_json:
        click.echo(f"stopped following; so far: {'; '.join(_ratios(make_report(tl)))}", err=True)
    return 0


def _write_html_quiet(report: Report, path: Path) -> None:
    """--follow: rewrite the HTML report at every poll; a failure is said once per kind, following goes on."""
    from nvrx.inspection.html_report import render_html

    tmp = _tmp_for(path)
    try:
        tmp.write_text(render_html(report, entry_text))
        os.replace(tmp, path)
    except OSError as exc:
        _discard(tmp)
        click.echo(f"nvrx inspect: cannot write --html {path}: {exc.strerror or exc}", err=True)


def _tmp_for(path: Path) -> Path:
    """The file the report is written to before it replaces PATH: hidden, in PATH's dir, its name bounded (a
    target name near the system's limit must fail at the rename, where the message names the target)."""
    return path.with_name(f".{path.name[:120]}.tmp-{os.getpid()}")


def _discard(tmp: Path) -> None:
    """Remove a half-written report; a failure to do so must not hide why the write failed."""
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        log.debug("cannot remove %s", tmp, exc_info=True)


def _sleep(seconds: float, stop: dict[str, bool]) -> None:
    end = time.monotonic() + seconds
    while not stop["now"]:
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.2))


def _json_line(it: Any) -> None:
    click.echo(json.dumps(entry_dict(it), default=str))


def _text_line(rich: bool, tail_lines: int) -> Callable[[Any], None]:
    console = _console() if rich else None

    def emit(it: Any) -> None:
        lines = [f"{_clock(it.t)}  {_LEVEL_MARK.get(it.level, '  ')} {entry_text(it)}"]
        lines += [f"{'':25}| {x}" for x in it.tail[-tail_lines:]] if tail_lines else []
        if console is None:
            click.echo("\n".join(lines))
            return
        from rich.markup import escape

        style = _LEVEL_STYLE.get(it.level, "")
        for i, line in enumerate(lines):
            text = escape(line)
            console.print(f"[{style}]{text}[/{style}]" if style and i == 0 else (f"[dim]{text}[/dim]" if i else text))

    return emit


# ------------------------------------------------------------------ plain text


def _clock(t: float | None, with_date: bool = True) -> str:
    if t is None:
        return "-"
    fmt = "%Y-%m-%d %H:%M:%S.%f" if with_date else "%H:%M:%S.%f"
    try:
        return datetime.fromtimestamp(t).strftime(fmt)[:-3]
    except (ValueError, OverflowError, OSError):  # a derived time beyond what dates can show
        return f"t={t!r:.20}"


def _secs(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 3600:
        return f"{x / 3600:.2f} h"
    if x >= 120:
        return f"{x / 60:.1f} min"
    if x >= 0.1 or x == 0:
        return f"{x:.2f} s"
    return f"{x * 1000:.3g} ms"


def _bytes(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _multi_day(report: Report) -> bool:
    s, e = report.span.get("start"), report.span.get("end")
    try:
        return bool(s and e and datetime.fromtimestamp(s).date() != datetime.fromtimestamp(e).date())
    except (ValueError, OverflowError, OSError):
        return True  # times that are not dates: show the date part too


def _summary(report: Report) -> list[str]:
    rounds = sum(len(j["rounds"]) for j in report.jobs)
    faults = sum(1 for f in report.faults if f["kind"] in ("failed", "node_left"))
    files = report.files
    head = (f"{len(report.jobs)} job(s), {rounds} round(s), {faults} fault(s); {files['count']} event file(s), "
            f"{_bytes(files['bytes'])}, {files['lines']} lines, {report.corrupt['count']} corrupt")
    span = report.span
    lines = [f"nvrx inspect: {', '.join(report.paths)}", head]
    if span.get("start") is not None:
        state = " (still running)" if span.get("running") else ""
        lines.append(f"wall time {_secs(span['wall_s'])}: {_clock(span['start'])} -> "
                     f"{_clock(span['end'])}{state}")
        lines += _time_lines(report)
    lines += _checkpoint_lines(report) + _interval_line(report)
    f = report.filters
    if f.get("rank") is not None or f.get("since") is not None or f.get("node") is not None:
        lines.append("filters:" + (f" rank {f['rank']}" if f.get("rank") is not None else "")
                     + (f" node {f['node']}" if f.get("node") is not None else "")
                     + (f" since {_clock(f['since'])}" if f.get("since") is not None else ""))
    return lines


def _checkpoint_lines(report: Report) -> list[str]:
    """One line: how many checkpoints were reported complete, per tier, with their steps."""
    if not report.checkpoints:
        return []
    tiers: dict[str, list[Any]] = {}
    for c in report.checkpoints:
        tiers.setdefault(str(c["tier"]), []).append(c["step"])
    parts = []
    for tier, steps in tiers.items():
        known = [x for x in steps if isinstance(x, int)]
        where = f" (steps {min(known)}-{max(known)})" if known else ""
        parts.append(f"{len(steps)} {tier}{where}")
    last = report.checkpoints[-1]
    return [f"checkpoints complete: {', '.join(parts)}; the last: step {last['step']} ({last['tier']}) at "
            f"{_clock(last['t'])}"]


def _interval_line(report: Report) -> list[str]:
    """One line: the checkpoint interval every_steps="auto" chose last, and why."""
    c = report.checkpoint_interval
    if not c:
        return []
    good = c.get("expected_goodput")
    return [f"checkpoint interval (auto): every {c.get('every_steps')} steps since {_clock(c['t'])}"
            + (f", expected goodput {good:.3f}" if isinstance(good, (int, float)) else "") + f": {c.get('why')}"]


def _fold_note(report: Report) -> list[str]:
    if not _folded(report):
        return []
    return [f"  ({len(report.ranks)} ranks: the {RANKS_SHOWN} with faults, hangs or the longest heartbeat gaps shown; "
            "--rank N or --node NAME shows the others)"]


def _ratios(report: Report) -> list[str]:
    """Uptime and goodput as two short phrases (goodput only when a progress source exists); under --rank / --node
    each says whose it is: uptime is the job's, goodput that rank's or node's ranks'."""
    scoped = report.goodput_scope != "job"
    up = f"uptime {report.uptime * 100:.1f} %" if report.uptime is not None else "uptime n/a"
    out = [up + (" (job-wide)" if scoped else "")]
    whose = f"{_whose(report.goodput_scope)}, " if scoped else ""
    if report.goodput is not None:
        out.append(f"goodput {report.goodput * 100:.1f} % ({whose}from {report.goodput_source})")
    else:
        out.append(f"no goodput ({whose}no progress source: no step sections, no heartbeats)")
    return out


def _whose(scope: str) -> str:
    """A goodput scope in words: node gpu7's ranks, rank 3."""
    return f"{scope}'s ranks" if scope.startswith("node ") else scope


def _time_lines(report: Report) -> list[str]:
    """The summary's uptime and goodput lines, with the seconds behind them."""
    a = report.time_accounting
    wall = _secs(a["wall_s"])
    up, good = _ratios(report)
    lines = [f"{up}: {_secs(a['uptime_s'])} with all ranks running / {wall} wall"]
    lines += _lost_lines(report)
    if report.goodput is None:
        return lines + [good]
    redone = (f"; {_secs(a['recomputed_s'])} of progress redone after restarts" if a["recomputed_s"] is not None
              else f"; recompute {a['recompute']}")
    job = (f"; the whole job: {a['job_goodput'] * 100:.1f} %" if isinstance(a.get("job_goodput"), (int, float))
           else "")
    return lines + [f"{good}: {_secs(a['kept_s'])} of progress kept / {wall} wall{redone}{job}"]


def _lost_lines(report: Report) -> list[str]:
    """Time lost to faults (each fault to all ranks running again), summed: the HTML report's figure too."""
    lost = [f["lost_s"] for f in report.faults if f.get("lost_s") is not None]
    a = report.time_accounting
    job = ""
    if report.goodput_scope != "job" and isinstance(a.get("job_stops"), int):
        job = f"; the whole job: {a['job_stops']} stop(s), {_secs(a.get('job_lost_s') or 0.0)}"
    if not report.faults:
        return [f"no stop shown{job}"] if job else []
    open_ = len(report.faults) - len(lost)
    tail = f" ({open_} not recovered)" if open_ else ""
    shown = " shown" if job else ""
    return [f"time lost to {len(report.faults)} stop(s){shown}: {_secs(sum(lost))}{tail}{job}"]


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return ["  " + fmt(headers), "  " + fmt(["-" * w for w in widths])] + ["  " + fmt(r) for r in rows]


def _fault_rows(report: Report, with_date: bool) -> list[list[str]]:
    return [[str(f["job"]), str(f["round"]), _clock(f.get("t"), with_date), f["kind"], str(f["rank"] if f.get("rank") is not None else "-"),
             f["cause"], _secs(f.get("lost_s")) if f.get("lost_s") is not None else "not recovered"]
            for f in report.faults]


RANKS_SHOWN = 8  # without --rank / --node, at most this many rank rows (the ones with hangs first)


def _folded(report: Report) -> bool:
    """Whether the per-rank tables are cut to a few rows (many ranks, no --rank / --node filter)."""
    f = report.filters
    return len(report.ranks) > RANKS_SHOWN and f.get("rank") is None and f.get("node") is None


def _ranks_shown(report: Report) -> list[dict[str, Any]]:
    if not _folded(report):
        return report.ranks
    faulty = {f.get("rank") for f in report.faults}
    return sorted(report.ranks, key=lambda r: (r["rank"] not in faulty, -r["hangs"],
                                               -(r["hb_max_interval_s"] or 0)))[:RANKS_SHOWN]


def _rank_rows(report: Report) -> list[list[str]]:
    rows = []
    for r in _ranks_shown(report):
        secs = "; ".join(f"{n}: {s['closes']} x, max {_secs(s['max_s'])}, ~{_secs(s['total_s_est'])}"
                         for n, s in r["sections"].items()) or "-"
        beats = str(r["heartbeats"])
        if r.get("auto_heartbeat"):  # automatic beats are seen by the monitor, not counted
            beats = "auto" if not r["heartbeats"] else f"{beats} + auto"
        rows.append([str(r["rank"]), ",".join(r["nodes"]), str(r["sessions"]), beats,
                     _secs(r["hb_max_interval_s"]), _secs(r["first_heartbeat_max_s"]), str(r["hangs"]), secs])
    return rows


def _fmt_timeouts(t: dict[str, Any] | None) -> str:
    if not t:
        return "-"
    f = TimeoutsInfo.F
    secs = t.get(f.sections) or {}
    parts = [f"first hb {_num(t.get(f.initial_heartbeat))}", f"hb {_num(t.get(f.heartbeat))}"]
    parts += [f"{n} {_num(v)}" for n, v in secs.items()]
    parts.append(f"out-of-section {_num(t.get(f.out_of_section))}")
    return ", ".join(parts)


def _num(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) or (isinstance(v, int) and not isinstance(v, bool) and abs(v) < 10**15):
        return f"{v:g}"
    text = str(v)
    return text if len(text) <= 20 else text[:17] + "..."


def _configured(cfg: dict[str, Any] | None) -> str:
    if not cfg:
        return "not logged (no ft_config event)"
    c, f = FtConfigInfo.F, TimeoutsInfo.F
    t = {f.initial_heartbeat: cfg.get(c.initial_rank_heartbeat_timeout), f.heartbeat: cfg.get(c.rank_heartbeat_timeout),
         f.sections: cfg.get(c.rank_section_timeouts) or {}, f.out_of_section: cfg.get(c.rank_out_of_section_timeout)}
    auto = "; automatic heartbeat" if cfg.get(c.auto_heartbeat) else ""
    return (f"{_fmt_timeouts(t)}; check every {_num(cfg.get(c.workload_check_interval))} s, "
            f"safety factor {_num(cfg.get(c.safety_factor))}, kill with {cfg.get(c.rank_termination_signal)}{auto}")


def _fmt_auto(a: dict[str, Any] | None) -> str:
    """The automatic heartbeat timeout of a rank: value, enforced or suggested, and what it came from."""
    if not a:
        return "-"
    f = HeartbeatTimeoutAuto.F
    how = "set" if a.get(f.mode) == "set" and not a.get(f.capped) else "suggested"
    busy = f"; {a['deferred']} busy gap(s) let through" if a.get("deferred") else ""
    return (f"hb {_num(a.get(f.timeout))} {how} ({_num(a.get(f.multiple))} x p{_num(a.get(f.percentile))} gap "
            f"{_num(a.get(f.basis))}, longest {_num(a.get(f.longest_gap))}, {a.get(f.gaps)} gaps{busy})")


def _timeout_rows(report: Report) -> list[list[str]]:
    """One row per rank; ranks with the same timeouts share a row (``0-1023``), so 8,000 ranks fit a screen."""
    to = report.timeouts
    auto = to.get("auto") or {}
    keys = sorted(set(to["in_force"]) | set(to["computed"]) | set(auto),
                  key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else k))
    rows: dict[tuple[str, str, str], list[str]] = {}
    for k in keys:
        cells = (_fmt_timeouts(to["in_force"].get(k)),
                 _fmt_timeouts((to["computed"].get(k) or {}).get("timeouts")) if k in to["computed"] else "-",
                 _fmt_auto(auto.get(k)))
        rows.setdefault(cells, []).append(k)
    return [[_rank_ranges(ks), *cells] for cells, ks in rows.items()]


def _rank_ranges(keys: list[str]) -> str:
    """Rank keys as ranges: 0-3,7 (other keys listed as they are)."""
    nums = [int(k) for k in keys if k.isdigit()]
    out, i = [], 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    shown = out[:8] + ([f"... ({len(out) - 8} more ranges)"] if len(out) > 8 else [])
    return ",".join(shown + [k for k in keys if not k.isdigit()][:4])


FAULT_HEAD = ["job", "round", "at", "kind", "rank", "cause", "time lost"]
RANK_HEAD = ["rank", "node", "runs", "heartbeats", "max hb gap", "first hb", "hangs", "sections: closes, max, ~total"]
TIMEOUT_HEAD = ["rank", "in force (s)", "computed (s)", "automatic (s)"]


def render_text(report: Report, tail_lines: int = 10, verbose: bool = False) -> str:
    """The report as plain text (no colours, no box drawing): what a pipe or a log file gets."""
    with_date = _multi_day(report)
    out = _summary(report) + ["", "Timeline"]
    rows, folded = timeline_rows(report, tail_lines, verbose)
    for row in rows:
        out.append(f"  {_clock(row.t, with_date)}  {_LEVEL_MARK.get(row.level, '  ')} {row.text}")
        out += [f"  {'':14}  | {x}" for x in row.tail]
    if not report.items:
        out.append("  (no entries)")
    note = folded.note()
    if note:
        out.append(f"  {note}")
    if report.faults and _faults_table(report, verbose):
        out += ["", "Faults and stops"] + _table(FAULT_HEAD, _fault_rows(report, with_date))
    if report.ranks:
        out += ["", "Ranks"] + _table(RANK_HEAD, _rank_rows(report)) + _fold_note(report)
    out += ["", "Timeouts", f"  configured: {_configured(report.timeouts['configured'])}"]
    rows = _timeout_rows(report)
    same = _as_configured(report, rows)
    if same:
        out.append(f"  {same}")
    elif rows:
        out += _table(TIMEOUT_HEAD, rows)
    out += _problems(report)
    if verbose:
        out += _definitions(report)
    while out and not out[-1]:
        out.pop()
    return "\n".join(out) + "\n"


def _as_configured(report: Report, rows: list[list[str]]) -> str | None:
    """One line instead of the timeouts table when every rank runs with the configured timeouts, none computed."""
    if len(rows) != 1 or rows[0][2:] != ["-", "-"]:
        return None
    if not _configured(report.timeouts["configured"]).startswith(rows[0][1] + ";"):
        return None
    return f"in force on ranks {rows[0][0]}: as configured (none computed, no automatic heartbeat timeout)"


def _faults_table(report: Report, verbose: bool) -> bool:
    """The faults table repeats the timeline's stop lines (cause, time lost): the default view leaves it out."""
    return verbose or not folds(report)


def _definitions(report: Report) -> list[str]:
    a = report.time_accounting
    out = [f"{name}: {text}" for name, text in a["definitions"].items()]
    if a.get("recompute"):
        out.append(f"redone: {a['recompute']}")
    return out


def _problems(report: Report) -> list[str]:
    out = []
    c = report.corrupt
    if c["count"]:
        out += ["", f"Corrupt lines: {c['count']} skipped"] + [f"  {x}" for x in c["first"]]
        if c["count"] > len(c["first"]):
            out.append(f"  ... and {c['count'] - len(c['first'])} more")
    versions = c.get("other_versions") or {}
    if versions:
        listed = ", ".join(f"{n} of version {v}" for v, n in versions.items())
        out += ["", f"Events of another nvrx skipped: {listed} (this nvrx reads event schema version "
                    f"{SCHEMA_VERSION}; inspect them with the nvrx that wrote them)"]
    if report.unknown_events:
        total = sum(report.unknown_events.values())
        out += ["", f"Unknown events: {total} counted, not interpreted"]
        out += [f"  {k}: {v}" for k, v in report.unknown_events.items()]
    return out + [""]


# ------------------------------------------------------------------ rich


def _console() -> Any:
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False)


def _render_rich(report: Report, tail_lines: int, verbose: bool = False) -> None:
    from rich.markup import escape
    from rich.table import Table

    console = _console()
    with_date = _multi_day(report)
    head = _summary(report)
    console.print(f"[bold]{escape(head[0])}[/bold]")
    for line in head[1:]:
        console.print(escape(line))
    tbl = Table(title="Timeline", title_justify="left", show_header=False, box=None, pad_edge=False)
    tbl.add_column("at", style="dim", no_wrap=True)
    tbl.add_column("what")
    rows, folded = timeline_rows(report, tail_lines, verbose)
    for row in rows:
        style = _LEVEL_STYLE.get(row.level, "")
        words = escape(row.text)
        text = f"[{style}]{words}[/{style}]" if style else words
        if row.tail:
            text += "\n" + "\n".join(f"[dim]| {escape(x)}[/dim]" for x in row.tail)
        tbl.add_row(_clock(row.t, with_date), text)
    console.print(tbl)
    if folded.note():
        console.print(f"[dim]{escape(str(folded.note()))}[/dim]")
    faults = _fault_rows(report, with_date) if _faults_table(report, verbose) else []
    for title, headers, rows in (("Faults and stops", FAULT_HEAD, faults),
                                 ("Ranks", RANK_HEAD, _rank_rows(report)),
                                 ("Timeouts in force, computed and automatic", TIMEOUT_HEAD, _timeout_rows(report))):
        if not rows:
            continue
        t = Table(title=title, title_justify="left")
        for h in headers:
            t.add_column(h)
        for r in rows:
            t.add_row(*(escape(c) for c in r))
        console.print(t)
        if title == "Ranks":
            for line in _fold_note(report):
                console.print(escape(line))
    console.print(f"configured timeouts: {escape(_configured(report.timeouts['configured']))}")
    for line in _problems(report):
        console.print(f"[yellow]{escape(line)}[/yellow]" if line else "")
    for line in _definitions(report) if verbose else []:
        console.print(f"[dim]{escape(line)}[/dim]")
