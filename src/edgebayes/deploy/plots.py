"""The report's figures, each a PNG as bytes (None when there is nothing to plot): drawn on a Figure with an
Agg canvas, so no pyplot state and never a display."""

from __future__ import annotations

import io
from typing import Any

from edgebayes.deploy.summary import dict_or_empty, fmt, fmt_ms, get, knob_label, num, point_label, same_point, time_axis

MARKERS = ("o", "s", "^", "D", "v", "P", "*", "h")   # one shape per series: colour-blind readers tell them apart


def _new_fig(w: float, h: float, **kw: Any):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=110, layout="constrained", **kw)
    FigureCanvasAgg(fig)
    return fig


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def plot_tradeoff(candidates: list, choice: dict, budget_ms: float | None,
                   budget_mb: float | None = None, percentile: Any = None, batch_size: Any = None) -> bytes | None:
    """Val accuracy vs latency (left) and vs model size (right) for every candidate; colour and shape = M,
    faded = violates a budget; a predicted latency with its band as a horizontal bar; the Pareto front, the
    budget lines and the chosen point drawn on both. The legend (the chosen point named in it) sits below the
    panels, over no data and no tick label."""
    pts = [(c, num(get(c, "cost", "latency_ms")), num(get(c, "val", "accuracy")))
           for c in candidates]
    pts = [p for p in pts if p[1] is not None and p[2] is not None]
    if not pts:
        return None
    from matplotlib.lines import Line2D

    bands = {id(c): get(c, "cost", "predicted_latency_band_ms") for c, _, _ in pts
             if num(get(c, "cost", "measured_latency_ms")) is None}
    bands = {i: [num(b[0]), num(b[1])] for i, b in bands.items()
             if isinstance(b, list) and len(b) == 2 and None not in (num(b[0]), num(b[1]))}
    unit, k = time_axis([x for _, x, _ in pts] + ([budget_ms] if budget_ms is not None else [])
                        + [v for b in bands.values() for v in b])
    budget_label = None if budget_ms is None else fmt_ms(budget_ms)
    budget_ms = None if budget_ms is None else k * budget_ms

    fig = _new_fig(11.0, 5.6)
    ax, ax_mb = fig.subplots(1, 2, width_ratios=[3, 2])
    _size_panel(ax_mb, candidates, choice, budget_mb)
    front = sorted((k * x, y) for c, x, y in pts if c.get("pareto_latency"))
    if len(front) > 1:
        ax.step(*zip(*front), where="post", color="#555", linewidth=1.1, zorder=1)
    ms = sorted({c.get("mc_samples") for c, _, _ in pts}, key=lambda m: (num(m) is None, num(m) or 0, str(m)))
    # Sequential colours: more posterior samples = darker, and no red (red means "violates").
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    colours = {m: cmap(0.85 * i / max(1, len(ms) - 1)) for i, m in enumerate(ms)}
    shapes = {m: MARKERS[i % len(MARKERS)] for i, m in enumerate(ms)}   # M told apart by shape, not by hue alone
    for c, x, y in pts:
        col, shape = colours[c.get("mc_samples")], shapes[c.get("mc_samples")]
        if id(c) in bands:
            lo, hi = bands[id(c)]
            ax.plot([k * lo, k * hi], [y, y], color=col, linewidth=1, alpha=0.6, zorder=1)
        if c.get("fits"):
            ax.scatter(k * x, y, s=46, marker=shape, color=col, edgecolor="black", linewidth=0.5, zorder=3)
        else:
            ax.scatter(k * x, y, s=46, marker=shape, color=col, alpha=0.4, zorder=2)   # faded, as on the right
    chosen = [(k * x, y) for c, x, y in pts
              if same_point(c, choice.get("knob_value"), choice.get("mc_samples"), choice.get("format"))]
    for x, y in chosen[:1]:
        ax.scatter(x, y, s=320, facecolor="none", edgecolor="crimson", linewidth=2.2, zorder=4)
    xs = [k * x for _, x, _ in pts] + ([budget_ms] if budget_ms is not None else []) + [
        k * v for b in bands.values() for v in b]
    if min(xs) > 0 and max(xs) / min(xs) > 10:  # wide spread: linear axis would squash the points
        _log_x(ax)
    if budget_ms is not None:
        ax.axvline(budget_ms, color="crimson", linestyle="--", linewidth=1.3)
    stat = f"p{fmt(num(percentile))} latency" if num(percentile) is not None else "latency"
    batch = f", batch size {batch_size}" if batch_size is not None else ""
    # the selection's figures (measured there or predicted), not the deployment's: the headline has those
    ax.set_xlabel(f"{stat} at selection{batch} ({unit})" + (", log scale" if ax.get_xscale() == "log" else ""))
    ax.set_ylabel("validation accuracy")
    ax.set_title("Candidate operating points: accuracy vs latency")
    ax.grid(True, alpha=0.3)
    ax.margins(x=0.08, y=0.12)
    handles = [Line2D([], [], marker=shapes[m], linestyle="", color=colours[m], markeredgecolor="black",
                      markeredgewidth=0.5, label=f"M = {m}") for m in ms]
    handles += [Line2D([], [], marker="o", linestyle="", color="grey", markeredgecolor="black", markeredgewidth=0.5,
                       label="fits budget"),
                Line2D([], [], marker="o", linestyle="", color="grey", alpha=0.4, label="violates budget (faded)")]
    if bands:
        handles.append(Line2D([], [], color="grey", linewidth=1, label="predicted latency's band"))
    if chosen:
        handles.append(Line2D([], [], marker="o", linestyle="", markerfacecolor="none", markeredgecolor="crimson",
                              markersize=12, label=f"chosen: {point_label(choice.get('knob'), choice.get('knob_value'))}, "
                                                   f"M={choice.get('mc_samples')}"))
    if len(front) > 1:
        handles.append(Line2D([], [], color="#555", label="Pareto front"))
    if budget_ms is not None:
        handles.append(Line2D([], [], color="crimson", linestyle="--", label=f"latency budget {budget_label} (left)"))
    if budget_mb is not None:
        handles.append(Line2D([], [], color="darkorange", linestyle="--", label=f"size budget {fmt(budget_mb)} MB (right)"))
    fig.legend(handles=handles, loc="outside lower center", ncols=min(6, len(handles)), fontsize=8, frameon=False)
    return _png(fig)


