"""Low-bit ONNX of a codebook-quantized network (SQS, paper 001): the deployed file as small as the model.

`lowbit_onnx` rewrites the fp32 ONNX that export writes (formats.py's "onnx") into the format
"onnx-codebook": every weight initializer with at most 255 distinct non-zero values (an SQS layer has K
levels per window) is replaced by

  - its codebook (float32 levels, stored once per distinct codebook: the M samples of a layer share it) and
    its level indices, bit-packed into uint8 bytes at 1, 2, 4 or 8 bits each (the smallest that holds the
    levels; 3 bits would straddle bytes), unpacked in the graph with BitShift / Mod / Gather. Gather from
    the codebook, not DequantizeLinear: SQS levels are k-means centres, not an affine grid
    scale * (q - zero_point), so DequantizeLinear (int4 / uint4 / uint8) cannot give them exactly. The
    indices could also be typed UINT4 (opset 21) or UINT2 (opset 25) initializers cast to int64:
    onnxruntime 1.31 runs both on the CPU (tried), at the same bytes; the uint8 bit-packing keeps the graph
    at the exporter's opset (17), which older runtimes on the boards load. BitShift, Mod, Gather,
    CumSum, Where, ScatterND, Range, TopK are all in opset 11, and onnxruntime constant-folds every one of
    them (NonZero it does not fold, so it is not used);
  - the sparsity mask as structure where it is structured: input features that every weight of a Gemm /
    MatMul ignores (whole pixels pruned by sqs.first_layer_scores = per-input; dead units of the layer
    before) are removed from the weight, and a Gather of the kept features runs before the layer, so their
    multiply-adds go too. The kept features are stored as a bit per input feature.
    Where the mask is not structured, the cheapest of three encodings per tensor (by stored bytes):
      zero-level   the zero is one more codebook level (K + 1 levels: 4 bits for K = 4);
      mask         one mask bit per weight + the indices of the kept weights only (CumSum, Where); the
                   mask of M samples stacked along the output channels (packed layout) stored once;
      zero-list    dense indices of K levels + the flat positions of the few zeros (uint16 / uint32), which
                   suits a layer whose zeros are few (the per-input boundary column).
Biases and every other initializer stay float32.

The dequantized weights are the exact float32 values of the fp32 graph: the low-bit graph computes the same
function (max |p - p_fp32| at float rounding, from the removed zero columns only).

In memory: onnxruntime (1.31, default graph optimizations) constant-folds the decoding subgraph when the
session is created, so the weights are expanded to dense float32 at load (the pruned input columns stay
removed): the file is small, the session's weights are fp32, and the latency is the fp32 graph's. Turning
constant folding off keeps the packed bytes in memory and decodes the weights at every call, many times
slower. No runtime here keeps 2-bit weights packed and computes on them. Bytes, latency and session memory
of both forms: benchmarks/results/sqs_mnist_mlp100_deployed.md.

TFLite: not written. Its quantized weight formats are affine int8 / int4 (a scale and zero point per tensor
or channel), which cannot hold a non-uniform codebook exactly (the 1e-4 fidelity would fail); a TFLite
graph that gathers from a codebook through constant indices was not tried.

`breakdown` says where an artifact's bytes go (indices, mask, codebooks, biases, weights stored whole,
graph), beside the fp32 file's. `weight_storage` writes the fp16 / int8 weight-storage forms of any fp32
ONNX (the spike-and-slab families' samples, benchmarks/sample_bytes.py).
"""

import math
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from edgebayes.compressed.codebook import index_bits, pack_indices
from edgebayes.provenance import atomic_path

MAX_LEVELS = 255          # non-zero levels of a codebook weight (the zero level makes 256: uint8 indices)
PACK_BITS = (1, 2, 4, 8)  # index widths that tile a byte
# Roles of the initializers the rewrite adds (by name prefix), for `breakdown`.
ROLES = {"idx": "indices", "mask": "mask", "zeros": "mask", "keep": "mask",
         "levels": "codebooks", "const": "graph", "w16_": "weights", "w8_": "weights", "scale_": "weights"}


