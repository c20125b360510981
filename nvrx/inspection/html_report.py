"""`nvrx inspect --html`: the report as one self-contained HTML file a person can look at.

One file, nothing fetched (no network, no external scripts, fonts or images): inline CSS, inline SVG and a
little JavaScript that only draws the rank lanes of the node a reader picks. It shows what the terminal view
says, from the same ``Report``: the summary figures (uptime, goodput, progress redone, time lost), a time axis
with one lane per node (rounds, restarts, faults, health-check failures; checkpoints and stragglers on rows of
their own; a node's ranks drawn on demand), goodput and time lost over time, each fault with its cause and the
output lines the terminal quotes, checkpoints, health results, the timeline entries, and what was skipped.

Size stays bounded at scale: a round's lanes are drawn as one rectangle per run of adjacent nodes (all nodes of a
round share its times), rank processes travel as compact JSON (tenths of a second from the start), and long
lists are cut with a note. Every text is escaped; the embedded JSON cannot end its script element early.
"""

from __future__ import annotations

import html
import json
import time
from typing import Any, Callable

from nvrx.inspection.run_report import Report
from nvrx.inspection.timeline import Entry

WIDTH = 1100          # px of the time axis
LABEL = 170           # px of the lane labels
ENTRIES_SHOWN = 3000  # timeline entries listed (the rest: --json)
CKPTS_SHOWN = 500
LEVEL_CLASS = {"error": "err", "warn": "warn", "ok": "ok", "info": "info"}
STOP_CLASS = {"succeeded": "ok", "failed": "bad", "node_left": "bad", "interrupted": "int", "scale_up": "int"}


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _secs(x: Any) -> str:
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return "-"
    if x >= 3600:
        return f"{x / 3600:.2f} h"
    if x >= 120:
        return f"{x / 60:.1f} min"
    return f"{x:.2f} s"


def _pct(x: Any) -> str:
    return f"{x * 100:.1f} %" if isinstance(x, (int, float)) and not isinstance(x, bool) else "n/a"


def _clock(t: Any) -> str:
    if not isinstance(t, (int, float)):
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f".{int((t % 1) * 1000):03d}"
    except (OverflowError, ValueError, OSError):
        return f"t={t!r:.20}"


class _Axis:
    """Unix time -> x pixel on the shared time axis."""

    def __init__(self, t0: float, t1: float) -> None:
        self.t0, self.span = t0, max(t1 - t0, 1e-3)

    def x(self, t: Any) -> float:
        if not isinstance(t, (int, float)):
            return float(LABEL)
        return round(LABEL + min(max((t - self.t0) / self.span, 0.0), 1.0) * WIDTH, 1)


def render_html(report: Report, word: Callable[[Entry], str]) -> str:
    """The whole page. WORD gives an entry's sentence (the CLI's ``entry_text``, so both views say the same)."""
    span = report.span
    t0 = span.get("start")
    t1 = span.get("end")
    if not isinstance(t0, (int, float)) or not isinstance(t1, (int, float)):
        t0 = t1 = time.time()
    axis = _Axis(float(t0), float(t1))
    nodes = _node_order(report)
    parts = [_head(report), _summary(report), _skipped(report), "<h2>Timeline</h2>",
             _timeline_svg(report, axis, nodes), _ranks_panel(nodes), "<h2>Goodput and time lost over time</h2>",
             _series_svg(report, axis), _faults(report), _health(report), _checkpoints(report),
             _entries(report, word), _definitions(report), _data(report, axis, nodes), _SCRIPT, "</body></html>\n"]
    return "".join(parts)


# ------------------------------------------------------------------ page parts


def _head(report: Report) -> str:
    refresh = '<meta http-equiv="refresh" content="5">' if report.span.get("running") else ""
    title = f"nvrx inspect: {', '.join(report.paths) or '(no run)'}"
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">{refresh}'
            f'<meta name="viewport" content="width=device-width">'
            f"<title>{_e(title)}</title><style>{_CSS}</style></head><body><h1>{_e(title)}</h1>")


