r"""What the main job's SYNTHETIC data allows: Bayes task accuracy and leakage.

The synthetic generator (``moddiffy_jax/data/synthetic.py``) plants three
cues of the gold task label y: the text's task word t (right with
probability 1 - label_noise), a gender marker g and an age marker a (each
follows y with the attribute's correlation, present with the marker
probability). This script draws a large sample from that process with the
main job's settings and prints, for representations that hold some of the
cues exactly (a lookup table per cue combination, the best any probe or
head can do):

* the Bayes task accuracy (what a head reading that representation can
  reach);
* each attribute's leakage: the best balanced accuracy of predicting the
  attribute's value from it (the attacker's metric, at its optimum).

Rows: all cues (what the core may learn), each attribute left out, the
gold label alone (the report's floor), and the cues kept only through the
Bayes decision y*(t, g, a) (a representation that holds the task word,
the other attribute and the decision: the decision uses the attribute, the
representation holds nothing more of it). Then what ``swap_keep_pivotal``
asks of a diff: the marker read as absent except where swapping it moves
the decision, and for core + both (both diffs' twins meeting wherever the
decision stays, so only the markers' presence and the decision are left)
the task word, which markers are present and the decision.

    python benchmarks/synthetic_bayes.py [--curve] [--pairs]

``--curve`` adds partial removal at the Bayes optimum: each attribute's
marker hidden (read as absent) or flipped on a random share of the
examples, the task cost against the share of the gap closed, and for both
attributes at once the least cost at which both gaps are half closed. A
diff trained on counterfactual word swaps makes the marker unreadable, as
"hidden" does (docs/efficacy.md, "Stop 47").

``--pairs`` (stop 73) hides by words, as a swap diff can: whole
counterpart pairs (a pair's two words made one), and a word of one class
read as absent (one-sided); see :func:`pairs`.

``--split dev`` / ``--split test`` (stop 63) applies the process's Bayes
rule (its likelihood ratios, ties counted as half right) to the rows of
the main job's own split (``--data_seed``; its split sizes, 2,000 dev
and 3,000 test examples), with each set of cues: what a head reading exactly those cues
scores on *that* split. A finite split's label noise differs from the
process's (the main job's test split has 8.9% noisy task words, its dev
split 10.9%), so these are the references a run's test (or dev) accuracy
should be read against. With ``--split``, ``--hide WORD,...`` (stop 73)
adds the row with those marker words read as absent (what hiding a swap
diff's counterpart pairs costs at the optimum on that split), and
``--spread ATTR:K`` prints that cost's spread over every choice of K
marker words of each class.

Numbers are of the SYNTHETIC process, not of a trained model.
"""

from __future__ import annotations

import argparse

import numpy as np


def sample(n, rng, corr, label_noise, marker_prob):
    y = rng.integers(0, 2, n)
    t = np.where(rng.random(n) < label_noise, 1 - y, y)
    values, seen = {}, {}
    for name in ("gender", "age"):  # the generator's draw order
        value = np.where(rng.random(n) < corr[name], y, rng.integers(0, 2, n))
        present = rng.random(n) < marker_prob
        values[name], seen[name] = value, np.where(present, value, 2)
    return y, t, values, seen


def _cells(columns):
    key = np.zeros(len(columns[0]), np.int64)
    for c in columns:
        key = key * (int(c.max()) + 1) + c
    return np.unique(key, return_inverse=True)[1]


def decide(columns, target, balanced=False):
    """The best prediction of ``target`` per cell of ``columns`` (balanced:
    the rule that maximises balanced accuracy)."""
    cells = _cells(columns)
    n_cells = cells.max() + 1
    ones = np.bincount(cells, weights=target, minlength=n_cells)
    count = np.bincount(cells, minlength=n_cells)
    rate = ones / np.maximum(count, 1)
    if balanced:
        p = target.mean()
        choose = rate / p > (1 - rate) / (1 - p)
    else:
        choose = rate > 0.5
    return choose[cells].astype(int)


