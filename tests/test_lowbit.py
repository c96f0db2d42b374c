"""Low-bit ONNX of SQS networks (issue 21): integer weights in the file, pruned inputs gone, same function."""

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from edgebayes.config import PipelineConfig
from edgebayes.export import lowbit
from edgebayes.compressed.samples import compress, predict
from edgebayes.export.formats import artifact_predict, export_artifact
from edgebayes.train.models import build_model
from edgebayes.train.sqs import SQSNet

INPUTS, CLASSES = 40, 5


def sqs_net(first_layer_scores="per-input", seed=0):
    """A small SQS MLP with distinct keep scores (as after training)."""
    torch.manual_seed(seed)
    cfg = PipelineConfig()
    cfg.model.family, cfg.model.hidden = "dnn", [16, 12]
    base = build_model(cfg.model, cfg.prior, (INPUTS,), CLASSES, n_train=100)
    # tau = 1: soft level probabilities phi, so that the M samples differ (a trained one is sharper)
    net = SQSNet(base, components=4, windowing="single", first_layer_scores=first_layer_scores, tau=1.0)
    net.initialise(keep_init=0.9, seed=seed)
    with torch.no_grad():
        for p in net.posteriors.values():
            p.score.copy_(torch.randn(p.score.shape))
    return net


@pytest.mark.parametrize("layout, m, temperature", [("packed", 1, 1.0), ("packed", 3, 1.0), ("unrolled", 1, 1.0),
                                                   ("unrolled", 3, 1.0), ("packed", 3, 0.6), ("unrolled", 3, 0.6)])
def test_codebook_onnx_has_integer_weights_no_pruned_inputs_and_the_torch_probabilities(tmp_path, layout, m,
                                                                                       temperature):
    """... at a fitted temperature too (select.temperature_scaling): one more scalar, not a weight."""
    torch.set_num_threads(1)
    net = sqs_net()
    compressed = compress(net, 0.5, m, seed=0)
    compressed.temperature = temperature
    mc = compressed.mc_model()
    x = torch.randn(64, INPUTS)
    details = {}
    path = export_artifact(mc, "onnx-codebook", tmp_path / "cb.onnx", x[:16], layout=layout, details=details)
    fp32 = export_artifact(mc, "onnx", tmp_path / "fp32.onnx", x[:16], layout=layout)
    graph = onnx.load(str(path)).graph
    inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    # No fp32 weight matrix is left: float initializers are codebooks (<= 256 levels) and biases (1-D).
    floats = {n: a for n, a in inits.items() if a.dtype == np.float32}
    assert all(a.ndim <= 1 for a in floats.values())
    assert any(a.dtype == np.uint8 for a in inits.values())
    # The first layer reads only the kept inputs: its stored weight has fewer columns than the input.
    first = net.keep_masks(0.5)[net.wrapped[0]]
    kept_inputs = int(first.any(0).sum())
    assert kept_inputs < INPUTS
    first_tensor = next(t for t in details["tensors"].values() if t["shape"][-1] == INPUTS)
    assert first_tensor["inputs_removed"] == INPUTS - kept_inputs
    assert first_tensor["stored_shape"][-1] == kept_inputs
    # The same function as PyTorch's SQS MC average.
    probs = artifact_predict(path, "onnx-codebook", x.numpy())
    assert np.abs(probs - predict(mc, x).numpy()).max() <= 1e-4
    b = details["bytes_breakdown"]
    assert b["bytes"] == path.stat().st_size and b["fp32_bytes"] == fp32.stat().st_size
    assert sum(b["sections"].values()) == b["bytes"] and b["sections"]["weights"] == 0