def _total_lost(report: Report) -> float:
    return sum(f.get("lost_s") or 0.0 for f in report.faults)


def _summary(report: Report) -> str:
    a, span = report.time_accounting, report.span
    rounds = sum(len(j["rounds"]) for j in report.jobs)
    faults = sum(1 for f in report.faults if f["kind"] in ("failed", "node_left"))
    redone = _secs(a.get("recomputed_s")) if a.get("recomputed_s") is not None else "unknown"
    cards = [("wall time", _secs(span.get("wall_s")), f"{_clock(span.get('start'))} to {_clock(span.get('end'))}"
              + (" (still running)" if span.get("running") else "")),
             ("goodput", _pct(report.goodput), _scope_words(report) + f"{_secs(a.get('kept_s'))} of progress kept"
              + (f", from {report.goodput_source}" if report.goodput_source else "")),
             ("uptime", _pct(report.uptime), f"{_secs(a.get('uptime_s'))} with all ranks running"
              + (" (the whole job)" if report.goodput_scope != "job" else "")),
             ("progress redone", redone, str(a.get("recompute") or "")),
             ("time lost to faults", _secs(_total_lost(report)), f"{len(report.faults)} stop(s), {faults} of them "
              f"faults; {rounds} round(s), {len(report.jobs)} job(s)"),
             ("checkpoints", str(len(report.checkpoints)), "reported complete by nvrx's checkpointers")]
    cells = "".join(f'<div class="card" id="card-{_e(k.split()[0])}"><div class="k">{_e(k)}</div>'
                    f'<div class="v">{_e(v)}</div><div class="s">{_e(sub)}</div></div>' for k, v, sub in cards)
    jobs = "".join(f"<li>job {_e(j['index'])} <b>{_e(j['run_id'] or '?')}</b>: {_e(j['status'])} (exit code "
                   f"{_e(j['exit_code'])}), {len(j['rounds'])} round(s), {len(j['nodes'])} node(s), "
                   f"{_e(_secs(j['seconds']))}</li>" for j in report.jobs)
    return f'<div class="cards">{cells}</div><ul class="jobs">{jobs}</ul>'


def _scope_words(report: Report) -> str:
    """Under --rank / --node the goodput is that rank's or node's ranks': said on its card, with the job's."""
    scope = report.goodput_scope
    if scope == "job":
        return ""
    whose = f"{scope}'s ranks" if scope.startswith("node ") else scope
    return f"of {whose} (the whole job: {_pct(report.time_accounting.get('job_goodput'))}); "


def _skipped(report: Report) -> str:
    """What the report could not use: corrupt lines and events of unknown kinds (e.g. a newer nvrx)."""
    out = []
    c = report.corrupt
    if c["count"]:
        first = "".join(f"<li><code>{_e(x)}</code></li>" for x in c["first"])
        out.append(f'<div class="skip"><b>Skipped {c["count"]} line(s) that are not valid events</b>'
                   f"<ul>{first}</ul></div>")
    for v, n in (c.get("other_versions") or {}).items():
        out.append(f'<div class="skip"><b>Skipped {n} event(s) of schema version {_e(v)}</b> (written by another '
                   "nvrx; inspect them with the nvrx that wrote them)</div>")
    if report.unknown_events:
        listed = ", ".join(f"{_e(k)}: {v}" for k, v in list(report.unknown_events.items())[:20])
        out.append(f'<div class="skip"><b>Skipped {sum(report.unknown_events.values())} event(s) of kinds this '
                   f"nvrx does not know</b> (written by another nvrx version?): {listed}</div>")
    return "".join(out)


def _node_order(report: Report) -> list[str]:
    """Every node the report names, in group-rank order of the rounds, then the others by name."""
    seen: dict[str, None] = {}
    for job in report.jobs:
        for rd in job["rounds"]:
            for n in rd["nodes"]:
                if n is not None:
                    seen.setdefault(str(n), None)
        for n in job["nodes"]:
            seen.setdefault(str(n), None)
    for h in report.health:
        for n in h["failed"]:
            seen.setdefault(str(n), None)
    for n in sorted(report.lanes):
        seen.setdefault(n, None)
    return list(seen)


