"""The removal recipe's fields of ``config.method`` and their defaults, with
what was measured for each (read by :func:`moddiffy_jax.methods.removal.
settings_from_config`)."""

from __future__ import annotations

import ml_collections


def config_fields() -> ml_collections.ConfigDict:
    """The removal recipe's fields of ``config.method`` (read by
    :func:`settings_from_config`); only methods that debias carry them."""
    f = ml_collections.ConfigDict()
    # "mmd" (default), "adversarial" or "swap" (the counterfactual swaps
    # alone, swap_weight below). Measured on MiniLM (docs/efficacy.md):
    # adversaries, by gradient reversal or confusion, are fooled in the loop
    # while a fresh probe reads the attribute as well as on the core; the
    # unbiased task-conditional MMD with gradual pruning removes part of it.
    f.objective = "mmd"
    # objective "auto" (the main job's default): for each attribute, the
    # swaps below where a bag-of-tokens read says its counterpart groups
    # close at least this share of the gap to the floor within swap_max_drop
    # points; else the MMD recipe (context.resolve_objective).
    f.auto_swap_closed = 0.5
    # Where the swaps pass for some attributes and not for others: each its
    # own removal in one run (the swaps for those, the MMD recipe for the
    # rest; config_lib.mixed_preset). False: every attribute the MMD recipe.
    f.auto_mix = True
    # Fields of that swap recipe (config_lib.SWAP_PRESET_FIELDS, comma-
    # separated) it keeps as the run set them even where they equal the
    # method's default; the command line (main.py) names here the ones it
    # set, so "--config.diff.compose_prob=0" stays 0 under "auto".
    f.auto_keep = ""
    f.adv_lambda = 1.0
    # "grl": gradient reversal (the paper); "confusion": the adversaries fit
    # detached representations and the encoder/diff pulls their prediction to
    # the attribute distribution given the task label (objectives/adversarial).
    f.adv_loss = "grl"
    f.mmd_weight = 10.0  # 3 removed less, same task cost (efficacy.md)
    # MMD kernel: "gaussian" (scale-invariant multi-bandwidth), "linear"
    # (first-moment matching), or "both". Conditioning on the task label:
    # "stratify" compares the attribute's groups within each task class,
    # "reweight" weights members by P(a) / P(a | y) so each group has the
    # marginal task distribution, "residual" reweights after subtracting each
    # task class's batch mean (no task distance left in the kernel), "none"
    # ignores the task (objectives/mmd.py).
    f.mmd_kernel = "both"
    f.mmd_conditional = "stratify"
    # Whitening: the kernels read the representations in the metric of a
    # running within-group covariance (EMA with this decay; ridge of shrinkage
    # times the geometric mean of the eigenvalues seen), the metric a fresh
    # linear probe reads. Without it a diff can meet the MMD by inflating one
    # direction while a probe still reads the attribute (docs/efficacy.md).
    f.mmd_whiten = True
    f.mmd_whiten_decay = 0.98
    f.mmd_whiten_shrinkage = 0.1
    # Whose scatter: "attribute" (the groups a probe of the attribute tells
    # apart; the task's spread counts) or "cell" ((task, attribute) pairs).
    f.mmd_whiten_within = "attribute"
    # Running linear erasure (objectives/erasure.py): the whitened distance
    # of the attribute groups' means, read along a running average of where
    # they differ (a per-batch estimate is mostly sampling noise). Weight
    # (0 = off) and the running average's decay.
    # Measured on MiniLM (docs/efficacy.md, "Stop 13"): with it a linear
    # probe reads less of both attributes than with the MMD alone on every
    # seed-0 variant tried; decay 0.8 tracked age better than 0.95. On
    # dwmw17 ("Stop 54") 0.98 follows the true direction more closely
    # (cosine 0.89 against 0.53) and removes no more (three seeds).
    f.fisher_weight = 10.0
    f.fisher_decay = 0.8
    # Erased targets (objectives/erasure.py): the modular debias step pulls
    # the diff's representation of each input to the core's with the
    # attribute's within-class offsets erased ("project": LEACE-style along
    # their directions; "shift": each row moved by its cell's offset).
    # Weight (0 = off), the running cell means' decay, the form. Measured
    # on MiniLM (docs/efficacy.md, "Stop 14"): on top of the default, both
    # forms removed nothing (the pull to the core keeps the attribute too);
    # on dwmw17 ("Stop 54"), where one direction holds what the report's
    # probes read, "project" at weight 1000 removed 0.9 points (seed 1;
    # the default recipe 3.7).
    f.target_weight = 0.0
    f.target_decay = 0.9
    f.target_mode = "project"
    # Memory: the MMD's groups also hold the (detached) representations of
    # this many previous batches with their attribute and task labels, so
    # its task-conditional groups are as large as a batch (memory + 1)
    # times the size, at the step cost of one batch. 0 = the batch alone.
    f.removal_memory = 0
    # Per-attribute removal weights, overriding the shared ones above for the
    # attributes named: "age: fisher_weight=100, mmd_weight=5; gender:
    # mmd_weight=3" (fields: mmd_weight, fisher_weight, target_weight,
    # adv_lambda, swap_weight, task_distill, and the switch swap_keep_task=
    # true/false: "gender: swap_keep_task=true, task_distill=3" keeps the
    # core's decision for gender alone). Empty: every attribute reads the
    # shared weights.
    f.attribute_weights = ""
    # Modular debias steps: the removal terms' gradient on each example's
    # representation loses its component against the task gradient (as in
    # PCGrad, per row of the representation), so a removal step does not
    # raise the task loss to first order through the representation.
    f.task_projection = False
    # The removal terms ramp linearly from 0 to full weight over the first
    # steps (the running statistics are collected from step 0): in
    # MoDDiffy-par the core learns the task meanwhile. 0 = full from step 0.
    f.removal_warmup_steps = 0
    # Modular debias steps: weight of the KL divergence from the core's own
    # task prediction (no diff, no gradient) to the prediction with the diff,
    # so removing an attribute does not remove the task with it. 0 = off.
    f.task_distill = 0.0
    # The modular debias steps' task labels: "gold", or "core_decision" (the
    # core's argmax on the batch, no gradient). The decision is a function of
    # the input, so where a swap leaves it unchanged the twins share their
    # label and the task term does not ask to keep the attribute's words; the
    # gold labels ask for the calibrated posterior, which holds them
    # (benchmarks/synthetic_bayes.py: the posterior alone leaks everything).
    f.task_target = "gold"
    # Whose prediction the debias steps' core-reading terms keep (the task
    # distill, task_target "core_decision", swap_distill, the pivotal pairs,
    # decision conditioning): "core", or "added_to": the model the diff is
    # added to in the step (the core plus the other diffs a composing step
    # added with diff.compose_prob; the core where it added none), so a diff
    # trained beside another is not asked to give back the decision the
    # other's removal changed (docs/efficacy.md, "Stop 66").
    f.keep_from = "core"
    # Task guard: each diff's removal weight backs off (down to 1 %) while the
    # diff's running accuracy on the training batches trails the core's by
    # more than the slack, and comes back while it does not (dual ascent on
    # "the diff keeps the task"; docs/efficacy.md).
    f.task_guard = False
    f.task_guard_slack = 0.01
    f.task_guard_rate = 1.0
    f.task_guard_decay = 0.9
    # The dual step's factor while a diff is back within the slack (the
    # weight's return; 1: as fast as it backed off for the same distance).
    f.task_guard_release = 1.0
    # The step the guard starts moving the weights at (0: from the start).
    # Measured on MiniLM (docs/efficacy.md, "Stop 23"): until gradual pruning
    # reaches the budget the dense diffs trail the core by 10-36 points at
    # any removal weight, and a guard from step 0 gives the removal up.
    f.task_guard_start = 0
    # The same start as a share of the L0 phase's steps (after train.*epochs
    # are resolved), used instead of task_guard_start where > 0: a schedule
    # of another length keeps the guard off through the same part of pruning.
    f.task_guard_start_share = 0.0
    f.freeze_task_head = False  # in modular debias steps.
    # What the task-conditional removal terms condition on: "label" (the
    # gold task label), "prediction" (the model's own predicted class) or
    # "core_prediction" (the core's, modular methods). Where the attribute
    # carries task signal the label cannot explain (the main job's data:
    # text + gender + age predict the label 3.6 points better than the text
    # alone), independence given the label costs that signal, while
    # independence given the decision keeps it; docs/efficacy.md, "Stop 25".
    f.condition_on = "label"
    # Counterfactual token swaps (modular text methods; objectives/
    # counterfactual.py): each debias step also encodes the batch with the
    # attribute's counterpart tokens swapped (she <-> he, sister <-> brother:
    # methods/token_merge.py's counterpart groups among at most
    # swap_candidates tokens that tell the attribute beyond the task label,
    # each scoring at least swap_share times the best) and pulls the two
    # representations together with this weight. 0 = off (one encoder pass
    # more per debias step when on).
    f.swap_weight = 0.0
    f.swap_candidates = 64
    f.swap_share = 0.1
    # False: no gradient through the twin's pass (a forward pass per debias
    # step instead of a forward and a backward); the pull is one-sided.
    f.swap_twin_gradient = True
    # > 0: swap only some groups, chosen by a bag-of-tokens logistic read of
    # each prefix of groups on the dev split (methods/swap_budget.py): the
    # fewest that close swap_target of the gap between the all-words read's
    # leakage and the floor, within swap_max_drop points of the read's task
    # accuracy (else the most within it). 0: every group (which costs the
    # task all the words are worth; docs/efficacy.md, "Stop 39"). The swap
    # recipe sets 0.75; 0.6 (stops 46-47, ten main-job runs where it chose
    # fewer groups) lowered the cost of diffs that remove past their floor
    # and passed 14 of 20 single diffs against 11, equal on held-out
    # samples: the choice where the task cost is what fails. Stop 73 (the
    # stop-68 recipe, seeds 0 and 2): 0.6 takes two gender pairs and age's
    # same three; gender removes less at the same cost (negative).
    f.swap_target = 0.0
    f.swap_max_drop = 2.5
    # > 0: each swapped attribute's swap weight is swap_weight times its read
    # gap (the all-words bag-of-tokens read's leakage on dev minus the
    # floor) over this reference, the ratio kept within [0.25, 4]
    # (methods/swap_budget.gap_weight); an attribute whose swap_weight
    # attribute_weights names keeps that. Chosen before training, from the
    # data alone; recorded in results.json's swap_reads. 0: off. Measured
    # at 0.075 on held-out samples (docs/efficacy.md, "Stop 49"): within
    # the run-to-run spread of the default by passes; on nine paired runs
    # (stop 50) age's removal 0.69 of its gap against 0.38 at the same
    # cost (2.6 points), passes unchanged, one gender diff collapsed to a
    # constant predictor (weight 11.6). Since stop 51 MoDDiffy-par's swap
    # recipe sets 0.075 with the task guard at a 10-point slack from two
    # thirds of the L0 phase, which turns that collapse into a diff that
    # removes nothing; 0 here (other methods and objectives).
    f.swap_gap_reference = 0.0
    # The order the groups' prefixes are read and chosen in: "rank" (by how
    # well their words tell the attribute) or "efficiency" (greedily by
    # the gap each closes per task point in the read; about k times as many
    # reads for k groups taken: methods/swap_budget.efficient_order).
    # Measured on held-out samples ("Stop 49"): cheaper reads, no cheaper
    # trained diffs; "rank".
    f.swap_order = "rank"
    # True (with swap_target > 0): besides whole counterpart groups, the
    # choice may take one word of the next group swapped with the
    # attribute's filler tokens (found on the training split: the tokens
    # standing where no marker is), a step between two whole numbers of
    # groups (methods/one_sided.py; swap_budget.choose_groups). Data with
    # no fillers gets no such step. Measured at swap_max_drop 2.25 on six
    # main-job draws (docs/efficacy.md, "Stop 74"): age at its bar and
    # under it in core + both, 9 of 18 rows against the default's 15: off
    # by default.
    f.swap_one_sided = False
    # > 0 (with swap_target > 0): at this share of the run's steps, read each
    # attribute's trained diff on the dev split (task accuracy; a fresh
    # linear probe fit on the first swap_reread_train training rows), scale
    # the prefix reads to it and choose the groups again, within
    # swap_reread_max_drop points (methods/swap_reread.py). 0: off.
    # Measured at 0.5 on three main-job runs (docs/efficacy.md, "Stop 43"):
    # fewer groups, less removal, mostly no less task cost; off by default.
    f.swap_reread_at = 0.0
    f.swap_reread_max_drop = 1.5
    f.swap_reread_train = 1000
    # What the re-read decides: "groups" (the groups chosen again, above) or
    # "decision": an attribute whose diff has closed at least
    # swap_keep_above of its gap on dev (1: down to its floor) keeps the
    # core's decision for the rest of the run (swap_keep_task for it, and the
    # KL to the core's prediction at weight swap_keep_distill): past the
    # floor the swaps take what the words tell the task, not the attribute.
    # Measured at swap_reread_at=1/3 on three main-job runs (docs/
    # efficacy.md, "Stop 45"): gender switched on all three, its cost fell
    # on all three (one still over the bar), and core + both lost gender's
    # removal on all three; off.
    # "weight": the swap term of an attribute whose diff has closed at least
    # swap_keep_above of its gap on dev is scaled by swap_weight_down for
    # the rest of the run; one that has closed less than swap_raise_below
    # at a dev cost within swap_reread_max_drop points by swap_weight_up.
    # Measured at swap_reread_at=1/3 on the same three runs (docs/
    # efficacy.md, "Stop 46"): gender's removal and cost stayed, age's
    # removal too, core + both removed less on all three; off.
    f.swap_reread_mode = "groups"
    f.swap_keep_above = 1.0
    f.swap_keep_distill = 3.0
    f.swap_weight_down = 0.5
    f.swap_weight_up = 2.0
    f.swap_raise_below = 0.6
    # True: the twins may differ along the directions that move the task
    # head's decision and nowhere else (the words could keep what they tell
    # the task). Measured on the main job: no effect (the twins' difference
    # lies almost wholly outside the decision directions, and the encoder
    # stops reading the words anyway; docs/efficacy.md, "Stop 40"); with
    # task_distill (stop 44) it keeps the core's decision: gender's removal
    # stops at its floor, age's goes. Per attribute: attribute_weights.
    f.swap_keep_task = False
    # True: the decision directions are left out only on the pairs whose
    # swap changes the core's decision (one more core forward pass on the
    # twin per debias step); every other pair keeps the whole distance, so
    # the words stay readable only where they decide the task. At the Bayes
    # optimum of the main job's data this holds each attribute through the
    # decision alone: 0.89 of its gap closed at no task cost (benchmarks/
    # synthetic_bayes.py). Trained on three held-out samples (docs/
    # efficacy.md, "Stop 48"): within the default's spread, core + both no
    # better; off here, on in MoDDiffy-par's swap recipe since stop 68 (with
    # swap_distill and keep_from "added_to": config_lib.SWAP_KEEP).
    f.swap_keep_pivotal = False
    # > 0: each debias step also adds the KL from the core's task prediction
    # (no diff, no gradient) to the diff's, with this weight, over the rows
    # the swap leaves unchanged (on the main job's data most of them carry
    # the attribute through words the swap did not choose). Measured at 3
    # on three held-out samples (docs/efficacy.md, "Stop 48"): age's cost
    # down 0.6-1.0 points, its removal down to a third of the gap, core +
    # both's gender removal lost (the core as the teacher); off here, 3 in
    # MoDDiffy-par's swap recipe since stop 68 (config_lib.SWAP_KEEP).
    f.swap_distill = 0.0
    # > 0 (with swap_keep_pivotal): the KL from the teacher's prediction on
    # the batch and on its twin, with this weight, over the pairs whose swap
    # moves the teacher's decision (where the attribute decides the task).
    # Measured on README command 1 (docs/efficacy.md, "Stop 72"): at 3 age's
    # cost 2.2 -> 0.9 points, but its removal 0.74 -> 0.08 of its gap and
    # gender's 0.81 -> 0.03: a trade, not adopted; off.
    f.swap_distill_pivotal = 0.0
    # True (with diff.compose_prob > 0): when a debias step adds another
    # attribute's diff, its twin also swaps that attribute's words, so this
    # diff is asked not to give back what the other removed (core + both).
    # Measured on the main job (docs/efficacy.md, "Stop 42"): core + both
    # up on training seed 0, every removal down on seed 1; off by default.
    f.swap_compose = False
    f.adversary = ml_collections.ConfigDict({"members": 5, "hidden": 1, "dropout": 0.3})
    return f