@pytest.mark.parametrize("layout", ["packed", "unrolled"])
def test_the_export_summary_counts_the_shipped_files_parameters_and_flops(tmp_path, layout):
    """The report's parameters and FLOPs of an onnx-codebook bundle were those of the fp32 ONNX beside it,
    with the input pixels the shipped file drops still counted: now of the shipped file. Parameters as
    onnxruntime holds them once it has decoded the weights; FLOPs by appendix A.1 with the first layer's
    inputs kept."""
    import onnxruntime as ort

    from edgebayes.compressed.structure import structure_report
    from edgebayes.export.onnx_export import onnx_parameter_count
    from edgebayes.stages import _shipped_structure

    torch.set_num_threads(1)
    net, m = sqs_net(), 3
    compressed = compress(net, 0.5, m, seed=0)
    mc = compressed.mc_model()
    x = torch.randn(16, INPUTS)
    details = {}
    path = export_artifact(mc, "onnx-codebook", tmp_path / "cb.onnx", x, layout=layout, details=details)
    fp32 = export_artifact(mc, "onnx", tmp_path / "fp32.onnx", x, layout=layout)
    structure = structure_report(compressed.dense_sample, compressed.samples[0], compressed.kept, (INPUTS,))
    shipped = _shipped_structure(details, onnx_parameter_count(fp32), structure, m)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "decoded.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    decoded = sum(int(np.prod(t.dims)) for t in onnx.load(str(tmp_path / "decoded.onnx")).graph.initializer
                  if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) >= 1)
    kept_inputs = int(net.keep_masks(0.5)[net.wrapped[0]].any(0).sum())
    first = next(mod for mod in compressed.samples[0].modules() if isinstance(mod, torch.nn.Linear))
    dropped = (INPUTS - kept_inputs) * first.out_features * m   # the first layer's columns, in every sample
    assert shipped["shipped_params"] == onnx_parameter_count(fp32) - dropped
    # onnxruntime's decoded graph: the same, or fewer where it keeps one copy of equal tensors (the biases the
    # unrolled samples share; onnx_parameter_count counts each use, as the fp32 figure does)
    assert decoded == shipped["shipped_params"] if layout == "packed" else decoded <= shipped["shipped_params"]
    flops = structure["pruned_flops"] - (INPUTS - kept_inputs) * first.out_features
    assert shipped["weights_dropped_with_inputs"] == dropped > 0
    assert shipped["physical_flops_ratio"] == pytest.approx(flops / structure["dense_flops"])
    assert shipped["physical_flops_ratio_before_input_removal"] == structure["physical_flops_ratio"]
    weights_only = {}
    export_artifact(mc, "onnx-fp16w", tmp_path / "w.onnx", x, layout=layout, details=weights_only)
    assert _shipped_structure(weights_only, 1, structure, m) == {}   # a file that drops nothing


@pytest.mark.parametrize("kind", ["dense", "zero-level", "mask", "zero-list"])
@pytest.mark.parametrize("levels", [2, 4, 16, 200])
def test_every_encoding_decodes_the_exact_weights(kind, levels):
    rng = np.random.default_rng(levels)
    codebook = rng.normal(size=levels).astype(np.float32)
    w = codebook[rng.integers(0, levels, size=(7, 9))]
    if kind != "dense":
        w[rng.random(w.shape) < 0.3] = 0
    graph = helper.make_graph([], "t", [], [helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [7, 9])])
    b = lowbit._Builder(graph)
    out, used = lowbit._decode(b, w, kind)
    assert used == kind
    graph.node.extend(b.nodes + [helper.make_node("Identity", [out], ["w"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    import onnxruntime as ort

    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {})[0]
    assert got.dtype == np.float32 and np.array_equal(got, w)


def test_a_network_without_a_codebook_is_refused(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(INPUTS, 8), torch.nn.ReLU(), torch.nn.Linear(8, CLASSES))
    with pytest.raises(ValueError, match=r"^onnx-codebook: no weight of the network .* SQS") as refused:
        export_artifact(torch.nn.Sequential(net, torch.nn.Softmax(-1)), "onnx-codebook", tmp_path / "x.onnx",
                        torch.randn(4, INPUTS), layout="unrolled")
    assert "tmp" not in str(refused.value)   # it named the temporary fp32 file the rewrite reads


def test_onnxruntime_decodes_the_weights_once_at_load(tmp_path):
    """Every decoding op is constant-folded when the session is created: no per-call decoding cost."""
    import onnxruntime as ort

    net = sqs_net(first_layer_scores="per-weight")
    mc = compress(net, 0.5, 2, seed=0).mc_model()
    path = export_artifact(mc, "onnx-codebook", tmp_path / "cb.onnx", torch.randn(16, INPUTS), layout="unrolled")
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    ops = {n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node}
    decoding = {"BitShift", "Mod", "CumSum", "Where", "ScatterND", "TopK", "Range", "Cast", "Slice"}
    assert ops and not ops & decoding, ops & decoding


def test_the_mask_of_stacked_samples_is_stored_once():
    rng = np.random.default_rng(0)
    block = rng.random((6, 50)) < 0.5
    w = np.where(np.tile(block, (4, 1)), rng.choice(np.float32([-0.3, -0.1, 0.1, 0.3]), (24, 50)), 0).astype(np.float32)
    assert lowbit._blocks(w != 0) == 4
    size, kind, parts = next(e for e in lowbit._encodings(w) if e[1] == "mask")
    assert parts["mask"].size == w.size // 4 and size == 300 // 8 + 1 + int((w != 0).sum()) * 2 // 8
    graph = helper.make_graph([], "t", [], [helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, list(w.shape))])
    b = lowbit._Builder(graph)
    out, _ = lowbit._decode(b, w, "mask")
    graph.node.extend(b.nodes + [helper.make_node("Identity", [out], ["w"])])
    import onnxruntime as ort

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {})[0]
    assert np.array_equal(got, w)


@pytest.mark.parametrize("storage, tolerance", [("fp16", 1e-3), ("int8", 2e-2)])
def test_fp16_and_int8_weight_storage_keep_the_function_and_store_no_fp32_weight(tmp_path, storage, tolerance):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 8),
                              torch.nn.ReLU(), torch.nn.Linear(8, CLASSES), torch.nn.Softmax(-1)).eval()
    x = torch.randn(32, 1, 8, 8)
    fp32 = export_artifact(net, "onnx", tmp_path / "fp32.onnx", x[:4], layout="unrolled")
    out = tmp_path / f"{storage}.onnx"
    assert lowbit.weight_storage(fp32, out, storage)["tensors"] == 3
    inits = [numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer]
    assert not [a for a in inits if a.dtype == np.float32 and a.ndim >= 2]
    assert any(a.dtype == (np.float16 if storage == "fp16" else np.int8) for a in inits)
    ref = artifact_predict(fp32, "onnx", x.numpy())
    assert np.abs(artifact_predict(out, "onnx", x.numpy()) - ref).max() <= tolerance
    stored = lowbit.breakdown(out)["sections"]["weights"]
    assert stored <= lowbit.breakdown(fp32)["sections"]["weights"] / (2 if storage == "fp16" else 3)


