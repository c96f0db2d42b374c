#!/usr/bin/env python3
"""Benchmark: how well a device's latency model predicts the deployed operating point's latency.

For each device: profile it afresh (`edgebayes devices profile`), then run select -> export -> deploy ->
report with --force (training is reused if up to date), and read from the report the chosen point's
predicted latency (the table fit) against the latency the deployment measured, at p90 and p99. Both are
over all timed runs (the rounds pooled, ondevice/timing.py latency_summary): the figure a budget is judged on, which
the table is fitted to. Target (issue 22): the median absolute error over the cycles <= 15 %, per device
and percentile, for `local` and `ssh-localhost` (its throwaway sshd is started and stopped by edgebayes).

    flock /tmp/edgebayes-bench.lock .venv/bin/python benchmarks/latency_prediction.py local ssh-localhost \
        --repeats 3 --out benchmarks/results/latency_prediction.json

--repeats runs the whole profile -> deploy -> report cycle that many times per device (the machine's own
noise is the point). Writes --out (default runs/benchmarks/latency_prediction.json) with machine, commit
and versions in `provenance`, and a Markdown table beside it.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

from edgebayes.cli import EXIT_BUDGET
from edgebayes.cli import main as edgebayes
from edgebayes.config import load_device_profile, load_pipeline_config
from edgebayes.ondevice.cli import positive_int
from edgebayes.provenance import provenance, write_json

TARGET = 0.15
PERCENTILES = ("p90", "p99")


def run(device, config, runs_dir):
    def call(*args):
        code = edgebayes([*args])
        if code not in (0, EXIT_BUDGET):   # a failed budget is a verdict, and still a measurement
            raise SystemExit(f"benchmark: `edgebayes {' '.join(args)}` exited {code}")

    call("devices", "profile", device, "--config", config, "--runs-dir", runs_dir)
    call("train", "--config", config, "--device", device, "--runs-dir", runs_dir)
    for stage in ("select", "export", "deploy", "report"):
        call(stage, "--config", config, "--device", device, "--runs-dir", runs_dir, "--force")
    name, profile = load_pipeline_config(config).name, load_device_profile(device).name
    report = json.loads((Path(runs_dir) / name / "report" / profile / "report.json").read_text())
    s = report["summary"]
    lp = s["latency_prediction"]
    return {"device": device, "chosen": {k: s[k] for k in ("knob", "knob_value", "mc_samples", "precision")},
            "predicted_by": lp["predicted_by"], "measurement_spread": lp["measurement_spread"],
            "runs": report["results"]["runs"],
            "best_round_ms": {p: s["latency_ms_best_round"][p] for p in PERCENTILES},
            **{p: lp["by_percentile"][p] for p in PERCENTILES}}


def summarize(rows, devices):
    out = {}
    for device in devices:
        for p in PERCENTILES:
            errors = [r[p]["error"] for r in rows if r["device"] == device]
            median = statistics.median(abs(e) for e in errors)
            out[f"{device}/{p}"] = {"errors": errors, "median_abs_error": median, "within_target": median <= TARGET}
    return out


def markdown(summary, rows):
    lines = ["# Latency model vs deployment, chosen point, all timed runs", "",
             f"Does each device's latency model predict the latency of the chosen point as deployed and measured "
             f"there? Target: median |error| <= {100 * TARGET:.0f} % over the cycles (issue 22).", "",
             f"`flock /tmp/edgebayes-bench.lock .venv/bin/python {' '.join(sys.argv)}`", "",
             "| device | percentile | errors per cycle | median abs error | within |", "|---|---|---|---|---|"]
    for key, v in summary.items():
        device, p = key.split("/")
        lines.append(f"| {device} | {p} | {', '.join(f'{100 * e:+.1f} %' for e in v['errors'])} | "
                     f"{100 * v['median_abs_error']:.1f} % | {'yes' if v['within_target'] else 'no'} |")
    lines += ["", "| cycle | device | chosen M | p90 predicted / measured | p99 predicted / measured | runs |",
              "|---|---|---|---|---|---|"]
    for i, r in enumerate(rows):
        lines.append(f"| {i + 1} | {r['device']} | {r['chosen']['mc_samples']} | "
                     + " | ".join(f"{1000 * r[p]['predicted_ms']:.2f} / {1000 * r[p]['measured_ms']:.2f} us"
                                  for p in PERCENTILES) + f" | {r['runs']} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("devices", nargs="+")
    parser.add_argument("--config", default="pipeline.yaml")
    parser.add_argument("--runs-dir", default="runs")
    parser.add_argument("--repeats", type=positive_int, default=1, help="profile -> deploy -> report cycles per device")
    parser.add_argument("--out", default=None, help="results JSON (default <runs-dir>/benchmarks/latency_prediction.json)")
    args = parser.parse_args(argv)
    rows = [run(d, args.config, args.runs_dir) for _ in range(args.repeats) for d in args.devices]
    summary = summarize(rows, args.devices)
    out = Path(args.out or Path(args.runs_dir) / "benchmarks" / "latency_prediction.json")
    write_json(out, {"target_median_abs_error": TARGET, "statistic": "all timed runs (rounds pooled)",
                     "config": args.config, "summary": summary, "results": rows, "provenance": provenance(None)})
    out.with_suffix(".md").write_text(markdown(summary, rows))
    for key, v in summary.items():
        print(f"{key}: errors {', '.join(f'{100 * e:+.1f} %' for e in v['errors'])}; median |error| "
              f"{100 * v['median_abs_error']:.1f} % ({'within' if v['within_target'] else 'OUTSIDE'} the "
              f"{100 * TARGET:.0f} % target)")
    print(f"written to {out} and {out.with_suffix('.md')}")
    return 0 if all(v["within_target"] for v in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