#: Removal settings added after the first runs, with the behaviour a run
#: whose config.json lacks them was trained with.
LATER_FIELDS = (
    ("adv_loss", "grl"),
    ("mmd_kernel", "gaussian"),
    ("mmd_conditional", "none"),
    ("mmd_whiten", False),
    ("mmd_whiten_decay", 0.98),
    ("mmd_whiten_shrinkage", 0.1),
    ("mmd_whiten_within", "cell"),
    ("task_distill", 0.0),
    ("task_target", "gold"),
    ("keep_from", "core"),
    ("task_guard", False),
    ("task_guard_slack", 0.01),
    ("task_guard_rate", 1.0),
    ("task_guard_decay", 0.9),
    ("task_guard_release", 1.0),
    ("task_guard_start", 0),
    ("fisher_weight", 0.0),
    ("fisher_decay", 0.95),
    ("removal_warmup_steps", 0),
    ("target_weight", 0.0),
    ("target_decay", 0.9),
    ("target_mode", "shift"),
    ("removal_memory", 0),
    ("attribute_weights", ""),
    ("task_projection", False),
    ("condition_on", "label"),
    ("swap_weight", 0.0),
    ("swap_candidates", 64),
    ("swap_share", 0.1),
    ("swap_twin_gradient", True),
    ("swap_target", 0.0),
    ("swap_max_drop", 2.5),
    ("swap_order", "rank"),
    ("swap_one_sided", False),
    ("swap_keep_task", False),
    ("swap_keep_pivotal", False),
    ("swap_distill", 0.0),
    ("swap_distill_pivotal", 0.0),
    ("swap_keep_distill", 3.0),
    ("swap_compose", False),
)