@pytest.mark.parametrize("m", [1, 2])
def test_codebook_onnx_of_a_network_with_batch_norms_stores_every_layer_as_k_levels(tmp_path, m):
    """A batch norm folded into its convolution scaled each output channel's K levels: K x C_out values, stored
    as 8-bit indices or, past 255, as plain fp32 (ResNet-18: 89.4 MB against 89.4 MB for onnx), while the
    run reported 2 bits (probe). Kept unfolded for onnx-codebook, every layer is a K-level codebook."""
    from edgebayes.train.sqs import build_sqs

    torch.set_num_threads(1)
    cfg = PipelineConfig.model_validate({"model": {"family": "sqs", "arch": "resnet20"},
                                         "sqs": {"components": 4, "windows": "single"}})
    torch.manual_seed(0)
    net = build_sqs(cfg, (3, 8, 8), CLASSES, 1000)
    for bn in (mod for mod in net.base.modules() if isinstance(mod, torch.nn.BatchNorm2d)):   # as trained
        bn.running_var.uniform_(0.5, 2.0), bn.running_mean.uniform_(-0.5, 0.5), bn.weight.data.uniform_(0.5, 1.5)
    net.initialise(cfg.sqs.keep_init, 0)
    mc = compress(net.eval(), 0.5, m, seed=0).mc_model()
    x = torch.randn(32, 3, 8, 8)
    details = {}
    path = export_artifact(mc, "onnx-codebook", tmp_path / "cb.onnx", x[:16], details=details)
    assert len(details["tensors"]) == len(net.wrapped)   # every layer (the M samples packed in one tensor each)
    inits = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    codebooks = [a for name, a in inits.items() if "levels" in name]
    assert codebooks and max(a.size for a in codebooks) <= 4 + 1   # K levels (+ the zero level), not K x C_out
    assert path.stat().st_size < 0.25 * export_artifact(mc, "onnx", tmp_path / "fp32.onnx", x[:16]).stat().st_size
    with torch.no_grad():
        assert np.abs(artifact_predict(path, "onnx-codebook", x.numpy()) - mc(x).numpy()).max() < 1e-5


def test_codebook_onnx_of_a_layer_with_every_weight_pruned_runs_and_computes_zeros(tmp_path):
    """At a non-zero rate of 1e-5 whole layers are pruned: their codebook was empty and onnxruntime's Gather
    failed on the file ('indices element out of data bounds', probe); the layer is a constant zero tensor."""
    torch.set_num_threads(1)
    net = sqs_net()
    # no network is left (compress refuses that for select and export); the exporter must still write an empty
    # layer, which a residual path goes around in other networks
    mc = compress(net, 1e-5, 2, seed=0, allow_no_network=True).mc_model()
    x = torch.randn(32, INPUTS)
    details = {}
    path = export_artifact(mc, "onnx-codebook", tmp_path / "cb.onnx", x[:16], details=details)
    assert any(t["encoding"] == "zeros" for t in details["tensors"].values())
    with torch.no_grad():
        assert np.abs(artifact_predict(path, "onnx-codebook", x.numpy()) - mc(x).numpy()).max() < 1e-5
