"""The runner's TFLite and TensorRT backends and multi-artifact bundles (edgebayes/ondevice).

TensorRT cannot be installed on these machines (its wheels fetch NVIDIA's libraries from NVIDIA's own index):
engine-build commands, the engine cache and the backend's buffer handling are tested here against a fake
engine; the real engine test runs only where tensorrt imports.
"""

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from _nets import samples_and_inputs
from edgebayes.export.bundle import write_bundle
from edgebayes.compressed.samples import MCAverage
from edgebayes.export.formats import FORMATS, export_artifact
from edgebayes.ondevice import backends, cli, runtimes
from edgebayes.ondevice import tensorrt_backend as trt_backend

FAST = ["--warmup", "1", "--min-runs", "3", "--min-seconds", "0.01", "--quiet"]
ARTIFACTS = ("onnx", "tflite-fp32", "tflite-int8")


@pytest.fixture(scope="module")
def multi_bundle(tmp_path_factory):
    """One bundle holding an MLP's MC average as ONNX, TFLite fp32 and TFLite int8."""
    samples, x = samples_and_inputs("mlp", 2, n=40)
    mc = MCAverage(samples).eval()
    with torch.no_grad():
        ref = mc(x).numpy()
    y = ref.argmax(axis=1)
    tmp = tmp_path_factory.mktemp("artifacts")
    artifacts = {}
    for fmt in ARTIFACTS:
        f = FORMATS[fmt]
        path = export_artifact(mc, fmt, tmp / f"{fmt}{f.suffix}", x[:8], x)
        artifacts[fmt] = {"path": path, "format": f.bundle_format, "precision": f.precision, "runtime": f.runtime}
    bundle = tmp_path_factory.mktemp("bundles") / "bundle"
    write_bundle(bundle, artifacts["onnx"]["path"], x.numpy(), y, ref, classes=list("abcdefghij"), mc_samples=2,
                 knob_name="inclusion_threshold", knob_value=0.5, reference_metrics={}, provenance={},
                 artifacts=artifacts)
    return bundle