def pack_bits(bits: int) -> int:
    """The stored width of an index of `bits` bits: the next of 1, 2, 4, 8."""
    return next(b for b in PACK_BITS if b >= bits)


def _pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Indices bit-packed as model.sqs packs them (most significant bit first), as a uint8 array."""
    return np.frombuffer(pack_indices(values, bits), dtype=np.uint8)


class _Builder:
    """Adds initializers and nodes to a graph; constants are stored once (by value)."""

    def __init__(self, graph):
        self.graph, self.nodes, self.consts, self.count = graph, [], {}, 0

    def name(self, stem):
        self.count += 1
        return f"{stem}{self.count}"

    def init(self, prefix, array):
        array = np.array(array, order="C")  # (not ascontiguousarray: it makes a scalar 1-D)
        key = (prefix, array.dtype.str, array.shape, array.tobytes())
        if key not in self.consts:  # one codebook / constant for every tensor that uses the same values
            name = self.name(prefix)
            self.graph.initializer.append(numpy_helper.from_array(array, name))
            self.consts[key] = name
        return self.consts[key]

    def node(self, op, inputs, **attrs):
        # Short value names and no node names (both optional to the format): they are bytes of the file.
        out = self.name("cb")
        self.nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    def unpack(self, packed: np.ndarray, bits: int, count: int, prefix: str) -> str:
        """Graph that decodes `count` ints of `bits` bits from the uint8 initializer `packed` -> int64 (count,)."""
        if bits < 8:
            per = 8 // bits
            col = self.init(prefix, packed.reshape(-1, 1))  # a column: the shifts broadcast along its rows
            shifts = self.init("const", (8 - bits * np.arange(1, per + 1)).astype(np.uint8))
            shifted = self.node("BitShift", [col, shifts], direction="RIGHT")
            data = self.node("Mod", [shifted, self.init("const", np.array(2 ** bits, np.uint8))])
            data = self.node("Reshape", [data, self.init("const", np.array([-1], np.int64))])
            data = self.node("Slice", [data, self.init("const", np.array([0], np.int64)),
                                       self.init("const", np.array([count], np.int64))])
        else:
            data = self.init(prefix, packed)
        return self.node("Cast", [data], to=onnx.TensorProto.INT64)

    def kept_positions(self, keep: np.ndarray) -> str:
        """Graph giving the positions of the True entries of the bool vector `keep` (stored as one bit each),
        ascending: the k largest of keep[i] * (n - i). Not NonZero: onnxruntime does not constant-fold it,
        and a graph with it would decode at every call."""
        n = keep.size
        bits = self.unpack(np.packbits(keep), 1, n, "keep")
        desc = self.node("Range", [self.init("const", np.array(n, np.int64)), self.init("const", np.array(0, np.int64)),
                                   self.init("const", np.array(-1, np.int64))])
        top = self.name("cb")
        self.nodes.append(helper.make_node("TopK", [self.node("Mul", [bits, desc]),
                                                    self.init("const", np.array([int(keep.sum())], np.int64))],
                                           [self.name("cb"), top]))
        return top


def _blocks(nonzero: np.ndarray, most: int = 16) -> int:
    """The largest k <= `most` such that the rows of `nonzero` are k equal blocks: the packed layout stacks
    the M samples of a layer along the output channels, and SQS samples share one mask (its inclusion is
    deterministic), so the mask is stored once and tiled M times."""
    rows = nonzero.shape[0]
    for k in range(min(most, rows), 1, -1):
        if rows % k == 0 and (nonzero.reshape(k, -1) == nonzero[: rows // k].reshape(1, -1)).all():
            return k
    return 1


def _encodings(w: np.ndarray):
    """Candidate encodings of one weight: (stored bytes, name, parts) for those that apply."""
    flat = w.ravel()
    nonzero = flat != 0
    levels, idx = np.unique(flat[nonzero], return_inverse=True)
    zeros, n = int((~nonzero).sum()), flat.size
    bits = pack_bits(index_bits(len(levels)))
    out = []
    if zeros == n:   # every weight pruned: no codebook to gather from, the weight is a constant zero tensor
        return [(0, "zeros", {"levels": np.zeros(0, np.float32)})]
    if zeros == 0:
        return [(math.ceil(n * bits / 8), "dense", {"levels": levels, "idx": idx, "bits": bits})]
    dense = np.zeros(n, np.int64)
    dense[nonzero] = idx + 1
    zbits = pack_bits(index_bits(len(levels) + 1))
    out.append((math.ceil(n * zbits / 8), "zero-level",
                {"levels": np.concatenate([[0.0], levels]).astype(np.float32), "idx": dense, "bits": zbits}))
    blocks = _blocks(nonzero.reshape(w.shape[0], -1))
    out.append((math.ceil(n / blocks / 8) + math.ceil((n - zeros) * bits / 8), "mask",
                {"levels": levels, "idx": idx, "bits": bits, "mask": nonzero[: n // blocks], "blocks": blocks}))
    pos_dtype = np.uint16 if n <= 2 ** 16 else np.uint32
    filled = np.zeros(n, np.int64)
    filled[nonzero] = idx
    out.append((math.ceil(n * bits / 8) + zeros * np.dtype(pos_dtype).itemsize, "zero-list",
                {"levels": levels, "idx": filled, "bits": bits, "zeros": np.flatnonzero(~nonzero).astype(pos_dtype)}))
    return out


def _decode(b: _Builder, w: np.ndarray, kind=None) -> tuple:
    """Graph computing the float32 weight `w` from its cheapest encoding (or the one named `kind`):
    (output name, encoding name)."""
    _, kind, p = min((e for e in _encodings(w) if kind in (None, e[1])), key=lambda e: e[0])
    n = w.size
    if kind == "zeros":
        return b.node("ConstantOfShape", [b.init("const", np.array(w.shape, np.int64))],
                      value=numpy_helper.from_array(np.zeros(1, np.float32))), kind
    levels = b.init("levels", np.asarray(p["levels"], np.float32))
    shape = b.init("const", np.array(w.shape, np.int64))
    if kind in ("dense", "zero-level", "zero-list"):
        idx = b.unpack(_pack(p["idx"], p["bits"]), p["bits"], n, "idx")
        flat = b.node("Gather", [levels, idx], axis=0)
        if kind == "zero-list":
            pos = b.node("Cast", [b.init("zeros", p["zeros"].reshape(-1, 1))], to=onnx.TensorProto.INT64)
            zero = b.init("const", np.zeros(len(p["zeros"]), np.float32))
            flat = b.node("ScatterND", [flat, pos, zero])
    else:  # mask: the kept weights' values scattered into zeros at the mask's positions
        kept = b.node("Gather", [levels, b.unpack(_pack(p["idx"], p["bits"]), p["bits"], len(p["idx"]), "idx")],
                      axis=0)
        mask = b.unpack(np.packbits(p["mask"]), 1, p["mask"].size, "mask")
        if p["blocks"] > 1:
            mask = b.node("Tile", [mask, b.init("const", np.array([p["blocks"]], np.int64))])
        # Weight i is kept value number cumsum(mask)[i] - 1 (clamped at 0 where the mask is 0, then zeroed).
        rank = b.node("Sub", [b.node("CumSum", [mask, b.init("const", np.array(0, np.int64))]),
                              b.init("const", np.array(1, np.int64))])
        rank = b.node("Max", [rank, b.init("const", np.array(0, np.int64))])
        flat = b.node("Where", [b.node("Cast", [mask], to=onnx.TensorProto.BOOL),
                                b.node("Gather", [kept, rank], axis=0), b.init("const", np.array(0, np.float32))])
    return b.node("Reshape", [flat, shape]), kind


def _is_codebook(w: np.ndarray) -> bool:
    """A weight of few levels whose encoding (with its codebook) is smaller than its float32 bytes: a small
    full-precision layer (40 weights, 40 values) has few values too, and gains nothing."""
    if w.dtype != np.float32 or w.ndim < 2 or len(np.unique(w[w != 0])) > MAX_LEVELS:
        return False
    cost, _, p = min(_encodings(w), key=lambda e: e[0])
    return cost + 4 * len(p["levels"]) < w.nbytes


def _input_axis(node, w):
    """The axis of a Gemm / MatMul weight that runs over the layer's input features, or None."""
    if node.op_type == "MatMul" and w.ndim == 2:
        return 0
    if node.op_type == "Gemm":
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return 1 if trans_b else 0
    return None


