"""Datasets as in-memory tensors with seeded train / val / test splits (and an optional OOD set).

Built in:
- digits: scikit-learn's 8x8 digits (1797 images, shipped inside the wheel): the embedded default, offline.
- mnist, fashion-mnist (IDX files read directly, .gz or not), cifar10 (torchvision): from a root folder (data.root, else $EDGEBAYES_DATA,
  else ./data). Nothing is downloaded unless data.download is true; absent files give one clear error.

Your own data (data.path: a file or folder; a relative path is read from the working directory):
- npz: arrays x_train, y_train and optionally x_test, y_test and x_val, y_val, or one set x, y; an optional
  `classes` array names the classes.
- image-folder: torchvision's ImageFolder layout, path/<class>/*.png|jpg|... or path/train/<class>/ and
  path/test/<class>/ (and optionally path/val/<class>/).
- csv: numeric feature columns and one label column (data.label_column; see _csv for the header rule).
- package.module:function: a loader of your own, called with the DataConfig (see _function).

Every source goes through the same checks (checked_sets; eb.fit too): one label per input, the same input
shape in every set, finite values, at least two classes, no test / val label unseen in training. Sets a source does not
provide are carved out of its training set: test first (data.test_fraction), then validation
(data.val_fraction), with a generator seeded by the run's seed, so a split never changes between runs.

Inputs are float32, images (C, H, W), feature vectors (F,), or with data.signals 1-D signals (C, L). Labels
are int64 class indices into `classes`. One exception, for memory: where the source holds 8-bit pixels (an image
folder of 8-bit images, uint8 arrays), the training split keeps them as uint8, a quarter of float32's bytes, and
is scaled to [0, 1] a batch at a time (`pixels_as_float`): the same float32 values, bit for bit. Every reader of
Splits.train_x converts what it takes; the validation, test and OOD sets are float32.
"""

import csv
import gzip
import os
import re
import struct
import unicodedata
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch


from edgebayes.errors import InputError
from edgebayes.plugins import IMPORT_PATH, load_callable, source_files
from edgebayes.progress import progress
from edgebayes.provenance import stat_fingerprint, stat_summary, walk_files


class DataError(InputError, ValueError):
    """The data set cannot be loaded; the message says which files and how to fix it. Also a ValueError: the
    Python API's functions refuse bad arguments with ValueErrors, and its data checks are these."""


@dataclass
class Splits:
    train_x: torch.Tensor   # float32, or uint8 pixels (x / 255): read it through pixels_as_float
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    classes: list
    ood_x: Optional[torch.Tensor] = None

    @property
    def input_shape(self):
        return tuple(self.train_x.shape[1:])


TORCHVISION = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST", "cifar10": "CIFAR10"}
FASHION_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                   "Ankle boot"]
SET_NAMES = ("train", "val", "test")
# an image folder's split folders beside train/, as export tools spell them
SPLIT_FOLDERS = {"val": ("val", "valid", "validation"), "test": ("test", "testing")}
# folder names that are splits, not classes (refused in the one-set layout, where they would read as classes)
SPLIT_LIKE = {"train", "training", *(name for spellings in SPLIT_FOLDERS.values() for name in spellings)}
PROGRESS_FROM = 5000      # images from which an image folder's reading shows its progress (a few seconds or more)
PROGRESS_INTERVAL = 10.0  # seconds between its lines off a terminal
# What PIL reads and torchvision's ImageFolder accepts; other files in the folders (notes, .DS_Store) are skipped.
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff", ".webp")
# A CSV column with one of these names (any case) is the label column unless data.label_column says otherwise.
LABEL_COLUMN_NAMES = ("label", "target", "class")
# `package.module:function`, the form of data.dataset that names a loader of your own.


def data_root(cfg) -> Path:
    return Path(cfg.root or os.environ.get("EDGEBAYES_DATA") or "data")


# ---------------------------------------------------------------------------------------------
# Built-in data sets. Each loader takes the DataConfig and returns ({set name: (x, y)}, classes).
# ---------------------------------------------------------------------------------------------
def _digits(cfg=None):
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.int64)
    return {"train": (x, y)}, [str(c) for c in bunch.target_names]


