"""The real compressed form of a sparse, quantized network on disk (paper 001).

Per layer the file stores
  - the codebook: the layer's quantization levels mu_k (float32), only those some kept weight uses;
  - the sparsity mask: one bit per weight (np.packbits);
  - the level indices of the kept weights, bit-packed at `bits` = ceil(log2(codebook size)) bits each
    (1, 2, 4 bits for K = 2, 4, 16), one index stream per posterior sample (M >= 1; the mask is shared
    because SQS prunes deterministically);
  - the bias in float32 (paper 001 quantizes weights only).
The packed streams of all layers are then entropy-coded with LZMA (Python's stdlib `lzma`, whose range
coder adapts to the byte statistics: a 50% mask costs ~1 bit per weight, a mask with whole dead columns
much less, and the M - 1 extra index streams, nearly identical to the first, almost nothing).

Layout: MAGIC, uint32 little-endian header length, a JSON header (shapes, bits, offsets), the XZ
payload. No pickle anywhere; `read` needs only numpy and the stdlib.

Two compression rates are reported (`rates`):
  - by paper 001's formula (eq. 14): 32 / bits x 1 / non-zero, with bits = log2 K. It counts only the
    kept weights' level indices: no mask, no codebook, no bias, no container;
  - by bytes: fp32 bytes of the same weights and biases (4 bytes each, per sample) / bytes of the file.
They differ by the mask (at a 50% non-zero rate an i.i.d. mask costs as much as a 2-bit index per kept
weight; its entropy coding recovers only what the mask's structure allows), by the biases and codebooks
(small), and, with windowing, by the extra levels (W windows x K components per layer can use more than K
distinct values, which log2 K does not count). `section_bytes` splits a file's bytes into mask, indices,
biases and codebooks; the measured rates of paper 001's per-weight keep scores and of per-input scores in
the first layer (train/sqs.py, whole pixels pruned: a much cheaper mask) are in
benchmarks/results/sqs_mnist_mlp100.md and sqs_ablations.md.

Masks of 2-D and 4-D weights may be stored input-major (weight.transpose(0, 1)): in an MLP on images a
dead input pixel then becomes one long run of zeros; per layer the smaller of the two orders is kept.
"""

import json
import lzma
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from edgebayes.errors import InputError
from edgebayes.provenance import atomic_path

MAGIC = b"EBSQS\x01"
MAX_BITS = 8          # codebooks of up to 256 levels
LZMA_PRESET = 9 | lzma.PRESET_EXTREME


class CodebookError(InputError):
    """A compressed file that cannot be read; the message names the file."""


@dataclass
class LayerCode:
    """One layer in compressed form. `indices` is (M, number of kept weights), indices into `codebook`,
    kept weights in row-major order of `mask`."""
    name: str
    codebook: np.ndarray             # float32 levels, (L,)
    mask: np.ndarray                 # bool, the weight's shape
    indices: np.ndarray              # int, (M, mask.sum())
    bias: Optional[np.ndarray] = None

    @property
    def bits(self) -> int:
        return index_bits(len(self.codebook))

    def weights(self, sample: int = 0) -> np.ndarray:
        """The dense float32 weight of one sample: codebook values at kept positions, exact zeros elsewhere."""
        w = np.zeros(self.mask.shape, dtype=np.float32)
        w[self.mask] = self.codebook[self.indices[sample]]
        return w


def index_bits(levels: int) -> int:
    """Bits of a packed index into a codebook of `levels` entries (at least 1)."""
    bits = max(1, math.ceil(math.log2(max(levels, 1))))
    if bits > MAX_BITS:
        raise ValueError(f"a codebook of {levels} levels needs {bits} bits; at most {MAX_BITS} are supported")
    return bits