def _size_panel(ax, candidates: list, choice: dict, budget_mb: float | None) -> None:
    """Val accuracy vs model size: Pareto-optimal points (accuracy, latency, size) filled, others hollow."""
    pts = [(c, num(get(c, "cost", "model_mb")), num(get(c, "val", "accuracy"))) for c in candidates]
    pts = [p for p in pts if p[1] is not None and p[2] is not None]
    for c, x, y in pts:
        on_front = bool(c.get("pareto"))
        ax.scatter(x, y, s=40, marker="o", facecolor="#2c7fb8" if on_front else "none", edgecolor="#2c7fb8",
                   alpha=1.0 if c.get("fits") else 0.45, zorder=3)
        if same_point(c, choice.get("knob_value"), choice.get("mc_samples"), choice.get("format")) and \
                c.get("precision", choice.get("precision")) == choice.get("precision"):
            ax.scatter(x, y, s=320, facecolor="none", edgecolor="crimson", linewidth=2.2, zorder=4)
    if budget_mb is not None:
        ax.axvline(budget_mb, color="darkorange", linestyle="--", linewidth=1.3)
    xs = [x for _, x, _ in pts] + ([budget_mb] if budget_mb is not None else [])
    if xs and min(xs) > 0 and max(xs) / min(xs) > 10:
        _log_x(ax)
    ax.set_xlabel("model file size (MB)")
    ax.set_ylabel("validation accuracy")
    ax.set_title("Accuracy vs size (filled: Pareto-optimal)")
    ax.grid(True, alpha=0.3)