def _read_idx(path: Path) -> np.ndarray:
    """An IDX file (the MNIST format), gzipped or not: magic (2 zero bytes, dtype, ndim), dims, data."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = struct.unpack(f">{ndim}I", data[4: 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _idx_file(raw: Path, stem: str):
    for candidate in (raw / stem, raw / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _mnist_like(name, cfg, train):
    """MNIST / Fashion-MNIST from root/<MNIST|FashionMNIST>/raw, gzipped or extracted.

    Read directly: torchvision 0.29 insists on extracted files, which a read-only shared copy of the
    original .gz files does not have. torchvision is only used to download, when the config allows it.
    """
    raw = data_root(cfg) / TORCHVISION[name] / "raw"
    prefix = "train" if train else "t10k"
    stems = (f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte")
    images, labels = (_idx_file(raw, s) for s in stems)
    if (images is None or labels is None) and cfg.download:
        _torchvision(name, cfg, train)
        images, labels = (_idx_file(raw, s) for s in stems)
    if images is None or labels is None:
        raise DataError(
            f"data set {name!r}: {prefix}-images-idx3-ubyte(.gz) and {prefix}-labels-idx1-ubyte(.gz) not found "
            f"in {raw.resolve()}. Point data.root or EDGEBAYES_DATA at the folder that holds "
            f"{TORCHVISION[name]}/raw, or set data.download: true where there is internet")
    x = torch.tensor(_read_idx(images), dtype=torch.float32).unsqueeze(1) / 255.0
    y = torch.tensor(_read_idx(labels), dtype=torch.int64)
    classes = [str(i) for i in range(10)] if name == "mnist" else FASHION_CLASSES
    return x, y, classes


def _torchvision(name, cfg, train):
    import torchvision

    root = data_root(cfg)
    cls = getattr(torchvision.datasets, TORCHVISION[name])
    try:
        ds = cls(root=str(root), train=train, download=cfg.download)
    except RuntimeError as e:
        raise DataError(
            f"data set {name!r}: files not found under {root.resolve()} ({e}). Point data.root or "
            f"EDGEBAYES_DATA at the folder that holds them, or set data.download: true where there is internet"
        ) from None
    data = ds.data if isinstance(ds.data, np.ndarray) else ds.data.numpy()
    x = torch.tensor(data, dtype=torch.float32) / 255.0
    x = x.unsqueeze(1) if x.dim() == 3 else x.permute(0, 3, 1, 2)  # (N, H, W[, C]) -> (N, C, H, W)
    y = torch.tensor(np.asarray(ds.targets), dtype=torch.int64)
    return x, y, [str(c) for c in ds.classes]


# The sets under the data root with an official train / test split: one half at a time (the OOD set
# needs only the test half).
OFFICIAL_SPLITS = {"mnist": _mnist_like, "fashion-mnist": _mnist_like, "cifar10": _torchvision}


def _official(cfg):
    load = OFFICIAL_SPLITS[cfg.dataset]
    x, y, classes = load(cfg.dataset, cfg, train=True)
    test_x, test_y, _ = load(cfg.dataset, cfg, train=False)
    return {"train": (x, y), "test": (test_x, test_y)}, classes


# ---------------------------------------------------------------------------------------------
# Your own data
# ---------------------------------------------------------------------------------------------
def _path(cfg, folder: bool) -> Path:
    """data.path, checked to exist and to be a folder (image-folder) or a file (npz, csv)."""
    if not cfg.path:
        raise DataError(f"data.path: required for data.dataset {cfg.dataset} (the file or folder to read)")
    path = Path(cfg.path).expanduser()
    if not path.exists():
        where = "" if path.is_absolute() else f" (a relative data.path is read from the working directory {Path.cwd()})"
        raise DataError(f"data.path: {path}: no such {'folder' if folder else 'file'}{where}")
    if folder and not path.is_dir():
        raise DataError(f"data.path: {path}: data.dataset image-folder reads a folder "
                        f"(<path>/<class>/*.png, or <path>/train/<class>/ and <path>/test/<class>/), got a file")
    if not folder and not path.is_file():
        got = "a folder" if path.is_dir() else "something else (a FIFO or a device: not a regular file)"
        raise DataError(f"data.path: {path}: data.dataset {cfg.dataset} reads a file, got {got}")
    return path


def _inputs(a, name, where, signals=False) -> torch.Tensor:
    """An array from the user as float32 (N, F), (N, C, H, W), or with `signals` (data.signals) (N, C, L).

    signals: 3-D arrays are 1-D signals (N, C, L) for Conv1d networks, 2-D ones single-channel signals
    (N, L) -> (N, 1, L). Otherwise 2-D: feature vectors. 3-D: grayscale images (N, H, W). 4-D: images, the
    channels being the axis of size 1, 3 or 4: the last (N, H, W, C) or the second (N, C, H, W). When both are (small images, e.g.
    (N, 1, 4, 4)) the array's own convention decides: a torch tensor is channels first (PyTorch's layout),
    anything else channels last (numpy's and PIL's).
    uint8 is taken as pixels, kept as uint8 (x / 255: pixels_as_float scales them to [0, 1]); other numbers are
    float32 as they are (other integer types too: counts and codes of tabular data are not pixels).
    """
    tie_channels_first = isinstance(a, torch.Tensor)
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu().numpy()
    a = np.asarray(a)
    if a.dtype.kind not in "biuf":
        raise DataError(f"{where}: {name} holds {a.dtype} values; expected numbers")
    if signals:
        if a.ndim not in (2, 3):
            raise DataError(f"{where}: {name} has shape {a.shape}; data.signals expects (N, channels, length) or "
                            f"(N, length)")
        if a.ndim == 2:
            a = a[:, None]
    elif a.ndim == 3:
        a = a[:, None]
    elif a.ndim == 4:
        if a.shape[3] not in (1, 3, 4) and a.shape[1] not in (1, 3, 4):
            raise DataError(f"{where}: {name} has shape {a.shape}: cannot tell the channel axis; expected "
                            f"(N, H, W, C) or (N, C, H, W) with C = 1, 3 or 4")
        if a.shape[3] in (1, 3, 4) and not (tie_channels_first and a.shape[1] in (1, 3, 4)):
            a = a.transpose(0, 3, 1, 2)
    elif a.ndim != 2:
        raise DataError(f"{where}: {name} has shape {a.shape}; expected (N, features), (N, H, W), (N, H, W, C) "
                        f"or (N, C, H, W)")
    if not a.flags.writeable:
        a = a.copy()
    # One copy at most: converted and laid out contiguously (N, C, H, W) at once.
    dtype = torch.uint8 if a.dtype == np.uint8 else torch.float32
    return torch.from_numpy(a).to(dtype, memory_format=torch.contiguous_format)


def _is_uint8(a):
    return a.dtype == torch.uint8 if isinstance(a, torch.Tensor) else np.asarray(a).dtype == np.uint8


def _sets_from_mapping(arrays: dict, where, signals=False) -> dict:
    """{x_train, y_train[, x_val, y_val][, x_test, y_test]} or {x, y} -> {set name: (x, y)}.

    Keys starting with x_ or y_ must be one of those: a misspelt x_tset would otherwise be dropped silently
    and the test set carved out of the training set instead. Other keys (metadata) are ignored.
    """
    keys = sorted(arrays)
    holds = f"it holds: {', '.join(keys) or 'nothing'}"
    odd = [k for k in keys if k[:2] in ("x_", "y_") and k[2:] not in SET_NAMES]
    if odd:
        raise DataError(f"{where}: unexpected {', '.join(odd)}: the sets are x_/y_ + train, val or test ({holds})")
    if "x_train" in arrays or "y_train" in arrays:
        if "x" in arrays or "y" in arrays:
            raise DataError(f"{where}: holds both x/y (one set) and x_train/y_train; keep one form ({holds})")
        sets = {}
        for s in SET_NAMES:
            xk, yk = f"x_{s}", f"y_{s}"
            if (xk in arrays) != (yk in arrays):
                missing = yk if xk in arrays else xk
                raise DataError(f"{where}: has {xk if xk in arrays else yk} but no {missing} ({holds})")
            if xk in arrays:
                sets[s] = (_inputs(arrays[xk], xk, where, signals), arrays[yk])
        if "train" not in sets:
            raise DataError(f"{where}: x_train and y_train are required with x_val / x_test ({holds})")
        pixels = {k for k in ("x_train", "x_val", "x_test") if k in arrays and _is_uint8(arrays[k])}
        if pixels and len(pixels) != len(sets):   # uint8 is scaled to [0, 1], other types are kept as they are
            raise DataError(f"{where}: {', '.join(sorted(pixels))} hold uint8 (pixels, scaled to [0, 1]) but "
                            f"{', '.join(sorted({f'x_{s}' for s in sets} - pixels))} do not (kept as they are); "
                            f"give every set the same dtype")
        return sets
    if "x" in arrays and "y" in arrays:
        return {"train": (_inputs(arrays["x"], "x", where, signals), arrays["y"])}
    raise DataError(f"{where}: expected arrays x_train and y_train (optionally x_test, y_test, x_val, y_val), "
                    f"or x and y ({holds})")


def _class_names(values, where):
    a = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
    if a.ndim != 1:
        raise DataError(f"{where}: classes has shape {a.shape}; expected one name per class (a 1-D array)")
    names = [v.decode() if isinstance(v, bytes) else str(v) for v in a.tolist()]
    if len(set(names)) < len(names):   # two outputs under one name: the report's per-class figures would merge
        twice = sorted({n for n in names if names.count(n) > 1})
        raise DataError(f"{where}: classes names {', '.join(map(repr, twice[:3]))} more than once; one name per class")
    return names


def _npz(cfg):
    """An .npz archive (np.savez / np.savez_compressed), read without pickle: object arrays are refused
    because unpickling runs code from the file."""
    path = _path(cfg, folder=False)
    where = f"data.path: {path}"
    try:
        archive = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:   # BadZipFile: a truncated download
        raise DataError(f"{where}: not an .npz archive ({e}); write one with "
                        f"np.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise DataError(f"{where}: holds a single array (.npy); write an .npz with "
                        f"np.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)")
    with archive:
        try:
            arrays = {k: archive[k] for k in archive.files}
        except (zipfile.BadZipFile, EOFError, OSError) as e:   # a damaged member (CRC) or a cut-off one
            raise DataError(f"{where}: the archive is damaged ({e}); copy or write it again") from None
        except ValueError as e:
            raise DataError(f"{where}: {e}; save labels and class names as plain arrays, e.g. "
                            f"np.array(names, dtype=str)") from None
    classes = arrays.pop("classes", None)
    return (_sets_from_mapping(arrays, where, cfg.signals),
            None if classes is None else _class_names(classes, where))


def _is_gray(image) -> bool:
    """Single-channel modes, and palette images whose palette holds only grays."""
    if image.mode in ("1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "I;16N", "F"):
        return True
    if image.mode in ("P", "PA"):
        palette = image.getpalette()
        if palette is None:
            return False
        rgb = np.asarray(palette).reshape(-1, 3)
        return bool((rgb == rgb[:, :1]).all())
    return False


WIDE_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N", "F")   # PIL's modes of more than 8 bits per value


def _pixels(image, channels, size) -> np.ndarray:
    """One decoded image (H, W[, 3]), resized to size = (W, H) when it differs: 8-bit modes as their uint8
    values (x / 255 in [0, 1]: pixels_as_float), wider ones as float32 in [0, 1].

    16-bit and 32-bit grayscale are scaled by 65535 (PNG's 16 bits), float images ('F') kept as they are.
    RGB drops an alpha channel; grayscale among RGB images is repeated over the three channels.
    """
    from PIL import Image

    if image.mode in WIDE_MODES:
        scale = 1.0 if image.mode == "F" else 65535.0
        image = image.convert("F")
    else:
        scale = None
        image = image.convert("L" if channels == 1 else "RGB")
    if image.size != size:
        image = image.resize(size, Image.Resampling.BILINEAR)
    a = np.asarray(image, dtype=np.uint8) if scale is None else np.asarray(image, dtype=np.float32) / np.float32(scale)
    if channels == 3 and a.ndim == 2:
        a = np.repeat(a[:, :, None], 3, axis=2)
    return a


def _class_files(folder: Path, where) -> dict:
    """{class name: image files} of folder/<class>/ (files found at any depth below <class>/, through symlinked
    folders too, hidden files and folders left out: a .thumbnails/ inside a class was read as its images). Names
    in Unicode's composed form (NFC): macOS writes 'ü' decomposed, and train/ and test/ copied apart spell one
    class two ways; two folders of one name in that form are refused (the second replaced the first)."""
    found = {}
    for d in sorted(d for d in folder.iterdir() if d.is_dir() and not d.name.startswith(".")):
        name = unicodedata.normalize("NFC", d.name)
        if name in found:
            raise DataError(f"{where}: class folders {found[name][0].name!r} and {d.name!r} in {folder} spell one "
                            f"name ({name!r}) in two Unicode forms; merge them or rename one")
        found[name] = (d, sorted(f for f in walk_files(d, hidden=False) if f.suffix.lower() in IMAGE_EXTENSIONS))
    return {name: files for name, (_, files) in found.items()}


def _image_folder(cfg):
    """torchvision's ImageFolder layout, read with PIL.

    With a path/train/ folder, path/train/<class>/ is the training set and path/test/<class>/ and
    path/val/<class>/ the others where present (a missing one is carved out of train; other folders beside
    them are ignored). Without, the folder is one set, path/<class>/, split like digits. Classes are the
    training folder's sub-folders, sorted. Channels follow the data: 1 when every image is grayscale, else 3
    (alpha dropped); data.channels sets them (3: grayscale read as RGB, as torchvision's ImageFolder does, for a
    network trained that way). Images must share one size, unless data.image_size = [H, W] resizes them (bilinear).
    """
    from PIL import Image, UnidentifiedImageError

    root = _path(cfg, folder=True)
    where = f"data.path: {root}"
    layout = f"expected {root}/<class>/*.png (or .jpg, ...), or {root}/train/<class>/ and {root}/test/<class>/"
    folders = {"train": root}
    if (root / "train").is_dir():
        folders = {"train": root / "train"}
        for s, spellings in SPLIT_FOLDERS.items():   # valid/ (Roboflow's export) was passed over without a word
            there = [root / name for name in spellings if (root / name).is_dir()]
            if len(there) > 1:
                raise DataError(f"{where}: {' and '.join(str(p) for p in there)} are both the {s} set; keep one")
            if there:
                folders[s] = there[0]
    else:   # Train/ Test/, training/ testing/: split folders that would otherwise be read as two classes
        split_like = sorted(d.name for d in root.iterdir() if d.is_dir() and d.name.lower() in SPLIT_LIKE
                            and any(c.is_dir() for c in d.iterdir()))   # class folders in it, not images
        if split_like:
            raise DataError(f"{where}: {root / split_like[0]} looks like a split, not a class "
                            f"({', '.join(split_like)}); {layout} (lower case: train, val, test)")
    found = {s: _class_files(f, where) for s, f in folders.items()}
    for s in ("val", "test"):
        if s in found and not any(found[s].values()):
            raise DataError(f"{where}: {folders[s]} holds no images in class folders; fill it as "
                            f"{folders[s]}/<class>/*.png or remove it (the {s} set is then carved out of train)")
    train = found["train"]
    if not any(train.values()):
        loose = [f.name for f in folders["train"].iterdir() if f.suffix.lower() in IMAGE_EXTENSIONS]
        hint = f"; the images there ({loose[0]}, ...) need one sub-folder per class" if loose else ""
        raise DataError(f"{where}: no images in class folders; {layout}{hint}")
    empty = [c for c, files in train.items() if not files]
    if empty:
        raise DataError(f"{where}: class folder {folders['train'] / empty[0]} holds no images "
                        f"({', '.join(IMAGE_EXTENSIONS)}); remove it or add its images")
    classes = sorted(train)
    if len(classes) < 2:
        raise DataError(f"{where}: one class folder ({classes[0]}); a classifier needs at least two ({layout})")
    for s in ("val", "test"):
        unseen = [c for c, files in found.get(s, {}).items() if files and c not in train]
        if unseen:
            raise DataError(f"{where}: {s}/{unseen[0]} is not a class of train/ (classes: {', '.join(classes)}); "
                            f"labels in {s} must be seen in training")

    files = {s: [(f, i) for i, c in enumerate(classes) for f in found[s].get(c, [])] for s in found}
    files = {s: pairs for s, pairs in files.items() if pairs}
    # Pass 1 reads headers only (mode and size), so a size mismatch is reported before any decoding.
    modes, sizes = {}, {}
    n = sum(len(pairs) for pairs in files.values())
    quiet = n < PROGRESS_FROM   # a few hundred images load in a second or two: no lines for them
    headers = progress([f for pairs in files.values() for f, _ in pairs], desc=f"data: {cfg.path}: headers",
                       unit="image", disable=quiet, interval=PROGRESS_INTERVAL)
    for f in headers:
        try:
            with Image.open(f) as image:
                modes[f], sizes[f] = (_is_gray(image), image.mode in WIDE_MODES), image.size
        except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as e:
            raise DataError(f"{where}: {f}: not a readable image ({e})") from None
    channels = cfg.channels or (1 if all(gray for gray, _ in modes.values()) else 3)
    # 8-bit images are held as their uint8 values (a quarter of float32's memory), wider ones as float32
    dtype = np.float32 if any(wide for _, wide in modes.values()) else np.uint8
    if cfg.image_size:
        size = (cfg.image_size[1], cfg.image_size[0])
    else:
        first = next(iter(sizes))
        other = next((f for f, s in sizes.items() if s != sizes[first]), None)
        if other is not None:
            (w1, h1), (w2, h2) = sizes[first], sizes[other]
            raise DataError(f"{where}: images differ in size: {first} is {h1}x{w1} (HxW), {other} is {h2}x{w2}; "
                            f"set data.image_size: [H, W] to resize them all")
        size = sizes[first]
    # data.image_size [100000, 100000] was "out of memory", exit 1: refused beyond all of the machine's memory (a
    # bound, not a fit); beyond half of what is available now, said (a run of 18 GiB of images beside 19 GiB free
    # was accepted, to be killed by the OS in training without a word: probe)
    need = n * size[0] * size[1] * channels * np.dtype(dtype).itemsize
    what = (f"{n} images of {size[1]}x{size[0]}x{channels} (HxWxC) need {need / 2**30:.1f} GiB as "
            f"{np.dtype(dtype).name}")
    advice = "set data.image_size smaller" + ("" if cfg.image_size else " (they are read at their own size)")
    if need > (memory := _physical_memory() or need):
        raise DataError(f"{where}: {what} to load, more than this machine's {memory / 2**30:.1f} GiB; {advice}")
    if (free := _available_memory()) is not None and need > free / 2:
        warnings.warn(f"{where}: {what}, more than half of the {free / 2**30:.1f} GiB this machine has available "
                      f"now; training needs more beside them, and the OS may stop it without a message: {advice}",
                      stacklevel=2)
    sets = {}
    for s, pairs in files.items():
        # decoded straight into channels-first rows: one copy of the set at the peak, not two
        x = np.empty((len(pairs), channels, size[1], size[0]), dtype=dtype)
        for i, (f, _) in enumerate(progress(pairs, desc=f"data: {cfg.path}: decoding the {s} set", unit="image",
                                            disable=quiet, interval=PROGRESS_INTERVAL)):
            try:   # a file cut after its header decodes only now
                with Image.open(f) as image:
                    a = _pixels(image, channels, size)
                if a.dtype != x.dtype:   # an 8-bit image among wider ones: scaled as they are, to [0, 1]
                    a = pixels_as_float(torch.from_numpy(a)).numpy()
                x[i] = a[None] if channels == 1 else a.transpose(2, 0, 1)
            except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as e:
                raise DataError(f"{where}: {f}: not a readable image ({e})") from None
        sets[s] = (torch.from_numpy(x), np.array([label for _, label in pairs], dtype=np.int64))
    return sets, classes


def _available_memory():
    """The memory available to a new process now in bytes (Linux's MemAvailable: free, and caches the kernel
    would give back), or None where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def _physical_memory():
    """This machine's memory in bytes, or None where the OS does not say (sysconf: Linux, macOS)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _is_number(text) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _csv(cfg):
    """A comma-separated file: numeric feature columns and one label column; one set, split like digits.

    Header: the first row is a header when it names data.label_column, or has a cell named label, target
    or class (any case), or has a cell that is not a number above one that is (a name over numeric data).
    Label column: data.label_column (a header name, or a 0-based index, negative from the end), else the
    column named label, target or class (in that order), else the last column. Every other column is a
    feature and must be numeric; missing values are not filled in.
    """
    path = _path(cfg, folder=False)
    where = f"data.path: {path}"
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:   # Excel's "CSV UTF-8" starts with a BOM: the
            # first header cell read "\ufefflabel", and the last feature column was taken as the label (probe)
            reader = csv.reader(f)  # line_num: the file's line a row ends on (quoted cells may span lines)
            rows = [(reader.line_num, row) for row in reader if any(c.strip() for c in row)]
    except UnicodeDecodeError:
        raise DataError(f"{where}: not a text CSV file (it does not decode as UTF-8)") from None
    except csv.Error as e:
        raise DataError(f"{where}: not a readable CSV file ({e})") from None
    if not rows:
        raise DataError(f"{where}: the file is empty")
    first = [c.strip() for c in rows[0][1]]
    lowered = [c.lower() for c in first]
    header = (isinstance(cfg.label_column, str) and cfg.label_column in first) \
        or any(n in lowered for n in LABEL_COLUMN_NAMES) \
        or (len(rows) > 1 and any(not _is_number(a) and _is_number(b) for a, b in zip(first, rows[1][1])))
    names = first if header else [f"column {j}" for j in range(len(first))]
    data = rows[1:] if header else rows
    if not data:
        raise DataError(f"{where}: a header and no data rows")
    for line, row in data:
        if len(row) != len(names):
            raise DataError(f"{where}: line {line} has {len(row)} cells, line {rows[0][0]} has {len(names)}")
    if len(names) < 2:
        raise DataError(f"{where}: one column; expected feature columns and a label column, separated by commas")

    label = cfg.label_column
    if isinstance(label, str):
        if label not in names:
            raise DataError(f"{where}: data.label_column {label!r} is not a column of the header "
                            f"({', '.join(names) if header else 'the file has no header row'})")
        j = names.index(label)
    elif isinstance(label, int):
        if not -len(names) <= label < len(names):
            raise DataError(f"{where}: data.label_column {label} is out of range for {len(names)} columns")
        j = label % len(names)
    else:
        j = next((lowered.index(n) for n in LABEL_COLUMN_NAMES if header and n in lowered), len(names) - 1)

    columns = list(zip(*(row for _, row in data)))
    features = []
    for k, column in enumerate(columns):
        if k == j:
            continue
        try:
            features.append(np.asarray(column).astype(np.float32))
        except ValueError:
            i = next(i for i, c in enumerate(column) if not _is_number(c))
            bad = "is empty (missing values are not filled in)" if not column[i].strip() else f"holds {column[i]!r}"
            raise DataError(f"{where}: feature column {names[k]!r} is not numeric: line {data[i][0]} {bad}; "
                            f"the label column is {names[j]!r} (data.label_column picks another)") from None
        if not np.isfinite(features[-1]).all():   # "nan", "inf" parse as numbers; the line, not x_train's count
            i = int(np.flatnonzero(~np.isfinite(features[-1]))[0])
            text = column[i].strip()
            why = ("beyond float32's range (3.4e38)" if np.isfinite(float(text)) else
                   "not a value (missing values are not filled in)" if np.isnan(float(text)) else "infinite")
            raise DataError(f"{where}: feature column {names[k]!r}: line {data[i][0]} holds {text!r}, {why}")
    y = np.asarray([c.strip() for c in columns[j]])
    missing = np.flatnonzero(y == "")
    if len(missing):
        raise DataError(f"{where}: line {data[missing[0]][0]} has no label in column {names[j]!r}")
    for kind in (np.int64, np.float64):  # labels written as numbers are numbers (sorted as numbers)
        try:
            y = y.astype(kind)
            break
        except ValueError:
            pass
    return {"train": (torch.from_numpy(np.stack(features, axis=1)), y)}, None


def resolve_loader(name):
    """The function `package.module:function` names (imported now: config validation calls this so that a
    misspelt module is reported with the config, before any work)."""
    return load_callable(name, f"data.dataset: {name}", DataError)


def _function(cfg):
    """A loader of your own, data.dataset: package.module:function (the module must be importable: installed,
    on PYTHONPATH, or in the working directory: edgebayes/plugins.py).

    Called as function(cfg) with the DataConfig (cfg.path, cfg.root and the other data keys are there for it
    to use). It returns (x_train, y_train, x_test, y_test) or (x_train, y_train, x_test, y_test, classes),
    as numpy arrays or tensors, or a dict with those keys (x_val / y_val allowed, or x / y for one set that
    is split like digits). Inputs and labels follow the npz rules (_inputs, _encode_labels).
    """
    where = f"data.dataset: {cfg.dataset}"
    loader = resolve_loader(cfg.dataset)
    try:
        result = loader(cfg)
    except Exception as e:   # the user's code: one message naming the key, not a traceback or "train failed"
        raise DataError(f"{where}: the loader failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                        f"it is called as {cfg.dataset.partition(':')[2]}(cfg), cfg the config's data section") from None
    if isinstance(result, dict):
        arrays = dict(result)
    elif isinstance(result, (tuple, list)) and len(result) in (4, 5):
        arrays = dict(zip(("x_train", "y_train", "x_test", "y_test", "classes"), result))
    else:
        raise DataError(f"{where}: returned {type(result).__name__}; expected (x_train, y_train, x_test, y_test"
                        f"[, classes]) or a dict with those keys")
    classes = arrays.pop("classes", None)
    where = f"{where}: returned"
    return (_sets_from_mapping(arrays, where, cfg.signals),
            None if classes is None else _class_names(classes, where))


# data.dataset -> loader(cfg) -> ({set name: (x, y)}, classes or None); a `package.module:function` is _function.
LOADERS = {"digits": _digits, "mnist": _official, "fashion-mnist": _official, "cifar10": _official,
           "npz": _npz, "image-folder": _image_folder, "csv": _csv}


# ---------------------------------------------------------------------------------------------
# Checks shared by every source, and the splits
# ---------------------------------------------------------------------------------------------
def _label_array(y, name, where) -> np.ndarray:
    a = y.detach().cpu().numpy() if isinstance(y, torch.Tensor) else np.asarray(y)
    if a.ndim == 2 and a.shape[1] == 1:
        a = a[:, 0]
    if a.ndim != 1:
        raise DataError(f"{where}: {name} has shape {a.shape}; expected one label per input (1-D); "
                        f"one-hot labels: use y.argmax(1)")
    if a.dtype.kind == "b":
        return a.astype(np.int64)
    if a.dtype.kind == "f":
        if not np.isfinite(a).all() or (a != np.round(a)).any():
            raise DataError(f"{where}: {name} holds non-integer numbers; expected class labels")
        return a.astype(np.int64)
    if a.dtype.kind in "iu":
        return a.astype(np.int64)
    if a.dtype.kind in "USO":
        return np.asarray([v.decode() if isinstance(v, bytes) else str(v) for v in a.tolist()])
    raise DataError(f"{where}: {name} holds {a.dtype} values; expected class labels (integers or strings)")


def _shown(name) -> str:
    """A class name for a message: as it is when printable, else its repr (a newline, an ANSI escape or a
    right-to-left override from a file's class names would otherwise act on the terminal)."""
    name = str(name)
    return name if name.isprintable() else repr(name)


def _encode_labels(labels: dict, classes, where):
    """{set: labels} -> ({set: int64 class indices}, class names).

    With class names given (npz `classes`, a loader's 5th value, the folder names): integer labels index
    them, string labels are looked up in them. Without: integers that are exactly 0..K-1 in training stay as
    they are; any other values (strings too) are mapped to their sorted unique training values, whose
    text becomes the class names.
    """
    train = labels["train"]
    if classes is not None:
        names = np.asarray(classes)
        if train.dtype.kind in "iu":
            lookup = lambda a: np.where((a >= 0) & (a < len(classes)), a, -1)  # noqa: E731
        else:
            order = np.argsort(names)
            lookup = lambda a: _lookup(names[order], a, order)  # noqa: E731
    else:
        values = np.unique(train)
        if train.dtype.kind in "iu" and np.array_equal(values, np.arange(len(values))):
            classes = [str(v) for v in values.tolist()]
            lookup = lambda a: np.where((a >= 0) & (a < len(classes)), a, -1)  # noqa: E731
        else:
            classes = [str(v) for v in values.tolist()]
            lookup = lambda a: _lookup(values, a)  # noqa: E731
    codes = {}
    for s, a in labels.items():
        if (a.dtype.kind in "iu") != (train.dtype.kind in "iu"):
            raise DataError(f"{where}: y_{s} holds {'numbers' if a.dtype.kind in 'iu' else 'strings'} but "
                            f"y_train {'numbers' if train.dtype.kind in 'iu' else 'strings'}")
        codes[s] = lookup(a)
        bad = np.flatnonzero(codes[s] < 0)
        if len(bad):
            shown = ", ".join(repr(v) for v in list(dict.fromkeys(a[bad].tolist()))[:5])
            raise DataError(f"{where}: y_{s} has labels that are not classes: {shown} "
                            f"(classes: {', '.join(_shown(c) for c in list(classes)[:20])}"
                            f"{f', ... {len(classes)} in all' if len(classes) > 20 else ''})")
    check_classes_seen(codes["train"], {s: codes[s] for s in ("val", "test") if s in codes}, classes, where)
    return {s: torch.from_numpy(c) for s, c in codes.items()}, [str(c) for c in classes]


def check_classes_seen(train_y, others, classes, where, carved=None):
    """The label rule of every split: training holds two classes or more, and each class of another split
    ({split name: class indices}) is one training has. `carved`: how the splits were carved from one set, where
    they were (at random, not stratified: a rare class can land wholly outside training); the message says so."""
    seen = np.unique(np.asarray(train_y))
    if len(seen) < 2:
        holds, fix = ((f"after the split ({carved}) the training split", "give more examples of the other classes")
                      if carved else ("y_train", "a classifier needs two or more"))
        raise DataError(f"{where}: {holds} holds a single class ({_shown(classes[seen[0]])}); {fix}")
    for name, ys in others.items():
        unseen = np.setdiff1d(np.unique(np.asarray(ys)), seen)
        if len(unseen):
            shown = ", ".join(repr(classes[i]) for i in unseen[:5])
            raise DataError(f"{where}: after the split ({carved}) the {name} split holds class(es) {shown} with no "
                            f"example left in the training split; give more examples of them, or provide the {name} "
                            f"set yourself" if carved else f"{where}: labels in y_{name} not seen in training: {shown}")


def _lookup(sorted_values, a, order=None):
    """Index of each value of a in sorted_values (its position in the unsorted original through order), -1
    where it is absent."""
    i = np.clip(np.searchsorted(sorted_values, a), 0, len(sorted_values) - 1)
    found = sorted_values[i] == a
    if order is not None:
        i = order[i]
    return np.where(found, i, -1)


def pixels_as_float(x: torch.Tensor) -> torch.Tensor:
    """x as float32 on its own device: uint8 pixels scaled to [0, 1] (x / 255, as the loaders scaled them
    before they kept uint8, bit for bit), float32 as it is. The divisor is a tensor on x's device: CUDA divides
    by a Python number as a multiplication by its reciprocal, one bit off for 126 of the 256 values (review)."""
    if x.dtype != torch.uint8:
        return x
    return x.to(torch.float32).div_(torch.tensor(255.0, device=x.device))   # in place: one float copy, not two


def as_inputs(a, keep_pixels=False):
    """A user's inputs as a float32 CPU tensor: an array, a list, or a tensor on any device (detached: one that
    requires grad too). eb.fit's x, eb.save's example, eb.run's x, bayesianize's calibration_x. uint8 (pixels) is
    scaled to [0, 1], as every data source of the pipeline scales it (`_inputs`): a net fitted on uint8 arrays
    through one and run on them through the other sees the same numbers. keep_pixels: uint8 stays uint8, for a
    training split (scaled a batch at a time: pixels_as_float)."""
    x = torch.as_tensor(a.detach().cpu() if isinstance(a, torch.Tensor) else np.asarray(a))
    return x if keep_pixels and x.dtype == torch.uint8 else pixels_as_float(x).to(torch.float32)


def class_indices(y, name, where) -> torch.Tensor:
    """Labels a user hands to eb.metrics or Compressed.calibrate as int64 class indices: integers, integral
    floats or booleans, one per input ((N,) or (N, 1)); one-hot, fractional and string labels refused by name."""
    a = _label_array(y, name, where)
    if a.dtype.kind not in "iu":
        raise DataError(f"{where}: {name} holds strings; expected class indices 0..C-1 (the net's outputs)")
    return torch.from_numpy(a)


def checked_sets(sets: dict, classes, where):
    """The checks every source passes: one label per input, one input shape, finite inputs, the labels."""
    shape = tuple(sets["train"][0].shape[1:])
    if 0 in shape:   # a layer would read no inputs: a division by zero at its initialisation, not a message
        raise DataError(f"{where}: x_train inputs have shape {shape}: no values per input")
    labels = {}
    for s, (x, y) in sets.items():
        y = _label_array(y, f"y_{s}", where)
        if len(x) != len(y):
            raise DataError(f"{where}: x_{s} has {len(x)} inputs but y_{s} has {len(y)} labels")
        if len(x) == 0:
            raise DataError(f"{where}: x_{s} is empty")
        if tuple(x.shape[1:]) != shape:
            raise DataError(f"{where}: x_{s} inputs have shape {tuple(x.shape[1:])} but x_train inputs {shape}")
        # in blocks: torch.isfinite of a float tensor allocates |x| (a float copy) and two bool masks of the whole
        # set; counted only in a block whose sum is not finite (a NaN or an infinity makes it so; an overflow too,
        # then counted as none), 40x faster: 23 s on 30,000 RGB images of 64x64 (probe)
        bad = 0 if not x.is_floating_point() else sum(
            int((~torch.isfinite(block)).sum()) for i in range(0, len(x), 4096)
            if not torch.isfinite((block := x[i:i + 4096]).sum()))
        if bad:
            raise DataError(f"{where}: x_{s} has {bad} values that are NaN or infinite")
        labels[s] = y
    codes, classes = _encode_labels(labels, classes, where)
    if len(sets) > 1:
        train_rows = _row_hashes(sets["train"][0])
        for s in sets.keys() - {"train"}:
            shared = int(np.isin(_row_hashes(sets[s][0]), train_rows).sum())
            if shared:   # its figures would be of examples the net was trained on
                warnings.warn(f"{where}: {shared} of the {len(sets[s][0])} inputs of x_{s} are also in x_train "
                              f"(exact copies): the {s} figures are partly of training examples", stacklevel=2)
    return {s: (x, codes[s]) for s, (x, _) in sets.items()}, classes


def _row_hashes(x, block_words=1 << 22):
    """A 64-bit hash of each input's exact float32 bits (a fixed random multiply-add over its words): equal
    inputs, equal hashes; unequal ones collide with probability about 2^-64 per pair. uint8 pixels are hashed as
    the float32 values they stand for, a block at a time (a float copy of the whole set is what uint8 saves)."""
    rows = x.reshape(len(x), -1)
    mix = np.random.default_rng(0).integers(1, 2**63, rows.shape[1], dtype=np.uint64) | np.uint64(1)
    block = max(1, block_words // max(1, rows.shape[1]))   # ~64 MiB of uint64 temporaries, whatever the row size
    return np.concatenate([(np.ascontiguousarray(pixels_as_float(rows[i:i + block]).numpy(), dtype=np.float32)
                            .view(np.uint32).astype(np.uint64) * mix).sum(1, dtype=np.uint64)
                           for i in range(0, len(rows), block)] or [np.zeros(0, np.uint64)])


def _source(cfg) -> str:
    if cfg.dataset in ("npz", "image-folder", "csv"):
        return f"data.path: {Path(cfg.path).expanduser()}"
    return f"data.dataset: {cfg.dataset}" if ":" in cfg.dataset else f"data set {cfg.dataset!r}"


def _load_sets(cfg):
    """({set name: (x, y)}, classes) of the configured source, checked."""
    if cfg.dataset in LOADERS:
        load = LOADERS[cfg.dataset]
    elif IMPORT_PATH.match(cfg.dataset):
        load = _function
    else:
        raise DataError(f"data.dataset: unknown data set {cfg.dataset!r}; expected one of {', '.join(LOADERS)}, "
                        f"or package.module:function")
    sets, classes = load(cfg)
    return checked_sets(sets, classes, _source(cfg))


def data_fingerprint(cfg) -> Optional[str]:
    """What data.path holds now (provenance.stat_fingerprint over its files; images only in an image folder),
    None for the built-in sets and a loader function of the user's given no data.path.

    The stage cache hashes the config, which names data.path but not what is in it: a rewritten npz or a
    folder with images added would otherwise leave a stale training run in place.
    """
    if not cfg.path or not (cfg.dataset in ("npz", "image-folder", "csv") or IMPORT_PATH.match(cfg.dataset)):
        return None
    # a loader of the user's own is handed data.path: what it holds counts, every file (its formats are its own)
    fingerprint, files, size = stat_summary(Path(cfg.path).expanduser(),
                                            IMAGE_EXTENSIONS if cfg.dataset == "image-folder" else None)
    return f"{fingerprint}: {files} files, {size} bytes"   # the counts: data_change says what changed


def data_change(was, now) -> str:
    """What changed between two data_fingerprints, for the message of a training that runs again: the files'
    count and size then and now, or, with both equal, files rewritten or touched (a copy or sync that does not
    keep modification times makes every file new). "" for a fingerprint of another form (older markers)."""
    counts = [re.fullmatch(r"[0-9a-f]+: (\d+) files, (\d+) bytes", str(v)) for v in (was, now)]
    if None in counts:
        return ""
    (n_was, b_was), (n_now, b_now) = ((int(m[1]), int(m[2])) for m in counts)
    if (n_was, b_was) == (n_now, b_now):
        what = "its size is the same" if n_now == 1 else f"the same {n_now:,} files and bytes"
        return (f"{what}, but rewritten or with other modification times (a copy or sync that does not keep "
                f"them makes every file new)")
    files = "files" if n_now != 1 or n_was != 1 else "file"
    return f"{n_now:,} {files} of {b_now / 1e6:,.3g} MB now, {n_was:,} of {b_was / 1e6:,.3g} MB when the stage ran"


def describe(cfg, input_shape) -> dict:
    """Which data a run read and what a raw input went through before the network, as the loader did it: what
    the train metrics, the report and the bundle's manifest say, so that an application on the device can feed
    the shipped model its own inputs the same way (probe: nothing said the 1/255, the RGB or the resize)."""
    if cfg.dataset == "image-folder":
        c, h, w = input_shape
        mode = "grayscale (PIL mode L)" if c == 1 else "RGB (PIL mode RGB: alpha dropped, grayscale repeated)"
        size = (f"resized to {h}x{w} (HxW) with PIL's bilinear filter" if cfg.image_size
                else f"at their own size, {h}x{w} (HxW)")
        steps = f"images read with PIL as {mode}, {size}; 8-bit values / 255, 16-bit grayscale / 65535"
    elif cfg.dataset == "csv":
        steps = "the feature columns in the file's order, the label column left out; numbers as written, not scaled"
    elif cfg.dataset == "digits":
        steps = "scikit-learn's 8x8 digits, values 0..16 divided by 16"
    elif cfg.dataset in OFFICIAL_SPLITS:
        steps = "8-bit pixels / 255"
    else:   # npz, or a loader of the user's own: the arrays as given
        kind = {3: "images channels first", 2: "signals as (channels, length)"}.get(len(input_shape),
                                                                                    "feature vectors")
        steps = ((f"what {cfg.dataset} returns, then " if IMPORT_PATH.match(cfg.dataset) else "")
                 + f"uint8 arrays / 255, other numbers as they are; {kind}")
    # the absolute path: a relative one says nothing once the report or the bundle has left the working folder
    path = Path(cfg.path).expanduser().resolve() if cfg.path else None
    source = (f"data.path: {path}" if cfg.dataset in ("npz", "image-folder", "csv") else
              _source(cfg) + (f" (data.path: {path})" if path and IMPORT_PATH.match(cfg.dataset) else ""))
    return {"source": source, "fingerprint": data_fingerprint(cfg),
            "preprocessing": f"{steps}; float32, shape (N, {', '.join(map(str, input_shape))})"}


def inputs_fingerprint(cfg, weight_files=()) -> list:
    """What the files a training reads hold now (size and mtime): data.path (data_fingerprint), the weight files
    [(config key, path)] and the user's own network and loader with what they import (plugins.source_files). A
    file replaced or edited under the same name makes another training: the train stage's fingerprint and
    SQS's pretraining cache count these. `cfg`: the pipeline config."""
    return list(inputs_parts(cfg, weight_files).values())


def inputs_parts(cfg, weight_files=()) -> dict:
    """inputs_fingerprint's pieces by what the user would call them (data.path, model.pretrained, the code of
    model.arch), so that a stage run again can say which changed."""
    held = {"data.path": h} if (h := data_fingerprint(cfg.data)) is not None else {}
    held.update({key: [key, stat_fingerprint(Path(path))] for key, path in weight_files})
    for key, value in (("model.arch", cfg.model.arch), ("data.dataset", cfg.data.dataset)):
        if sources := source_files(value):
            held[f"the code of {key}"] = [key, *(stat_fingerprint(f) for f in sources)]
    return held


def _split(n, fraction, generator):
    perm = torch.randperm(n, generator=generator)
    k = int(round(n * fraction))
    return perm[k:], perm[:k]


def load_data(cfg, seed: int) -> Splits:
    """Load the configured data set with seeded splits: the source's own test / val sets where it has
    them, else carved out of its training set (test first, then validation)."""
    g = torch.Generator().manual_seed(seed)
    sets, classes = _load_sets(cfg)
    x, y = sets.pop("train")
    n_given = len(x)
    # Indices into the given training set, composed, so that each split is one copy of its rows (x[rest][train]
    # would be two, with the whole set alive beside them).
    if "test" in sets:
        rest = torch.arange(len(x))
        test_x, test_y = sets.pop("test")
    else:
        rest, test = _split(len(x), cfg.test_fraction, g)
        test_x, test_y = x[test], y[test]
    if "val" in sets:
        train, (val_x, val_y) = rest, sets.pop("val")
    else:
        train, val = _split(len(rest), cfg.val_fraction, g)
        val_x, val_y = x[rest[val]], y[rest[val]]
        train = rest[train]
    carved = train
    train = train[: cfg.train_subset]  # a quick run's subset (None: all); validation and test stay whole
    for name, part in (("training", train), ("validation", val_x), ("test", test_x)):
        if len(part) == 0:
            raise DataError(f"{_source(cfg)}: the {name} split is empty ({n_given} inputs in the "
                            f"training set, data.test_fraction {cfg.test_fraction}, data.val_fraction "
                            f"{cfg.val_fraction}); give more data or change the fractions")
    check_classes_seen(y[carved], {"validation": val_y, "test": test_y}, classes, _source(cfg),
                       carved=f"data.test_fraction {cfg.test_fraction}, data.val_fraction {cfg.val_fraction}")
    left_out = np.setdiff1d(np.unique(y[carved].numpy()), np.unique(y[train].numpy()))
    if len(left_out):   # a quick run's choice, but one example of ten classes trained without a word (probe)
        shown = ", ".join(repr(classes[i]) for i in left_out[:5]) + (", ..." if len(left_out) > 5 else "")
        warnings.warn(f"{_source(cfg)}: data.train_subset {cfg.train_subset} leaves {len(left_out)} class(es) of the "
                      f"training split without an example ({shown}): the network never learns them")
    # training keeps uint8 pixels (a quarter of the bytes, scaled a batch at a time); the others are float32,
    # made once the whole given set is gone (each split holds its own copy of its rows): a lower peak
    splits = Splits(x[train], y[train], val_x, val_y, test_x, test_y, classes)
    del x, y, sets, val_x, test_x
    splits.val_x, splits.test_x = pixels_as_float(splits.val_x), pixels_as_float(splits.test_x)
    if cfg.ood:
        splits.ood_x = _ood_set(cfg, splits, g)
    return splits


def _ood_set(cfg, splits, generator):
    """Out-of-distribution inputs of the same shape: uniform noise, or another data set's test images.

    Noise is drawn in the training inputs' range [min, max]: [0, 1] for images, the features' own scale
    for unscaled tabular data (noise in [0, 1] would sit inside or far off such data by accident).
    """
    n = len(splits.test_x)
    if cfg.ood == "noise":
        lo, hi = (float(pixels_as_float(v)) for v in (splits.train_x.min(), splits.train_x.max()))
        return lo + (hi - lo) * torch.rand((n,) + splits.input_shape, generator=generator)
    if cfg.ood == "digits":
        x = _digits()[0]["train"][0]
    else:
        try:
            x = OFFICIAL_SPLITS[cfg.ood](cfg.ood, cfg.model_copy(update={"dataset": cfg.ood, "ood": None}),
                                         train=False)[0]
        except DataError as e:   # its files are missing: said as the key that asked for them
            raise DataError(f"data.ood: {e}") from None
    if tuple(x.shape[1:]) != splits.input_shape:
        raise DataError(f"data.ood: {cfg.ood} images have shape {tuple(x.shape[1:])}, "
                        f"but {cfg.dataset} has {splits.input_shape}")
    return x[torch.randperm(len(x), generator=generator)[:n]]
