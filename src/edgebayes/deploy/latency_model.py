"""Latency of an operating point on a device: measured there, or predicted by a model of the device.

Three sources, in the order selection prefers them (device profile key `latency_model`):

1. measure: the candidates' model files are copied to the device and timed there by the runner
   (`runner.pyz --time-models`, the same protocol as a deployment's benchmark). Needs the device reachable.
   Every figure here, measured or in a table, is the runner's `latency_ms`: the percentile over all timed
   samples of the interleaved rounds, the figure a deployment's budget is judged on, so the model is
   fitted to and judged on the same statistic (ondevice/timing.py, latency_summary).
2. table: `edgebayes devices profile DEVICE` times a sweep of MC-averaged MLPs on the device (the run's
   input size, hidden widths at 1/8 .. 1 of the configured ones, each M of select.mc_samples, each
   precision the runtime takes) and stores them in a table. Latency at each percentile is then fitted by
   non-negative least squares on relative error,

       latency ~ c0 + c1 * operators + c2 * MFLOPs + c3 * parameter MB,

   operators = the operators one inference dispatches, counted in the exported file (`operator_count`;
   per-operator cost dominates small models, and it is what separates M = 1's plain graph from the
   packed one's reshapes, or the unrolled layout's M branches, at equal FLOPs), MFLOPs = paper FLOPs
   (appendix A.1, multiplies) x batch size, parameter MB = kept weights x bytes per value. Tables live in
   runs/devices/<device>/latency_table.json (this machine's measurements; not in git) or, for boards
   measured elsewhere, devices/profiles/<device>.json (shipped); `latency_model.table` names another file.
3. flops: an estimate from the board's spec sheet (SpecSheetPredictor), for a board never profiled:

       latency ~ overhead_ms + max(FLOPs x batch / flops_per_second, weight bytes / memory bandwidth),

   a roofline of the data sheet's figures (the sustained throughput the profile declares from the peak,
   the published memory bandwidth, each profile's `latency_model.source` names where they come from),
   judged with a wide declared band (`latency_model.estimate_band`, x0.5 to x3 by default): nothing on
   the board was measured. For small models the overhead is nearly all of it, so the candidates barely
   differ; the report says so.

Every prediction carries its basis and an error band: a table's is its fit's largest relative error at
that percentile (in-sample), the spec sheet's the declared band. A table that does not cover a candidate
(another architecture or input size than the table's sweep, operators, FLOPs or weights outside its rows'
range, or a fit error over MAX_FIT_ERROR) says why (`TablePredictor.covers`); selection then measures that
candidate on the device when it can, and otherwise marks the prediction as not covered.

A kind `measure` device that cannot be reached falls back to the table, then to the spec sheet.
"""

import json
import math
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from edgebayes.config import devices_dirs
from edgebayes.deploy.transport import TransportError, runner_failure
from edgebayes.errors import StageError
from edgebayes.export.formats import formats_for, operator_count
from edgebayes.ondevice.bundle import RUNNER_FILE
from edgebayes.ondevice.cli import command_line
from edgebayes.ondevice.pack import write_runner
from edgebayes.provenance import exclusive, provenance, read_json, write_json
from edgebayes.train.layers import LayerFactory
from edgebayes.train.zoo.mlp import mlp

BYTES_PER_VALUE = {"fp32": 4, "fp16": 2, "int8": 1}
PERCENTILES = ("p50", "p90", "p99")
# Input sizes of the data sets (flattened) for the profiling sweep; every set has 10 classes.
IN_FEATURES = {"digits": 64, "mnist": 784, "fashion-mnist": 784, "cifar10": 3072}
WIDTH_FRACTIONS = (0.125, 0.25, 0.5, 0.75, 1.0)
# A table whose fit misses one of its own rows by more than this does not cover any candidate (issue 35).
MAX_FIT_ERROR = 0.25
# How far outside its rows' range (operators, MFLOPs, weight MB) a table is still read: 25 % either way.
RANGE_MARGIN = 1.25


