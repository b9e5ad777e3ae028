"""Image benchmarks on disk: prepared TFDS directories, Corrupted CIFAR-10 PNG folders.

Nothing is ever downloaded.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import os
import pathlib
import re
from collections.abc import Callable
from typing import Any

import ml_collections
import numpy as np

# --------------------------------------------------------------------------
# TFDS (optional; never downloads).
from moddiffy_jax.data.images import (
    CIFAR10_CLASSES,
    TFDS_INSTALL_HINT,
    VISION_SPLITS,
    ImageDataset,
    ImageSplit,
    log_sizes,
)


def _import_tfds() -> Any:
    try:
        return importlib.import_module("tensorflow_datasets")
    except ImportError as e:
        raise ImportError(
            "The TFDS sources need tensorflow_datasets, which is not installed. "
            f"Fix: {TFDS_INSTALL_HINT}."
        ) from e


def prepared_tfds_builder(tfds: Any, name: str, data_dir: str) -> Any:
    """``tfds.builder(name, data_dir=...)`` after checking it is prepared.

    Nothing is downloaded: an unprepared dataset is an error that names the
    directory searched and how to prepare it.

    Args:
      tfds: the imported ``tensorflow_datasets`` module.
      name: TFDS dataset name, e.g. ``"celeb_a"``.
      data_dir: ``data.vision.tfds_data_dir``; empty uses TFDS's default
        (``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``).

    Raises:
      FileNotFoundError: the dataset is not prepared there.
    """
    builder = tfds.builder(name, data_dir=data_dir or None)
    is_prepared = getattr(builder, "is_prepared", None)
    if callable(is_prepared):
        prepared = bool(is_prepared())
    else:
        prepared = os.path.isfile(
            os.path.join(str(builder.data_dir), "dataset_info.json")
        )
    if not prepared:
        searched = (
            data_dir
            or "the TFDS default data dir ($TFDS_DATA_DIR or ~/tensorflow_datasets)"
        )
        raise FileNotFoundError(
            f"TFDS dataset {name!r} is not prepared in {searched} (looked for "
            f"{builder.data_dir}). This library never downloads. Fix: on a machine "
            f"with network access run `tfds build {name} --data_dir=<dir>` (CelebA "
            "may need its files placed in <dir>/downloads/manual first), copy <dir> "
            "here and set data.vision.tfds_data_dir=<dir>."
        )
    return builder


def _resize_pil(image: np.ndarray, height: int, width: int) -> np.ndarray:
    pil = importlib.import_module("PIL.Image")
    if image.shape[:2] == (height, width):
        return image
    out = pil.fromarray(image).resize((width, height), pil.BILINEAR)
    return np.asarray(out, dtype=np.uint8)


def _short_side_shape(height: int, width: int, size: int) -> tuple[int, int]:
    """torchvision ``Resize(size)``: the shorter side becomes ``size``."""
    if height <= width:
        return size, int(size * width / height)
    return int(size * height / width), size


def _balanced_indices(
    task: np.ndarray, bias: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Equal-size random samples of every (task, bias) cell (the min cell size)."""
    cells = [np.flatnonzero((task == t) & (bias == b)) for t in (0, 1) for b in (0, 1)]
    size = min(len(c) for c in cells)
    if size == 0:
        raise ValueError("A (target, bias) cell is empty; cannot balance the split.")
    return np.sort(np.concatenate([rng.choice(c, size, replace=False) for c in cells]))