def _short_names(g):
    """Name every value but the graph's input and output v0, v1, ... and drop node names and doc strings
    (all optional to the format): the exporter's '/samples.0/hidden1/Gemm_output_0' names are a tenth of a
    small file. The tensors' roles (breakdown) are read before this, from the encoding's own names."""
    keep = {v.name for v in (*g.input, *g.output)}
    names = {}

    def short(name):
        if not name or name in keep:
            return name
        if name not in names:
            prefix = next((p for p in ROLES if name.startswith(p)), "v")
            names[name] = f"{prefix}{len(names)}"
        return names[name]

    for t in g.initializer:
        t.name = short(t.name)
    for n in g.node:
        n.name, n.doc_string = "", ""
        n.input[:] = [short(i) for i in n.input]
        n.output[:] = [short(o) for o in n.output]
    for v in g.value_info:
        v.name = short(v.name)


def _save(model, nodes, replaced, out_path):
    """The rewritten graph: `nodes` in order, the `replaced` initializers dropped, short names; checked and
    written atomically."""
    g = model.graph
    del g.node[:]
    g.node.extend(nodes)
    kept = [t for t in g.initializer if t.name not in replaced]
    del g.initializer[:]
    g.initializer.extend(kept)
    _short_names(g)
    onnx.checker.check_model(model)
    with atomic_path(out_path) as tmp:
        onnx.save(model, str(tmp))


