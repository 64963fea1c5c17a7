"""The status page (``GET /``) and the CSV of pods (``GET /status.csv``), from /status.

What this module decides:

- The page is rendered here, whole, from a /status document and a history export
  (``history.History.export`` without pods, or the workers' merge): no JavaScript
  library, nothing fetched from elsewhere. A tiny inline script replaces the page's body
  with a fresh copy every two seconds, keeping the scroll position and the open pod
  lists; without scripts, a meta refresh reloads it every five. **A page that cannot
  refresh says so**: while refreshes fail (the activator stopped, the network is down,
  an answer that is not 200), a banner reads ``stale: last refresh failed N s ago``
  (N counts from the first failure of the streak), with the error, and the page is
  dimmed; the next good refresh takes both away.
- Per service: a summary line (capacity, in flight, queue, the oldest wait, the last ten
  seconds' rates, byte totals; per priority class its queue, oldest wait and sheds, and
  the tenants with the most queued), three sparklines of the last fifteen minutes as inline
  SVG (queued / in flight / capacity; requests per second with the 5xx and rejected
  answers; queue wait p99), each with the pod state changes marked on its time axis,
  the answers by class and the rejections by reason, and the pods. The legend of each
  chart gives the same figures as the summary (this moment's, or the same ten seconds'
  rates), never another moment's. A chart's labels (its scale, in the chart's unit,
  and its time axis) sit in strips above and below the plotted area: no line crosses
  them.
- Pods are sorted by trouble: not healthy first, then the longest failure streak, then
  the most in flight. The first ``VISIBLE_PODS`` rows are shown, the others are folded
  in a ``<details>`` (a service of 200 pods stays one screen). A pod whose slots are
  all in use has its row marked ``busy``. Its columns (``POD_TABLE``), grouped as
  HAProxy's stats page groups them: in flight now, its most at once over the charts'
  window and since start, and its slots here (HAProxy's Cur / Max / Limit); requests,
  their rate and retries elsewhere; answers by class; the pod's time per answer over
  the last ten seconds; failures; the last probe; the time in its state and the time
  it spent pending in all. Each cell says which column it is (``data-col``).
- A configuration without services says so, with the file's path.
- Every text that comes from outside (names, addresses, reasons, paths) is escaped.
- ``/status.csv``: one row per pod (RFC 4180, ``csv`` module) with its service's
  columns; a service without pods has one row with the pod columns empty.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Iterable, Mapping, Sequence
from html import escape
from itertools import groupby
from typing import Any

from .history import CLASSES, STATES

#: Pod rows shown before the rest are folded away.
VISIBLE_PODS = 20
#: Seconds drawn by the sparklines: the whole history, or as much of it as there is
#: (at least ``MIN_WINDOW``), so that a young process's charts are not a sliver.
WINDOW = 900
MIN_WINDOW = 60
#: A sparkline: the plotted area between a strip for its scale (above) and one for its
#: time axis (below), so that no line is drawn over a label.
WIDTH, PLOT_HEIGHT, STRIP = 600, 56, 16
HEIGHT = PLOT_HEIGHT + 2 * STRIP
LABEL_PX = 11

STATE_COLOURS = {"healthy": "#2e7d32", "pending": "#b28704", "draining": "#1565c0", "removed": "#757575"}
COLOURS = {
    "queued": "#e65100",
    "in_flight": "#1565c0",
    "capacity": "#9e9e9e",
    "requests": "#1565c0",
    "5xx": "#c62828",
    "rejected": "#ef6c00",
    "p99": "#6a1b9a",
}

STYLE = (
    "body{font:14px system-ui,sans-serif;margin:1.5em;color:#212121}"
    "table{border-collapse:collapse;margin:.5em 0 1em}"
    "table.pods{font-size:13px}table.pods th{white-space:normal}tr.groups th{text-align:center}"
    "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right;white-space:nowrap}th{background:#eee}"
    "td.l,th.l{text-align:left}.state{color:#fff;border-radius:3px;padding:1px 6px}.busy{background:#fff3e0}"
    ".err,.peer-down{color:#b71c1c}.peer-up{color:#2e7d32}.muted{color:#757575}section{margin-bottom:2em}"
    ".charts{display:flex;flex-wrap:wrap;gap:1em}figure{margin:0}figcaption{font-size:13px;color:#424242}"
    "svg.spark{background:#fafafa;border:1px solid #e0e0e0}svg.spark rect.plot{fill:#fff}"
    ".key{display:inline-block;width:10px;height:3px;vertical-align:middle;margin:0 3px 0 8px}"
    "summary{cursor:pointer;margin:.3em 0}"
    "#stale{position:sticky;top:0;background:#b71c1c;color:#fff;padding:.4em .8em;font-weight:bold;z-index:1}"
    "body.stale section,body.stale>p{opacity:.45}"
)

# Replaces the body with a fresh copy every 2 s, keeping the scroll and the open <details>;
# while refreshes fail, shows (and counts up, every second) the stale banner.
REFRESH_SCRIPT = (
    "(function(){var since=null,why='';"
    "function banner(){var b=document.getElementById('stale');if(since===null){if(b){b.remove()}"
    "document.body.classList.remove('stale');return}if(!b){b=document.createElement('p');b.id='stale';"
    "document.body.insertBefore(b,document.body.firstChild)}document.body.classList.add('stale');"
    "b.textContent='stale: last refresh failed '+Math.round((Date.now()-since)/1000)+' s ago ('+why+')'}"
    "function refresh(){fetch(location.href,{cache:'no-store'}).then(function(r){"
    "if(!r.ok){throw new Error('HTTP '+r.status)}return r.text()})"
    ".then(function(text){var d=new DOMParser().parseFromString(text,'text/html');"
    "var open=Array.prototype.map.call(document.querySelectorAll('details[open]'),function(e){return e.id});"
    "document.body.replaceWith(d.body);open.forEach(function(id){var e=document.getElementById(id);"
    "if(e){e.open=true}});since=null;banner()})"
    ".catch(function(e){if(since===null){since=Date.now()}why=String(e&&e.message||e);banner()})"
    ".then(function(){setTimeout(refresh,2000)})}"
    "setInterval(function(){if(since!==null){banner()}},1000);setTimeout(refresh,2000)})();"
)


# -- formatting ------------------------------------------------------------------------


def fmt_number(value: float) -> str:
    """``12``, ``3.5``, ``0.25``: whole numbers without decimals, others with at most 2."""
    if value == int(value):
        return str(int(value))
    return f"{value:.2f}".rstrip("0").rstrip(".") if abs(value) < 10 else f"{value:.1f}"


def fmt_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value <= 0:
        return "0"
    if value < 1:
        return f"{value * 1000:.0f} ms" if value >= 0.001 else f"{value * 1000:.2f} ms"
    if value < 120:
        return f"{value:.1f} s"
    if value < 7200:
        return f"{value / 60:.0f} min"
    return f"{value / 3600:.1f} h"


def fmt_bytes(value: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"  # not reached


# -- sparklines --------------------------------------------------------------------------


class Line:
    """One series of a sparkline: its name, values (None: no point) and colour."""

    def __init__(self, name: str, values: Sequence[float | None], colour: str) -> None:
        self.name = name
        self.values = values
        self.colour = colour


def sparkline(
    times: Sequence[int],
    lines: Sequence[Line],
    *,
    end: int,
    window: int = WINDOW,
    markers: Iterable[Mapping[str, Any]] = (),
    label: str = "",
    scale: Callable[[float], str] = fmt_number,
    floor: float = 1.0,
) -> str:
    """An inline SVG of ``lines`` over the ``window`` seconds up to ``end`` (wall-clock
    seconds): one ``<polyline>`` per unbroken run of points of each line (a None breaks
    it), on one scale from 0 to the largest value (at least ``floor``, written with
    ``scale`` in the strip above the plotted area); a vertical line per marker (a pod
    state change) with its description as a tooltip; the time axis in the strip below."""
    start = end - window + 1
    top = max([floor, *(v for line in lines for v in line.values if v is not None)])
    bottom = STRIP + PLOT_HEIGHT

    def x(t: float) -> float:
        return round((t - start) / max(window - 1, 1) * WIDTH, 1)

    def y(v: float) -> float:
        return round(bottom - v / top * PLOT_HEIGHT, 1)

    parts = [
        f"<svg class='spark' xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{HEIGHT}' "
        f"viewBox='0 0 {WIDTH} {HEIGHT}' role='img' aria-label='{escape(label)}'>",
        f"<title>{escape(label)}</title>",
        f"<rect class='plot' x='0' y='{STRIP}' width='{WIDTH}' height='{PLOT_HEIGHT}'/>",
    ]
    for marker in markers:
        mx = x(float(marker["t"]))
        if 0 <= mx <= WIDTH:
            colour = STATE_COLOURS.get(str(marker.get("new")), "#000")
            text = f"{marker.get('pod')} {marker.get('old')} -> {marker.get('new')} ({marker.get('reason', '')})"
            parts.append(
                f"<line class='change' x1='{mx}' y1='{STRIP}' x2='{mx}' y2='{bottom}' stroke='{colour}' "
                f"stroke-dasharray='2,2'><title>{escape(text)}</title></line>"
            )
    for line in lines:
        run: list[str] = []
        runs: list[list[str]] = []
        for t, v in zip(times, line.values, strict=False):
            if v is None or t < start:
                if run:
                    runs.append(run)
                run = []
                continue
            run.append(f"{x(t)},{y(v)}")
        if run:
            runs.append(run)
        for points in runs:
            if len(points) == 1:  # a lone point: a short dash, so that it shows
                px, py = points[0].split(",")
                points = [f"{max(float(px) - 1, 0)},{py}", points[0]]
            parts.append(
                f"<polyline class='series' data-series='{escape(line.name)}' data-points='{len(points)}' "
                f"fill='none' stroke='{line.colour}' stroke-width='1.5' points='{' '.join(points)}'/>"
            )
    text = f"font-size='{LABEL_PX}' fill='#424242'"
    parts.append(f"<text class='scale' x='3' y='{STRIP - 4}' {text}>{escape(scale(top))}</text>")
    since = f"-{window // 60} min" if window >= 120 else f"-{window} s"
    parts.append(f"<text class='axis' x='3' y='{HEIGHT - 4}' {text}>{since}</text>")
    parts.append(f"<text class='axis' x='{WIDTH - 3}' y='{HEIGHT - 4}' {text} text-anchor='end'>now</text>")
    parts.append("</svg>")
    return "".join(parts)


def _key(name: str, colour: str) -> str:
    return f"<span class='key' style='background:{colour}'></span>{escape(name)}"


def _last(values: Sequence[float | None]) -> float | None:
    return next((v for v in reversed(values) if v is not None), None)


def charts(history: Mapping[str, Any] | None, end: int, service: Mapping[str, Any]) -> str:
    """The three sparklines of one service (an empty note while there is no history),
    their legends with the figures of the service's summary (``service``)."""
    if not history or not history.get("t"):
        return "<p class='muted'>no history yet (one point a second)</p>"
    times = history["t"]
    markers = history.get("transitions", ())
    window = min(WINDOW, max(MIN_WINDOW, end - times[0] + 1))
    capacity = history["capacity"]
    load = [  # capacity first, so that the other two are drawn over it
        Line("capacity", capacity, COLOURS["capacity"]),
        Line("in_flight", history["in_flight"], COLOURS["in_flight"]),
        Line("queued", history["queued"], COLOURS["queued"]),
    ]
    rejected = [sum(values) for values in zip(*history["rejected"].values(), strict=True)] or [0] * len(times)
    server_errors = history["responses"]["5xx"]
    requests = history["requests"]
    per_second = service.get("per_second", {})
    rates = [
        Line("requests", requests, COLOURS["requests"]),
        Line("5xx", server_errors, COLOURS["5xx"]),
        Line("rejected", rejected, COLOURS["rejected"]),
    ]
    p99 = history["queue_wait_p99"]
    last_p99 = _last(p99)
    caps = "unlimited" if service["capacity"] is None else service["capacity"]
    figures = [
        (
            f"<span class='legend' data-legend='queued'>{_key('queued', COLOURS['queued'])} {service['queued']}</span>"
            f"<span class='legend' data-legend='in_flight'>{_key('in flight', COLOURS['in_flight'])}"
            f" {service['in_flight']}</span>"
            f"<span class='legend' data-legend='capacity'>{_key('capacity', COLOURS['capacity'])} {caps}</span>",
            sparkline(times, load, end=end, window=window, markers=markers, label="queued, in flight and capacity"),
        ),
        (
            f"<span class='legend' data-legend='requests'>{_key('req/s', COLOURS['requests'])}"
            f" {fmt_number(service.get('requests_per_second', 0.0))}</span>"
            f"<span class='legend' data-legend='5xx'>{_key('5xx', COLOURS['5xx'])}"
            f" {fmt_number(per_second.get('responses', {}).get('5xx', 0.0))}/s</span>"
            f"<span class='legend' data-legend='rejected'>{_key('rejected', COLOURS['rejected'])}"
            f" {fmt_number(per_second.get('rejected', 0.0))}/s</span>"
            " <span class='muted'>(last 10 s)</span>",
            sparkline(
                times, rates, end=end, window=window, markers=markers, label="requests per second, 5xx and rejected"
            ),
        ),
        (
            f"<span class='legend' data-legend='queue_wait_p99'>{_key('queue wait p99', COLOURS['p99'])}"
            f" {fmt_seconds(last_p99)}</span> <span class='muted'>(last second with a wait)</span>",
            sparkline(
                times,
                [Line("queue_wait_p99", p99, COLOURS["p99"])],
                end=end,
                window=window,
                markers=markers,
                label="queue wait p99 (seconds)",
                scale=fmt_seconds,
                floor=0.001,
            ),
        ),
    ]
    return (
        "<div class='charts'>"
        + "".join(f"<figure><figcaption>{caption}</figcaption>{svg}</figure>" for caption, svg in figures)
        + "</div>"
    )


