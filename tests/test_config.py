"""Config validation (config.py) through the command line (cli.main): bad input exits 2 before any work,
with one message on stderr naming the file and the key."""

import copy
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from edgebayes.cli import EXIT_BAD_INPUT, main
from edgebayes.config import (
    ConfigError,
    fingerprint,
    known_devices,
    load_device_profile,
    load_pipeline_config,
)

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "pipeline.yaml"
LOCAL_DEVICE = ROOT / "devices" / "local.yaml"


def _base():
    return yaml.safe_load(PIPELINE.read_text())


def _write(path: Path, data) -> Path:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def _run(capsys, tmp_path, config, device="local", stage="train"):
    runs = tmp_path / "runs"
    rc = main([stage, "--config", str(config), "--device", str(device), "--runs-dir", str(runs)])
    captured = capsys.readouterr()
    return rc, captured.err, runs


def _nothing_written(runs: Path):
    return not runs.exists() or not any(runs.rglob("*"))


# Each case: (edit of the parsed pipeline.yaml, regex the message must contain after "<file>: ").
def _set(path, value):
    def edit(d):
        *parents, last = path.split(".")
        for p in parents:
            d = d.setdefault(p, {})
        d[last] = value
    return edit


BAD_CONFIGS = {
    "unknown top-level key": (_set("epochs", 3), r"epochs: unknown key"),
    "unknown nested key": (_set("train.epoch", 3), r"train\.epoch: unknown key"),
    "wrong type (string for int)": (_set("train.epochs", "ten"), r"train\.epochs: expected an integer, got 'ten'"),
    "wrong type (bool for int)": (_set("train.batch_size", True), r"train\.batch_size: expected an integer"),
    "wrong type in a list": (_set("model.hidden", [64, "x"]), r"model\.hidden\[1\]: expected an integer, got 'x'"),
    "empty list": (_set("model.hidden", []), r"model\.hidden: expected a non-empty list"),
    "section not a mapping": (_set("train", [1, 2]), r"train: expected a mapping"),
    "empty knob values": (_set("select.knob_values", []), r"select\.knob_values: expected a list"),
    "out of range (epochs)": (_set("train.epochs", 0), r"train\.epochs: expected a positive integer"),
    "negative threads": (_set("train.threads", -1), r"train\.threads: expected a non-negative integer"),
    "SQS-only format for ss-gl": (_set("export.formats", ["onnx", "onnx-codebook"]),
                                  r"export\.formats: onnx-codebook is made for model\.family sqs only, not ss-gl"),
    "bad literal": (_set("model.family", "ss-xx"), r"model\.family: expected one of .*'ss-gl'.*got 'ss-xx'"),
    "bad literal (dataset)": (_set("data.dataset", "imagenet"), r"data\.dataset: expected one of"),
    "unknown export format": (_set("export.formats", ["onnx", "coreml"]),
                              r"export\.formats\[1\]: expected one of .*'tflite-int8'.*got 'coreml'"),
    "export format twice": (_set("export.formats", ["onnx", "onnx"]), r"export\.formats: expected each format once"),
    "bad MC layout": (_set("export.layout", "diagonal"), r"export\.layout: expected one of 'packed', 'unrolled'"),
    "bad calibration size": (_set("export.calibration_size", 0), r"export\.calibration_size: expected a positive"),
    "nested: fixed groups not below groups": (_set("nested.fixed_groups", 32),
                                              r"nested\.fixed_groups: expected an integer in 0\.\.groups - 1 = 31"),
    "nested: annealing upwards": (_set("nested.temperature_min", 2.0),
                                  r"nested\.temperature_min: expected a positive number no larger than"),
    "nested: width multiplier": (_set("model.width_multiplier", 0), r"model\.width_multiplier: expected a positive"),
    # 128 levels in each of 4 windows: up to 512 per layer, past the 8-bit indices of model.sqs (it failed after
    # the whole fine-tuning, probe)
    "sqs: more levels than a layer holds": (
        lambda d: [_set("model.family", "sqs")(d), _set("train.flops_target", None)(d), _set("sqs.components", 128)(d)],
        r"sqs\.components: 128 levels x 4 windows \(outlier\) can give 512 levels per layer, more than the 256"),
    # onnx-codebook's indices keep one of the 256 values for the zero: 64 x 4 = 256 levels left a layer plain fp32
    "sqs: more levels than onnx-codebook holds": (
        lambda d: [_set("model.family", "sqs")(d), _set("train.flops_target", None)(d), _set("sqs.components", 64)(d),
                   _set("export.formats", ["onnx", "onnx-codebook"])(d)],
        r"sqs\.components: 64 levels x 4 windows \(outlier\) can give 256 levels per layer, more than the 255 \(8-bit "
        r"indices\) a compressed layer holds in onnx-codebook"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_pipeline_config_exits_2_naming_file_and_key(case, capsys, tmp_path):
    """Each invalid pipeline.yaml exits 2 with one message 'edgebayes: <file>: <key>: ...' and writes nothing."""
    edit, pattern = BAD_CONFIGS[case]
    data = _base()
    edit(data)
    config = _write(tmp_path / "pipeline.yaml", data)
    rc, err, runs = _run(capsys, tmp_path, config)
    assert rc == EXIT_BAD_INPUT == 2
    assert err.startswith("edgebayes: ") and err.count("\n") == 1  # one message
    assert re.search(re.escape(str(config)) + ": " + pattern, err), err
    assert _nothing_written(runs)


def test_missing_config_file(capsys, tmp_path):
    """A config path that does not exist exits 2 naming the file."""
    config = tmp_path / "nope.yaml"
    rc, err, runs = _run(capsys, tmp_path, config, stage="pipeline")
    assert rc == 2
    assert f"{config}: file not found" in err
    assert _nothing_written(runs)


def test_an_integer_past_pythons_digit_limit_is_bad_input(capsys, tmp_path):
    """5001 digits: PyYAML's int() raised a ValueError traceback, in a file and in --set (probe)."""
    config = _write(tmp_path / "pipeline.yaml", "name: x\ntrain:\n  epochs: 1" + "0" * 5000 + "\n")
    rc, err, runs = _run(capsys, tmp_path, config)
    assert rc == 2 and f"{config}: Exceeds the limit (4300 digits)" in err and err.count("\n") == 1
    assert main(["pipeline", "--set", "train.epochs=1" + "0" * 5000, "--runs-dir", str(tmp_path / "r")]) == 2
    assert "--set train.epochs: Exceeds the limit" in capsys.readouterr().err


def test_invalid_yaml(capsys, tmp_path):
    """YAML that does not parse exits 2 naming the file, the message on one line."""
    config = _write(tmp_path / "pipeline.yaml", "name: x\ntrain: [1, 2\nseed: 0\n")
    rc, err, runs = _run(capsys, tmp_path, config)
    assert rc == 2
    assert f"{config}: not valid YAML" in err
    assert err.count("\n") == 1
    assert _nothing_written(runs)


def test_unknown_device_lists_known_devices(capsys, tmp_path):
    """An unknown device name exits 2; the message names it and lists the known devices (incl. local)."""
    config = _write(tmp_path / "pipeline.yaml", _base())
    rc, err, runs = _run(capsys, tmp_path, config, device="no-such-board")
    assert rc == 2
    assert "unknown device 'no-such-board'" in err
    assert "local" in err.split("known devices:")[1]
    assert "local" in known_devices()
    assert _nothing_written(runs)


@pytest.mark.parametrize("edit, pattern", [
    (_set("budgets.latency_msx", 3.0), r"budgets\.latency_msx: unknown key"),
    (_set("budgets.percentile", 95), r"budgets\.percentile: expected one of 50, 90, 99"),
    (_set("budgets.latency_ms", -1.0), r"budgets\.latency_ms: expected a positive number or null"),
    (_set("latency_model.kind", "flops"), r"latency_model\.flops_per_second: a positive number is required"),
])
def test_bad_device_profile_yaml(edit, pattern, capsys, tmp_path):
    """A device profile given as a YAML path with a bad key/value exits 2 naming that file and the key."""
    data = yaml.safe_load(LOCAL_DEVICE.read_text())
    edit(data)
    device = _write(tmp_path / "board.yaml", data)
    config = _write(tmp_path / "pipeline.yaml", _base())
    rc, err, runs = _run(capsys, tmp_path, config, device=device)
    assert rc == 2
    assert re.search(re.escape(str(device)) + ": " + pattern, err), err
    assert _nothing_written(runs)


def test_device_profile_requires_name(tmp_path):
    """A device profile without its required `name` key is refused."""
    data = yaml.safe_load(LOCAL_DEVICE.read_text())
    del data["name"]
    device = _write(tmp_path / "board.yaml", data)
    with pytest.raises(ConfigError, match=re.escape(str(device)) + r": name: required key is missing"):
        load_device_profile(str(device))


# ---------------------------------------------------------------------------------------------
def test_shipped_configs_load_with_expected_values():
    """pipeline.yaml and devices/local.yaml load without error and carry the documented values."""
    cfg = load_pipeline_config(PIPELINE)
    assert cfg.name == "digits-ssgl" and cfg.seed == 0
    assert cfg.data.dataset == "digits" and cfg.data.download is False and cfg.data.ood == "noise"
    assert cfg.model.family == "ss-gl" and cfg.model.hidden == [64, 64] and cfg.model.activation == "silu"
    assert cfg.prior.inclusion_constant == 1e-9 and cfg.prior.a0 == 4.0 and cfg.prior.b0 == 2.0
    assert cfg.train.lr == pytest.approx(3e-3) and isinstance(cfg.train.lr, float)
    assert cfg.select.knob_values == [0.5, 0.7, 0.9] and cfg.select.mc_samples == [1, 2, 4, 8]

    profile = load_device_profile("local")
    assert profile.name == "local"
    assert profile.runtime.name == "onnxruntime" and profile.runtime.threads == 1  # as its latency table is timed
    assert profile.budgets.latency_ms == 2.0 and profile.budgets.percentile == 90
    assert profile.budgets.memory_mb == 1024.0 and isinstance(profile.budgets.memory_mb, float)
    assert profile.connection.kind == "local" and profile.connection.python is None
    assert profile.latency_model.kind == "measure"
    # the same profile through its path
    assert load_device_profile(str(LOCAL_DEVICE)) == profile


def test_fingerprint_tracks_values_not_formatting(tmp_path):
    """fingerprint() changes when a config value changes, and not when only the file's formatting does
    (key order, comments, 1 vs 1.0 for a float); a section's fingerprint ignores other sections."""
    cfg = load_pipeline_config(PIPELINE)

    data = _base()
    reordered = dict(reversed(list(data.items())))
    reordered["prior"]["sigma0_sq"] = 1  # an int for a float field
    same = load_pipeline_config(_write(tmp_path / "same.yaml", "# no comments here\n" + yaml.safe_dump(reordered)))
    assert fingerprint(same) == fingerprint(cfg)
    assert fingerprint(same.train) == fingerprint(cfg.train)
    assert len(fingerprint(cfg)) == 16 and re.fullmatch(r"[0-9a-f]+", fingerprint(cfg))

    changed = copy.deepcopy(data)
    changed["train"]["epochs"] += 1
    other = load_pipeline_config(_write(tmp_path / "changed.yaml", changed))
    assert fingerprint(other) != fingerprint(cfg)
    assert fingerprint(other.train) != fingerprint(cfg.train)
    assert fingerprint(other.select) == fingerprint(cfg.select)
    assert fingerprint(other.model) == fingerprint(cfg.model)

    changed = copy.deepcopy(data)
    changed["select"]["knob_values"] = [0.5, 0.8]
    other = load_pipeline_config(_write(tmp_path / "changed2.yaml", changed))
    assert fingerprint(other.select) != fingerprint(cfg.select)
    assert fingerprint("train", cfg.seed, cfg.data, cfg.model, cfg.prior, cfg.train) == \
        fingerprint("train", other.seed, other.data, other.model, other.prior, other.train)


# ---------------------------------------------------------------------------------------------
def _mnist_config(tmp_path):
    try:
        import torchvision  # noqa: F401
    except ImportError as e:
        pytest.skip(f"torchvision is not importable ({e}): the mnist loader cannot be exercised")
    empty = tmp_path / "empty-data"
    empty.mkdir()
    data = _base()
    data["data"].update(dataset="mnist", root=str(empty), download=False, ood=None)
    return _write(tmp_path / "pipeline.yaml", data), empty


def test_missing_dataset_files_exit_2_naming_dataset_and_folder(capsys, tmp_path):
    """`edgebayes train` on mnist with an empty data.root and download false exits 2 with a data error
    naming the data set and the folder (and how to fix it)."""
    config, empty = _mnist_config(tmp_path)
    rc, err, runs = _run(capsys, tmp_path, config)
    assert rc == 2
    assert err.startswith("edgebayes: ")
    assert "'mnist'" in err and str(empty.resolve()) in err
    assert "data.download" in err
    assert not (runs / "digits-ssgl" / "train" / "checkpoint.pt").exists()


def test_missing_dataset_files_write_nothing(capsys, tmp_path):
    """Bad input (here: absent data files) is reported before any work: nothing under --runs-dir."""
    config, _ = _mnist_config(tmp_path)
    rc, _, runs = _run(capsys, tmp_path, config)
    assert rc == 2
    assert _nothing_written(runs), sorted(str(p.relative_to(runs)) for p in runs.rglob("*"))


def test_exponent_floats_without_a_dot_are_numbers(tmp_path):
    """`lr: 1e-3` means 0.001 (YAML 1.2), not the string '1e-3' of YAML 1.1."""
    text = (ROOT / "pipeline.yaml").read_text().replace("lr: 3.0e-3", "lr: 3e-3")
    assert "lr: 3e-3" in text
    path = tmp_path / "p.yaml"
    path.write_text(text)
    assert load_pipeline_config(path).train.lr == pytest.approx(3e-3)


def test_unknown_ood_set_names_file_and_key(tmp_path, capsys):
    """data.ood is checked with the config, before any work, like data.dataset."""
    text = (ROOT / "pipeline.yaml").read_text().replace("ood: noise", "ood: svhn")
    path = tmp_path / "p.yaml"
    path.write_text(text)
    assert main(["train", "--config", str(path), "--runs-dir", str(tmp_path / "runs")]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "p.yaml: data.ood: expected" in err and "'svhn'" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_builds_its_network(path):
    from types import SimpleNamespace

    from edgebayes.train.families import build as model_for

    cfg = load_pipeline_config(path)
    shape = {"cifar10": (3, 32, 32), "digits": (1, 8, 8)}.get(cfg.data.dataset, (1, 28, 28))
    if cfg.model.arch == "mlp":
        shape = (int(np.prod(shape)),)
    splits = SimpleNamespace(input_shape=shape, classes=list(range(10)), train_x=torch.zeros(4, *shape))
    net = model_for(cfg, splits).eval()
    with torch.no_grad():
        assert net(torch.zeros(2, *shape)).shape == (2, 10)


@pytest.mark.parametrize("depth", [20, 32, 56])
def test_cifar_resnets_have_6n_plus_2_weighted_layers(depth):
    from edgebayes.config import ModelConfig, PriorConfig
    from edgebayes.train.models import build_model

    net = build_model(ModelConfig(family="dnn", arch=f"resnet{depth}"), PriorConfig(), (3, 32, 32), 10, n_train=100)
    weighted = [n for n, m in net.named_modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))
                and "shortcut" not in n]
    assert len(weighted) == depth  # the stem, 2 per basic block, the classifier; projections not counted


# ---------------------------------------------------------------------------------------------
# `edgebayes config schema`: the JSON Schema describes the shipped files (jsonschema is not installed here,
# so a small validator of the keywords the schema uses checks them)
# ---------------------------------------------------------------------------------------------
def _conforms(value, schema, defs, where=""):
    """Raise AssertionError naming the key where `value` breaks `schema` (object, array, scalar types,
    enum, anyOf, $ref, bounds, minItems, additionalProperties, required)."""
    if "$ref" in schema:
        return _conforms(value, defs[schema["$ref"].split("/")[-1]], defs, where)
    if "anyOf" in schema:
        for option in schema["anyOf"]:
            try:
                return _conforms(value, option, defs, where)
            except AssertionError:
                pass
        raise AssertionError(f"{where}: {value!r} matches no option")
    if "enum" in schema or "const" in schema:
        assert value in schema.get("enum", [schema.get("const")]), f"{where}: {value!r} not in the enum"
    kind = schema.get("type")
    python = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None),
              "integer": int, "number": (int, float)}
    if kind:
        assert isinstance(value, python[kind]) and (kind in ("boolean",) or not isinstance(value, bool)), \
            f"{where}: {value!r} is not {kind}"
    if kind == "object":
        for key in schema.get("required", []):
            assert key in value, f"{where}.{key}: required"
        for key, item in value.items():
            assert key in schema["properties"] or schema.get("additionalProperties", True), f"{where}.{key}: unknown"
            if key in schema["properties"]:
                _conforms(item, schema["properties"][key], defs, f"{where}.{key}")
    if kind == "array":
        assert len(value) >= schema.get("minItems", 0), f"{where}: too short"
        for i, item in enumerate(value):
            _conforms(item, schema.get("items", {}), defs, f"{where}[{i}]")
    for bound, ok in (("minimum", lambda v, b: v >= b), ("exclusiveMinimum", lambda v, b: v > b),
                      ("maximum", lambda v, b: v <= b), ("exclusiveMaximum", lambda v, b: v < b)):
        if bound in schema and isinstance(value, (int, float)):
            assert ok(value, schema[bound]), f"{where}: {value!r} breaks {bound} {schema[bound]}"