def _bypass_identities(g, weights):
    """The exporter hands an initializer that several layers share (equal samples, equal biases) to them
    through Identity nodes: let those layers read the initializer itself, so that it is decoded once and a
    Gemm's weight is seen as an initializer (its pruned inputs can then be removed)."""
    alias = {n.output[0]: n.input[0] for n in g.node if n.op_type == "Identity" and n.input[0] in weights}
    outputs = {o.name for o in g.output}
    keep = [n for n in g.node if not (n.op_type == "Identity" and n.output[0] in alias and n.output[0] not in outputs)]
    for n in keep:
        n.input[:] = [alias.get(i, i) if i not in outputs else i for i in n.input]
    del g.node[:]
    g.node.extend(keep)


def lowbit_onnx(fp32_path, out_path) -> dict:
    """Write the low-bit form of the fp32 ONNX at `fp32_path` to `out_path` (atomically); returns
    {"tensors": {initializer: {"encoding", "shape", "stored_shape", "inputs_removed"}}, "inputs_removed": n,
    "runtime_weight_bytes": the weights' bytes once the runtime has decoded them (dense fp32)}.

    Raises ValueError when no weight of the graph is codebook-quantized (not an SQS network).
    """
    model = onnx.load(str(fp32_path))
    g = model.graph
    weights = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    _bypass_identities(g, weights)
    users = {}
    for node in g.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    b = _Builder(g)
    decoded, tensors, removed = {}, {}, 0
    new_nodes = []
    for node in g.node:
        for slot, name in enumerate(node.input):
            if name not in weights or not _is_codebook(weights[name]):
                continue
            if name in decoded:  # a weight read twice (the exporter's Identity re-use): decoded once
                node.input[slot] = decoded[name]
                continue
            w, info = weights[name], {"shape": list(weights[name].shape), "inputs_removed": 0}
            axis = _input_axis(node, w)
            if axis is not None and len(users[name]) == 1:  # a weight of several layers keeps its shape
                dead = ~np.any(w != 0, axis=1 - axis)
                if dead.any() and not dead.all():
                    # Structured mask: drop the input features no weight reads, gather the rest before the layer.
                    w = np.compress(~dead, w, axis=axis)
                    gathered = b.node("Gather", [node.input[0], b.kept_positions(~dead)], axis=-1)
                    node.input[0] = gathered
                    info["inputs_removed"] = int(dead.sum())
                    removed += int(dead.sum())
            out, kind = _decode(b, w)
            info.update(encoding=kind, stored_shape=list(w.shape))
            decoded[name], tensors[name] = out, info
            node.input[slot] = out
        new_nodes += b.nodes
        b.nodes = []
        new_nodes.append(node)
    if not tensors:   # not named by fp32_path: that is the exporter's temporary file
        raise ValueError(f"onnx-codebook: no weight of the network has <= {MAX_LEVELS} distinct values: not a "
                         f"codebook-quantized (SQS) network; onnx-codebook is for SQS models")
    _save(model, new_nodes, decoded, out_path)
    # What the runtime holds once it has decoded (constant-folded) the weights: dense float32 without the
    # removed inputs, plus every tensor stored as it was (biases).
    decoded_bytes = sum(4 * int(np.prod(t["stored_shape"])) for t in tensors.values())
    runtime_bytes = decoded_bytes + sum(a.nbytes for n, a in weights.items() if n not in decoded)
    return {"tensors": tensors, "inputs_removed": removed, "runtime_weight_bytes": int(runtime_bytes)}


