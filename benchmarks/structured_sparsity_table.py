"""One table (and a plot) of paper 000's comparison from runs measured apart: the JSON results of
benchmarks/structured_sparsity.py and the logs of its --train-only runs (as the grid script writes them), so
that seeds trained on different machines or days land in one place, each row citing where its figures come from.

    python benchmarks/structured_sparsity_table.py OUT SOURCE [SOURCE ...] [--title TEXT] [--notes MARKDOWN]

A SOURCE is either a results .json (every row in it) or a train log named `<setting>-<family>-s<seed>.log`
(its train stage's own test evaluation: the same `evaluate` call, split, seed and 10 MC samples as the
benchmark's, printed to 3 decimals, so compression and FLOPs are to 0.1 point). A run found in both keeps the
JSON's figures. The setting of a JSON row is its `--set` list; of a log, the name before the family, where
`base` (shown as "config file") is the config as given and several settings are joined by commas
(`train.a=1,train.b=2`, a file name without spaces). Rows are grouped by (family, setting), mean and sample standard deviation
over seeds, beside issue 20's targets, the paper's 1,200-epoch figures and the validation accuracy at the last
epoch (the trainer's record, from the JSON or else the run's log), by which settings are chosen. The median model of a run is empty
at the end of an epoch when a layer's kept units are 0; the table lists such epochs after the first 3.

Writes OUT.md, OUT.json and OUT.png (accuracy against pruned FLOPs, one point per run), each atomically.
"""

import argparse
import io
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "reproduce"))
from paper000_table1 import ROWS as PAPER_ROWS  # noqa: E402
from structured_sparsity import FAMILIES, PAPER_LABEL, _mean_spread, empty_epochs  # noqa: E402

from edgebayes.ondevice.atomic import atomic_path  # noqa: E402
from edgebayes.errors import CorruptFileError  # noqa: E402
from edgebayes.provenance import provenance, read_json, result_path, write_json  # noqa: E402

# Issue 20's done-when: median-model accuracy at least (%) with pruned FLOPs at most (%), at <= 20 epochs
TARGET = {"ss-ig": (98.6, 15.0), "ss-gl": (98.8, 15.0), "ss-ghs": (98.9, 12.5)}
PAPER = {label: (acc[0], flops[0]) for label, _, acc, _, flops in PAPER_ROWS}   # SS-IG: (98.68, 15.05), ...
AS_COMMITTED = "config file"
ROW_FIELDS = ("family", "seed", "accuracy", "flops_ratio", "compression")   # what is read of a results row
LOG_NAME = re.compile(rf"^(?P<setting>.+)-(?P<family>{'|'.join(map(re.escape, FAMILIES))})-s(?P<seed>\d+)\.log$")
EPOCH_LINE = re.compile(r"epoch (\d+)/\d+: .*val_acc=([\d.]+), kept_nodes=\[([\d, ]*)\]")
TEST_LINE = re.compile(r"test accuracy ([\d.]+), NLL [\d.naif]+, ECE [\d.naif]+; kept nodes \[[\d, ]*\]; "
                       r"compression ([\d.]+), FLOPs ratio ([\d.]+)")


class SourceError(ValueError):
    pass


def rows_of_json(path):
    try:
        d = read_json(path)
    except CorruptFileError as e:
        raise SourceError(str(e)) from None
    if not isinstance(d, dict) or not isinstance(d.get("rows"), list):
        raise SourceError(f"{path}: no 'rows' list (not a structured_sparsity.py result)")
    for i, r in enumerate(d["rows"]):
        needed = ROW_FIELDS[:2] if "median_model_empty" in r else ROW_FIELDS   # an empty model has no figures
        missing = [k for k in needed if k not in r]
        if missing:
            raise SourceError(f"{path}: rows[{i}] lacks {', '.join(missing)} (not a structured_sparsity.py result)")
    setting = ", ".join(d.get("settings") or []) or AS_COMMITTED
    return [{"family": r["family"], "seed": r["seed"], "setting": setting, "accuracy": r["accuracy"],
             "flops_ratio": r["flops_ratio"], "compression": r["compression"],
             "kept_per_epoch": r.get("kept_per_epoch") or [], "latency_ratio": r.get("latency_ratio"),
             "val_accuracy": (r.get("val_accuracy_per_epoch") or [None])[-1],
             "source": path.name} for r in d["rows"] if "median_model_empty" not in r]


