"""The memory a model takes on the device: estimated before deployment, measured after (issue 21).

`budgets.memory_mb` judges the model's own memory, not the runtime's: the runner's peak RSS while the model
is loaded, run and warmed up, above the process with the runtime loaded (imported, and its one-off set-up
of the first session made). Python, numpy and the runtime are there whatever the model; counting them made
a 0.1 MB model measure as 60-100 MB. The runtime's parts are measured on the device too and reported beside.
No torch here: the report reads it.
"""


def memory_estimate(model_mb, activations_mb, mc_samples, runtime_memory, runtime_weights_mb=None):
    """(the model's own memory in MB, estimated; lower bound?; parts) of a candidate on the device.

    The model's own memory is what `budgets.memory_mb` judges, before deployment on this estimate and after
    it on the runner's measurement (peak RSS while the model is loaded, run and warmed up, above the process
    with the runtime loaded: own_memory): the model file (read while the session is built) + the
    runtime's copy of the weights (as big as the file, or for onnx-codebook the decoded fp32 weights:
    onnxruntime expands them at load, export/lowbit.py) + M x the activations of one sample (the packed
    layout runs the M samples side by side). 45 MB at session creation for a 22 MB ONNX file with
    onnxruntime 1.31. The runtime's baseline and one-off set-up (runner.time_models measures both on the
    device) are in `parts` and make the deployed process's estimate (`deployed_estimate`), not the budget's.
    Not fitted from measured profiles (issue 21 asks for that): a sum of the parts, exact for the weights.
    """
    runtime_memory = runtime_memory or {}
    baseline, setup = runtime_memory.get("runtime_baseline_mb"), runtime_memory.get("runtime_setup_mb")
    weights = model_mb + (model_mb if runtime_weights_mb is None else runtime_weights_mb)
    parts = {"runtime_baseline_mb": baseline, "runtime_setup_mb": setup, "weights_mb": weights,
             "activations_mb": mc_samples * activations_mb}
    own = weights + parts["activations_mb"]
    return own, False, parts


def own_memory(measured, parts):
    """The model's own memory after deployment, as `budgets.memory_mb` judges it: {"own_mb", "baseline_mb",
    "setup_mb", "measured_as"}, from the runner's `memory` (its model_mb: peak RSS while the model is loaded,
    run and warmed up, minus the RSS before, above the runtime imported) less the runtime's one-off set-up
    (first session: thread pools, kernel tables, arena; `parts`, measured by the runner on the device at
    selection or profiling, with the same runtime and threads). That set-up is the runtime's, not the
    model's: ~9 MB for onnxruntime 1.31 here, against 0.3 MB for the default digits model. Without a set-up
    measurement nothing is subtracted (the figure is then an upper bound and says so). The set-up is measured
    in another process of the same device (the selection's timing run), not in the deploying one.

    Where the set-up measured in that other process is larger than this process's whole rise (a model of a few
    KB: the two processes' set-ups differ by more than the model), the difference says nothing about the model:
    the weights' exact bytes (`parts`' weights_mb, the file and the runtime's copy) stand for it, and the text
    says so. Reported as 0 MB, it passed every memory budget."""
    model = measured.get("model_mb")
    if model is None:
        return None
    parts = parts or {}
    setup, weights = parts.get("runtime_setup_mb"), parts.get("weights_mb")
    own = model - (setup or 0.0)
    base = measured.get("runtime_baseline_mb")
    if setup is not None and base is not None:
        how = (f"the model's own: peak RSS above the runtime loaded (subtracted: {setup:.2f} MB of runtime "
               f"set-up measured on the device at selection, above a {base:.1f} MB baseline of the runtime imported)")
    else:
        how = "the model's own peak RSS with the runtime's set-up in it (no set-up measurement to subtract)"
    stand_in = weights is not None and own < weights
    if stand_in:
        how = (f"below what the measurement resolves (peak RSS {model:.2f} MB above the runtime loaded, "
               f"{setup or 0.0:.2f} MB of runtime set-up measured at selection subtracted): the weights' exact "
               f"bytes, file and runtime copy, stand for it")
        own = weights
    # stand_in: the figure is the weights' bytes, not a measurement (the report says so wherever it shows it)
    return {"own_mb": max(0.0, own), "baseline_mb": base, "setup_mb": setup, "measured_as": how,
            "stand_in": stand_in}


def deployed_estimate(parts):
    """The whole deployed process's memory from memory_estimate's parts (None without the runtime's)."""
    if parts.get("runtime_baseline_mb") is None or parts.get("runtime_setup_mb") is None:
        return None
    return sum(v for v in parts.values() if v is not None)