def _lane_height(count: int) -> int:
    return 16 if count <= 40 else max(2, min(16, 1600 // max(count, 1)))


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted lane indices as (first, count) runs of adjacent lanes."""
    out: list[tuple[int, int]] = []
    for i in sorted(set(indices)):
        if out and out[-1][0] + out[-1][1] == i:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


def _timeline_svg(report: Report, axis: _Axis, nodes: list[str]) -> str:
    h = _lane_height(len(nodes))
    top = 64  # axis, rounds, checkpoints and stragglers rows
    height = top + h * len(nodes) + 8
    index = {n: i for i, n in enumerate(nodes)}
    y = lambda i: top + i * h  # noqa: E731
    out = [f'<div class="scroll"><svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{LABEL + WIDTH + 20}" '
           f'height="{height}" font-size="11">']
    out.append(_ticks(axis, height))
    out.append(f'<text x="4" y="34" class="lbl">checkpoints</text><text x="4" y="50" class="lbl">stragglers</text>')
    for job in report.jobs:
        x0, x1 = axis.x(job["start"]), axis.x(job["end"])
        out.append(f'<rect class="job" x="{x0}" y="{top - 4}" width="{max(x1 - x0, 1)}" height="{height - top}">'
                   f"<title>job {_e(job['run_id'])}: {_e(job['status'])}</title></rect>")
        for rd in job["rounds"]:
            out.append(_round_bars(rd, job, axis, index, y, h, top, height))
    for c in report.checkpoints[:20000]:
        x = axis.x(c["t"])
        out.append(f'<rect class="ckpt" x="{x}" y="26" width="2" height="10"><title>checkpoint step {_e(c["step"])} '
                   f'({_e(c["tier"])}) complete at {_e(_clock(c["t"]))} on {c["ranks"]} rank(s)</title></rect>')
    for it in report.items:
        if it.kind == "straggler" and it.level == "warn":
            out.append(f'<circle class="strag" cx="{axis.x(it.t)}" cy="47" r="4"><title>{_e(it.text or "")}'
                       "</title></circle>")
    for f in report.faults:
        x = axis.x(f.get("t"))
        label = f"round {f['round']} {f['kind']}: {f['cause']}"
        out.append(f'<line class="fault" x1="{x}" x2="{x}" y1="{top - 6}" y2="{height}"><title>{_e(label)}</title>'
                   "</line>")
        i = index.get(str(f.get("node")))
        if i is not None:
            out.append(f'<circle class="faultdot" cx="{x}" cy="{y(i) + h / 2}" r="{max(3, h / 2)}"><title>{_e(label)}'
                       "</title></circle>")
    for hc in report.health:
        for n in hc["failed"]:
            i = index.get(str(n))
            if i is not None:
                out.append(f'<rect class="sick" x="{axis.x(hc["t"]) - 3}" y="{y(i)}" width="6" height="{max(h, 3)}">'
                           f"<title>node {_e(n)} failed its health checks before round {hc['round']}</title></rect>")
    if h >= 9:
        out += [f'<text class="node" data-node="{_e(n)}" x="4" y="{y(i) + h - 3}">{_e(n[:26])}</text>'
                for i, n in enumerate(nodes)]
    else:
        out.append(f'<text x="4" y="{top + 10}" class="lbl">{len(nodes)} nodes</text>')
    out.append(f'<rect class="pick" x="0" y="{top}" width="{LABEL}" height="{h * len(nodes)}" '
               f'data-top="{top}" data-h="{h}"/></svg></div>')
    return "".join(out)


def _round_bars(rd: dict[str, Any], job: dict[str, Any], axis: _Axis, index: dict[str, int], y: Callable[[int], float],
                h: int, top: int, height: int) -> str:
    """One round: its restart line and label, and one bar per run of adjacent lanes of its nodes."""
    start, running = rd["t"], rd.get("ranks_running_at")
    end = rd.get("stop_t") if rd.get("stop_t") is not None else job["end"]
    x0, xr, x1 = axis.x(start), axis.x(running if running is not None else end), axis.x(end)
    cls = STOP_CLASS.get(str(rd.get("stop")), "run")
    out = [f'<line class="restart" x1="{x0}" x2="{x0}" y1="12" y2="{height}"/>'
           f'<text class="rlbl" x="{x0 + 2}" y="20">r{rd["round"]}</text>']
    lanes = [index[str(n)] for n in rd["nodes"] if str(n) in index]
    title = (f"<title>round {rd['round']} of job {_e(job['run_id'])}: {len(rd['nodes'])} node(s), world size "
             f"{_e(rd.get('world_size'))}, ended {_e(rd.get('stop') or 'open')}</title>")
    for first, count in _runs(lanes):
        yy, hh = y(first), max(h * count - (1 if h > 4 else 0), 1)
        if xr > x0:
            out.append(f'<rect class="starting" x="{x0}" y="{yy}" width="{round(xr - x0, 1)}" height="{hh}"/>')
        out.append(f'<rect class="{cls}" x="{xr}" y="{yy}" width="{max(round(x1 - xr, 1), 0.5)}" height="{hh}">'
                   f"{title}</rect>")
    return "".join(out)


def _ticks(axis: _Axis, height: int) -> str:
    out = [f'<line class="axis" x1="{LABEL}" x2="{LABEL + WIDTH}" y1="8" y2="8"/>']
    for k in range(6):
        t = axis.t0 + axis.span * k / 5
        x = axis.x(t)
        out.append(f'<line class="grid" x1="{x}" x2="{x}" y1="8" y2="{height}"/>'
                   f'<text class="tick" x="{x + 2}" y="7">{_e(time.strftime("%H:%M:%S", time.localtime(t)))}</text>')
    return "".join(out)


def _ranks_panel(nodes: list[str]) -> str:
    options = "".join(f'<option value="{_e(n)}">{_e(n)}</option>' for n in nodes)
    return ('<details id="ranks"><summary>Ranks of a node (pick one, or click its lane)</summary>'
            f'<select id="node-select">{options}</select><div id="rank-lanes" class="scroll"></div></details>')


def _series_svg(report: Report, axis: _Axis) -> str:
    pts = [p for p in report.series if isinstance(p.get("t"), (int, float))]
    hgt, top = 160, 10
    lost_max = max([p.get("lost_s") or 0.0 for p in pts] + [1e-9])
    out = [f'<div class="scroll"><svg id="series" xmlns="http://www.w3.org/2000/svg" width="{LABEL + WIDTH + 60}" '
           f'height="{hgt + 30}" font-size="11">',
           f'<text x="4" y="{top + 10}" class="good">goodput (%)</text>',
           f'<text x="4" y="{top + 26}" class="lost">time lost (s, right)</text>']
    for k in (0, 50, 100):
        yy = top + hgt * (1 - k / 100)
        out.append(f'<line class="grid" x1="{LABEL}" x2="{LABEL + WIDTH}" y1="{yy}" y2="{yy}"/>'
                   f'<text class="tick" x="{LABEL - 26}" y="{yy + 4}">{k}</text>')
    out.append(f'<text class="tick" x="{LABEL + WIDTH + 4}" y="{top + 4}">{lost_max:.0f} s</text>')
    good = " ".join(f"{axis.x(p['t'])},{round(top + hgt * (1 - min(max(p['goodput'], 0), 1)), 1)}"
                    for p in pts if isinstance(p.get("goodput"), (int, float)))
    lost = " ".join(f"{axis.x(p['t'])},{round(top + hgt * (1 - (p.get('lost_s') or 0) / lost_max), 1)}" for p in pts)
    if good:
        out.append(f'<polyline class="goodline" points="{good}"/>')
    if lost:
        out.append(f'<polyline class="lostline" points="{lost}"/>')
    for p in pts:
        if isinstance(p.get("goodput"), (int, float)):
            out.append(f'<circle class="gooddot" cx="{axis.x(p["t"])}" cy="{round(top + hgt * (1 - p["goodput"]), 1)}" '
                       f'r="3"><title>after round {p["round"]} of job {p["job"]}: goodput {_pct(p["goodput"])}, '
                       f'time lost {_secs(p.get("lost_s"))}</title></circle>')
    out.append("</svg></div>")
    if not pts:
        out.append("<p>No rounds ended yet.</p>")
    return "".join(out)


def _faults(report: Report) -> str:
    if not report.faults:
        return "<h2>Faults</h2><p>No faults.</p>"
    rows = []
    for f in report.faults:
        tail = f.get("tail") or []
        quoted = f"<pre>{_e(chr(10).join(str(x) for x in tail))}</pre>" if tail else ""
        lost = _secs(f.get("lost_s")) if f.get("lost_s") is not None else "not recovered"
        rows.append(f'<tr class="fault-row"><td>{_e(f["job"])}</td><td>{_e(f["round"])}</td>'
                    f'<td>{_e(_clock(f.get("t")))}</td><td>{_e(f["kind"])}</td><td>{_e(f.get("rank", "-"))}</td>'
                    f'<td>{_e(f.get("node") or "-")}</td><td class="cause">{_e(f["cause"])}{quoted}</td>'
                    f"<td>{_e(lost)}</td><td class=\"jit\">{_e(_jit(f))}</td></tr>")
    return ("<h2>Faults</h2><table><tr><th>job</th><th>round</th><th>at</th><th>kind</th><th>rank</th><th>node</th>"
            f"<th>cause (and the rank's last output lines)</th><th>time lost</th><th>just-in-time checkpoint</th>"
            f"</tr>{''.join(rows)}</table>")


def _jit(fault: dict[str, Any]) -> str:
    """The fault's just-in-time checkpoint line (--jit-ckpt), or a dash when none was asked for."""
    j = fault.get("jit_checkpoint")
    return str(j["text"]) if isinstance(j, dict) and j.get("text") else "-"


def _health(report: Report) -> str:
    if not report.health:
        return ""
    rows = "".join(f"<tr><td>{h['job']}</td><td>{h['round']}</td><td>{h['passed']}</td>"
                   f"<td>{_ms_range(h['min_s'], h['max_s'])}</td>"
                   f"<td class=\"{'bad' if h['failed'] else ''}\">{_e(', '.join(map(str, h['failed'][:50])) or '-')}"
                   f"{' ...' if len(h['failed']) > 50 else ''}</td></tr>" for h in report.health)
    return ("<h2>Node health checks</h2><table><tr><th>job</th><th>before round</th><th>nodes passed</th>"
            f"<th>took</th><th>failed (sat out)</th></tr>{rows}</table>")


def _ms_range(low: float, high: float) -> str:
    a, b = f"{low * 1000:.0f}", f"{high * 1000:.0f}"
    return f"{a} ms" if a == b else f"{a}-{b} ms"


def _checkpoints(report: Report) -> str:
    if not report.checkpoints:
        return "<h2>Checkpoints</h2><p>No checkpoint reported complete (progress after a failure counts as redone " \
               "only from checkpoint sections, if any).</p>"
    shown = report.checkpoints[-CKPTS_SHOWN:]
    rows = "".join(f"<tr><td>{_e(c['job'])}</td><td>{_e(c['round'])}</td><td>{_e(c['tier'])}</td>"
                   f"<td>{_e(c['step'])}</td><td>{_e(_clock(c['taken']))}</td><td>{_e(_clock(c['t']))}</td>"
                   f"<td>{c['ranks']}</td></tr>" for c in shown)
    cut = (f"<p>The last {CKPTS_SHOWN} of {len(report.checkpoints)} shown.</p>"
           if len(report.checkpoints) > CKPTS_SHOWN else "")
    return ("<h2>Checkpoints</h2><table><tr><th>job</th><th>round</th><th>tier</th><th>step</th><th>state taken</th>"
            f"<th>complete</th><th>ranks</th></tr>{rows}</table>{cut}")


def _entries(report: Report, word: Callable[[Entry], str]) -> str:
    items = report.items[:ENTRIES_SHOWN]
    rows = []
    for it in items:
        try:
            text = word(it)
        except Exception:  # the CLI's wording never raises; a report is never lost to one sentence
            text = str(it.text or it.kind)
        tail = f"<pre>{_e(chr(10).join(it.tail[-10:]))}</pre>" if it.tail else ""
        if it.repeats:
            text += f" (and {it.repeats} more times, the same)"
        rows.append(f'<tr class="{LEVEL_CLASS.get(it.level, "info")}"><td>{_e(_clock(it.t))}</td>'
                    f"<td>{_e(it.job if it.job is not None else '-')}</td><td>{_e(text)}{tail}</td></tr>")
    cut = (f"<p>{len(report.items) - ENTRIES_SHOWN} more entries: see <code>nvrx inspect --json</code>.</p>"
           if len(report.items) > ENTRIES_SHOWN else "")
    return (f'<h2>Timeline entries</h2><table class="entries"><tr><th>at</th><th>job</th><th>what</th></tr>'
            f"{''.join(rows)}</table>{cut}")


def _definitions(report: Report) -> str:
    a = report.time_accounting
    items = [f"<li><b>{_e(k)}</b>: {_e(v)}</li>" for k, v in (a.get("definitions") or {}).items()]
    if a.get("recompute"):
        items.append(f"<li><b>redone</b>: {_e(a['recompute'])}</li>")
    return f'<h2>How these figures are computed</h2><ul class="defs">{"".join(items)}</ul>'


def _data(report: Report, axis: _Axis, nodes: list[str]) -> str:
    """The rank processes per node for the script: [global rank, start, end, hang start] in 0.1 s from t0."""
    rel = lambda t: None if not isinstance(t, (int, float)) else int(round((t - axis.t0) * 10))  # noqa: E731
    lanes = {n: [[r if isinstance(r, int) else -1, rel(s), rel(e), rel(hg)] for r, s, e, hg in report.lanes.get(n, [])]
             for n in nodes if n in report.lanes}
    data = {"span": round(axis.span * 10), "label": LABEL, "width": WIDTH, "lanes": lanes}
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=True).replace("</", "<\\/")
    return f'<script id="nvrx-data" type="application/json">{text}</script>'


_CSS = """
body{font:13px/1.4 system-ui,-apple-system,'Segoe UI',sans-serif;margin:16px;color:#1d2330;background:#fff}
h1{font-size:18px;margin:0 0 12px}h2{font-size:15px;margin:22px 0 8px;border-bottom:1px solid #dde}
.cards{display:flex;flex-wrap:wrap;gap:10px}.card{border:1px solid #d5d9e3;border-radius:6px;padding:8px 12px;
min-width:150px;max-width:260px}.card .k{color:#667;font-size:11px;text-transform:uppercase}.card .v{font-size:20px;
font-weight:600}.card .s{color:#556;font-size:11px}.jobs{margin:8px 0}.skip{background:#fff6e0;border:1px solid
#e8c770;padding:6px 10px;margin:8px 0;border-radius:4px}.scroll{overflow-x:auto}
table{border-collapse:collapse;margin:4px 0}td,th{border:1px solid #e0e3ea;padding:3px 6px;vertical-align:top;
text-align:left}th{background:#f3f5f9}pre{margin:4px 0 0;font-size:11px;background:#f7f7f9;padding:4px;
white-space:pre-wrap;max-width:900px}.entries tr.err td{color:#a31515}.entries tr.warn td{color:#8a5a00}
.entries tr.ok td{color:#1c7c3c}td.bad{color:#a31515}.cause{max-width:700px}
svg .ok{fill:#5aa66f}svg .bad{fill:#c9736b}svg .int{fill:#e0b04f}svg .run{fill:#5b8fd0}svg .starting{fill:#d7dbe4}
svg .job{fill:#f4f6fb}svg .restart{stroke:#7a8497;stroke-dasharray:2 3}svg .rlbl,svg .tick,svg .lbl{fill:#556}
svg .grid{stroke:#eceef3}svg .axis{stroke:#99a}svg .ckpt{fill:#2f6fc4}svg .strag{fill:#e08a1e}
svg .fault{stroke:#c0392b;stroke-width:1.5;stroke-dasharray:4 2}svg .faultdot{fill:#c0392b}svg .sick{fill:#8e44ad}
svg .node{fill:#333;cursor:pointer}svg .pick{fill:transparent;cursor:pointer}svg .goodline{fill:none;stroke:#1c7c3c;
stroke-width:2}svg .lostline{fill:none;stroke:#c0392b;stroke-width:1.5;stroke-dasharray:4 2}svg .gooddot{fill:#1c7c3c}
svg .good{fill:#1c7c3c}svg .lost{fill:#c0392b}svg .hang{fill:#c0392b}svg .rank{fill:#5b8fd0}
"""

# Draws the rank lanes of one node on demand (the only script; reads the JSON above, touches nothing else).
_SCRIPT = """<script>
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("nvrx-data").textContent);
  var select = document.getElementById("node-select"), box = document.getElementById("rank-lanes");
  var panel = document.getElementById("ranks"), pick = document.querySelector("#timeline .pick");
  function esc(s) { return String(s).replace(/[&<>"]/g, function (c) { return "&#" + c.charCodeAt(0) + ";"; }); }
  function x(d) { return data.label + Math.max(0, Math.min(1, (d === null ? data.span : d) / Math.max(data.span, 1))) * data.width; }
  function show(name) {
    var rows = data.lanes[name] || [], ranks = {}, order = [], out = [];
    rows.forEach(function (r) { if (!(r[0] in ranks)) { ranks[r[0]] = []; order.push(r[0]); } ranks[r[0]].push(r); });
    order.sort(function (a, b) { return a - b; });
    var h = 14, height = order.length * h + 10;
    out.push('<svg xmlns="http://www.w3.org/2000/svg" width="' + (data.label + data.width + 20) + '" height="' + height + '" font-size="11">');
    order.forEach(function (rank, i) {
      var y = 4 + i * h;
      out.push('<text x="4" y="' + (y + 10) + '">rank ' + esc(rank) + '</text>');
      ranks[rank].forEach(function (s) {
        var x0 = x(s[1]), x1 = x(s[2]);
        out.push('<rect class="rank" x="' + x0 + '" y="' + y + '" width="' + Math.max(x1 - x0, 0.5) + '" height="' + (h - 3) + '"/>');
        if (s[3] !== null) { out.push('<rect class="hang" x="' + x(s[3]) + '" y="' + y + '" width="' + Math.max(x1 - x(s[3]), 1) + '" height="' + (h - 3) + '"><title>no progress from here: hung</title></rect>'); }
      });
    });
    out.push("</svg>");
    box.innerHTML = rows.length ? out.join("") : "<p>No rank processes of " + esc(name) + " in the monitors' events.</p>";
    select.value = name;
  }
  select.addEventListener("change", function () { show(select.value); });
  if (pick) {
    pick.addEventListener("click", function (ev) {
      var box2 = pick.getBoundingClientRect(), h = Number(pick.getAttribute("data-h"));
      var i = Math.floor((ev.clientY - box2.top) / h), option = select.options[i];
      if (option) { panel.open = true; show(option.value); panel.scrollIntoView(); }
    });
  }
  if (select.options.length) { show(select.options[0].value); }
  document.body.setAttribute("data-ready", String(Math.round(performance.now())));
})();
</script>"""
