"""Runtime backends: load a model once, then run(x) -> class probabilities.

Each backend imports its runtime lazily (in load_runtime / __init__), so that this package imports on a
device that has only one runtime. To add a runtime: subclass Backend, implement __init__/run/version/info,
register it in runtimes.BACKENDS and give it a row in tables.RUNTIME_MODULES (and formats in tables.FORMATS).
TensorRT, whose engines are built on the target, is in tensorrt_backend.py.
"""

import contextlib
import os
import re
import sys
import tempfile

import numpy as np

ACCURACY_BATCH = 256  # rows per run of the accuracy pass: big enough to be fast, small enough for a Pi's memory

# Lines TensorFlow / LiteRT's native code writes at start-up that say nothing about the run (absl INFO lines:
# oneDNN notes, op counts; the delegate notice). Warnings and errors are not in it.
NATIVE_NOISE = (
    re.compile(r"^I\d{4} \d\d:\d\d:[\d.]+ +\d+ [\w./-]+\.cc:\d+\] "),
    re.compile(r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$"),
    re.compile(r"^INFO: Created TensorFlow Lite XNNPACK delegate for CPU\.$"),
)


class RuntimeProblem(Exception):
    """The requested runtime is unknown, not installed, or failed on the model."""


def native_model_source(path):
    """(path, None) as a runtime's C++ constructor takes it, or (None, the file's bytes) where no str can name it.

    Runtimes' bindings encode a path as UTF-8. Outside Python's UTF-8 mode, in a C / POSIX or other non-UTF-8
    locale, a folder named with non-ASCII characters reaches Python as surrogate escapes, which do not encode:
    onnxruntime refused it with a pybind11 TypeError. Such a path's own bytes are usually UTF-8 (what the name
    was written as), and decoded as that they name the same file; where they are not, the model is handed over
    as bytes (held once more while the session is built)."""
    path = os.fspath(path)
    try:
        path.encode("utf-8")
        return path, None
    except UnicodeEncodeError:
        pass
    try:
        return os.fsencode(path).decode("utf-8"), None
    except UnicodeDecodeError:
        with open(path, "rb") as f:
            return None, f.read()


@contextlib.contextmanager
def native_noise_filtered(patterns=NATIVE_NOISE):
    """Native libraries write to file descriptor 2 directly, past sys.stderr and any log level: while the
    block runs, fd 2 goes to a temporary file, and afterwards every line of it except the known start-up
    noise (`patterns`) is written to stderr as it came. Where fd 2 cannot be redirected, nothing is."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            except ValueError:
                pass
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = [line for line in capture.read().decode(errors="replace").splitlines(keepends=True)
                    if not any(p.search(line.rstrip("\r\n")) for p in patterns)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()



class Backend:
    """Interface: load a model once, then run(x) -> class probabilities."""

    name = "base"

    def __init__(self, model_path, threads=0):
        self.model_path = model_path
        self.threads = threads

    @property
    def version(self):
        raise NotImplementedError

    def run(self, x):
        """Run one batch `x` (np.ndarray) and return probabilities [batch, C]."""
        raise NotImplementedError

    def info(self):
        """JSON-ready description of the runtime for the results file."""
        return {"name": self.name, "version": self.version, "threads": self.threads}

    # The shape of one input the model takes (None for a dimension it leaves open), or None when unknown.
    example_shape = None

    @staticmethod
    def load_runtime():
        """Import the runtime and nothing else: the process's memory then is the runtime's baseline (no
        model), which the model's own memory is measured against (see `main`)."""


class OnnxRuntimeBackend(Backend):
    """ONNX Runtime on CPU by default; other execution providers on request."""

    name = "onnxruntime"

    @staticmethod
    def load_runtime():
        try:
            import onnxruntime  # noqa: F401
        except ImportError as exc:
            raise RuntimeProblem(f"onnxruntime is not installed ({exc}); "
                                 "install it with: pip install onnxruntime") from exc

    def __init__(self, model_path, threads=0, providers=None):
        super().__init__(model_path, threads)
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise RuntimeProblem(f"onnxruntime is not installed ({exc}); "
                                 "install it with: pip install onnxruntime") from exc
        self._ort = ort
        providers = list(providers) if providers else ["CPUExecutionProvider"]
        available = ort.get_available_providers()
        unknown = [p for p in providers if p not in available]
        if unknown:
            # ORT would silently fall back to CPU; a benchmark must not.
            raise RuntimeProblem(f"onnxruntime execution provider(s) not available: {', '.join(unknown)} "
                                 f"(available: {', '.join(available)})")
        options = ort.SessionOptions()
        if threads > 0:
            options.intra_op_num_threads = threads
        try:
            named, content = native_model_source(model_path)
            self.session = ort.InferenceSession(named or content, sess_options=options, providers=providers)
        except Exception as exc:  # ORT raises its own exception types
            raise RuntimeProblem(f"onnxruntime could not load {model_path}: {exc}") from exc
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        if len(inputs) != 1 or len(outputs) != 1:
            raise RuntimeProblem(f"{model_path}: expected one input and one output, "
                                 f"got {len(inputs)} and {len(outputs)}")
        self.input_name = inputs[0].name
        self.output_name = outputs[0].name
        shape = inputs[0].shape   # [] where the graph leaves the rank open
        self.example_shape = tuple(d if isinstance(d, int) else None for d in shape[1:]) if shape else None

    @property
    def version(self):
        return self._ort.__version__

    def run(self, x):
        return self.session.run([self.output_name], {self.input_name: x})[0]

    def info(self):
        info = super().info()
        info["providers"] = self.session.get_providers()  # what ORT actually uses
        return info


def _tflite_interpreter():
    """The TFLite Interpreter class: ai_edge_litert, else tflite_runtime, else tensorflow.lite.

    ai-edge-litert is the maintained runtime (numpy 2); tflite_runtime is what older Raspberry Pi images
    carry (numpy 1); full TensorFlow has it as tf.lite. Returns (Interpreter, package name, version).
    TensorFlow's C++ start-up messages (CPU feature notes, "Created TensorFlow Lite XNNPACK delegate")
    are not the benchmark's: their log level is raised unless the caller set one.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with native_noise_filtered():
        return _import_tflite_interpreter()


def _import_tflite_interpreter():
    tried = []
    try:
        import ai_edge_litert
        from ai_edge_litert import interpreter as litert
        return litert.Interpreter, "ai-edge-litert", getattr(ai_edge_litert, "__version__", "unknown")
    except ImportError as exc:
        tried.append(f"ai_edge_litert ({exc})")
    try:
        import tflite_runtime
        from tflite_runtime import interpreter as tflr
        return tflr.Interpreter, "tflite_runtime", getattr(tflite_runtime, "__version__", "unknown")
    except ImportError as exc:
        tried.append(f"tflite_runtime ({exc})")
    try:
        import tensorflow as tf
        return tf.lite.Interpreter, "tensorflow.lite", tf.__version__
    except ImportError as exc:
        tried.append(f"tensorflow ({exc})")
    raise RuntimeProblem("no TFLite runtime is installed (tried " + "; ".join(tried) +
                         "); install one with: pip install ai-edge-litert")


class TFLiteBackend(Backend):
    """A .tflite model on the CPU (XNNPACK) with LiteRT / tflite_runtime / tf.lite.

    Quantized input and output tensors (full-integer int8 models) are handled here: the input is
    quantized with the tensor's scale and zero point, the output dequantized, so run() always takes and
    returns float32. A model with a fixed batch (litert-torch exports batch 1) runs a larger batch in
    chunks of its batch size, the last one zero-padded.
    """

    name = "tflite"

    @staticmethod
    def load_runtime():
        _tflite_interpreter()

    def __init__(self, model_path, threads=0):
        super().__init__(model_path, threads)
        interpreter_cls, self.package, self._version = _tflite_interpreter()
        try:
            with native_noise_filtered():   # "Created TensorFlow Lite XNNPACK delegate for CPU."
                named, content = native_model_source(model_path)
                self.interpreter = interpreter_cls(model_path=named, model_content=content, num_threads=threads or None)
                self.interpreter.allocate_tensors()
        except Exception as exc:
            raise RuntimeProblem(f"{self.package} could not load {model_path}: {exc}") from exc
        inputs, outputs = self.interpreter.get_input_details(), self.interpreter.get_output_details()
        if len(inputs) != 1 or len(outputs) != 1:
            raise RuntimeProblem(f"{model_path}: expected one input and one output, "
                                 f"got {len(inputs)} and {len(outputs)}")
        self.input, self.output = inputs[0], outputs[0]
        signature = self.input.get("shape_signature", self.input["shape"])
        self.dynamic_batch = int(signature[0]) == -1
        self.batch = int(self.input["shape"][0])
        self.example_shape = tuple(int(d) if d >= 0 else None for d in signature[1:])

    @property
    def version(self):
        return self._version

    @staticmethod
    def _quantize(x, detail):
        if detail["dtype"] == np.float32:
            return x.astype(np.float32, copy=False)
        scale, zero_point = detail["quantization"]
        info = np.iinfo(detail["dtype"])
        return np.clip(np.round(x / scale) + zero_point, info.min, info.max).astype(detail["dtype"])

    @staticmethod
    def _dequantize(y, detail):
        if detail["dtype"] == np.float32:
            return y
        scale, zero_point = detail["quantization"]
        return (y.astype(np.float32) - zero_point) * scale

    def _invoke(self, x):
        self.interpreter.set_tensor(self.input["index"], self._quantize(x, self.input))
        self.interpreter.invoke()
        return self._dequantize(self.interpreter.get_tensor(self.output["index"]), self.output)

    def run(self, x):
        n = len(x)
        if self.dynamic_batch:
            if n != self.batch:
                self.interpreter.resize_tensor_input(self.input["index"], [n, *x.shape[1:]])
                self.interpreter.allocate_tensors()
                self.batch = n
            return self._invoke(x).copy()
        outs = []
        for start in range(0, n, self.batch):
            chunk = x[start:start + self.batch]
            if len(chunk) < self.batch:
                chunk = np.concatenate([chunk, np.zeros((self.batch - len(chunk), *x.shape[1:]), x.dtype)])
            outs.append(self._invoke(chunk)[: n - start].copy())
        return np.concatenate(outs) if len(outs) > 1 else outs[0]

    def info(self):
        info = super().info()
        info.update({"package": self.package, "input_dtype": np.dtype(self.input["dtype"]).name,
                     "model_batch": None if self.dynamic_batch else self.batch})
        return info