def test_config_schema_describes_every_shipped_config_and_profile(tmp_path, capsys):
    out = tmp_path / "schema" / "pipeline.json"
    assert main(["config", "schema", "--out", str(out)]) == 0
    pipeline = json.loads(out.read_text())
    assert main(["config", "schema", "--device"]) == 0
    device = json.loads(capsys.readouterr().out)
    assert [p.name for p in out.parent.iterdir()] == ["pipeline.json"]     # written atomically, no temp file left

    families = pipeline["$defs"]["ModelConfig"]["properties"]["family"]["enum"]
    assert families == ["dnn", "bnn", "ss-ig", "ss-gl", "ss-ghs", "sqs", "bn3", "fn3"]
    assert device["required"] == ["name"] and "required" not in pipeline           # a run has defaults for all
    assert all(d["additionalProperties"] is False for d in [pipeline, device, *pipeline["$defs"].values()])
    assert pipeline["$defs"]["TrainConfig"]["properties"]["epochs"]["exclusiveMinimum"] == 0

    from edgebayes.config import _load_yaml   # YAML 1.2 numbers (4.7e10), as editors read them

    files = [PIPELINE, *sorted((ROOT / "configs").glob("*.yaml"))]
    for path in files:
        _conforms(_load_yaml(path), pipeline, pipeline["$defs"], path.name)
    profiles = [p for p in sorted((ROOT / "devices").glob("*.yaml")) if "alias" not in _load_yaml(p)]
    for path in profiles:
        _conforms(_load_yaml(path), device, device["$defs"], path.name)
    assert len(files) > 10 and len(profiles) > 4

    bad = _base()
    bad["model"]["family"] = "ss-nope"
    with pytest.raises(AssertionError, match="model.family"):
        _conforms(bad, pipeline, pipeline["$defs"])