def balanced_accuracy(pred, target):
    return 0.5 * ((pred[target == 0] == 0).mean() + (pred[target == 1] == 1).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2_000_000)
    parser.add_argument("--gender_corr", type=float, default=0.8)
    parser.add_argument("--age_corr", type=float, default=0.5)
    parser.add_argument("--label_noise", type=float, default=0.1)
    parser.add_argument("--marker_prob", type=float, default=0.9)
    parser.add_argument(
        "--curve", action="store_true", help="partial removal: cost against gap"
    )
    parser.add_argument(
        "--split",
        choices=("dev", "test"),
        help="the Bayes rule's accuracy on the main job's own split instead",
    )
    parser.add_argument(
        "--pairs",
        action="store_true",
        help="word-level hiding: whole counterpart pairs and one-sided words",
    )
    parser.add_argument(
        "--spread",
        default="",
        help="with --split: ATTR:K, the Bayes cost of every way of hiding K "
        "of the attribute's marker words of each class (K counterpart pairs)",
    )
    parser.add_argument("--data_seed", type=int, default=0)
    parser.add_argument(
        "--hide",
        default="",
        help="with --split: comma-separated marker words read as absent (a "
        "swap diff's hidden counterpart pairs), for one more row",
    )
    args = parser.parse_args()
    if args.split and args.spread:
        name, _, k = args.spread.partition(":")
        costs = hidden_pairs_spread(args, name, int(k))
        print(
            f"{args.split} split (data seed {args.data_seed}), {name}: {k} words of "
            f"each class hidden, {len(costs)} choices: Bayes cost min "
            f"{costs.min():.2f}, median {np.median(costs):.2f}, max {costs.max():.2f} "
            f"points; within 2 points: {np.mean(costs <= 2.0):.0%}"
        )
        return
    if args.split:
        split_accuracies(args)
        return
    rng = np.random.default_rng(0)
    corr = {"gender": args.gender_corr, "age": args.age_corr}
    y, t, values, seen = sample(args.n, rng, corr, args.label_noise, args.marker_prob)
    g, a = seen["gender"], seen["age"]
    decision = decide([t, g, a], y)
    # The posterior P(y | t, g, a) itself (a code per distinct value): what a
    # continuous logit holds, against the decision's one bit.
    posterior = _posterior_code([t, g, a], y)
    rows = [
        ("t, g, a (all cues)", [t, g, a]),
        ("t, a (gender left out)", [t, a]),
        ("t, g (age left out)", [t, g]),
        ("t (both left out)", [t]),
        ("y (gold label: the floor)", [y]),
        ("t, a, y*(t, g, a)", [t, a, decision]),
        ("t, g, y*(t, g, a)", [t, g, decision]),
        ("t, y*(t, g, a)", [t, decision]),
        ("t, a, g unless g moves y*", [t, a, _unless_pivotal(t, g, a, decision, 1)]),
        ("t, g, a unless a moves y*", [t, g, _unless_pivotal(t, g, a, decision, 2)]),
        ("t, markers present, y*", [t, g < 2, a < 2, decision]),
        ("P(y | t, g, a) alone", [posterior]),
        ("t, g, P(y | t, g, a)", [t, g, posterior]),
        ("t, a, P(y | t, g, a)", [t, a, posterior]),
    ]
    print("| representation holds | task accuracy | gender leakage | age leakage |")
    print("|---|---|---|---|")
    for label, cols in rows:
        acc = np.mean(decide(cols, y) == y)
        leak = [
            balanced_accuracy(decide(cols, values[n], balanced=True), values[n])
            for n in ("gender", "age")
        ]
        print(f"| {label} | {acc:.3f} | {leak[0]:.3f} | {leak[1]:.3f} |")
    if args.curve:
        curve(rng, y, t, values, seen)
        joint(rng, y, t, values, seen)
    if args.pairs:
        pairs(rng, y, t, values, seen)


def _main_job_split(args):
    """The main job's ``args.split`` (its generator settings and sizes) and
    the attributes' task correlations."""
    from moddiffy_jax.config_lib import experiment_config
    from moddiffy_jax.data.synthetic import generate_synthetic

    sizes = experiment_config("moddiffy_par", "").data.synthetic  # the main job's
    corr = {"gender": args.gender_corr, "age": args.age_corr}
    data = generate_synthetic(
        seed=args.data_seed,
        num_train=sizes.num_train,
        num_dev=sizes.num_dev,
        num_test=sizes.num_test,
        attr_task_correlation=corr,
        label_noise=args.label_noise,
        attr_marker_prob=args.marker_prob,
    )
    return data.splits[args.split], corr


def _word_index(texts, words) -> np.ndarray:
    """Per text: the index in ``words`` of the (last) one it holds as a
    whole word, or -1."""
    out = np.full(len(texts), -1)
    for i, text in enumerate(texts):
        padded = f" {text} "
        for j, w in enumerate(words):
            if f" {w} " in padded:
                out[i] = j
    return out