class LatencyModelError(StageError):
    pass


def features(operators, flops, param_count, precision, batch_size):
    """The regressors of the table model for one operating point (see the module docstring)."""
    return [1.0, float(operators), flops * batch_size / 1e6, param_count * BYTES_PER_VALUE[precision] / 1e6]


def table_path(profile, runs_dir):
    """Where this device's table is read: latency_model.table, else the run folder's, else a shipped one
    (profiles/<name>.json beside the device profiles, a user's folder first: config.devices_dirs)."""
    if profile.latency_model.table:
        return Path(profile.latency_model.table)
    measured = Path(runs_dir) / "devices" / profile.name / "latency_table.json"
    shipped = [d / "profiles" / f"{profile.name}.json" for d in devices_dirs()]
    return measured if measured.is_file() else next((p for p in shipped if p.is_file()), shipped[-1])


class TablePredictor:
    """Per precision and percentile, the NNLS fit of a device's latency table."""

    def __init__(self, table, path):
        from scipy.optimize import nnls

        self.path, self.batch_size, self.rows = Path(path), table["batch_size"], table["rows"]
        self.memory = table.get("memory")   # the runtime's memory on the device (runner.time_models)
        # what the rows were timed with: a table of another runtime or thread count predicts nothing here
        self.runtime_name = (table.get("runtime") or {}).get("name")
        self.threads = (table.get("protocol") or {}).get("threads")
        self.coefs, self.fit_error, self.outliers = {}, {}, {}
        for precision in sorted({r["precision"] for r in table["rows"]}):
            rows = [r for r in table["rows"] if r["precision"] == precision]
            x = np.array([features(r["operators"], r["flops"], r["params"], precision, self.batch_size) for r in rows])
            for p in PERCENTILES:
                y = np.array([r["latency_ms"][p] for r in rows])
                # Divide each row by its latency: least squares on relative error, so the small models that
                # selection cares about weigh as much as the large ones.
                a = x / y[:, None]
                coef, _ = nnls(a, np.ones(len(y)))
                # One round of outlier rejection: a row's tail percentile is one measurement of a few
                # seconds, and a slow spell of the device during it (measured: a p99 of 9.75 us among rows
                # at 6.6) would move the four coefficients for every model. Rows off by more than three
                # times the median residual (and 5 %) are left out of the refit, and named.
                residual = np.abs(x @ coef / y - 1)
                keep = residual <= max(0.05, 3 * float(np.median(residual)))
                if not keep.all() and keep.sum() > x.shape[1]:
                    coef, _ = nnls(a[keep], np.ones(int(keep.sum())))
                else:
                    keep[:] = True
                self.coefs[precision, p] = coef
                self.fit_error[precision, p] = float(np.max(np.abs(x[keep] @ coef / y[keep] - 1)))
                self.outliers[precision, p] = [r.get("id") for r, k in zip(rows, keep) if not k]

    @classmethod
    def load(cls, path):
        try:
            return cls(read_json(path), path)
        except (OSError, ValueError, KeyError) as e:
            raise LatencyModelError(f"{path}: not a readable latency table ({e}); re-run "
                                    "`edgebayes devices profile`") from None

    def predict(self, operators, flops, params, precision, percentile, batch_size):
        key = (precision, f"p{percentile}")
        if key not in self.coefs:
            raise LatencyModelError(f"{self.path} has no {precision} measurements; re-run `edgebayes devices "
                                    "profile` with that precision in runtime.precision")
        if batch_size != self.batch_size:
            raise LatencyModelError(f"{self.path} was measured at batch size {self.batch_size}, the budget is "
                                    f"for batch size {batch_size}; re-run `edgebayes devices profile`")
        return float(np.dot(features(operators, flops, params, precision, batch_size), self.coefs[key]))

    def describe(self):
        return f"predicted (table fit, {self.path.name})"

    def band(self, predicted, precision, percentile):
        """[low, high] ms: the fit's largest relative error on its own rows at this percentile, either way."""
        e = self.fit_error.get((precision, f"p{percentile}"), 0.0)
        return [predicted * (1 - e), predicted * (1 + e)]

    def covers(self, operators, flops, params, precision, percentile, in_features, arch):
        """None when the table is read within what it measured; else why not (said in the log and report).
        The sweep holds MLPs of the run's input size (profile_device): another architecture or input size,
        figures outside its rows' range, or a fit error over MAX_FIT_ERROR is an extrapolation."""
        rows = [r for r in self.rows if r["precision"] == precision]
        if not rows:
            return f"it has no {precision} rows"
        widths = {r["widths"][0] for r in rows if r.get("widths")}
        if arch != "mlp":
            return f"it sweeps MLPs, this model is {arch} (other layer shapes)"
        if widths and in_features not in widths:
            return f"it was measured with {'/'.join(map(str, sorted(widths)))} input features, this model has {in_features}"
        worst = self.fit_error.get((precision, f"p{percentile}"), 0.0)
        if worst > MAX_FIT_ERROR:
            return (f"its p{percentile} fit misses its own rows by up to {100 * worst:.0f} % "
                    f"(over {100 * MAX_FIT_ERROR:.0f} %)")
        x = features(operators, flops, params, precision, self.batch_size)
        for i, name in ((1, "operators"), (2, "MFLOPs"), (3, "weight MB")):
            values = [features(r["operators"], r["flops"], r["params"], precision, self.batch_size)[i] for r in rows]
            lo, hi = min(values) / RANGE_MARGIN, max(values) * RANGE_MARGIN
            if not lo <= x[i] <= hi:
                return f"{name} {x[i]:.4g} is outside its rows' {min(values):.4g}..{max(values):.4g}"
        return None

    basis, has_table = "table", True