# -- pods ------------------------------------------------------------------------------------


def trouble_key(pod: Mapping[str, Any]) -> tuple[bool, int, int]:
    """Sort key, most troubled first: not healthy, then the failure streak, then in flight."""
    return (pod["state"] == "healthy", -int(pod.get("failures", 0)), -int(pod.get("in_flight", 0)))


def _mean_pod_time(pod: Mapping[str, Any]) -> float | None:
    """The pod's time per answer over the last ten seconds (None: no answer then)."""
    recent = pod.get("recent_pod_time_seconds") or {}
    count = recent.get("count", 0)
    return recent.get("sum", 0.0) / count if count else None


def _probe(pod: Mapping[str, Any], field: str) -> Any:
    return (pod.get("last_probe") or {}).get(field)


#: The pod table, grouped as HAProxy's stats page groups its columns: (group, header,
#: ``data-col``, the cell's text from the pod). Cells are escaped by ``pod_row``.
POD_TABLE: tuple[tuple[str, str, str, Callable[[Mapping[str, Any]], str]], ...] = (
    ("", "pod", "pod", lambda pod: str(pod["address"])),
    ("", "state", "state", lambda pod: str(pod["state"])),
    ("in flight", "now", "in_flight", lambda pod: str(pod["in_flight"])),
    ("in flight", "max 15 min", "peak_window", lambda pod: str(pod.get("peak_in_flight_window", "-"))),
    ("in flight", "max", "peak", lambda pod: str(pod.get("peak_in_flight", "-"))),
    ("in flight", "slots", "slots", lambda pod: "\u221e" if pod.get("slots") is None else str(pod["slots"])),
    ("announced", "load", "load", lambda pod: "-" if pod.get("load") is None else fmt_number(pod["load"])),
    ("announced", "cc", "announced_concurrency", lambda pod: str(pod.get("announced_concurrency") or "-")),
    ("requests", "total", "requests", lambda pod: str(pod.get("requests", 0))),
    ("requests", "req/s", "requests_per_second", lambda pod: fmt_number(pod.get("requests_per_second", 0.0))),
    ("requests", "retried", "retries", lambda pod: str(pod.get("retries", 0))),
    *(
        ("answers", cls, cls, lambda pod, cls=cls: str((pod.get("responses") or {}).get(cls, 0)))
        for cls in ("2xx", "3xx", "4xx", "5xx")
    ),
    ("", "pod time", "pod_time", lambda pod: fmt_seconds(_mean_pod_time(pod))),
    ("failures", "total", "failures_total", lambda pod: str(pod.get("failures_total", 0))),
    ("failures", "streak", "streak", lambda pod: str(pod.get("failures", 0))),
    ("last probe", "result", "probe", lambda pod: str(_probe(pod, "result") or "-")),
    ("last probe", "took", "probe_took", lambda pod: fmt_seconds(_probe(pod, "duration_seconds"))),
    ("last probe", "when", "probe_when", lambda pod: _ago(_probe(pod, "seconds_ago"))),
    ("time", "in state", "in_state", lambda pod: fmt_seconds(pod.get("seconds_in_state"))),
    ("time", "pending", "pending_total", lambda pod: fmt_seconds((pod.get("seconds_by_state") or {}).get("pending"))),
)
_LEFT = frozenset({"pod", "state", "probe"})


