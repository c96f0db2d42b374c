"""Benchmark report writer: one JSON + one self-contained HTML page per run.

`write_report(inputs, out_dir)` takes what the earlier stages produced (training metrics, candidate operating
points, the chosen point, export facts, the device runner's results) and writes

* ``report.json``  - a computed ``summary`` block (summary.py) followed by the inputs verbatim,
* ``report.html``  - a single page with every plot embedded as a data URI,
* ``*.png``        - the same plots (plots.py) as separate files.

The page is rendered from the Jinja2 templates beside this file: ``page.html.j2`` includes one template per
section, in the order of ``SECTIONS``; adding a section is one template in ``templates/sections/`` and its name
in that list. Every value a template prints is HTML-escaped (run, device and class names come from the user);
only the templates' own markup and their macros' output is not.

Every file is written through ``provenance.atomic_path`` (a temp file in ``out_dir`` renamed into place), so a
crash never leaves a half-written report behind. ``write_comparison`` writes one page setting several devices'
reports side by side; ``terminal_summary`` / ``summary_text`` are the block `edgebayes` prints.
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

import jinja2
from markupsafe import Markup

from edgebayes.deploy import plots
from edgebayes.deploy.plots import hist_window as _hist_window  # noqa: F401  (tests check the axis window)
from edgebayes.deploy.summary import (BUDGETS, BYTES_PER_MB, METRIC_LABELS, METRICS, NA, dict_or_empty, diff,
                                      fidelity_rows, fmt, fmt_diff, fmt_ms, fmt_pct, fmt_unit, get,
                                      jsonable as _jsonable, knob_label, num, point_label, same_point, shipped_bytes_rows,
                                      summarize as _summarize, summary_text, terminal_summary)
from edgebayes.provenance import atomic_path

__all__ = ["write_report", "write_comparison", "terminal_summary", "summary_text", "fmt_ms", "SECTIONS"]

# The run page's sections, top to bottom: templates/sections/<name>.html.j2.
SECTIONS = ["headline", "budgets", "tradeoff", "knob", "latency_model", "sparsity", "reference", "uncertainty",
            "latency_memory", "training", "candidates", "fidelity", "shipped_bytes", "provenance"]


def _escape(value) -> Markup:
    """Every printed value, escaped as html.escape does (quotes included); macro output is markup already."""
    return value if isinstance(value, Markup) else Markup(html.escape(str(value), quote=True))


def _budget_text(row: dict) -> str:
    if row["verdict"] == "not set":
        return f"{row['label']}: not set"
    return (f"{row['label']} {fmt_unit(row['measured'], row['unit'])} / {fmt_unit(row['limit'], row['unit'])}: "
            f"{row['verdict']}")


def _kv_row(item: tuple) -> list:
    key, value = item
    return [key, json.dumps(value) if isinstance(value, (dict, list)) else fmt(value)]


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
                             autoescape=True, finalize=_escape, undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.do"])
    env.filters.update(fmt=fmt, fmt_ms=fmt_ms, fmt_unit=fmt_unit, fmt_diff=fmt_diff, fmt_pct=fmt_pct, num=num,
                       get=get, diff=diff, knob_label=knob_label, budget_text=_budget_text, kv_row=_kv_row,
                       signed_pct=lambda x: NA if x is None else f"{100 * x:+.1f} %",
                       near_any=lambda x, *targets: any(math.isclose(x, t) for t in targets))
    env.globals.update(NA=NA, METRICS=METRICS, METRIC_LABELS=METRIC_LABELS, BUDGETS=BUDGETS,
                       BYTES_PER_MB=BYTES_PER_MB, point_label=point_label, same_point=same_point, zip=zip)
    return env


_ENV = _environment()


def _data_uri(png: bytes | None) -> str | None:
    return None if png is None else "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _measured_on(results: dict) -> dict:
    """What the device's runner ran on: runtime and machine, from its results."""
    rt, hw = dict_or_empty(results.get("runtime")), dict_or_empty(results.get("device"))
    return {
        "runtime": " ".join(str(x) for x in (rt.get("name"), rt.get("version")) if x) or None,
        "providers": ", ".join(map(str, rt.get("providers") or [])) or None,
        "threads": rt.get("threads"),
        "host": hw.get("hostname"), "platform": hw.get("platform"), "machine": hw.get("machine"),
        "processor": hw.get("processor") or None, "cpu count": hw.get("cpu_count"),
        "python": hw.get("python"), "numpy": hw.get("numpy"),
    }