def hidden_pairs_spread(args, attribute: str, k: int) -> np.ndarray:
    """Every way of hiding ``k`` of ``attribute``'s marker words of each
    class (what swapping k counterpart pairs can hide: the pairing does not
    matter to the Bayes rule) on the main job's ``args.split``: the Bayes
    rule's task cost in points against all cues, one per choice, sorted."""
    import itertools

    from moddiffy_jax.data.synthetic import ATTR_MARKERS, TASK_WORDS

    split, corr = _main_job_split(args)
    y = np.asarray(split.task) == 1
    follow = {n: corr[n] + (1 - corr[n]) / 2 for n in corr}

    if attribute not in ATTR_MARKERS or not 0 <= k <= min(
        len(ws) for ws in ATTR_MARKERS.get(attribute, {"": ()}).values()
    ):
        raise SystemExit(
            f"--spread {attribute}:{k}: the attribute must be one of "
            f"{sorted(ATTR_MARKERS)} and K at most its words a class."
        )
    ratio = {
        "task": np.log((1 - args.label_noise) / args.label_noise),
        **{n: np.log(follow[n] / (1 - follow[n])) for n in follow},
    }
    evidence = np.zeros(len(y))
    marker = {}
    task_words = {c: TASK_WORDS[c] for c in ("negative", "positive")}
    for name, table in (("task", task_words), *ATTR_MARKERS.items()):
        classes = list(table.values())
        for c in (0, 1):
            found = _word_index(split.text, classes[c])
            if name == attribute:
                marker[c] = found
            evidence[found >= 0] += (1.0 if c == 1 else -1.0) * ratio[name]

    def accuracy(d):
        return np.mean(np.where(np.isclose(d, 0.0), 0.5, (d > 0) == y))

    full = accuracy(evidence)
    n_words = [len(v) for v in ATTR_MARKERS[attribute].values()]
    costs = []
    for hide0 in itertools.combinations(range(n_words[0]), k):
        for hide1 in itertools.combinations(range(n_words[1]), k):
            d = evidence.copy()
            d[np.isin(marker[0], hide0)] += ratio[attribute]  # class 0 read -1
            d[np.isin(marker[1], hide1)] -= ratio[attribute]
            costs.append(100.0 * (full - accuracy(d)))
    return np.sort(np.asarray(costs))


def split_accuracies(args) -> dict[str, float]:
    """The Bayes rule's task accuracy on the main job's own ``args.split``
    with each set of cues (the text's cues parsed from its words), printed
    and returned by cue set ("tga", "ta", "tg", "t"; with --hide "thi":
    each marker unless it is a hidden word; "noisy": the share of rows
    whose task word is not the label's)."""
    from moddiffy_jax.data.synthetic import ATTR_MARKERS, TASK_WORDS

    split, corr = _main_job_split(args)
    y = np.asarray(split.task)
    words = {"negative": TASK_WORDS["negative"], "positive": TASK_WORDS["positive"]}

    hidden = {w.strip() for w in getattr(args, "hide", "").split(",") if w.strip()}
    known = {w for m in ATTR_MARKERS.values() for ws in m.values() for w in ws}
    if hidden - known:
        raise SystemExit(
            f"--hide names {sorted(hidden - known)}, which are not marker words "
            f"of the generator (moddiffy_jax/data/synthetic.py ATTR_MARKERS)."
        )

    def cue(table, hide=()):  # +1 for class 1's words, -1 for class 0's, 0 for none
        out = np.zeros(len(y))
        for c, ws in enumerate(table.values()):
            found = _word_index(split.text, [w for w in ws if w not in hide])
            out[found >= 0] = 1.0 if c == 1 else -1.0
        return out

    def log_ratio(p):  # a cue that follows y with probability p
        return np.log(p / (1 - p))

    follow = {n: corr[n] + (1 - corr[n]) / 2 for n in corr}
    evidence = {
        "t": cue(words) * log_ratio(1 - args.label_noise),
        "g": cue(ATTR_MARKERS["gender"]) * log_ratio(follow["gender"]),
        "a": cue(ATTR_MARKERS["age"]) * log_ratio(follow["age"]),
    }
    if hidden:  # "h", "i": the markers with the hidden words read as absent
        evidence["h"] = cue(ATTR_MARKERS["gender"], hidden) * log_ratio(
            follow["gender"]
        )
        evidence["i"] = cue(ATTR_MARKERS["age"], hidden) * log_ratio(follow["age"])
    noisy = np.mean((evidence["t"] > 0) != (y == 1))
    print(
        f"{args.split} split (data seed {args.data_seed}): {len(y)} rows, "
        f"{noisy:.1%} with a noisy task word; Bayes task accuracy with the cues:"
    )
    print("| cues | task accuracy |")
    print("|---|---|")
    out = {"noisy": float(noisy)}
    rows = [
        ("t, g, a (all cues)", "tga"),
        ("t, a (gender left out)", "ta"),
        ("t, g (age left out)", "tg"),
        ("t (both left out)", "t"),
    ]
    if hidden:  # "thi": t, and each marker unless it is a hidden word
        rows.append((f"t, g, a with {', '.join(sorted(hidden))} read as absent", "thi"))
    for label, keys in rows:
        d = sum(evidence[k] for k in keys)
        right = np.where(np.isclose(d, 0.0), 0.5, (d > 0) == (y == 1))
        out[keys] = float(np.mean(right))
        print(f"| {label} | {out[keys]:.4f} |")
    return out