def _ago(seconds: float | None) -> str:
    return "-" if seconds is None else f"{fmt_seconds(seconds)} ago"


def _pod_header() -> str:
    """Two header rows: the groups over their columns, then the columns."""
    top = "".join(
        f"<th colspan='{len(list(columns))}'>{escape(group)}</th>"
        for group, columns in groupby(POD_TABLE, key=lambda column: column[0])
    )
    names = "".join(
        f"<th class='l'>{escape(name)}</th>" if col in _LEFT else f"<th>{escape(name)}</th>"
        for _, name, col, _ in POD_TABLE
    )
    return f"<tr class='groups'>{top}</tr><tr>{names}</tr>"


POD_HEADER = _pod_header()


def pod_row(pod: Mapping[str, Any]) -> str:
    slots = pod.get("slots")
    busy = slots is not None and pod["in_flight"] >= max(slots, 1)
    row_class = " class='busy'" if busy else ""
    cells = []
    for _, _, col, text in POD_TABLE:
        value = escape(text(pod))
        classes = ["l"] if col in _LEFT else []
        if col == "state":
            colour = STATE_COLOURS.get(pod["state"], "#424242")
            value = f"<span class='state' style='background:{colour}'>{value}</span>"
        elif col == "probe" and value not in ("pass", "-"):
            classes.append("err")
        elif col == "probe" and value == "-":
            classes.append("muted")
        elif col == "streak" and int(pod.get("failures", 0)):
            classes.append("err")
        css = f" class='{' '.join(classes)}'" if classes else ""
        cells.append(f"<td{css} data-col='{col}'>{value}</td>")
    return f"<tr{row_class} data-pod='{escape(pod['address'])}'>{''.join(cells)}</tr>"