def pack_indices(indices: np.ndarray, bits: int) -> bytes:
    """Bit-pack non-negative integers < 2**bits, `bits` bits each, most significant bit first."""
    indices = np.asarray(indices).ravel()
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be in 1..{MAX_BITS}, got {bits}")
    if indices.size and (indices.min() < 0 or indices.max() >= 2**bits):
        raise ValueError(f"indices must lie in [0, {2**bits}) to be packed in {bits} bits")
    as_bits = np.unpackbits(indices.astype(np.uint8)[:, None], axis=1)[:, 8 - bits:]
    return np.packbits(as_bits.ravel()).tobytes()


def unpack_indices(data: bytes, bits: int, count: int) -> np.ndarray:
    """Inverse of pack_indices: `count` integers of `bits` bits each."""
    flat = np.unpackbits(np.frombuffer(data, dtype=np.uint8))[: count * bits].reshape(count, bits)
    padded = np.zeros((count, 8), dtype=np.uint8)
    padded[:, 8 - bits:] = flat
    return np.packbits(padded, axis=1).ravel().astype(np.int64)


def _orders(mask):
    """Candidate storage orders of a mask: row-major, and input-major for weights of 2 or more dims."""
    yield "output-major", mask
    if mask.ndim >= 2:
        yield "input-major", np.swapaxes(mask, 0, 1)


def _encode_layer(layer: LayerCode):
    """The packed sections of one layer and its header entry."""
    if layer.indices.ndim != 2 or layer.indices.shape[1] != int(layer.mask.sum()):
        raise ValueError(f"{layer.name}: indices must be (M, kept weights) = (M, {int(layer.mask.sum())}), "
                         f"got {layer.indices.shape}")
    # The order whose packed mask the entropy coder shrinks most (see the module docstring).
    order, view = min(_orders(layer.mask),
                      key=lambda o: len(lzma.compress(np.packbits(o[1].ravel()).tobytes(), preset=6)))
    indices = layer.indices
    if order == "input-major":
        # The kept weights are then listed in input-major order: permute the index streams to match.
        indices = indices[:, _input_major_rank(layer.mask, view)]
    bits = layer.bits
    sections = [np.asarray(layer.codebook, dtype="<f4").tobytes(), np.packbits(view.ravel()).tobytes()]
    sections += [pack_indices(indices[m], bits) for m in range(len(indices))]
    if layer.bias is not None:
        sections.append(np.asarray(layer.bias, dtype="<f4").tobytes())
    entry = {"name": layer.name, "shape": list(layer.mask.shape), "levels": len(layer.codebook), "bits": bits,
             "kept": int(layer.mask.sum()), "samples": len(indices), "mask_order": order,
             "bias": None if layer.bias is None else int(np.asarray(layer.bias).size),
             "sections": [len(s) for s in sections]}
    return entry, sections


def _input_major_rank(mask, view):
    """For each kept weight in input-major order (`view` = mask with axes 0, 1 swapped), its rank among
    the kept weights in row-major order."""
    positions = np.swapaxes(np.arange(mask.size).reshape(mask.shape), 0, 1)[view]
    return np.searchsorted(np.flatnonzero(mask.ravel()), positions)


def write(path, layers: list, meta: Optional[dict] = None) -> dict:
    """Write `layers` (a list of LayerCode) to `path` atomically; returns {"bytes", "header"}."""
    entries, payload = [], []
    for layer in layers:
        entry, sections = _encode_layer(layer)
        entries.append(entry)
        payload += sections
    header = json.dumps({"format": "edgebayes-sqs-codebook", "version": 1, "compression": "xz",
                         "layers": entries, "meta": meta or {}}).encode()
    blob = MAGIC + struct.pack("<I", len(header)) + header + lzma.compress(b"".join(payload), preset=LZMA_PRESET)
    with atomic_path(path) as tmp:
        Path(tmp).write_bytes(blob)
    return {"bytes": len(blob), "header": json.loads(header)}