def _posterior_code(columns, target):
    """Each example's P(target = 1 | its cell of ``columns``), as the index
    of that value among the distinct ones (cells with equal posteriors share
    a code): a representation that holds the posterior, as a logit does."""
    cells = _cells(columns)
    count = np.bincount(cells)
    rate = np.bincount(cells, weights=target) / np.maximum(count, 1)
    return np.unique(np.round(rate, 9), return_inverse=True)[1][cells]


def _unless_pivotal(t, g, a, decision, which):
    """The marker (``which``: 1 gender, 2 age) read as absent wherever
    swapping it for the other value leaves the decision y*(t, g, a) as it is
    (``swap_keep_pivotal``: the twins meet everywhere but where the swap
    moves the core's decision)."""
    table = np.zeros(64, np.int64)
    table[(t * 4 + g) * 4 + a] = decision
    cues = [t, g, a]
    marker = cues[which]
    cues[which] = np.where(marker < 2, 1 - marker, marker)
    moved = table[(cues[0] * 4 + cues[1]) * 4 + cues[2]] != decision
    return np.where(moved, marker, 2)


def _masked(cue, u, form, share):
    if form == "hidden":
        return np.where(u < share, 2, cue)
    return np.where((u < share) & (cue < 2), 1 - cue, cue)


def _floor_and_lead(y, t, values, seen):
    floor, lead = {}, {}
    for n in ("gender", "age"):
        floor[n] = balanced_accuracy(decide([y], values[n], balanced=True), values[n])
        everything = decide([t, seen["gender"], seen["age"]], values[n], balanced=True)
        lead[n] = balanced_accuracy(everything, values[n])
    return floor, lead


def joint(rng, y, t, values, seen) -> None:
    """Both markers partly removed at once (core + both), each hidden or
    flipped on its own random share: the least task cost at which both
    gaps are at least half closed, per pair of forms."""
    keep = slice(0, 500_000)  # a finer grid on fewer draws
    y, t = y[keep], t[keep]
    values = {n: v[keep] for n, v in values.items()}
    seen = {n: v[keep] for n, v in seen.items()}
    floor, lead = _floor_and_lead(y, t, values, seen)
    acc0 = np.mean(decide([t, seen["gender"], seen["age"]], y) == y)
    ug, ua = rng.random(len(y)), rng.random(len(y))
    shares = np.round(np.arange(0.05, 0.65, 0.05), 2)

    def read(fg, fa, sg, sa):
        g = _masked(seen["gender"], ug, fg, sg)
        a = _masked(seen["age"], ua, fa, sa)
        cost = 100 * (acc0 - np.mean(decide([t, g, a], y) == y))
        closed = []
        for n in ("gender", "age"):
            leak = balanced_accuracy(
                decide([t, g, a], values[n], balanced=True), values[n]
            )
            closed.append((lead[n] - leak) / (lead[n] - floor[n]))
        return cost, closed

    print("\ncore + both: least cost with both gaps at least half closed")
    print(
        "| gender marker | age marker | shares | cost (pts) | gender closed | age closed |"
    )
    print("|---|---|---|---|---|---|")
    for fg in ("hidden", "flipped"):
        for fa in ("hidden", "flipped"):
            best = None  # (cost, sg, sa, closed) on the 0.05 grid
            for sg in shares:
                for sa in shares:
                    cost, closed = read(fg, fa, sg, sa)
                    if min(closed) >= 0.5 and (best is None or cost < best[0]):
                        best = (cost, sg, sa, closed)
            if best is None:
                print(f"| {fg} | {fa} | none up to 0.6 | | | |")
                continue
            # Then down by 0.01 in either share while both stay half closed.
            moved = True
            while moved:
                moved = False
                _, sg, sa, _ = best
                for tg, ta in ((sg - 0.01, sa), (sg, sa - 0.01)):
                    if min(tg, ta) <= 0:
                        continue
                    cost, closed = read(fg, fa, round(tg, 2), round(ta, 2))
                    if min(closed) >= 0.5 and cost < best[0]:
                        best, moved = (cost, round(tg, 2), round(ta, 2), closed), True
                        break
            cost, sg, sa, (cg, ca) = best
            print(
                f"| {fg} | {fa} | {sg:.2f}, {sa:.2f} | {cost:.2f} | {cg:.2f} "
                f"| {ca:.2f} |"
            )