def pod_tables(name: str, pods: Sequence[Mapping[str, Any]]) -> str:
    """The pods of a service, most troubled first; beyond VISIBLE_PODS folded away."""
    if not pods:
        return "<p class='muted'>no pods</p>"
    ordered = sorted(pods, key=trouble_key)
    shown, folded = ordered[:VISIBLE_PODS], ordered[VISIBLE_PODS:]
    parts = [f"<table class='pods'>{POD_HEADER}", *map(pod_row, shown), "</table>"]
    if folded:
        healthy = sum(1 for pod in folded if pod["state"] == "healthy")
        parts.append(
            f"<details class='more-pods' id='pods-{escape(name)}'><summary>{len(folded)} more pods"
            f" ({healthy} healthy)</summary><table class='pods'>{POD_HEADER}"
        )
        parts.extend(map(pod_row, folded))
        parts.append("</table></details>")
    return "".join(parts)


# -- the page --------------------------------------------------------------------------------


def _counts(label: str, counts: Mapping[str, int]) -> str:
    shown = [f"{escape(key)} {value}" for key, value in counts.items() if value]
    return f"{label}: " + (" &middot; ".join(shown) if shown else "<span class='muted'>none</span>")


def service_section(name: str, service: Mapping[str, Any], history: Mapping[str, Any] | None, end: int) -> str:
    esc = escape
    capacity = "unlimited" if service["capacity"] is None else service["capacity"]
    per_second = service.get("per_second", {})
    totals = service.get("totals", {})
    states: dict[str, int] = {}
    for pod in service["pods"]:
        states[pod["state"]] = states.get(pod["state"], 0) + 1
    forward = service.get("forward_to")
    summary = [
        f"hosts {esc(', '.join(service['hosts']))}",
        f"cc {service['container_concurrency']}",
        esc(str(service["lb_policy"])),
        f"capacity {capacity}",
        f"in flight {service['in_flight']}",
        f"queued {service['queued']}/{service['queue_depth']}",
        f"oldest wait <b class='oldest-wait'>{esc(fmt_seconds(service.get('oldest_wait_seconds', 0.0)))}</b>",
        f"<b>{fmt_number(service.get('requests_per_second', 0.0))}</b> req/s",
        f"5xx {fmt_number(per_second.get('responses', {}).get('5xx', 0.0))}/s",
        f"rejected {fmt_number(per_second.get('rejected', 0.0))}/s",
        f"in {esc(fmt_bytes(totals.get('bytes_in', 0)))}, out {esc(fmt_bytes(totals.get('bytes_out', 0)))}",
    ]
    if forward:
        summary.append(f"forwards to {esc(forward)}")
    launch = service.get("launch")
    if launch is not None:
        cold = launch["cold_starts"]
        mean = f", mean {esc(fmt_seconds(launch['cold_start_seconds_total'] / cold))}" if cold else ""
        summary.append(
            f"<span class='launch'>launch: desired <b>{launch['desired']}</b> ({launch['min']}..{launch['max']}), "
            f"running {launch['running']}, starting {launch['starting']}, cold starts {cold}{mean}, "
            f"failed {launch['failed']}{', PANIC' if launch['panicking'] else ''}</span>"
        )
    for klass, seen in service.get("classes", {}).items():
        summary.append(
            f"<span class='class'>{esc(klass)}: queued {seen['queued']}, oldest "
            f"{esc(fmt_seconds(seen['oldest_wait_seconds']))}, shed {seen['shed']}</span>"
        )
    if service.get("top_tenants"):
        top = ", ".join(f"{esc(t['tenant'] or '(none)')} {t['queued']}" for t in service["top_tenants"])
        summary.append(f"<span class='tenants'>most queued: {top}</span>")
    changes = list((history or {}).get("transitions", ()))[-10:]
    recent = ""
    if changes:
        items = "".join(
            f"<li>{esc(fmt_seconds(max(0.0, end - change['t'])))} ago: {esc(str(change['pod']))} "
            f"{esc(str(change['old']))} &rarr; {esc(str(change['new']))} ({esc(str(change.get('reason', '')))})</li>"
            for change in reversed(changes)
        )
        recent = (
            f"<details id='changes-{esc(name)}'><summary>last pod state changes</summary><ul>{items}</ul></details>"
        )
    return (
        f"<section class='service' id='service-{esc(name)}'><h2>{esc(name)}</h2>"
        f"<p class='summary'>{' &middot; '.join(summary)}</p>"
        f"{charts(history, end, service)}"
        f"<p>{_counts('answers', totals.get('responses', {}))}"
        f"<br>{_counts('rejections', totals.get('rejected', {}))}"
        f"<br>{_counts('pods', dict(sorted(states.items())))}</p>"
        f"{recent}{pod_tables(name, service['pods'])}</section>"
    )