@pytest.fixture
def bundle(multi_bundle, tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(multi_bundle, dst)
    return dst


@pytest.mark.parametrize("artifact", ARTIFACTS)
def test_runner_runs_each_artifact(multi_bundle, tmp_path, artifact):
    out = tmp_path / "r.json"
    assert cli.main(["--bundle", str(multi_bundle), "--out", str(out), "--artifact", artifact, *FAST]) == 0
    res = json.loads(out.read_text())
    assert res["bundle"]["artifact"] == artifact and res["runtime"]["name"] == FORMATS[artifact].runtime
    assert res["max_abs_prob_diff"] <= (1e-5 if FORMATS[artifact].precision == "fp32" else 0.1)
    if artifact == "tflite-int8":
        assert res["runtime"]["input_dtype"] == "int8" and res["runtime"]["model_batch"] == 1


def test_default_artifact_is_the_primary_model_file(multi_bundle, tmp_path):
    out = tmp_path / "r.json"
    assert cli.main(["--bundle", str(multi_bundle), "--out", str(out), *FAST]) == 0
    assert json.loads(out.read_text())["bundle"]["artifact"] == "onnx"


def _expect_bundle_error(bundle, tmp_path, capsys, *extra):
    code = cli.main(["--bundle", str(bundle), "--out", str(tmp_path / "r.json"), *extra, *FAST])
    assert code == cli.EXIT_BUNDLE and not (tmp_path / "r.json").exists()
    return capsys.readouterr().err


def test_missing_artifact_file_is_refused(bundle, tmp_path, capsys):
    (bundle / "model-tflite-int8.tflite").unlink()
    err = _expect_bundle_error(bundle, tmp_path, capsys, "--artifact", "onnx")  # any artifact: the bundle is incomplete
    assert "model-tflite-int8.tflite: missing" in err


def test_altered_artifact_file_is_refused(bundle, tmp_path, capsys):
    path = bundle / "model-tflite-fp32.tflite"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert "model-tflite-fp32.tflite: sha256 mismatch" in _expect_bundle_error(bundle, tmp_path, capsys)


def test_unknown_or_unlisted_artifact_is_refused(bundle, tmp_path, capsys):
    assert "no artifact 'tflite-fp16'" in _expect_bundle_error(bundle, tmp_path, capsys, "--artifact", "tflite-fp16")
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["artifacts"]["onnx-int8"] = {"model_file": "model-onnx-int8.onnx", "format": "onnx",
                                          "precision": "int8", "runtime": "onnxruntime"}
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    assert "'model-onnx-int8.onnx' is not listed in 'files'" in _expect_bundle_error(bundle, tmp_path, capsys)


@pytest.mark.parametrize("raw_name", [b"caf\xc3\xa9", b"caf\xe9"], ids=["utf8-bytes", "latin1-bytes"])
def test_runtimes_open_models_under_names_no_utf8_str_carries(multi_bundle, tmp_path, raw_name):
    """Outside Python's UTF-8 mode (a C locale, PYTHONUTF8=0) a non-ASCII folder name reaches Python as surrogate
    escapes, which the runtimes' bindings refused (onnxruntime: a pybind11 TypeError). Both runtimes open the
    file such a str names, whether its bytes are UTF-8 or not."""
    folder = Path(os.fsdecode(bytes(tmp_path) + b"/" + raw_name))
    folder.mkdir()
    for artifact in ("onnx", "tflite-fp32"):
        src = multi_bundle / ("model.onnx" if artifact == "onnx" else "model-tflite-fp32.tflite")
        shutil.copy(src, folder / src.name)
    weird = str(folder)[:len(str(tmp_path)) + 1] + raw_name.decode("ascii", "surrogateescape")   # as a C locale shows it
    evaluation = np.load(multi_bundle / "eval.npz")
    x, ref = evaluation["x"][:5], evaluation["reference_probs"][:5]
    for backend in (backends.OnnxRuntimeBackend(f"{weird}/model.onnx", threads=1),
                    backends.TFLiteBackend(f"{weird}/model-tflite-fp32.tflite", threads=1)):
        assert np.allclose(backend.run(x), ref, atol=1e-5)


# --- TFLite -----------------------------------------------------------------------------------

def test_tflite_backend_runs_batches_on_a_batch_one_model(multi_bundle):
    backend = backends.TFLiteBackend(str(multi_bundle / "model-tflite-fp32.tflite"), threads=1)
    x = np.load(multi_bundle / "eval.npz")["x"][:7]
    batch = backend.run(x)
    rows = np.concatenate([backend.run(x[i:i + 1]) for i in range(7)])
    assert batch.shape == (7, 10) and np.array_equal(batch, rows)
    assert backend.info()["package"] == "ai-edge-litert"


def test_tflite_loader_falls_back_to_tflite_runtime(monkeypatch):
    fake_interpreter = type("Interpreter", (), {})
    fake = types.ModuleType("tflite_runtime")
    fake.__version__ = "2.14.0"
    fake.interpreter = types.SimpleNamespace(Interpreter=fake_interpreter)
    monkeypatch.setitem(sys.modules, "ai_edge_litert", None)  # None in sys.modules: ImportError on import
    monkeypatch.setitem(sys.modules, "tflite_runtime", fake)
    monkeypatch.setitem(sys.modules, "tflite_runtime.interpreter", fake.interpreter)
    assert backends._tflite_interpreter() == (fake_interpreter, "tflite_runtime", "2.14.0")

    monkeypatch.setitem(sys.modules, "tflite_runtime", None)
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    with pytest.raises(backends.RuntimeProblem, match="no TFLite runtime.*pip install ai-edge-litert"):
        backends._tflite_interpreter()


# --- TensorRT ---------------------------------------------------------------------------------

OPTIONS = trt_backend.trt_build_options("fp16", 512, "input", (1, 28, 28), max_batch=64, opt_batch=1)


def test_trtexec_command_carries_precision_workspace_and_shapes():
    cmd = trt_backend.trtexec_command("b/model.onnx", "cache/k.engine", OPTIONS, trtexec="/usr/src/tensorrt/bin/trtexec")
    assert cmd[:3] == ["/usr/src/tensorrt/bin/trtexec", "--onnx=b/model.onnx", "--saveEngine=cache/k.engine"]
    assert "--memPoolSize=workspace:512" in cmd and "--fp16" in cmd and "--int8" not in cmd
    assert {"--minShapes=input:1x1x28x28", "--optShapes=input:1x1x28x28", "--maxShapes=input:64x1x28x28"} <= set(cmd)
    int8 = trt_backend.trtexec_command("m.onnx", "e", {**OPTIONS, "precision": "int8"})
    assert "--int8" in int8 and "--fp16" not in int8
    assert not {"--int8", "--fp16"} & set(trt_backend.trtexec_command("m.onnx", "e", {**OPTIONS, "precision": "fp32"}))
    with pytest.raises(backends.RuntimeProblem, match="precision 'int4'"):
        trt_backend.trt_build_options("int4", 512, "input", (4,), 8)


def test_engine_cache_key_follows_content_options_and_version(tmp_path):
    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"graph-1")
    key = trt_backend.engine_cache_key(onnx, OPTIONS, "10.3")
    assert key == trt_backend.engine_cache_key(onnx, dict(reversed(list(OPTIONS.items()))), "10.3")
    assert key != trt_backend.engine_cache_key(onnx, {**OPTIONS, "workspace_mb": 1024}, "10.3")
    assert key != trt_backend.engine_cache_key(onnx, OPTIONS, "8.6")
    onnx.write_bytes(b"graph-2")
    assert key != trt_backend.engine_cache_key(onnx, OPTIONS, "10.3")


