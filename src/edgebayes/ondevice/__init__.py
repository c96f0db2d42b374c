"""What runs on the device: bundle verification, runtime backends, metrics, timing and the runner's
command line.

This package is the bottom layer of edgebayes. It imports only the standard library, numpy and (inside
functions, when a backend is made) the inference runtime, and nothing of edgebayes outside itself, with
relative imports only: at export time `pack.write_runner` zips it into the bundle as one zipapp
(runner.pyz), hashed in the manifest, and the device runs that file with its own python, which has neither
torch nor edgebayes. train, export and deploy import the metrics and the bundle checks from here, so they
are defined once; nothing here imports upward (tests/test_layers.py checks it).

    tables    formats, runtimes, precisions and the timing protocol's defaults (config.py uses them too)
    atomic    the one atomic file writer
    metrics   accuracy, NLL, ECE, Brier, reliability, OOD AUROC/AUPR, selective prediction
    bundle    manifest checks, sha256, the eval set
    backends  onnxruntime and TFLite; tensorrt_backend: engines built on the target; runtimes: the registry
    timing    the latency protocol; machine: memory (RSS) and device facts
    cli       the runner's command line (python runner.pyz --bundle ...), and the one builder of it
    pack      the zipapp
"""