def render_page(status: Mapping[str, Any], history: Mapping[str, Any] | None = None) -> str:
    """The whole status page (see the module docstring)."""
    esc = escape
    config = status["config"]
    end = int((history or {}).get("last", -1))
    if end <= 0:
        end = max([t for h in (history or {}).get("services", {}).values() for t in h.get("t", ())] or [0])
    ready = "ready" if status.get("ready") else "<b class='err'>NOT READY</b>"
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        "<noscript><meta http-equiv='refresh' content='5'></noscript>",
        f"<title>activator {esc(str(status.get('version', '')))}</title><style>{STYLE}</style>",
        f"<script>{REFRESH_SCRIPT}</script></head><body>",
        f"<h1>activator {esc(str(status.get('version', '')))}</h1>",
        f"<p>config <code>{esc(str(config.get('path', '')))}</code> loaded {esc(str(config.get('loaded_at', '')))}"
        f" &middot; {ready}"
        f" &middot; up {fmt_seconds(status.get('uptime_seconds', 0.0))}"
        " &middot; <a href='/status'>/status</a> (JSON) &middot; <a href='/status.csv'>/status.csv</a>"
        " &middot; <a href='/status/history'>/status/history</a> &middot; <a href='/metrics'>/metrics</a></p>",
    ]
    if config.get("last_error"):
        parts.append(f"<p class='err'>last reload failed: {esc(str(config['last_error']))}</p>")
    peers = status.get("activator", {}).get("peers") or {}
    if peers:
        me = status["activator"].get("self")
        health = status["activator"].get("health") or {}

        def label(name: str) -> str:
            if name == me:
                return f"<b>{esc(name)}</b>"
            state = health.get(name, {}).get("state")
            return esc(name) if state is None else f"{esc(name)} <span class='peer-{esc(state)}'>{esc(state)}</span>"

        parts.append("<p>peers: " + ", ".join(label(n) for n in sorted(peers)) + "</p>")
    workers = status.get("workers")
    if workers:
        parts.append(
            "<p>workers: "
            + ", ".join(f"{w['index']} {'ready' if w.get('ready') else 'NOT READY'}" for w in workers)
            + "</p>"
        )
    histories = (history or {}).get("services", {})
    if not status["services"]:
        parts.append(
            f"<p class='no-services'>no services: <code>{esc(str(config.get('path', '')))}</code> configures none"
            " (<code>services: {}</code>); add one to the file and it is served once the file is saved.</p>"
        )
    for name, service in status["services"].items():
        parts.append(service_section(name, service, histories.get(name), end))
    parts.append("</body></html>")
    return "".join(parts)