def _render_html(d: dict, s: dict, pngs: dict[str, bytes | None]) -> str:
    predicted = s.get("mode") == "predicted"
    results = dict_or_empty(d.get("results"))
    title = f"edgebayes report: {s['run_name'] or NA} on {s['device'] or NA}" + (" (predicted)" if predicted else "")
    return _ENV.get_template("page.html.j2").render(
        sections=SECTIONS, title=title, d=d, s=s, predicted=predicted, results=results,
        train=dict_or_empty(d.get("train")), choice=dict_or_empty(d.get("choice")), lat=dict_or_empty(results.get("latency_ms")),
        here=dict_or_empty(get(d, "predicted", "here")), measured_on=_measured_on(results), fidelity=fidelity_rows(d),
        shipped_bytes=shipped_bytes_rows(d),
        pngs={name: _data_uri(png) for name, png in pngs.items()}) + "\n"


def _write_all(out_dir: Path, files: dict[str, bytes]) -> None:
    for name, blob in files.items():
        with atomic_path(out_dir / name) as tmp:
            tmp.write_bytes(blob)


def _json_bytes(data) -> bytes:
    return (json.dumps(data, indent=2, allow_nan=False) + "\n").encode("utf-8")


def write_comparison(reports: list, out_dir: Path, name: str = "devices") -> dict:
    """One page setting the chosen points of several devices side by side (`edgebayes report --devices a b
    c`). reports: [(report dict, path of its report.html)]; a report dict may carry "stale", why it no longer
    shows the device's current choice (cli._report_staleness), said on its row. Writes <name>.html, <name>.json and the plot into
    out_dir; returns the JSON."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for report, path in reports:
        t = terminal_summary(report, path)
        s = dict_or_empty(report.get("summary"))
        rows.append({**t, "latency_stat": s.get("latency_stat"), "latency_ms": s.get("latency_at_percentile_ms"),
                     "latency_all": t["latency_ms"], "budget_ms": s.get("latency_budget_ms"),
                     "run_name": s.get("run_name"), "stale": report.get("stale")})
    png = plots.plot_devices(rows)
    links = [Path(r["report"]).relative_to(out_dir) if r["report"] and Path(r["report"]).is_relative_to(out_dir)
             else r["report"] for r in rows]
    page = _ENV.get_template("devices.html.j2").render(
        title=f"edgebayes: {', '.join(sorted({str(r['run_name']) for r in rows}))} on {len(rows)} devices",
        rows=[{**r, "link": link} for r, link in zip(rows, links)], figure=_data_uri(png),
        unplotted=[str(r["device"]) for r in rows if num(r["latency_ms"]) is None]) + "\n"
    data = {"devices": rows}
    files = {f"{name}.html": page.encode("utf-8"), f"{name}.json": _json_bytes(_jsonable(data))}
    if png is not None:
        files[f"{name}.png"] = png
    _write_all(out_dir, files)
    return data


def write_report(inputs: dict, out_dir: Path) -> dict:
    """Write report.json, report.html and the PNG plots into out_dir; return the report dict.

    Everything is rendered in memory first and then written atomically, so a
    failure while plotting leaves no partial report.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    d = _jsonable(dict(inputs))  # numpy/NaN-safe copy; the page and the JSON see the same values
    s = _summarize(d)
    report = {"summary": s, **{k: v for k, v in d.items() if k != "summary"}, "fidelity": fidelity_rows(d)}
    pngs = plots.report_figures(d, s)
    page = _render_html(d, s, pngs)
    files = {name: png for name, png in pngs.items() if png is not None}
    files.update({"report.json": _json_bytes(report), "report.html": page.encode("utf-8")})
    _write_all(out_dir, files)
    for name, png in pngs.items():   # a figure this report has not (a predicted report has no histogram): an
        if png is None:              # earlier report's file of that name would show another run's figures
            (out_dir / name).unlink(missing_ok=True)
    return report