def test_engine_is_built_once_with_trtexec_then_cached(tmp_path):
    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"graph")
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        engine = next(a.split("=", 1)[1] for a in cmd if a.startswith("--saveEngine="))
        Path(engine).write_bytes(b"engine")
        return subprocess.CompletedProcess(cmd, 0, stdout="&&&& PASSED")

    trt = types.SimpleNamespace(__version__="10.3")
    which = lambda name: f"/opt/{name}"  # noqa: E731
    path, built = trt_backend.cached_engine(trt, onnx, OPTIONS, tmp_path / "cache", run=fake_run, which=which)
    assert built and Path(path).read_bytes() == b"engine" and calls[0][0] == "/opt/trtexec"
    again, built = trt_backend.cached_engine(trt, onnx, OPTIONS, tmp_path / "cache", run=fake_run, which=which)
    assert again == path and not built and len(calls) == 1

    def failing_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, stdout="[E] Error: unsupported op\n&&&& FAILED")
    with pytest.raises(backends.RuntimeProblem, match="trtexec failed.*unsupported op"):
        trt_backend.cached_engine(trt, onnx, {**OPTIONS, "precision": "int8"}, tmp_path / "cache", run=failing_run,
                                  which=which)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [Path(path).name]   # no partial engine left


class FakeMemory:
    """Device memory as byte arrays: checks that the backend copies the right bytes to the right buffers."""

    def __init__(self):
        self.buffers, self.syncs, self.stream = {}, 0, 7

    def malloc(self, nbytes):
        ptr = 0x1000 * (len(self.buffers) + 1)
        self.buffers[ptr] = bytearray(nbytes)
        return ptr

    def free(self, ptr):
        del self.buffers[ptr]

    def to_device(self, ptr, array):
        assert array.flags["C_CONTIGUOUS"] and array.nbytes <= len(self.buffers[ptr]), "buffer overflow"
        self.buffers[ptr][: array.nbytes] = array.tobytes()

    def to_host(self, array, ptr):
        array[...] = np.frombuffer(bytes(self.buffers[ptr][: array.nbytes]), array.dtype).reshape(array.shape)

    def synchronize(self):
        self.syncs += 1


