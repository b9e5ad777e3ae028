"""The embedded default dataset: SYNTHETIC review-like sentences, made in code.

Nothing is downloaded. Sentences are plain English words, so a real WordPiece
tokenizer handles them, e.g. ``"emma thinks the movie was wonderful again
with her grandchildren ."``. Each example has

- a task label (``negative``/``positive``, or ``negative``/``neutral``/
  ``positive``) carried by a task word; with probability ``label_noise`` the
  text's task word comes from another class, so the task is learnable but not
  perfectly;
- two protected attributes, ``gender`` (``female``/``male``: names, pronouns,
  family words) and ``age`` (``old``/``young``: marker words such as
  ``retirement`` / ``homework``). Each attribute's marker word is present with
  probability ``attr_marker_prob`` (otherwise a neutral word stands in), so a
  probe can recover the attribute from the representation.

Correlation knob: with probability ``c = attr_task_correlation[a]`` attribute
``a`` takes the value aligned with the task label (task class ``k`` -> attribute
class ``k mod n``), otherwise a uniformly random value. For the balanced binary
task this makes the Pearson (phi) correlation between task label and attribute
equal to ``c`` in expectation; ``c = 0`` makes them independent.

This is a synthetic sanity-check dataset, not a benchmark: results on it say
that code works, not that a method debiases real text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from moddiffy_jax.data.dataset import StringColumns, TextDataset, encode_splits

NAME = "synthetic"

TASK_CLASSES = {
    2: ("negative", "positive"),
    3: ("negative", "neutral", "positive"),
}
TASK_WORDS = {
    "negative": ("terrible", "awful", "boring", "poor", "bad", "dull", "weak"),
    "neutral": ("average", "ordinary", "typical", "standard", "plain", "usual"),
    "positive": ("great", "wonderful", "excellent", "brilliant", "good", "superb"),
}
# attribute -> class -> marker words (classes sorted, as the vocab will be).
ATTR_MARKERS = {
    "gender": {
        "female": ("she", "emma", "mary", "sarah", "anna", "her mother", "my sister"),
        "male": ("he", "john", "james", "david", "peter", "his father", "my brother"),
    },
    "age": {
        "old": ("retirement", "grandchildren", "pension", "retired", "my grandson"),
        "young": ("homework", "college", "school", "classmates", "my exams"),
    },
}
NEUTRAL = {
    "gender": ("someone", "a reviewer", "a friend", "they", "the guest"),
    "age": ("today", "recently", "again", "this week", "lately"),
}
TOPICS = ("movie", "book", "restaurant", "hotel", "concert", "game", "show", "trip")
VERBS = ("thinks", "says", "felt", "wrote", "believes", "noticed")
FILLERS = ("really", "honestly", "overall", "actually", "quite", "certainly", "so")
TEMPLATES = (
    "{subj} {verb} the {topic} was {task} {age} .",
    "{subj} {verb} the {topic} was {filler} {task} , {age} .",
    "{age} , {subj} {verb} that the {topic} was {task} .",
    "the {topic} was {task} , {subj} {verb} {age} .",
)
ATTRIBUTES = tuple(ATTR_MARKERS)


def generate_synthetic(
    *,
    seed: int = 0,
    num_train: int = 2000,
    num_dev: int = 500,
    num_test: int = 500,
    num_task_classes: int = 2,
    attributes: Sequence[str] = ATTRIBUTES,
    attr_task_correlation: Mapping[str, float] | float = 0.8,
    eval_attr_task_correlation: float | None = None,
    label_noise: float = 0.1,
    attr_marker_prob: float = 0.9,
) -> TextDataset:
    """Generates the synthetic dataset deterministically from ``seed``.

    Args:
      seed: determines every split (each split has its own stream, so changing
        ``num_dev`` does not change train).
      num_train: train size.
      num_dev: dev size.
      num_test: test size.
      num_task_classes: 2 or 3.
      attributes: subset of ``("gender", "age")`` to keep, in this order.
      attr_task_correlation: attribute -> correlation ``c`` in [0, 1] (see the
        module docstring), or one float for all attributes. Attributes missing
        from a mapping get 0.
      eval_attr_task_correlation: if set, the correlation used for dev and test
        for every attribute (e.g. 0 for an unbiased evaluation set); ``None``
        uses the train correlations.
      label_noise: probability that the text's task word comes from a class
        other than the label.
      attr_marker_prob: probability that each attribute's marker word appears.

    Returns:
      A :class:`TextDataset` named ``"synthetic"`` with ``synthetic=True``.
    """
    if num_task_classes not in TASK_CLASSES:
        raise ValueError(
            f"num_task_classes must be one of {sorted(TASK_CLASSES)}, "
            f"got {num_task_classes}."
        )
    unknown = [a for a in attributes if a not in ATTR_MARKERS]
    if unknown or not attributes:
        raise ValueError(
            f"Synthetic attributes must be a non-empty subset of {list(ATTRIBUTES)}, "
            f"got {list(attributes)}."
        )
    if isinstance(attr_task_correlation, int | float):
        corr = {a: float(attr_task_correlation) for a in ATTRIBUTES}
    else:
        extra = sorted(set(attr_task_correlation) - set(ATTRIBUTES))
        if extra:
            raise ValueError(
                f"attr_task_correlation names unknown attributes {extra}; valid: "
                f"{list(ATTRIBUTES)}."
            )
        corr = {a: float(attr_task_correlation.get(a, 0.0)) for a in ATTRIBUTES}
    for key, value in [
        *corr.items(),
        ("eval_attr_task_correlation", eval_attr_task_correlation),
        ("label_noise", label_noise),
        ("attr_marker_prob", attr_marker_prob),
    ]:
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValueError(f"{key} must be in [0, 1], got {value}.")
    classes = TASK_CLASSES[num_task_classes]
    sizes = {"train": num_train, "dev": num_dev, "test": num_test}
    raw = {}
    for split_id, (split, size) in enumerate(sizes.items()):
        if size <= 0:
            continue
        split_corr = corr
        if split != "train" and eval_attr_task_correlation is not None:
            split_corr = {a: eval_attr_task_correlation for a in ATTRIBUTES}
        raw[split] = _generate_split(
            np.random.default_rng([seed, split_id]),
            size=size,
            classes=classes,
            corr=split_corr,
            label_noise=label_noise,
            marker_prob=attr_marker_prob,
            attributes=tuple(attributes),
        )
    return encode_splits(
        raw,
        attributes=tuple(attributes),
        task_column="task",
        attr_columns={a: a for a in attributes},
        task_classes=classes,
        attr_classes={a: tuple(ATTR_MARKERS[a]) for a in attributes},
        name=NAME,
        synthetic=True,
    )


def _generate_split(
    rng: np.random.Generator,
    *,
    size: int,
    classes: tuple[str, ...],
    corr: Mapping[str, float],
    label_noise: float,
    marker_prob: float,
    attributes: tuple[str, ...],
) -> StringColumns:
    k = len(classes)
    task = rng.integers(0, k, size)
    # The text's class: the label, or with prob label_noise another class.
    noisy = rng.random(size) < label_noise
    text_class = np.where(noisy, (task + rng.integers(1, k, size)) % k, task)
    # Every attribute is always drawn (fixed draw order), then subset, so the
    # data of one attribute does not depend on which others are kept.
    attr_idx, has_marker = {}, {}
    for a in ATTRIBUTES:
        n_vals = len(ATTR_MARKERS[a])
        aligned = task % n_vals
        follow = rng.random(size) < corr[a]
        attr_idx[a] = np.where(follow, aligned, rng.integers(0, n_vals, size))
        has_marker[a] = rng.random(size) < marker_prob
    template = rng.integers(0, len(TEMPLATES), size)
    picks = rng.integers(0, 1 << 30, (size, 6))
    texts = []
    for i in range(size):
        words = {}
        for slot, a in (("subj", "gender"), ("age", "age")):
            if has_marker[a][i]:
                pool = ATTR_MARKERS[a][tuple(ATTR_MARKERS[a])[attr_idx[a][i]]]
            else:
                pool = NEUTRAL[a]
            words[slot] = pool[picks[i, 0 if slot == "subj" else 1] % len(pool)]
        pool = TASK_WORDS[classes[text_class[i]]]
        words["task"] = pool[picks[i, 2] % len(pool)]
        words["topic"] = TOPICS[picks[i, 3] % len(TOPICS)]
        words["verb"] = VERBS[picks[i, 4] % len(VERBS)]
        words["filler"] = FILLERS[picks[i, 5] % len(FILLERS)]
        texts.append(TEMPLATES[template[i]].format(**words))
    return StringColumns(
        text=texts,
        text_pair=None,
        task=[classes[t] for t in task],
        attrs={a: [tuple(ATTR_MARKERS[a])[j] for j in attr_idx[a]] for a in attributes},
    )