class SpecSheetPredictor:
    """A board never profiled: the roofline of its spec sheet's figures (module docstring), with the
    profile's declared band. Nothing of the board was measured (has_table False)."""

    basis, has_table, memory = "spec sheet", False, None

    def __init__(self, lm):
        self.lm = lm

    def predict(self, operators, flops, params, precision, percentile, batch_size):
        compute_ms = 1000.0 * flops * batch_size / self.lm.flops_per_second
        bandwidth = self.lm.memory_bandwidth_gb_s
        memory_ms = 0.0 if not bandwidth else 1000.0 * params * BYTES_PER_VALUE[precision] / (bandwidth * 1e9)
        return self.lm.overhead_ms + max(compute_ms, memory_ms)

    def describe(self):
        return "estimated from the spec sheet"   # the profile's latency_model.source says which (the report shows it)

    def band(self, predicted, precision, percentile):
        low, high = self.lm.estimate_band
        return [predicted * low, predicted * high]

    def covers(self, *args):
        return None


def predictor_for(profile, runs_dir):
    """The best prediction model available for a device, or None (kind measure, no table, no throughput)."""
    lm = profile.latency_model
    if lm.kind == "flops":
        return SpecSheetPredictor(lm)
    path = table_path(profile, runs_dir)
    if path.is_file():
        predictor = TablePredictor.load(path)
        if (why := _other_setup(predictor, profile)) is None:
            return predictor
        if lm.table:   # a table the profile names: profiling writes the run folder's, never this one
            raise LatencyModelError(f"device {profile.name}: latency_model.table {path} was measured {why}; give a "
                                    f"table of this set-up, or remove latency_model.table so that `edgebayes devices "
                                    f"profile {profile.name}` measures one")
        if lm.kind == "table":
            raise LatencyModelError(f"device {profile.name}: {path} was measured {why}; re-run "
                                    f"`edgebayes devices profile {profile.name}`")
        # measure: as if there were no table (a reachable device is profiled again, overwriting it)
        return SpecSheetPredictor(lm) if lm.flops_per_second else None
    if lm.kind == "table":
        raise LatencyModelError(f"device {profile.name}: latency_model.kind is table but {path} does not exist; "
                                f"run `edgebayes devices profile {profile.name}`")
    return SpecSheetPredictor(lm) if lm.flops_per_second else None