def breakdown(path, fp32_path=None) -> dict:
    """Where the bytes of an ONNX file go: {"bytes", "sections": {indices, mask, codebooks, biases, graph}}
    (graph = everything but the stored tensors: nodes, names, the small decoding constants), with the fp32
    file's bytes and the compression ratio fp32 / this file when `fp32_path` is given."""
    size = Path(path).stat().st_size
    sections = dict.fromkeys(("indices", "mask", "codebooks", "biases", "weights", "graph"), 0)
    tensors = 0
    for t in onnx.load(str(path)).graph.initializer:
        nbytes = numpy_helper.to_array(t).nbytes
        tensors += nbytes
        role = next((r for p, r in ROLES.items() if t.name.startswith(p)), None)
        if role is None:
            role = "biases" if len(t.dims) <= 1 else "weights"
        sections[role] += nbytes
    sections["graph"] += size - tensors
    out = {"bytes": size, "sections": sections}
    if fp32_path is not None:
        fp32 = Path(fp32_path).stat().st_size
        out.update(fp32_bytes=fp32, compression_ratio=fp32 / size)
    return out


def weight_storage(fp32_path, out_path, storage: str) -> dict:
    """Rewrite the weights (float32 initializers of 2 or more dimensions) of an fp32 ONNX file to `storage`:
    "fp16" (stored fp16, a Cast back to float32 before use) or "int8" (symmetric per output channel: int8
    values and float32 scales, a DequantizeLinear before use; axis 0, the output channels of a Gemm with
    transB, of a Conv and of the packed layout's grouped 1x1 Conv). Compute stays fp32: this changes what
    is stored and shipped. Biases stay float32. Returns {"tensors": n rewritten}."""
    if storage not in ("fp16", "int8"):
        raise ValueError(f"weight storage {storage!r}; expected fp16 or int8")
    model = onnx.load(str(fp32_path))
    g = model.graph
    weights = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    _bypass_identities(g, weights)
    b, done, nodes = _Builder(g), {}, []
    for node in g.node:
        for slot, name in enumerate(node.input):
            w = weights.get(name)
            if w is None or w.dtype != np.float32 or w.ndim < 2:
                continue
            if name not in done:
                if storage == "fp16":
                    done[name] = b.node("Cast", [b.init("w16_", w.astype(np.float16))], to=onnx.TensorProto.FLOAT)
                else:
                    axis = 1 if node.op_type == "MatMul" or (node.op_type == "Gemm" and _input_axis(node, w) == 0) else 0
                    peak = np.abs(w).max(axis=tuple(i for i in range(w.ndim) if i != axis))
                    scale = np.where(peak > 0, peak / 127, 1).astype(np.float32)
                    shape = [1] * w.ndim
                    shape[axis] = -1
                    q = np.clip(np.round(w / scale.reshape(shape)), -127, 127).astype(np.int8)
                    done[name] = b.node("DequantizeLinear", [b.init("w8_", q), b.init("scale_", scale)], axis=axis)
            node.input[slot] = done[name]
        nodes += b.nodes
        b.nodes = []
        nodes.append(node)
    _save(model, nodes, done, out_path)
    return {"tensors": len(done)}