# --set section.key=value: the command line's override of one key, validated as the file is (issue 35)
SET_ERRORS = {
    "train.epoch=3": r"^edgebayes: --set train\.epoch: unknown key \(allowed: epochs, ",
    "train.epochs=ten": r"^edgebayes: --set train\.epochs: expected an integer, got 'ten'",
    "train.epochs=0": r"^edgebayes: --set train\.epochs: expected a positive integer",
    "model.hidden=[64, x]": r"^edgebayes: --set model\.hidden\[1\]: expected an integer, got 'x'",
    "epochs=3": r"^edgebayes: --set epochs=3: expected section\.key=value \(or name / seed=value\), e\.g\. --set "
                r"train\.epochs=3",
    "train=3": r"^edgebayes: --set train=3: expected section\.key=value",
    "seed=-1": r"^edgebayes: --set seed: expected an integer in 0\.\.2\^32 - 1",
    "train.epochs": r"^edgebayes: --set train\.epochs: expected section\.key=value",
    "name.x=1": r"^edgebayes: --set name\.x=1: name is not a section in ",
    "train.lr=[1": r"^edgebayes: --set train\.lr=\[1: the value is not valid YAML",
    "train.lr_milestones=[9999]": r"pipeline\.yaml with --set train\.lr_milestones=\[9999\]: train\.lr_milestones: "
                                  r"expected epochs between 1 and train\.epochs",
}