def plot_knob(candidates: list, knob: Any) -> bytes | None:
    """Validation accuracy and ECE against the knob, one line per M (and precision); None for a family
    without a knob (one network)."""
    if knob == "none":
        return None
    series: dict = {}
    for c in candidates:
        k, acc, ece = num(c.get("knob_value")), num(get(c, "val", "accuracy")), num(get(c, "val", "ece"))
        if k is not None and acc is not None and ece is not None:
            label = f"M = {c.get('mc_samples')}" + (f", {c['precision']}" if c.get("precision") not in (None, "fp32") else "")
            series.setdefault(label, []).append((k, acc, ece))
    if not series:
        return None
    fig = _new_fig(9.0, 3.4)
    a1, a2 = fig.subplots(1, 2)
    for i, (label, rows) in enumerate(sorted(series.items())):
        rows.sort()
        shape = MARKERS[i % len(MARKERS)]   # lines told apart by shape too, not by hue alone
        a1.plot([r[0] for r in rows], [r[1] for r in rows], marker=shape, label=label)
        a2.plot([r[0] for r in rows], [r[2] for r in rows], marker=shape, label=label)
    for ax, what in ((a1, "validation accuracy"), (a2, "validation ECE")):
        ax.set_xlabel(knob_label(knob))
        ax.set_ylabel(what)
        ax.set_title(f"{what[:1].upper()}{what[1:]} vs {knob_label(knob)}")
        ax.grid(True, alpha=0.3)
    handles, labels = a1.get_legend_handles_labels()   # below both panels, over no line
    fig.legend(handles, labels, loc="outside lower center", ncols=min(6, len(labels)), fontsize=8, frameon=False)
    return _png(fig)