class FakeTensorRT:
    """The slice of the tensorrt API the backend uses; the 'engine' is softmax(x @ W)."""

    __version__ = "10.3-fake"

    class Logger:
        WARNING = 2

        def __init__(self, level):
            pass

    class TensorIOMode:
        INPUT, OUTPUT = "input", "output"

    def __init__(self, weight, memory):
        self.weight, self.memory = weight, memory

    @staticmethod
    def nptype(dtype):
        return dtype

    def Runtime(self, logger):  # noqa: N802 (tensorrt's name)
        trt = self

        class Engine:
            num_io_tensors = 2

            def get_tensor_name(self, i):
                return ["input", "probs"][i]

            def get_tensor_mode(self, name):
                return trt.TensorIOMode.INPUT if name == "input" else trt.TensorIOMode.OUTPUT

            def get_tensor_dtype(self, name):
                return np.float32

            def create_execution_context(self):
                return Context()

        class Context:
            def __init__(self):
                self.shape, self.address = None, {}

            def set_input_shape(self, name, shape):
                self.shape = tuple(shape)

            def get_tensor_shape(self, name):
                return (self.shape[0], trt.weight.shape[1])

            def set_tensor_address(self, name, ptr):
                self.address[name] = ptr

            def execute_async_v3(self, stream):
                n, features = self.shape[0], int(np.prod(self.shape[1:]))
                raw = bytes(trt.memory.buffers[self.address["input"]][: n * features * 4])
                logits = np.frombuffer(raw, np.float32).reshape(n, features) @ trt.weight
                probs = np.exp(logits - logits.max(1, keepdims=True))
                probs /= probs.sum(1, keepdims=True)
                trt.memory.buffers[self.address["probs"]][: probs.nbytes] = probs.astype(np.float32).tobytes()
                return True

        class Runtime:
            def deserialize_cuda_engine(self, data):
                return Engine() if data == b"fake engine" else None

        return Runtime()