@pytest.mark.parametrize("setting", list(SET_ERRORS))
def test_set_is_validated_like_the_file_one_message_naming_it(setting, capsys, tmp_path):
    config = _write(tmp_path / "pipeline.yaml", _base())
    runs = tmp_path / "runs"
    rc = main(["pipeline", "--config", str(config), "--set", setting, "--runs-dir", str(runs)])
    err = capsys.readouterr().err
    assert rc == EXIT_BAD_INPUT and err.count("\n") == 1 and re.search(SET_ERRORS[setting], err), err
    assert _nothing_written(runs)


def test_set_overrides_the_file_and_changes_the_fingerprint_and_the_commands(tmp_path):
    from edgebayes.stages import Context

    config = _write(tmp_path / "pipeline.yaml", _base())
    settings = ("train.epochs=3", "train.lr=2e-3", "select.mc_samples=[1, 4]", "model.hidden=[8]", "data.root=",
                "seed=7")   # the top-level keys too: `--set seed=1` was refused (probe)
    cfg = load_pipeline_config(config, settings)
    assert (cfg.train.epochs, cfg.train.lr, cfg.select.mc_samples, cfg.model.hidden, cfg.data.root, cfg.seed) == (
        3, 0.002, [1, 4], [8], None, 7)
    plain = load_pipeline_config(config)
    assert plain.train.epochs == _base()["train"]["epochs"]   # the file is left as it was
    device = load_device_profile("local")
    with_set = Context(cfg, device, config_path=str(config), settings=settings)
    assert with_set.fingerprint("train") != Context(plain, device).fingerprint("train")
    # a hint's command line runs the same config: the --set options are in it, quoted for a shell
    assert "--set train.epochs=3" in with_set.command("report") and "'select.mc_samples=[1, 4]'" in with_set.command("report")