def row_of_log(path):
    m = LOG_NAME.match(path.name)
    if not m:
        raise SourceError(f"{path}: a log's name must be <setting>-<family>-s<seed>.log, families {FAMILIES}")
    text = path.read_text(errors="replace")
    test = TEST_LINE.findall(text)
    kept, val = {}, {}
    for epoch, acc, units in EPOCH_LINE.findall(text):   # a resumed run logs its epochs again: the last counts
        kept[int(epoch)] = [int(u) for u in units.split(",") if u.strip()]
        val[int(epoch)] = float(acc)
    # the same label as a JSON row of the same --set list
    setting = ", ".join(m["setting"].split(",")) if m["setting"] != "base" else AS_COMMITTED
    if not test:   # stopped before the end of training: listed, not counted
        return {"family": m["family"], "seed": int(m["seed"]), "setting": setting, "unfinished": len(kept),
                "source": path.name}
    acc, compression, flops = map(float, test[-1])
    return {"family": m["family"], "seed": int(m["seed"]), "setting": setting, "accuracy": acc,
            "flops_ratio": flops, "compression": compression,
            "kept_per_epoch": [kept[e] for e in sorted(kept)], "latency_ratio": None, "source": path.name,
            "val_accuracy": val[max(val)] if val else None}


def collect(paths):
    """Rows keyed by (family, setting, seed): JSON rows first, then logs of runs no JSON has; and the logs of
    runs that stopped before the end of training."""
    rows, unfinished = {}, []
    for p in sorted(paths, key=lambda p: p.suffix != ".json"):
        if not p.is_file():
            raise SourceError(f"{p}: no such file")
        for r in rows_of_json(p) if p.suffix == ".json" else [row_of_log(p)]:
            if "unfinished" in r:
                unfinished.append(r)
                continue
            kept = rows.setdefault((r["family"], r["setting"], r["seed"]), r)
            if kept["val_accuracy"] is None:   # results written before they kept it: from the run's log
                kept["val_accuracy"] = r["val_accuracy"]
    return rows, [r for r in unfinished if (r["family"], r["setting"], r["seed"]) not in rows]


def late_empty_epochs(r):
    """Epochs after the first 3 at whose end a layer of the median model kept no unit."""
    history = [{"epoch": e, "kept_nodes": units} for e, units in enumerate(r["kept_per_epoch"], 1)]
    return [e for e in empty_epochs(history) if e > 3]


def _order(item):
    """Rows in the paper's order of families, the committed configs first, then by setting and seed."""
    (family, setting, seed), _ = item
    return FAMILIES.index(family), setting != AS_COMMITTED, setting, seed


def summarise(rows):
    """One entry per (family, setting): seeds, mean and sd of accuracy / FLOPs / compression (%), target met."""
    groups = {}
    for (family, setting, _), r in sorted(rows.items(), key=_order):
        groups.setdefault((family, setting), []).append(r)
    out = []
    for (family, setting), runs in groups.items():
        acc = [100 * r["accuracy"] for r in runs]
        flops = [100 * r["flops_ratio"] for r in runs]
        entry = {"family": family, "setting": setting, "seeds": [r["seed"] for r in runs],
                 "accuracy": _mean_spread(acc), "flops": _mean_spread(flops),
                 "compression": _mean_spread([100 * r["compression"] for r in runs]),
                 "val_accuracy": _mean_spread([100 * r["val_accuracy"] for r in runs])
                 if all(r["val_accuracy"] is not None for r in runs) else "-",
                 "late_empty": {r["seed"]: late for r in runs if (late := late_empty_epochs(r))}}
        if family in TARGET:
            ta, tf = TARGET[family]
            a_ok, f_ok = statistics.mean(acc) >= ta, statistics.mean(flops) <= tf
            entry["met"] = {(True, True): "yes", (True, False): "accuracy only", (False, True): "FLOPs only",
                            (False, False): "no"}[(a_ok, f_ok)]
        out.append(entry)
    return out