def plot_latency_prediction(candidates: list, lp: dict) -> bytes | None:
    """Predicted against measured latency: every candidate measured at selection, and the chosen point's
    deployment benchmark at p50 / p90 / p99 (all over every timed run); the diagonal is a perfect latency
    model, the band +-25 %."""
    pts = [(num(get(c, "cost", "measured_latency_ms")), num(get(c, "cost", "predicted_latency_ms")))
           for c in candidates]
    pts = [(m, p) for m, p in pts if m is not None and p is not None]
    chosen = {k: (num(v.get("measured_ms")), num(v.get("predicted_ms")))
              for k, v in dict_or_empty(lp.get("by_percentile")).items() if isinstance(v, dict)}
    chosen = {k: v for k, v in chosen.items() if None not in v}
    if not chosen and None not in (num(lp.get("measured_ms")), num(lp.get("predicted_ms"))):
        chosen = {f"p{fmt(lp.get('percentile'))}": (num(lp["measured_ms"]), num(lp["predicted_ms"]))}
    if not pts and not chosen:
        return None
    values = [v for pt in pts + list(chosen.values()) for v in pt]
    unit, k = time_axis(values)
    fig = _new_fig(4.8, 4.2)
    ax = fig.add_subplot()
    if pts:
        ax.scatter([k * m for m, _ in pts], [k * p for _, p in pts], s=28, color="#74a9cf", edgecolor="black",
                   linewidth=0.4, label=f"candidates at selection (p{fmt(lp.get('percentile'))})", zorder=3)
    for (name, (m, pr)), marker in zip(sorted(chosen.items()), ("o", "*", "D", "s")):
        ax.scatter(k * m, k * pr, s=110, marker=marker, color="crimson", zorder=4,
                   label=f"chosen, deployed, {name} (error {100 * (pr - m) / m:+.1f} %)")
    lo, hi = k * min(values) * 0.8, k * max(values) * 1.2
    ax.plot([lo, hi], [lo, hi], color="grey", linestyle="--", linewidth=1)
    ax.fill_between([lo, hi], [0.75 * lo, 0.75 * hi], [1.25 * lo, 1.25 * hi], color="grey", alpha=0.12,
                    label="±25 %")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel(f"measured latency, all timed runs ({unit})")
    ax.set_ylabel(f"predicted latency ({unit})")
    ax.set_title("Latency model: predicted vs measured", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    return _png(fig)


def plot_sparsity(layers: Any) -> bytes | None:
    rows = [l for l in (layers or []) if isinstance(l, dict)
            and num(l.get("kept")) is not None and num(l.get("total")) is not None]
    if not rows:
        return None
    fig = _new_fig(7.0, 0.9 + 0.55 * max(3, len(rows)))
    ax = fig.add_subplot()
    names = [str(l.get("name", f"layer {i + 1}")) for i, l in enumerate(rows)]
    y = list(range(len(rows)))[::-1]  # first layer on top
    totals = [num(l["total"]) for l in rows]
    kept = [num(l["kept"]) for l in rows]
    ax.barh(y, totals, color="#d9d9d9", label="total nodes")
    ax.barh(y, kept, color="#2c7fb8", height=0.55, label="kept nodes")
    for yi, k, t in zip(y, kept, totals):
        ax.text(t, yi, f"  {k:g}/{t:g}", va="center", fontsize=9)
    ax.set_yticks(y, names)
    ax.set_xlim(0, max(totals) * 1.18)
    ax.set_xlabel("nodes (units)")
    ax.set_title("Kept nodes per layer after pruning")
    ax.legend(loc="lower right", fontsize=8)
    return _png(fig)


def hist_window(xs: list[float]) -> tuple[float, float, float]:
    """(low, high, padding) of the histogram's x-axis for sorted samples: from the fastest run to the
    99.9th percentile, or 1.5 x the 99th where the last 0.9 % stretch further, so that a few runs 10-100x
    slower (a 2-core machine's other work) do not squeeze the rest into one bar; the legend names them."""
    p99, p999 = (xs[min(len(xs) - 1, int(q * len(xs)))] for q in (0.99, 0.999))
    lo, hi = xs[0], min(p999, 1.5 * p99)
    return lo, hi, 0.05 * (hi - lo) if hi > lo else 0.05 * hi


def plot_latency_hist(samples: Any, lat: dict, budget_ms: float | None, histogram: Any = None,
                      runs: Any = None, batch_size: Any = None) -> bytes | None:
    """Histogram of the timed runs: every run when the runner counted them (`histogram`: geometric bins from
    the fastest to the slowest, drawn on a log axis, so the total and the maximum are the table's), else the
    runner's sample of them, titled as such. The axis ends at the 99.9th percentile (or 1.5 x p99 where the
    last 0.9 % stretch further: a few runs 10-100x slower would squeeze the rest into one bar); the runs
    beyond, the maximum and a budget off the axis are named in the legend, not drawn."""
    edges, counts = _histogram(histogram)
    xs = sorted(v for v in (num(s) for s in (samples or [])) if v is not None)
    if counts is None and not xs:
        return None
    if counts is not None:
        total = sum(counts)
        cum, p999 = 0, edges[-1]
        for c, right in zip(counts, edges[1:]):
            cum += c
            if cum >= 0.999 * total:
                p999 = right
                break
        p99 = num(lat.get("p99"))
        lo, hi = edges[0], min(p999, 1.5 * p99) if p99 else p999
        keep = [i for i in range(len(counts)) if edges[i + 1] <= hi * (1 + 1e-9)] or [0]
        shown_edges, shown = edges[: keep[-1] + 2], counts[: keep[-1] + 1]
        hi, pad = shown_edges[-1], 0.0
        beyond = total - sum(shown)
        title = f"Latency on the device: all {total:,} timed runs"
    else:
        lo, hi, pad = hist_window(xs)
        shown = [v for v in xs if v <= hi]
        beyond = len(xs) - len(shown)
        title = (f"Latency on the device: {len(xs):,} of {num(runs):,.0f} timed runs (every k-th)" if num(runs)
                 else "Latency on the device (a sample of the timed runs)")
    unit, k = time_axis([hi])
    fig = _new_fig(5.6, 4.4)
    ax = fig.add_subplot()
    if counts is not None:
        ax.stairs(shown, [k * e for e in shown_edges], fill=True, color="#74a9cf")
        _log_x(ax)
        ax.set_xlim(k * lo / 1.03, k * hi * 1.03)
    else:
        ax.hist([k * v for v in shown], bins=min(60, max(10, len(shown) // 20)), range=(k * lo, k * hi),
                color="#74a9cf", edgecolor="white", linewidth=0.3)
        ax.set_xlim(k * (lo - pad), k * (hi + pad))
    top = hi * 1.03 + pad
    for key, style in (("p50", ":"), ("p90", "--"), ("p99", "-.")):
        v = num(lat.get(key))
        if v is not None and v <= top:
            ax.axvline(k * v, color="black", linestyle=style, linewidth=1, label=f"{key} {fmt_ms(v)}")
    from matplotlib.lines import Line2D

    extra = []
    slowest = num(lat.get("max")) if num(lat.get("max")) is not None else (xs[-1] if xs else None)
    if beyond:
        extra.append(Line2D([], [], linestyle="", label=f"{beyond:,} slower runs not drawn (max {fmt_ms(slowest)})"))
    if budget_ms is not None and budget_ms <= top:
        ax.axvline(k * budget_ms, color="crimson", linestyle="--", linewidth=1.3, label=f"budget {fmt_ms(budget_ms)}")
    elif budget_ms is not None:
        extra.append(Line2D([], [], color="crimson", linestyle="--", label=f"budget {fmt_ms(budget_ms)} (off the axis)"))
    ax.set_title(title, fontsize=10)
    batch = f", batch size {batch_size}" if batch_size is not None else ""
    ax.set_xlabel(f"latency of one inference{batch} ({unit})" + (", log scale" if counts is not None else ""))
    ax.set_ylabel("runs")
    handles, _ = ax.get_legend_handles_labels()
    # below the plot, never over its bars
    fig.legend(handles=handles + extra, fontsize=7, loc="outside lower center", ncols=2, frameon=False)
    return _png(fig)


def _histogram(histogram: Any) -> tuple[list | None, list | None]:
    """(edges, counts) of the runner's run histogram, or (None, None) when absent or malformed."""
    edges, counts = get(histogram, "edges_ms"), get(histogram, "counts")
    if not isinstance(edges, list) or not isinstance(counts, list) or len(edges) != len(counts) + 1 or not counts:
        return None, None
    edges, counts = [num(e) for e in edges], [num(c) for c in counts]
    if None in edges or None in counts or edges[0] <= 0:
        return None, None
    return edges, [int(c) for c in counts]


def plot_selective(selective: Any) -> bytes | None:
    """Accuracy against the fraction of inputs rejected, the most uncertain (highest predictive entropy)
    first: what a Bayesian net's uncertainty buys when it may say "not sure"."""
    if not isinstance(selective, dict):
        return None
    pts = [(num(r), num(a)) for r, a in zip(selective.get("rejected") or [], selective.get("accuracy") or [])]
    pts = [(r, a) for r, a in pts if r is not None and a is not None]
    if len(pts) < 2:
        return None
    fig = _new_fig(4.8, 3.6)
    ax = fig.add_subplot()
    ax.plot([100 * r for r, _ in pts], [a for _, a in pts], marker="o", markersize=3, color="#2c7fb8",
            label="by predictive entropy")
    ax.axhline(pts[0][1], color="grey", linestyle=":", linewidth=1, label=f"no rejection ({fmt(pts[0][1])})")
    ax.set_xlabel("inputs rejected, most uncertain first (%)")
    ax.set_ylabel("accuracy on the rest")
    ax.set_title("Selective prediction: accuracy vs rejection", fontsize=10)
    ax.grid(True, alpha=0.3)
    fig.legend(fontsize=8, loc="outside lower center", ncol=2)   # below the axes: inside, it sat on the baseline
    return _png(fig)


def plot_reliability(rel: Any, ece: Any) -> bytes | None:
    acc = rel.get("bin_accuracy") if isinstance(rel, dict) else None
    if not isinstance(acc, list) or not acc:
        return None
    conf = rel.get("bin_confidence") or [None] * len(acc)
    count = rel.get("bin_count") or [None] * len(acc)
    nb = len(acc)
    width = 1.0 / nb
    centers = [(i + 0.5) * width for i in range(nb)]
    fig = _new_fig(4.7, 4.7)
    gs = fig.add_gridspec(2, 1, height_ratios=[4, 1])
    ax = fig.add_subplot(gs[0])
    axc = fig.add_subplot(gs[1], sharex=ax)
    # Empty bins (count 0 or no value) are left blank rather than drawn as zero accuracy.
    bx, bh, cx, cy = [], [], [], []
    for c, a, v, n in zip(centers, acc, conf, count):
        if n == 0:
            continue
        if num(a) is not None:
            bx.append(c)
            bh.append(num(a))
        if num(v) is not None:
            cx.append(c)
            cy.append(num(v))
    ax.bar(bx, bh, width=width * 0.95, color="#2c7fb8", edgecolor="white", label="accuracy in bin")
    ax.scatter(cx, cy, color="black", s=14, zorder=3, label="mean confidence in bin")
    ax.plot([0, 1], [0, 1], linestyle="--", color="grey", label="perfect calibration")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy")
    ax.set_title("Reliability diagram" + (f" (ECE = {fmt(num(ece))})" if num(ece) is not None else ""))
    ax.legend(loc="upper left", fontsize=8)
    ax.tick_params(labelbottom=False)
    axc.bar(centers, [num(n) or 0 for n in count], width=width * 0.95, color="#bdbdbd")
    axc.set_xlabel("confidence (max predicted probability)")
    axc.set_ylabel("examples")
    return _png(fig)


LEGEND_LAYERS = 8   # more layers than this: one line per layer stays, in grey and unnamed, beside their total


def plot_history(history: Any, layer_names: list[str]) -> bytes | None:
    """Validation accuracy (left) and kept nodes per hidden layer (right) over the epochs. A network of many
    layers (a torchvision CNN has dozens) gets its layers as thin grey lines and their total as the named
    one: a legend of every layer would not fit beside the axes."""
    hist = [h for h in (history or []) if isinstance(h, dict)]
    ep = [(num(h.get("epoch")) if num(h.get("epoch")) is not None else i + 1) for i, h in enumerate(hist)]
    acc = [(e, num(h.get("val_accuracy"))) for e, h in zip(ep, hist) if num(h.get("val_accuracy")) is not None]
    kept = [(e, h["kept_nodes"]) for e, h in zip(ep, hist) if isinstance(h.get("kept_nodes"), list)]
    if not acc and not kept:
        return None
    fig = _new_fig(9.0, 3.4)
    a1, a2 = fig.subplots(1, 2)
    if acc:
        a1.plot(*zip(*acc), color="#2c7fb8")
    a1.set_title("Validation accuracy during training")
    a1.set_xlabel("epoch")
    a1.set_ylabel("val accuracy")
    a1.grid(True, alpha=0.3)
    width = max((len(k) for _, k in kept), default=0)
    many = width > LEGEND_LAYERS
    for j in range(width):
        pts = [(e, num(k[j])) for e, k in kept if j < len(k) and num(k[j]) is not None]
        if pts and many:
            a2.plot(*zip(*pts), color="#bdbdbd", linewidth=0.8)
        elif pts:
            a2.plot(*zip(*pts), label=layer_names[j] if j < len(layer_names) else f"layer {j + 1}")
    if many:
        total = [(e, sum(num(v) or 0 for v in k)) for e, k in kept]
        a2.plot(*zip(*total), color="#2c7fb8", linewidth=2, label=f"all {width} layers together")
        a2.set_yscale("log")   # the total and the single layers on one axis
    a2.set_title("Kept nodes per hidden layer" + (" (grey: each layer)" if many else ""))
    a2.set_xlabel("epoch")
    a2.set_ylabel("kept nodes")
    a2.grid(True, alpha=0.3)
    if width:
        a2.legend(fontsize=8)
    return _png(fig)



def _log_x(ax):
    """A log x axis labelled in plain numbers at 1, 2, 5 x 10^n and nowhere else: matplotlib's labelled minor
    ticks ran into each other ("3x10^14x10^1"), and a range within one decade showed a single label."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def plot_devices(rows: list[dict]) -> bytes | None:
    pts = [(r["device"], num(r["latency_ms"]), num(r["accuracy"]), r["mode"]) for r in rows]
    pts = [p for p in pts if p[1] is not None and p[2] is not None]
    if not pts:
        return None
    unit, k = time_axis([x for _, x, _, _ in pts])
    fig = _new_fig(6.0, 3.8)
    ax = fig.add_subplot()
    for name, x, y, mode in pts:
        ax.scatter(k * x, y, s=70, marker="o" if mode == "measured" else "^",
                   color="#2c7fb8" if mode == "measured" else "#9e9ac8", edgecolor="black", linewidth=0.5, zorder=3)
    xs = [k * x for _, x, _, _ in pts]
    if min(xs) > 0 and max(xs) / min(xs) > 10:
        _log_x(ax)
    mid = (min(xs) + max(xs)) / 2 if ax.get_xscale() == "linear" else (min(xs) * max(xs)) ** 0.5
    for name, x, y, _ in pts:   # a label towards the middle, so that none leaves the axes
        right = k * x > mid
        ax.annotate(name, (k * x, y), xytext=(-7 if right else 7, 5), textcoords="offset points", fontsize=8,
                    ha="right" if right else "left")
    ax.set_xlabel(f"latency at each device's budget percentile ({unit})")
    ax.set_ylabel("accuracy")
    ax.set_title("Chosen point per device (circle: measured, triangle: predicted)", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.margins(x=0.12, y=0.2)   # the axes from the data, with room for the labels
    bottom, top = ax.get_ylim()
    if top > 1:                 # an accuracy axis ends at 1 (the margin pushed it to 1.02 at equal accuracies)
        ax.set_ylim(bottom - (top - 1), 1.0)
    return _png(fig)



def report_figures(d: dict, s: dict) -> dict[str, bytes | None]:
    """Every figure of a run's report page, by its file name, from the inputs d and their summary s."""
    results, train = dict_or_empty(d.get("results")), dict_or_empty(d.get("train"))
    layers = get(train, "sparsity", "layers") or []
    candidates = [c for c in d.get("candidates") or [] if isinstance(c, dict)]
    hidden_names = [str(l.get("name")) for l in layers if isinstance(l, dict) and l.get("name") != "output"]
    return {
        "tradeoff.png": plot_tradeoff(candidates, d.get("choice") or {}, s["latency_budget_ms"],
                                      s["budgets"]["model_mb"]["limit"], s["latency_percentile"],
                                      get(d, "device", "budgets", "batch_size")),
        "knob.png": plot_knob(candidates, s["knob"]),
        "latency_prediction.png": plot_latency_prediction(candidates, s["latency_prediction"]),
        "sparsity.png": plot_sparsity(layers),
        "latency_hist.png": plot_latency_hist(results.get("latency_samples_ms"),
                                              results.get("latency_ms") or {}, s["latency_budget_ms"],
                                              results.get("latency_histogram"), results.get("runs"),
                                              results.get("batch_size")),
        "reliability.png": plot_reliability(d.get("reliability") or get(d, "predicted", "here", "reliability"),
                                            s["metrics"]["ece"]["device"]),
        "selective.png": plot_selective(s.get("selective")),
        "training.png": plot_history(train.get("history"), hidden_names),
    }