def load_tfds_celeba(config: ml_collections.ConfigDict) -> ImageDataset:
    """``celeba_tfds`` source: CelebA from a prepared TFDS ``celeb_a`` (spec B8).

    As FFW: ``train`` = the official train split (natural bias; optionally a
    random ``num_train`` subset); the official validation split balanced over
    the four (target, bias) cells (each cut to the smallest cell at random) and
    split ``celeba_gate_train_fraction`` / rest into ``gate_train`` /
    ``gate_val``; ``test`` = the balanced official test split. ``dev`` is the
    same data as ``gate_val`` (FFW schedules the vanilla learning rate on the
    balanced gate-val loss). Images are resized like torchvision
    ``Resize(image_size)`` (shorter side, aspect kept: 218x178 -> 274x224 at
    224), bilinear. The bias is the natural ``Male`` label (FFW uses
    ``1 - Male``; only the class order differs).

    Memory: the official train split at 224 is ~30 GB of uint8; use a smaller
    ``image_size`` or ``num_train``.
    """
    v = config.vision
    tfds = _import_tfds()
    builder = prepared_tfds_builder(tfds, "celeb_a", v.tfds_data_dir)
    size = v.image_size or 224
    target, bias_name = v.celeba_target, v.celeba_bias
    rng = np.random.default_rng([config.seed, 0])

    def read(split: str, pick: Callable[[np.ndarray, np.ndarray], np.ndarray]):
        skip = {"image": tfds.decode.SkipDecoding()}
        labels = [
            (bool(ex["attributes"][target]), bool(ex["attributes"][bias_name]))
            for ex in tfds.as_numpy(
                builder.as_dataset(split=split, shuffle_files=False, decoders=skip)
            )
        ]
        y = np.array([t for t, _ in labels], dtype=np.int32)
        b = np.array([m for _, m in labels], dtype=np.int32)
        keep = pick(y, b)
        wanted = set(keep.tolist())
        images = []
        ds = builder.as_dataset(split=split, shuffle_files=False, decoders=skip)
        pil = importlib.import_module("PIL.Image")
        for i, ex in enumerate(tfds.as_numpy(ds)):
            if i in wanted:
                img = np.asarray(pil.open(io.BytesIO(ex["image"])).convert("RGB"))
                h, w = _short_side_shape(img.shape[0], img.shape[1], size)
                images.append(_resize_pil(img, h, w))
        return ImageSplit(
            images=np.stack(images),
            task=y[keep],
            attrs={bias_name: b[keep]},
        )

    def pick_train(y, b):
        if v.num_train is None or v.num_train >= len(y):
            return np.arange(len(y))
        return np.sort(rng.choice(len(y), v.num_train, replace=False))

    train = read("train", pick_train)
    valid = read("validation", lambda y, b: _balanced_indices(y, b, rng))
    test = read("test", lambda y, b: _balanced_indices(y, b, rng))
    perm = rng.permutation(len(valid))
    n_gate = int(round(v.celeba_gate_train_fraction * len(valid)))
    gate_val = valid.subset(np.sort(perm[n_gate:]))
    splits = {
        "train": train,
        "dev": gate_val,
        "gate_train": valid.subset(np.sort(perm[:n_gate])),
        "gate_val": gate_val,
        "test": test,
    }
    log_sizes("celeba_tfds", splits)
    return ImageDataset(
        splits=splits,
        task_classes=(f"not_{target}", target),
        attr_classes={bias_name: (f"not_{bias_name}", bias_name)},
        name="celeba_tfds",
        synthetic=False,
        description=(
            f"CelebA (TFDS celeb_a), target {target}, bias {bias_name}; balanced "
            "official validation -> gate_train/gate_val, balanced official test"
        ),
    )


def load_tfds_cifar10_corrupted(config: ml_collections.ConfigDict) -> ImageDataset:
    """``corrupted_cifar10_tfds``: always raises; there is no faithful TFDS mapping.

    Raises:
      ValueError: explaining why and how to supply the data instead.
    """
    raise ValueError(
        "TFDS 'cifar10_corrupted' is the CIFAR-10-C test-time robustness benchmark "
        "(test images only, one corruption per config). It is not the biased "
        "Corrupted CIFAR-10 of LfF/DFA/FFW, whose training set correlates each "
        "class with one corruption (align/conflict folders), so it cannot be "
        "mapped faithfully and is not faked here. Fix: use data.source="
        "'corrupted_cifar10' with data.vision.cifar10c_dir=<root> holding the "
        "image folders <root>/<p>pct/{align,conflict,valid}/<class>/*.png and "
        "<root>/test/<class>/*.png (file names ending in _<label>_<bias>.png), "
        "and data.vision.cifar10c_percent=<p>."
    )


# --------------------------------------------------------------------------
# Corrupted CIFAR-10 from image folders.

_LABEL_BIAS = re.compile(r"_(\d+)_(\d+)\.png$")