def table_set_aside(profile, runs_dir):
    """Why the device's latency table is not used (timed with another runtime or thread count), or None."""
    path = table_path(profile, runs_dir)
    if profile.latency_model.kind == "flops" or not path.is_file():
        return None
    why = _other_setup(TablePredictor.load(path), profile)
    return None if why is None else f"{path} was measured {why}"


def _other_setup(predictor, profile):
    """None when the table's rows were timed with the profile's runtime and threads; else how they were."""
    r = profile.runtime
    if predictor.runtime_name is not None and predictor.runtime_name != r.name:
        return f"with {predictor.runtime_name}, the profile's runtime is {r.name}"
    if predictor.threads is not None and predictor.threads != r.threads:
        return f"at {predictor.threads} runtime threads, the profile has runtime.threads {r.threads}"
    return None


# ---------------------------------------------------------------------------------------------
# Measuring on the device
# ---------------------------------------------------------------------------------------------
def measure_models(transport, profile, models, example, bench, log=print):
    """Time model files on the device with the runner. models: [(id, local path, runtime)].

    Returns {id: {"latency_ms": {...}, "runs": ...}} plus the runner's runtime and device facts under
    the key None. Raises TransportError when the device cannot be used. The runner is this source's
    (there is no bundle yet), zipped like a bundle's and sent in the timing folder.
    """
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "timing"
        folder.mkdir()
        np.save(folder / "example.npy", np.ascontiguousarray(example, dtype=np.float32))
        spec = {"example": "example.npy", "models": []}
        for ident, path, runtime in models:
            name = f"{ident}{Path(path).suffix}"
            shutil.copyfile(path, folder / name)
            spec["models"].append({"id": ident, "file": name, "runtime": runtime})
        (folder / "spec.json").write_text(json.dumps(spec))
        write_runner(folder / RUNNER_FILE)
        size = sum(f.stat().st_size for f in folder.iterdir())
        transport.preflight(profile.runtime.name, size, profile.connection.min_free_mb)
        # A timing folder of this call's own on the device (removed after): two runs timing there at once
        # never read each other's spec or results; the runner's timing lock makes the second one wait.
        with transport.own_folder(f"timing-{profile.name}") as device:
            device.put(folder, "timing")
            log(f"timing {len(models)} models on {profile.name} ({device.where()})")
            code, err = device.run(command_line(f"timing/{RUNNER_FILE}", "timing/results.json",
                                                time_models="timing/spec.json", **bench,
                                                batch_size=profile.budgets.batch_size,
                                                threads=profile.runtime.threads, tags={"device": profile.name}))
            if code != 0:
                raise TransportError(device.disk_full(err) or runner_failure(profile.name, code, err))
            device.get("timing/results.json", folder / "results.json")
        results = read_json(folder / "results.json")
    timed = {m["id"]: m for m in results.get("models") or []}
    missing = [ident for ident, _, _ in models if ident not in timed]
    if missing:
        raise TransportError(f"device {profile.name}: the timing results lack {', '.join(missing[:3])}"
                             f"{' ...' if len(missing) > 3 else ''}: not the models sent; run again")
    timed[None] = {"runtime": results["runtime"], "device": results["device"], "protocol": results["protocol"],
                   "memory": results.get("memory"), "latency_statistic": "all samples"}
    return timed


# ---------------------------------------------------------------------------------------------
# `edgebayes devices profile`
# ---------------------------------------------------------------------------------------------
def _mlp(widths, activation):
    """A plain MLP of these widths (inputs, hidden..., classes): the zoo's, built deterministic."""
    return mlp(LayerFactory("dnn", activation=activation), (widths[0],), widths[-1], hidden=widths[1:-1]).eval()