def _cached_fake_engine(tmp_path, fake, precision):
    """(backend, weight, memory, rng): a fake TensorRT's engine of softmax(x @ W) for (3, 4) inputs, in the
    cache under the key the backend computes, loaded with a batch profile up to 8."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((12, 5)).astype(np.float32)
    memory = FakeMemory()
    trt = fake(weight, memory)
    onnx = tmp_path / "bundle" / "model.onnx"
    onnx.parent.mkdir()
    onnx.write_bytes(b"graph")
    options = trt_backend.trt_build_options(precision, 256, "input", (3, 4), max_batch=8)
    cache = tmp_path / "engines"
    cache.mkdir()
    (cache / (trt_backend.engine_cache_key(onnx, options, trt.__version__) + ".engine")).write_bytes(b"fake engine")
    backend = runtimes.make_backend("tensorrt", str(onnx), precision=precision, workspace_mb=256,
                                    engine_cache=str(cache), example_shape=(3, 4), max_batch=8, trt=trt, memory=memory)
    return backend, weight, memory, rng


def test_tensorrt_backend_buffers_against_a_fake_engine(tmp_path):
    backend, weight, memory, rng = _cached_fake_engine(tmp_path, FakeTensorRT, "int8")
    assert not backend.built and backend.info()["precision"] == "int8"
    # Buffers sized for max_batch rows: 8 x 12 float32 in, 8 x 5 float32 out.
    assert sorted(len(b) for b in memory.buffers.values()) == [8 * 5 * 4, 8 * 12 * 4]
    x = rng.standard_normal((19, 3, 4)).astype(np.float32)  # more rows than max_batch: chunks of 8
    logits = x.reshape(19, 12) @ weight
    expected = np.exp(logits - logits.max(1, keepdims=True))
    expected /= expected.sum(1, keepdims=True)
    out = backend.run(x)
    assert out.shape == (19, 5) and np.allclose(out, expected, atol=1e-6)
    assert memory.syncs == 3
    assert np.allclose(backend.run(x[:1]), expected[:1], atol=1e-6)  # a smaller batch after a larger one
    backend.close()
    assert memory.buffers == {}


def test_tensorrt_engine_build_time_is_recorded(tmp_path, monkeypatch):
    """An engine built now (a cache miss) has its build time in the results, apart from the cold start."""
    memory = FakeMemory()
    trt = FakeTensorRT(np.ones((4, 3), np.float32), memory)
    onnx = tmp_path / "bundle" / "model.onnx"
    onnx.parent.mkdir()
    onnx.write_bytes(b"graph")

    def slow_build(trt_module, model_path, options, cache_dir, run=None, which=None):
        import time

        time.sleep(0.05)
        path = Path(cache_dir) / "built.engine"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"fake engine")
        return str(path), True

    monkeypatch.setattr(trt_backend, "cached_engine", slow_build)
    backend = runtimes.make_backend("tensorrt", str(onnx), precision="fp16", engine_cache=str(tmp_path / "c"),
                                    example_shape=(4,), max_batch=2, trt=trt, memory=memory)
    assert backend.built and backend.engine_build_ms >= 50
    assert backend.info()["engine_build_ms"] == backend.engine_build_ms


def test_tensorrt_backend_without_tensorrt_fails_clearly(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(backends.RuntimeProblem, match="TensorRT is not installed"):
        trt_backend.TensorRTBackend(str(tmp_path / "m.onnx"), example_shape=(4,))


def test_real_tensorrt_engine(multi_bundle, tmp_path):
    pytest.importorskip("tensorrt", reason="TensorRT cannot be installed on these machines (NVIDIA's wheels "
                                           "download from NVIDIA's index); engines are built on the target")
    backend = runtimes.make_backend("tensorrt", str(multi_bundle / "model.onnx"), precision="fp16",
                                    workspace_mb=256, engine_cache=str(tmp_path), example_shape=(64,))
    x = np.load(multi_bundle / "eval.npz")["x"]
    ref = np.load(multi_bundle / "eval.npz")["reference_probs"]
    assert np.abs(backend.run(x) - ref).max() < 1e-2


def test_a_tensorrt_before_8_is_refused_by_name_before_any_engine_build(tmp_path, monkeypatch):
    """TensorRT 7 has no serialized-network builder: refused before any build (the version check came only
    after a cached engine loaded, review)."""
    trt = FakeTensorRT(np.ones((4, 3), np.float32), FakeMemory())
    trt.__version__ = "7.1.3"
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"graph")
    monkeypatch.setattr(trt_backend, "cached_engine", lambda *a, **k: pytest.fail("built with TensorRT 7"))
    with pytest.raises(backends.RuntimeProblem, match=r"TensorRT 7.1.3 is too old for this runner: it needs TensorRT >= 8.0"):
        runtimes.make_backend("tensorrt", str(onnx), example_shape=(4,), trt=trt, memory=FakeMemory())


class FakeTensorRT82(FakeTensorRT):
    """TensorRT 8.2's slice of the API (JetPack 4.6, a Jetson Nano): binding indices, execute_async_v2, and a
    builder config with max_workspace_size; the same softmax(x @ W) engine."""

    __version__ = "8.2.1.8"

    def Runtime(self, logger):  # noqa: N802
        trt, named = self, super().Runtime(logger).deserialize_cuda_engine(b"fake engine")
        names = ["input", "probs"]

        class Engine:
            num_bindings = 2

            def get_binding_name(self, i):
                return names[i]

            def binding_is_input(self, i):
                return i == 0

            def get_binding_dtype(self, i):
                return np.float32

            def create_execution_context(self):
                return Context(named.create_execution_context())

        class Context:
            def __init__(self, inner):
                self.inner = inner   # the named fake, driven through binding indices

            def set_binding_shape(self, i, shape):
                assert i == 0, "the input's binding"
                self.inner.set_input_shape(names[i], shape)

            def get_binding_shape(self, i):
                return self.inner.get_tensor_shape(names[i])

            def execute_async_v2(self, bindings, stream_handle):
                assert stream_handle == trt.memory.stream and all(bindings)
                for name, ptr in zip(names, bindings):
                    self.inner.set_tensor_address(name, ptr)
                return self.inner.execute_async_v3(stream_handle)

        class Runtime:
            def deserialize_cuda_engine(self, data):
                return Engine() if data == b"fake engine" else None

        return Runtime()


def test_tensorrt_8_2_of_a_jetson_nano_runs_with_binding_indices(tmp_path):
    """JetPack 4.6 (TensorRT 8.2, the last a Jetson Nano gets) was refused as too old: the shipped jetson-nano
    profile could not finish on its board. It runs through the binding-index API, with the same buffers."""
    backend, weight, memory, rng = _cached_fake_engine(tmp_path, FakeTensorRT82, "fp16")
    options = trt_backend.trt_build_options("fp16", 256, "input", (3, 4), max_batch=8)
    x = rng.standard_normal((19, 3, 4)).astype(np.float32)
    logits = x.reshape(19, 12) @ weight
    expected = np.exp(logits - logits.max(1, keepdims=True))
    expected /= expected.sum(1, keepdims=True)
    assert np.allclose(backend.run(x), expected, atol=1e-6) and memory.syncs == 3
    backend.close()
    # trtexec before 8.4 takes --workspace and --buildOnly (--memPoolSize and --skipInference came with 8.4)
    cmd = trt_backend.trtexec_command("m.onnx", "m.engine", options, trt_version="8.2.1.8")
    assert "--workspace=256" in cmd and "--buildOnly" in cmd and not any("memPool" in c for c in cmd)
    cmd = trt_backend.trtexec_command("m.onnx", "m.engine", options, trt_version="10.3.0")
    assert "--memPoolSize=workspace:256" in cmd and "--skipInference" in cmd


def test_the_python_builder_of_tensorrt_8_2_sets_the_workspace_it_has(tmp_path):
    """8.2's builder config has max_workspace_size, not set_memory_pool_limit (a traceback on JetPack 4)."""
    from types import SimpleNamespace

    config = SimpleNamespace(max_workspace_size=0, set_flag=lambda flag: None,
                             add_optimization_profile=lambda profile: None)
    profile = SimpleNamespace(set_shape=lambda *a: None)
    network = object()
    builder = SimpleNamespace(create_network=lambda flags: network, create_builder_config=lambda: config,
                              create_optimization_profile=lambda: profile,
                              build_serialized_network=lambda net, cfg: b"engine bytes")
    parser = SimpleNamespace(parse=lambda data: True, num_errors=0)
    trt = SimpleNamespace(Logger=FakeTensorRT.Logger, Builder=lambda logger: builder,
                          NetworkDefinitionCreationFlag=SimpleNamespace(EXPLICIT_BATCH=0),
                          OnnxParser=lambda net, logger: parser, BuilderFlag=SimpleNamespace(FP16=1, INT8=2))
    (tmp_path / "m.onnx").write_bytes(b"graph")
    options = trt_backend.trt_build_options("fp16", 64, "input", (4,), max_batch=2)
    trt_backend.build_engine_python(trt, tmp_path / "m.onnx", tmp_path / "m.engine", options)
    assert config.max_workspace_size == 64 << 20 and (tmp_path / "m.engine").read_bytes() == b"engine bytes"