def test_every_key_is_described_once_in_the_schema_and_in_its_error_message(capsys, tmp_path):
    """Issue 35: each key of pipeline.yaml and of a device profile has its Field description, which the JSON
    Schema carries and a type or range error on that key repeats."""
    from edgebayes.config import DeviceProfile, PipelineConfig, Section

    def sections(model):
        yield model
        for f in model.model_fields.values():
            if isinstance(f.annotation, type) and issubclass(f.annotation, Section):
                yield from sections(f.annotation)

    undescribed = [f"{m.__name__}.{k}" for root in (PipelineConfig, DeviceProfile) for m in sections(root)
                   for k, f in m.model_fields.items() if not (f.description or "").strip()]
    assert undescribed == []
    assert main(["config", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    epochs = schema["$defs"]["TrainConfig"]["properties"]["epochs"]["description"]
    assert epochs == PipelineConfig.model_fields["train"].annotation.model_fields["epochs"].description
    data = _base()
    data["train"]["epochs"] = "ten"
    rc, err, _ = _run(capsys, tmp_path, _write(tmp_path / "pipeline.yaml", data))
    assert rc == 2 and err.rstrip().endswith(f"train.epochs: {epochs}")


def test_the_keys_tables_of_the_readmes_are_the_field_descriptions(capsys):
    """devices/README.md and configs/README.md hold `edgebayes config schema [--device] --markdown` verbatim:
    regenerate them when a key or its description changes."""
    from edgebayes.config import keys_table

    assert main(["config", "schema", "--markdown"]) == 0 and capsys.readouterr().out == keys_table("pipeline")
    assert keys_table("pipeline") in (ROOT / "configs/README.md").read_text()
    assert keys_table("device") in (ROOT / "devices/README.md").read_text()
    assert "| `train.epochs` | training epochs" in keys_table("pipeline")


def test_lr_milestones_may_be_written_empty_as_its_default_is(tmp_path):
    """[] is train.lr_milestones' default (a constant rate): a file or --set may say it too."""
    config = _write(tmp_path / "pipeline.yaml", _base())
    assert load_pipeline_config(config).train.lr_milestones == []
    assert load_pipeline_config(config, ("train.lr_milestones=[]",)).train.lr_milestones == []
    assert load_pipeline_config(config, ("train.lr_milestones=[1]",)).train.lr_milestones == [1]


@pytest.mark.parametrize("text, said", [("- name: x\n", "got a list"), ("hello\n", "got a string"),
                                        ("1: 2\nname: x\n", "key 1 is not a name")])
def test_a_config_or_device_profile_that_is_not_a_mapping_is_one_message(tmp_path, capsys, text, said):
    """A YAML list or scalar at the top level was an IndexError from the validator, exit 1; a number as a key
    read as 'expected PipelineConfig'."""
    path = _write(tmp_path / "odd.yaml", text)
    for args in (["train", "--config", str(path)], ["train", "--config", str(PIPELINE), "--device", str(path)]):
        rc = main(args + ["--runs-dir", str(tmp_path / "runs")])
        err = capsys.readouterr().err
        assert rc == EXIT_BAD_INPUT and said in err and "odd.yaml" in err and "Traceback" not in err, args
    assert not (tmp_path / "runs").exists()


def test_a_comma_separated_device_list_is_answered_with_the_spaced_one():
    from edgebayes.config import load_device_profile

    with pytest.raises(ConfigError, match=r"unknown device 'local,jetson-orin-nano': .*; several devices are given "
                                          r"apart: local jetson-orin-nano$"):
        load_device_profile("local,jetson-orin-nano")