def markdown(title, summary, rows, unfinished, notes=""):
    lines = [f"# {title}", "", *([notes, ""] if notes else []),
             "| model | setting | seeds | accuracy, median model (%) | pruned FLOPs (%) | compression (%) | "
             "issue 20's target | paper (1,200 epochs) | met | empty median model after epoch 3 | "
             "validation accuracy, last epoch (%) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        label = PAPER_LABEL[s["family"]]
        target = ">= {} at <= {}".format(*TARGET[s["family"]]) if s["family"] in TARGET else ""
        paper = "{} / {}".format(*PAPER[label]) if label in PAPER else ""
        empty = "; ".join(f"seed {k}: epochs {v}" for k, v in s["late_empty"].items()) or "none"
        lines.append(f"| {label} | {s['setting']} | {', '.join(map(str, s['seeds']))} | {s['accuracy']} | "
                     f"{s['flops']} | {s['compression']} | {target} | {paper} | {s.get('met', '')} | {empty} | {s['val_accuracy']} |")
    lines += ["", "| model | setting | seed | accuracy, median model (%) | pruned FLOPs (%) | compression (%) | "
              "kept units at the end | validation accuracy, last epoch (%) | latency ratio | source |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for (family, setting, seed), r in sorted(rows.items(), key=_order):
        lat = "not measured" if r["latency_ratio"] is None else f"{r['latency_ratio']:.3f}"
        kept = r["kept_per_epoch"][-1] if r["kept_per_epoch"] else "-"
        val = "-" if r["val_accuracy"] is None else f"{100 * r['val_accuracy']:.1f}"
        lines.append(f"| {PAPER_LABEL[family]} | {setting} | {seed} | {100 * r['accuracy']:.2f} | "
                     f"{100 * r['flops_ratio']:.2f} | {100 * r['compression']:.2f} | {kept} | {val} | {lat} | {r['source']} |")
    if unfinished:
        lines += ["", "Stopped before the end of training (left out): " + "; ".join(
            f"{PAPER_LABEL[r['family']]} {r['setting']} seed {r['seed']} after {r['unfinished']} epochs ({r['source']})"
            for r in unfinished) + "."]
    return "\n".join(lines) + "\n"


def plot(rows, title):
    """PNG bytes: median-model accuracy against pruned FLOPs, one point per run (colour: family, marker:
    setting), the paper's means as stars and each family's target as the corner of its region."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.8), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    top = max(100 * r["accuracy"] for r in rows.values()) + 0.15   # the target regions' upper edge, drawn
    colours = dict(zip(FAMILIES, ("0.4", "0.65", "tab:blue", "tab:orange", "tab:green")))
    settings = sorted({r["setting"] for r in rows.values()}, key=lambda s: (s != AS_COMMITTED, s))
    markers = dict(zip(settings, "o^sDvP<>XhH"))
    for family in FAMILIES:
        runs = [r for r in rows.values() if r["family"] == family]
        for setting in settings:
            pts = [(100 * r["flops_ratio"], 100 * r["accuracy"]) for r in runs if r["setting"] == setting]
            if pts:
                ax.scatter(*zip(*pts), color=colours[family], marker=markers[setting], s=36,
                           label=f"{PAPER_LABEL[family]}, {setting}")
        if family in TARGET and runs:
            ta, tf = TARGET[family]
            ax.plot([0, tf, tf], [ta, ta, top], color=colours[family], ls="--", lw=1)
            pa, pf = PAPER[PAPER_LABEL[family]]
            ax.scatter([pf], [pa], color=colours[family], marker="*", s=140, edgecolor="k", lw=0.5)
    ax.set_xscale("log")
    ax.set_xlabel("pruned FLOPs (% of the dense network, log scale)")
    ax.set_ylabel("test accuracy, median model (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.set_ylim(top=top)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), title="one point per run; stars: the paper;\n"
              "dashed: issue 20's target,\nthe region up and left of it", title_fontsize=7)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="path without suffix: .md, .json and .png are written")
    ap.add_argument("sources", nargs="+", type=Path, help="structured_sparsity.py .json results or train logs")
    ap.add_argument("--title", default="Paper 000's comparison (structured_sparsity.py runs)")
    ap.add_argument("--notes", default="", help="markdown put under the title: how and where the runs were made")
    args = ap.parse_args(argv)
    try:
        rows, unfinished = collect(args.sources)
    except SourceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = summarise(rows)
    out = Path(args.out)
    md = markdown(args.title, summary, rows, unfinished, args.notes)
    write_json(result_path(out, ".json"), {"summary": summary, "rows": list(rows.values()), "unfinished": unfinished,
                                          "sources": [str(p) for p in args.sources], "provenance": provenance(None)})
    with atomic_path(result_path(out, ".md")) as tmp:
        tmp.write_text(md)
    with atomic_path(result_path(out, ".png")) as tmp:
        tmp.write_bytes(plot(rows, args.title))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