def pairs(rng, y, t, values, seen) -> None:
    """Hiding by words, as a diff trained on counterpart swaps can: the
    generator picks each marker word uniformly among its class's words
    (moddiffy_jax/data/synthetic.py ATTR_MARKERS), and a representation
    that holds every word apart is the lookup table on (t, other marker,
    the word). Hiding k counterpart pairs merges each pair's two words into
    one state (their swap's invariance); hiding a word one-sidedly reads
    it as absent (merged with the rows that have no marker, whose filler
    words are merged too). Cost in points against all cues and the share
    of the gap closed (stop 73)."""
    from moddiffy_jax.data.synthetic import ATTR_MARKERS

    floor, lead = _floor_and_lead(y, t, values, seen)
    acc0 = np.mean(decide([t, seen["gender"], seen["age"]], y) == y)
    for name, other in (("gender", "age"), ("age", "gender")):
        n_words = min(len(ws) for ws in ATTR_MARKERS[name].values())
        word = rng.integers(0, n_words, len(y))  # the marker's word, if present
        marker, value = seen[name], values[name]
        print(f"\n{name}: {n_words} marker words a class, hidden by words")
        print("| pairs hidden | class-0 words one-sided | cost (pts) | gap closed |")
        print("|---|---|---|---|")
        for k in range(0, 4):
            for one_sided in (0, 1, 2):
                state = np.where(marker == 2, 0, 10 + 2 * word + marker)
                state = np.where((marker < 2) & (word < k), 1 + word, state)
                hide = (marker == 0) & (word >= k) & (word < k + one_sided)
                state = np.where(hide, 0, state)
                cols = [t, seen[other], state]
                acc = np.mean(decide(cols, y) == y)
                leak = balanced_accuracy(decide(cols, value, balanced=True), value)
                closed = (lead[name] - leak) / (lead[name] - floor[name])
                print(
                    f"| {k} | {one_sided} | {100 * (acc0 - acc):.2f} | {closed:.2f} |"
                )


def curve(rng, y, t, values, seen) -> None:
    """Partial removal at the Bayes optimum: the representation holds the
    task word, the other marker and the attribute's marker, the latter
    hidden (read as absent) on a random share q of the examples or flipped
    on a share p. Gap closed toward the floor and task cost (points) against
    all cues; the share of the gap a half-removal diff must close is 0.5."""
    floor, leads = _floor_and_lead(y, t, values, seen)
    acc0 = np.mean(decide([t, seen["gender"], seen["age"]], y) == y)
    u = rng.random(len(y))
    for name, other in (("gender", "age"), ("age", "gender")):
        value, lead = values[name], leads[name]
        print(f"\n{name}: all cues leak {lead:.3f}, floor {floor[name]:.3f}")
        print("| marker | share | task accuracy | cost (pts) | leakage | gap closed |")
        print("|---|---|---|---|---|---|")
        for form in ("hidden", "flipped"):
            for share in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0):
                if form == "flipped" and share > 0.5:
                    continue
                cols = [t, seen[other], _masked(seen[name], u, form, share)]
                acc = np.mean(decide(cols, y) == y)
                leak = balanced_accuracy(decide(cols, value, balanced=True), value)
                closed = (lead - leak) / (lead - floor[name])
                print(
                    f"| {form} | {share:.1f} | {acc:.3f} | {100 * (acc0 - acc):.2f} "
                    f"| {leak:.3f} | {closed:.2f} |"
                )


if __name__ == "__main__":
    main()