def read(path) -> tuple:
    """Read a file written by `write`: (list of LayerCode, meta)."""
    path = Path(path)
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise CodebookError(f"{path}: cannot read: {e.strerror}") from None
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 4:
        raise CodebookError(f"{path}: not an edgebayes SQS codebook file (bad magic)")
    (n,) = struct.unpack_from("<I", blob, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        header = json.loads(blob[start: start + n])
        payload = lzma.decompress(blob[start + n:])
    except (ValueError, lzma.LZMAError) as e:
        raise CodebookError(f"{path}: corrupt header or payload: {e}") from None
    layers, offset = [], 0
    for entry in header["layers"]:
        chunks = []
        for size in entry["sections"]:
            chunks.append(payload[offset: offset + size])
            offset += size
        shape, order = tuple(entry["shape"]), entry["mask_order"]
        codebook = np.frombuffer(chunks[0], dtype="<f4").astype(np.float32)
        stored_shape = shape if order == "output-major" else (shape[1], shape[0]) + shape[2:]
        size = int(np.prod(shape))
        view = np.unpackbits(np.frombuffer(chunks[1], dtype=np.uint8))[:size].astype(bool).reshape(stored_shape)
        indices = np.stack([unpack_indices(chunks[2 + m], entry["bits"], entry["kept"])
                            for m in range(entry["samples"])])
        mask = view if order == "output-major" else np.swapaxes(view, 0, 1)
        if order == "input-major":
            rowmajor = np.empty_like(indices)
            rowmajor[:, _input_major_rank(mask, view)] = indices
            indices = rowmajor
        bias = (np.frombuffer(chunks[2 + entry["samples"]], dtype="<f4").astype(np.float32)
                if entry["bias"] is not None else None)
        layers.append(LayerCode(entry["name"], codebook, np.ascontiguousarray(mask), indices, bias))
    return layers, header.get("meta", {})


def section_bytes(layers: list) -> dict:
    """Where a file's bytes go: the masks, the level indices and the rest (codebooks, biases), each stream
    entropy-coded on its own as `write` codes them together (their sum is within a few % of the payload)."""
    parts = {"mask": [], "indices": [], "codebooks_biases": []}
    for layer in layers:
        _, sections = _encode_layer(layer)
        samples = len(layer.indices)
        parts["codebooks_biases"] += [sections[0]] + sections[2 + samples:]
        parts["mask"].append(sections[1])
        parts["indices"] += sections[2: 2 + samples]
    return {k: len(lzma.compress(b"".join(v), preset=LZMA_PRESET)) for k, v in parts.items()}


def fp32_bytes(layers: list) -> int:
    """Bytes of one sample's weights and biases as dense float32."""
    return 4 * sum(l.mask.size + (0 if l.bias is None else np.asarray(l.bias).size) for l in layers)


def rates(layers: list, file_bytes: int, bits: float) -> dict:
    """Compression rates of a file holding `layers`: by paper 001's eq. 14 and by bytes.

    `bits` is the paper's Bits = log2 K. The bytes rate compares with M dense fp32 copies when the file
    holds M samples, so that it describes the same set of weights.
    """
    total = sum(l.mask.size for l in layers)
    kept = sum(int(l.mask.sum()) for l in layers)
    samples = layers[0].indices.shape[0] if layers else 1
    nonzero = kept / total
    packed = sum(math.ceil(l.mask.size / 8) + samples * math.ceil(l.indices.shape[1] * l.bits / 8)
                 + 4 * (len(l.codebook) + (0 if l.bias is None else np.asarray(l.bias).size)) for l in layers)
    dense = samples * fp32_bytes(layers)
    return {
        "weights": total, "kept_weights": kept, "nonzero_rate": nonzero, "samples": samples,
        "bits_formula": bits, "bits_stored": [l.bits for l in layers],
        "rate_formula": 32.0 / bits / nonzero,
        "fp32_bytes": dense, "packed_bytes": packed, "file_bytes": file_bytes,
        "rate_packed": dense / packed, "rate_bytes": dense / file_bytes,
        "bits_per_weight_file": 8 * file_bytes / (samples * total),
    }