def _read_png_folder(root: pathlib.Path, size: int | None) -> ImageSplit:
    paths = sorted(p for p in root.rglob("*.png") if p.is_file())
    if not paths:
        raise FileNotFoundError(f"No *.png files under {root}.")
    pil = importlib.import_module("PIL.Image")
    images, task, bias = [], [], []
    for p in paths:
        m = _LABEL_BIAS.search(p.name)
        if m is None:
            raise ValueError(
                f"{p}: the file name must end in _<label>_<bias>.png (the Corrupted "
                "CIFAR-10 release format)."
            )
        img = np.asarray(pil.open(p).convert("RGB"), dtype=np.uint8)
        if size is not None:
            img = _resize_pil(img, size, size)
        images.append(img)
        task.append(int(m.group(1)))
        bias.append(int(m.group(2)))
    shapes = {im.shape for im in images}
    if len(shapes) != 1:
        raise ValueError(
            f"Images under {root} have different shapes {sorted(shapes)}; set "
            "data.vision.image_size to resize them."
        )
    return ImageSplit(
        images=np.stack(images),
        task=np.asarray(task, dtype=np.int32),
        attrs={"corruption": np.asarray(bias, dtype=np.int32)},
    )


def load_cifar10c_folders(config: ml_collections.ConfigDict) -> ImageDataset:
    """``corrupted_cifar10`` source: the biased Corrupted CIFAR-10 image folders.

    Layout (the LfF/DFA release used by FFW, spec "[F] data on disk"):
    ``<cifar10c_dir>/<p>pct/{align,conflict,valid}/<class>/*.png`` and
    ``<cifar10c_dir>/test/<class>/*.png``, file names ending in
    ``_<label>_<bias>.png``. ``train`` = align + conflict of ``<p>pct``;
    ``dev`` = ``<p>pct/valid``; the test folder is split at random into
    ``cifar10c_fractions`` = (gate_train, test, gate_val), FFW's 60/20/20 in
    its order. Images are kept at their size (32x32) unless ``image_size``
    is set. No augmentation here (FFW: random crop and flip on train).
    """
    v = config.vision
    if not v.cifar10c_dir:
        raise ValueError(
            "data.vision.cifar10c_dir is empty; set it to the Corrupted CIFAR-10 "
            "root holding <p>pct/ and test/."
        )
    root = pathlib.Path(v.cifar10c_dir)
    pct = root / f"{v.cifar10c_percent}pct"
    for folder in (pct / "align", pct / "conflict", pct / "valid", root / "test"):
        if not folder.is_dir():
            raise FileNotFoundError(
                f"{folder} does not exist; expected the Corrupted CIFAR-10 layout "
                "<root>/<p>pct/{align,conflict,valid}/<class>/*.png and "
                "<root>/test/<class>/*.png (data.vision.cifar10c_percent="
                f"{v.cifar10c_percent!r})."
            )
    size = v.image_size
    align = _read_png_folder(pct / "align", size)
    conflict = _read_png_folder(pct / "conflict", size)
    train = ImageSplit(
        images=np.concatenate([align.images, conflict.images]),
        task=np.concatenate([align.task, conflict.task]),
        attrs={
            "corruption": np.concatenate(
                [align.attrs["corruption"], conflict.attrs["corruption"]]
            )
        },
    )
    test_pool = _read_png_folder(root / "test", size)
    fractions = tuple(v.cifar10c_fractions)
    if len(fractions) != 3 or min(fractions) <= 0 or abs(sum(fractions) - 1) > 1e-6:
        raise ValueError(
            "data.vision.cifar10c_fractions must be 3 positive fractions summing to "
            f"1 (gate_train, test, gate_val), got {fractions}."
        )
    perm = np.random.default_rng([config.seed, 0]).permutation(len(test_pool))
    n1 = int(round(fractions[0] * len(perm)))
    n2 = n1 + int(round(fractions[1] * len(perm)))
    splits = {
        "train": train,
        "dev": _read_png_folder(pct / "valid", size),
        "gate_train": test_pool.subset(np.sort(perm[:n1])),
        "test": test_pool.subset(np.sort(perm[n1:n2])),
        "gate_val": test_pool.subset(np.sort(perm[n2:])),
    }
    log_sizes("corrupted_cifar10", splits)
    return ImageDataset(
        splits={s: splits[s] for s in VISION_SPLITS},
        task_classes=CIFAR10_CLASSES,
        attr_classes={"corruption": tuple(f"corruption_{i}" for i in range(10))},
        name="corrupted_cifar10",
        synthetic=False,
        description=(
            f"Corrupted CIFAR-10 ({v.cifar10c_percent}% conflicting) from image "
            f"folders under {root}"
        ),
    )