def profiling(profile, runs_dir, log=print):
    """One process at a time profiles a device of a runs folder: two pipelines of different runs on the same
    device both profiled it at once (each timing the other's load) and the table left was one run's, while the
    other's predictions came from its own. A second waits here, then finds the first one's table."""
    return exclusive(Path(runs_dir) / "devices" / profile.name / "profiling.lock", f"profiling {profile.name}",
                     wait=log)


def profile_device(profile, cfg, transport, runs_dir, bench, log=print, sizes=None):
    """Measure the sweep on the device and write its latency table; returns (path, table). `sizes` (inputs per
    example, classes): the data's, where the caller holds it (select), else read from the config's data."""
    from edgebayes.compressed.samples import MCAverage
    from edgebayes.compressed.structure import count_weights, paper_flops
    from edgebayes.export.formats import export_artifact

    if cfg.model.arch != "mlp":
        raise LatencyModelError(f"devices profile sweeps MLPs (model.arch mlp); for {cfg.model.arch} use "
                                "latency_model.kind measure (a reachable device) or flops")
    in_features, classes = sizes or (IN_FEATURES.get(cfg.data.dataset), 10)
    if in_features is None:  # data of the user's own: size the sweep like its inputs and classes (select passes
        # the data's sizes: reading it again there took 11 s for 20,000 images)
        from edgebayes.data import load_data

        splits = load_data(cfg.data, cfg.seed)
        in_features, classes = int(np.prod(splits.input_shape)), len(splits.classes)
    gen = torch.Generator().manual_seed(cfg.seed)
    example = torch.rand((1, in_features), generator=gen)
    rows, models = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in formats_for(profile):
            for frac in WIDTH_FRACTIONS:
                widths = [in_features] + [max(1, round(h * frac)) for h in cfg.model.hidden] + [classes]
                for m in sorted(cfg.select.mc_samples):
                    torch.manual_seed(len(rows))
                    samples = [_mlp(widths, cfg.model.activation) for _ in range(m)]
                    ident = f"{fmt.name}-w{'x'.join(map(str, widths[1:-1]))}-m{m}"
                    path = export_artifact(MCAverage(samples).eval(), fmt.name, Path(tmp) / f"{ident}{fmt.suffix}",
                                           example, example, cfg.export.opset, layout=cfg.export.layout)
                    rows.append({"id": ident, "format": fmt.name, "precision": fmt.precision, "widths": widths,
                                 "mc_samples": m, "layout": cfg.export.layout,
                                 "operators": operator_count(path),
                                 "flops": m * paper_flops(samples[0], (in_features,)),
                                 "params": m * count_weights(samples[0])})
                    models.append((ident, path, fmt.runtime))
        timed = measure_models(transport, profile, models, example.numpy(), bench, log=log)
    for row in rows:
        row["latency_ms"] = {k: timed[row["id"]]["latency_ms"][k] for k in (*PERCENTILES, "mean")}
        row["runs"] = timed[row["id"]]["runs"]
    table = {"device": profile.name, "batch_size": profile.budgets.batch_size, "rows": rows, **timed[None],
             "provenance": provenance(None)}
    predictor = TablePredictor(table, "latency_table.json")
    table["fit"] = {f"{prec}/{p}": {"coefficients": [float(c) for c in predictor.coefs[prec, p]],
                                    "max_relative_error": predictor.fit_error[prec, p],
                                    "outliers": predictor.outliers[prec, p]}
                    for prec, p in predictor.coefs}
    path = Path(runs_dir) / "devices" / profile.name / "latency_table.json"
    write_json(path, table)
    return path, table


def relative_error(predicted, measured):
    if predicted is None or measured is None or not measured or not math.isfinite(predicted):
        return None
    return (predicted - measured) / measured