# -- CSV -----------------------------------------------------------------------------------

SERVICE_COLUMNS = (
    "service",
    "hosts",
    "container_concurrency",
    "lb_policy",
    "capacity",
    "service_in_flight",
    "queued",
    "queue_depth",
    "oldest_wait_seconds",
    "service_requests_per_second",
)
POD_COLUMNS = (
    "pod",
    "state",
    "in_flight",
    "peak_in_flight",
    "peak_in_flight_window",
    "slots",
    "requests",
    "requests_per_second",
    "retries",
    *(f"responses_{cls}" for cls in CLASSES),
    "pod_time_seconds_count",
    "pod_time_seconds_sum",
    "failures",
    "failures_total",
    "seconds_in_state",
    *(f"seconds_{state}" for state in STATES),
    "last_probe_result",
    "last_probe_duration_seconds",
    "last_probe_seconds_ago",
)
CSV_COLUMNS = SERVICE_COLUMNS + POD_COLUMNS


def _cell(value: Any) -> Any:
    return "" if value is None else value


def status_csv(status: Mapping[str, Any]) -> str:
    """``/status.csv``: one row per pod, with its service's columns (``CSV_COLUMNS``;
    an empty cell is None: unlimited capacity or slots, no probe yet)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(CSV_COLUMNS)
    for name, service in status["services"].items():
        head = [
            name,
            " ".join(service.get("hosts", ())),
            service.get("container_concurrency"),
            service.get("lb_policy"),
            service.get("capacity"),
            service.get("in_flight"),
            service.get("queued"),
            service.get("queue_depth"),
            service.get("oldest_wait_seconds"),
            service.get("requests_per_second"),
        ]
        pods = service.get("pods") or [None]
        for pod in pods:
            if pod is None:
                writer.writerow([_cell(v) for v in head] + [""] * len(POD_COLUMNS))
                continue
            probe = pod.get("last_probe") or {}
            responses = pod.get("responses") or {}
            pod_time = pod.get("pod_time_seconds") or {}
            spent = pod.get("seconds_by_state") or {}
            row = [
                pod["address"],
                pod["state"],
                pod["in_flight"],
                pod.get("peak_in_flight"),
                pod.get("peak_in_flight_window"),
                pod.get("slots"),
                pod.get("requests"),
                pod.get("requests_per_second"),
                pod.get("retries"),
                *(responses.get(cls) for cls in CLASSES),
                pod_time.get("count"),
                pod_time.get("sum"),
                pod.get("failures"),
                pod.get("failures_total"),
                pod.get("seconds_in_state"),
                *(spent.get(state) for state in STATES),
                probe.get("result"),
                probe.get("duration_seconds"),
                probe.get("seconds_ago"),
            ]
            writer.writerow([_cell(v) for v in head + row])
    return out.getvalue()
