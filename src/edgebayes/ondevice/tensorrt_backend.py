"""The TensorRT backend: the engine is built on the target from the bundle's ONNX, cached, and run with
explicit CUDA buffers.

Engines are GPU- and TensorRT-version-specific, so the bundle ships ONNX (fp32, or NNCF's Q/DQ model for
int8) and the engine is built here, on the target, once: it is cached under a key made of the ONNX's
sha256, the build options and the TensorRT version. trtexec (JetPack ships it) builds when it is on the
PATH, else the tensorrt Python API does.
"""

import hashlib
import json
import os
import time

import numpy as np

from .atomic import atomic_path
from .backends import ACCURACY_BATCH, Backend, RuntimeProblem
from .bundle import sha256_file
from .tables import PRECISIONS


def trt_build_options(precision, workspace_mb, input_name, example_shape, max_batch, opt_batch=1):
    """The options an engine is built with (and cached under): precision, workspace, shape profile."""
    if precision not in PRECISIONS:
        raise RuntimeProblem(f"TensorRT precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if workspace_mb < 1 or max_batch < opt_batch or opt_batch < 1:
        raise RuntimeProblem(f"TensorRT build options: workspace {workspace_mb} MiB, batch profile "
                             f"1..{opt_batch}..{max_batch} are not valid")
    example_shape = [int(d) for d in example_shape]
    return {"precision": precision, "workspace_mb": int(workspace_mb), "input_name": input_name,
            "min_shape": [1, *example_shape], "opt_shape": [int(opt_batch), *example_shape],
            "max_shape": [int(max_batch), *example_shape]}


def engine_cache_key(onnx_path, options, trt_version):
    """sha256 of the ONNX file, the build options and the TensorRT version: same key, same engine."""
    digest = hashlib.sha256()
    digest.update(sha256_file(onnx_path).encode())
    digest.update(json.dumps(options, sort_keys=True).encode())
    digest.update(str(trt_version).encode())
    return digest.hexdigest()


def trtexec_command(onnx_path, engine_path, options, trtexec="trtexec", trt_version=None):
    """The trtexec command line that builds `engine_path` from `onnx_path` with `options` (TensorRT before 8.4,
    JetPack 4's 8.2: --workspace and --buildOnly, which 8.4 replaced by --memPoolSize and --skipInference)."""
    def dims(shape):
        return "x".join(str(d) for d in shape)

    name, old = options["input_name"], _version(trt_version) < (8, 4)
    cmd = [trtexec, f"--onnx={onnx_path}", f"--saveEngine={engine_path}",
           (f"--workspace={options['workspace_mb']}" if old else f"--memPoolSize=workspace:{options['workspace_mb']}"),
           f"--minShapes={name}:{dims(options['min_shape'])}",
           f"--optShapes={name}:{dims(options['opt_shape'])}",
           f"--maxShapes={name}:{dims(options['max_shape'])}",
           "--buildOnly" if old else "--skipInference"]
    if options["precision"] == "fp16":
        cmd.append("--fp16")
    elif options["precision"] == "int8":
        cmd.append("--int8")  # explicit quantization: the scales come from the model's Q/DQ nodes
    return cmd


def build_engine_python(trt, onnx_path, engine_path, options):
    """Build and serialize an engine with the tensorrt Python API (TensorRT 8.0 to 10)."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    explicit_batch = getattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH", None)
    network = builder.create_network(0 if explicit_batch is None else 1 << int(explicit_batch))
    parser = trt.OnnxParser(network, logger)
    with open(onnx_path, "rb") as fh:
        if not parser.parse(fh.read()):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise RuntimeProblem(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    if hasattr(config, "set_memory_pool_limit"):
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options["workspace_mb"] << 20)
    else:   # before 8.3 (JetPack 4's 8.2)
        config.max_workspace_size = options["workspace_mb"] << 20
    if options["precision"] == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    elif options["precision"] == "int8":
        config.set_flag(trt.BuilderFlag.INT8)
    profile = builder.create_optimization_profile()
    profile.set_shape(options["input_name"], options["min_shape"], options["opt_shape"], options["max_shape"])
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeProblem(f"TensorRT failed to build an engine from {onnx_path}")
    with atomic_path(engine_path) as tmp:
        tmp.write_bytes(bytes(serialized))


def cached_engine(trt, onnx_path, options, cache_dir, run=None, which=None):
    """Path of the engine for (ONNX, options): built with trtexec or the Python API on a cache miss."""
    import shutil
    import subprocess

    os.makedirs(cache_dir, exist_ok=True)
    engine_path = os.path.join(cache_dir, engine_cache_key(onnx_path, options, trt.__version__) + ".engine")
    if os.path.isfile(engine_path):
        return engine_path, False
    trtexec = (which or shutil.which)("trtexec")
    if trtexec:
        with atomic_path(engine_path) as tmp:   # a failed or interrupted build leaves no engine behind
            done = (run or subprocess.run)(trtexec_command(onnx_path, tmp, options, trtexec, trt.__version__),
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                           universal_newlines=True)   # text= is 3.7+
            if done.returncode != 0 or not os.path.getsize(tmp):
                tail = (done.stdout or "").strip().splitlines()[-3:]
                raise RuntimeProblem(f"trtexec failed to build an engine from {onnx_path} "
                                     f"(exit {done.returncode}): {' | '.join(tail)}")
    else:
        build_engine_python(trt, onnx_path, engine_path, options)
    return engine_path, True


def _version(version):
    """(major, minor) of a TensorRT version string; (99, 0) for one it cannot read or None (taken as new: the
    engine's API is checked after loading)."""
    parts = (str(version).split(".") + ["0"])[:2]   # "7" reads as 7.0
    try:
        major, minor = (int(part) for part in parts)
    except ValueError:
        return (99, 0)
    return (major, minor)


def _too_old(version):
    """Whether a TensorRT version is before 8.0, which has no serialized-network builder this backend uses.
    8.0 to 8.4 (JetPack 4.6's 8.2 on a Jetson Nano) run with the binding-index API (_Bindings)."""
    return _version(version) < (8, 0)


TOO_OLD = "is too old for this runner: it needs TensorRT >= 8.0 (JetPack >= 4.6)"


def cuda_memory():
    """CudaMemory (cuda-python), else PyCudaMemory (pycuda: JetPack 4's Python 3.6, where cuda-python has no
    wheel); RuntimeProblem naming both when neither is installed."""
    try:
        return CudaMemory()
    except ImportError as exc:
        first = exc
    try:
        return PyCudaMemory()
    except ImportError as exc:
        raise RuntimeProblem(f"the TensorRT backend needs cuda-python ({first}) or pycuda ({exc}); install one: "
                             f"pip install cuda-python (Python >= 3.8) or pip install pycuda") from None


class CudaMemory:
    """Device buffers and copies through CUDA's runtime API (cuda-python), the way TensorRT's samples do."""

    def __init__(self):
        try:
            from cuda.bindings import runtime as cudart
        except ImportError:
            from cuda import cudart   # older cuda-python; ImportError: cuda_memory tries pycuda
        self.cudart = cudart
        self.stream = self._check(cudart.cudaStreamCreate())

    def _check(self, result):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            raise RuntimeProblem(f"CUDA error {err}")
        return rest[0] if rest else None

    def malloc(self, nbytes):
        return int(self._check(self.cudart.cudaMalloc(nbytes)))

    def free(self, ptr):
        self._check(self.cudart.cudaFree(ptr))

    def to_device(self, ptr, array):
        self._check(self.cudart.cudaMemcpyAsync(ptr, array.ctypes.data, array.nbytes,
                                                self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream))

    def to_host(self, array, ptr):
        self._check(self.cudart.cudaMemcpyAsync(array.ctypes.data, ptr, array.nbytes,
                                                self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream))

    def synchronize(self):
        self._check(self.cudart.cudaStreamSynchronize(self.stream))


class PyCudaMemory:
    """The same buffers and copies through pycuda (JetPack 4's samples use it); `stream` is the stream's handle,
    as TensorRT's execute calls take it."""

    def __init__(self):
        import pycuda.autoinit  # noqa: F401  (a context on device 0)
        import pycuda.driver as cuda

        self.cuda, self._stream, self.allocations = cuda, cuda.Stream(), {}
        self.stream = self._stream.handle

    def malloc(self, nbytes):
        allocation = self.cuda.mem_alloc(nbytes)
        self.allocations[int(allocation)] = allocation
        return int(allocation)

    def free(self, ptr):
        self.allocations.pop(ptr).free()

    def to_device(self, ptr, array):
        self.cuda.memcpy_htod_async(ptr, array, self._stream)

    def to_host(self, array, ptr):
        self.cuda.memcpy_dtoh_async(array, ptr, self._stream)

    def synchronize(self):
        self._stream.synchronize()


class _Bindings:
    """TensorRT 8.0-8.4's I/O API (binding indices; 8.5 named the tensors) behind the named calls the backend
    makes: a Jetson Nano stays at JetPack 4.6's TensorRT 8.2."""

    def __init__(self, engine, context):
        self.engine, self.context = engine, context
        self.index = {engine.get_binding_name(i): i for i in range(engine.num_bindings)}
        self.pointers = [0] * engine.num_bindings

    def names(self):
        return list(self.index)

    def is_input(self, name):
        return self.engine.binding_is_input(self.index[name])

    def dtype(self, name):
        return self.engine.get_binding_dtype(self.index[name])

    def set_input_shape(self, name, shape):
        self.context.set_binding_shape(self.index[name], tuple(shape))

    def get_tensor_shape(self, name):
        return tuple(self.context.get_binding_shape(self.index[name]))

    def set_tensor_address(self, name, ptr):
        self.pointers[self.index[name]] = int(ptr)

    def execute(self, stream):
        return self.context.execute_async_v2(bindings=self.pointers, stream_handle=stream)


class _Named:
    """TensorRT >= 8.5's named-tensor I/O API, as _Bindings presents it."""

    def __init__(self, trt, engine, context):
        self.trt, self.engine, self.context = trt, engine, context

    def names(self):
        return [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]

    def is_input(self, name):
        return self.engine.get_tensor_mode(name) == self.trt.TensorIOMode.INPUT

    def dtype(self, name):
        return self.engine.get_tensor_dtype(name)

    def set_input_shape(self, name, shape):
        self.context.set_input_shape(name, tuple(shape))

    def get_tensor_shape(self, name):
        return tuple(self.context.get_tensor_shape(name))

    def set_tensor_address(self, name, ptr):
        self.context.set_tensor_address(name, ptr)

    def execute(self, stream):
        return self.context.execute_async_v3(stream)


class TensorRTBackend(Backend):
    """A TensorRT engine built on this device from the bundle's ONNX (cached), run with explicit buffers.

    Buffers: one device buffer for the input and one for the output, sized for `max_batch` rows of the
    engine's own dtypes, allocated once; run() sets the input shape, copies the batch in, enqueues, copies
    the [batch, C] output back and waits for the stream. Larger batches run in chunks of max_batch.
    `trt` and `memory` can be injected (tests use fakes; TensorRT cannot be installed on the CI machines).
    """

    name = "tensorrt"

    @staticmethod
    def load_runtime():
        try:
            import tensorrt  # noqa: F401
        except ImportError as exc:
            raise RuntimeProblem(f"TensorRT is not installed ({exc}); on Jetson it comes with JetPack "
                                 "(python3-libnvinfer), elsewhere: pip install tensorrt") from exc

    def __init__(self, model_path, threads=0, precision="fp16", workspace_mb=1024, engine_cache=None,
                 example_shape=None, max_batch=ACCURACY_BATCH, opt_batch=1, trt=None, memory=None):
        super().__init__(model_path, threads)
        if trt is None:
            try:
                import tensorrt as trt
            except ImportError as exc:
                raise RuntimeProblem(f"TensorRT is not installed ({exc}); on Jetson it comes with JetPack "
                                     "(python3-libnvinfer), elsewhere: pip install tensorrt") from exc
        self.trt = trt
        if example_shape is None:
            raise RuntimeProblem("the TensorRT backend needs the per-example input shape (from the manifest)")
        if _too_old(trt.__version__):   # before any build
            raise RuntimeProblem(f"TensorRT {trt.__version__} {TOO_OLD}")
        options = trt_build_options(precision, workspace_mb, "input", example_shape, max_batch, opt_batch)
        cache_dir = engine_cache or os.path.join(os.path.dirname(os.path.abspath(model_path)), "..", "trt-engines")
        t0 = time.perf_counter()
        try:
            self.engine_path, self.built = cached_engine(trt, model_path, options, cache_dir)
        except OSError as exc:   # one line and exit 3, not a traceback
            where = os.path.abspath(exc.filename) if exc.filename else None
            cache = os.path.abspath(cache_dir)   # the cache, or a folder above it that makedirs could not make
            in_cache = where is not None and os.path.commonpath([where, cache]) in (where, cache)
            hint = "; give a writable folder with --engine-cache DIR" if in_cache else ""
            raise RuntimeProblem(f"TensorRT engine build: {where or model_path}: {exc.strerror or exc}{hint}") from exc
        # Building an engine takes seconds to minutes on a board and happens once per (ONNX, options,
        # TensorRT version): recorded apart from the session's cold start; None when it came from the cache.
        self.engine_build_ms = 1000.0 * (time.perf_counter() - t0) if self.built else None
        self.options, self.max_batch = options, int(max_batch)
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        with open(self.engine_path, "rb") as fh:
            self.engine = runtime.deserialize_cuda_engine(fh.read())
        if self.engine is None:
            raise RuntimeProblem(f"TensorRT could not load the engine {self.engine_path}; delete it to rebuild")
        if not hasattr(self.engine, "num_io_tensors") and not hasattr(self.engine, "num_bindings"):
            raise RuntimeProblem(f"TensorRT {trt.__version__} {TOO_OLD}")   # a version string _too_old could not read
        self.context = self.engine.create_execution_context()
        self.io = (_Named(trt, self.engine, self.context) if hasattr(self.engine, "num_io_tensors")
                   else _Bindings(self.engine, self.context))
        names = self.io.names()
        inputs = [n for n in names if self.io.is_input(n)]
        outputs = [n for n in names if n not in inputs]
        if len(inputs) != 1 or len(outputs) != 1:
            raise RuntimeProblem(f"{self.engine_path}: expected one input and one output, "
                                 f"got {len(inputs)} and {len(outputs)}")
        self.input_name, self.output_name = inputs[0], outputs[0]
        self.input_dtype = np.dtype(trt.nptype(self.io.dtype(self.input_name)))
        self.output_dtype = np.dtype(trt.nptype(self.io.dtype(self.output_name)))
        self.memory = memory or cuda_memory()
        self.example_shape = tuple(int(d) for d in example_shape)
        # The output row size is known once the input shape is set: ask at max batch.
        self.io.set_input_shape(self.input_name, (self.max_batch,) + self.example_shape)
        out_row = int(np.prod(self.io.get_tensor_shape(self.output_name)[1:]))
        self.d_input = self.memory.malloc(self.max_batch * int(np.prod(self.example_shape)) * self.input_dtype.itemsize)
        self.d_output = self.memory.malloc(self.max_batch * out_row * self.output_dtype.itemsize)
        self.io.set_tensor_address(self.input_name, self.d_input)
        self.io.set_tensor_address(self.output_name, self.d_output)

    @property
    def version(self):
        return self.trt.__version__

    def _run_chunk(self, x):
        x = np.ascontiguousarray(x, dtype=self.input_dtype)
        self.io.set_input_shape(self.input_name, x.shape)
        out = np.empty(self.io.get_tensor_shape(self.output_name), dtype=self.output_dtype)
        self.memory.to_device(self.d_input, x)
        if not self.io.execute(getattr(self.memory, "stream", 0)):
            raise RuntimeProblem(f"TensorRT failed to run {self.engine_path}")
        self.memory.to_host(out, self.d_output)
        self.memory.synchronize()
        return out.astype(np.float32, copy=False)

    def run(self, x):
        if len(x) <= self.max_batch:
            return self._run_chunk(x)
        return np.concatenate([self._run_chunk(x[i:i + self.max_batch]) for i in range(0, len(x), self.max_batch)])

    def close(self):
        for ptr in (self.d_input, self.d_output):
            self.memory.free(ptr)
        self.d_input = self.d_output = None

    def info(self):
        info = super().info()
        info.update({"engine": os.path.basename(self.engine_path), "engine_built_now": self.built,
                     "engine_build_ms": self.engine_build_ms,
                     "precision": self.options["precision"], "workspace_mb": self.options["workspace_mb"]})
        return info