def test_without_cuda_python_or_pycuda_the_backend_names_both(monkeypatch):
    for module in ("cuda", "cuda.bindings", "pycuda", "pycuda.autoinit", "pycuda.driver"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(backends.RuntimeProblem, match=r"needs cuda-python \(.*\) or pycuda \(.*\); install one"):
        trt_backend.cuda_memory()


def test_an_engine_build_failure_names_the_file_and_blames_the_cache_only_when_it_is_the_cache(tmp_path, monkeypatch):
    trt = FakeTensorRT(np.ones((4, 3), np.float32), FakeMemory())
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"graph")
    for failing, hint in ((tmp_path / "cache" / "k.engine", True), (tmp_path, True),   # the cache or above it
                          (tmp_path / "cache2" / "k.engine", False), (tmp_path / "bin" / "trtexec", False)):
        def build(*args, failing=failing, **kwargs):
            raise PermissionError(13, "Permission denied", str(failing))

        monkeypatch.setattr(trt_backend, "cached_engine", build)
        with pytest.raises(backends.RuntimeProblem) as caught:
            runtimes.make_backend("tensorrt", str(onnx), example_shape=(4,), engine_cache=str(tmp_path / "cache"),
                                  trt=trt, memory=FakeMemory())
        assert f"{failing}: Permission denied" in str(caught.value)
        assert ("--engine-cache" in str(caught.value)) == hint
