"""Building blocks of the experiment configs in ``configs/``.

``base_config(method)`` holds every field the library reads, with the
defaults of the MoDDiffy paper (learning rates, L0 weight, hard-concrete
constants, adversary ensemble). ``configs/<method>.py`` files call
``experiment_config(method, arg)``, where ``arg`` is a comma-separated list of
``key=value`` (``data=synthetic|dwmw17``, ``model=minilm|tiny``,
``objective=adversarial|mmd``), and return the config locked, so a misspelled
override fails instead of being ignored.
"""

from __future__ import annotations

import ml_collections

from moddiffy_jax.data import default_data_config

# Path of the real benchmark, relative to the repository root (never copied).
DWMW17_PATH = "../shared/data/dwmw17_dialect/dwmw17_dialect.csv"

_ARG_KEYS = {
    "data": ("synthetic", "dwmw17"),
    "model": ("minilm", "tiny"),
    "objective": ("adversarial", "mmd"),
}


def parse_arg(arg: str | None) -> dict[str, str]:
    """Parses ``"data=dwmw17,model=tiny"``; unknown keys or values are errors."""
    out = {"data": "synthetic", "model": "minilm", "objective": "adversarial"}
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


def base_config(method: str) -> ml_collections.ConfigDict:
    """Every field, with the paper's defaults, for ``method``."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.num_devices = 0  # 0: all visible devices.

    c.method = ml_collections.ConfigDict()
    c.method.name = method
    c.method.attributes = ()  # empty: every attribute of the dataset.
    c.method.objective = "adversarial"  # or "mmd".
    c.method.adv_lambda = 1.0
    c.method.mmd_weight = 1.0
    c.method.freeze_task_head = False  # in modular debias steps.
    c.method.core_run = ""  # moddiffy_post: workdir of a finetune run.
    c.method.adversary = ml_collections.ConfigDict(
        {"members": 5, "hidden": 1, "dropout": 0.3}
    )

    c.model = ml_collections.ConfigDict()
    c.model.init = "pretrained"  # or "random".
    c.model.dir = ""  # empty: $MODDIFFY_MODEL_DIR or the bundled MiniLM.
    c.model.tokenizer_dir = ""
    c.model.vocab_size = 30522  # random tiny model only.
    c.model.dtype = "float32"
    c.model.task_hidden = 0
    c.model.task_dropout = 0.3
    c.model.adapter_reduction_factor = 2

    c.diff = ml_collections.ConfigDict()
    c.diff.include = (r".*",)
    # The pooler is unused (the representation is the CLS token); the
    # reference gave it a diff anyway, which only inflated the top-k budget.
    c.diff.exclude = (r"pooler/.*",)
    c.diff.structured = False
    c.diff.straight_through = True
    c.diff.left = -1.5
    c.diff.right = 1.5
    c.diff.temperature = 1.0
    c.diff.init_log_alpha = 5.0
    c.diff.l0_weight = 1.25e-7
    c.diff.keep = 0.01  # fraction (float) or count (int) of kept entries.
    c.diff.scope = "global"

    c.optim = ml_collections.ConfigDict()
    for role, lr, wd in (
        ("encoder", 2e-5, 0.0),
        ("adapter", 1e-4, 0.0),
        ("diff", 2e-5, 0.0),
        ("log_alpha", 0.1, 0.0),
        ("heads", 1e-4, 0.01),
    ):
        c.optim[f"lr_{role}"] = lr
        c.optim[f"wd_{role}"] = wd
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8
    c.optim.clip_norm = 1.0

    c.train = ml_collections.ConfigDict()
    c.train.batch_size = 64
    c.train.num_steps = 300  # single-phase methods.
    c.train.l0_steps = 200  # diff methods: L0 phase ...
    c.train.fixmask_steps = 100  # ... then fixmask phase.
    c.train.log_every = 10
    c.train.eval_every = 0  # 0: only at the end of each phase.
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
    c.eval.inlp = True
    c.data = default_data_config()
    return c


def set_data(c: ml_collections.ConfigDict, data: str) -> None:
    if data == "dwmw17":
        c.data.source = "dwmw17_dialect"
        c.data.path = DWMW17_PATH
        c.data.max_length = 48
    else:
        c.data.source = "synthetic"
        c.data.max_length = 32


def set_tiny_model(c: ml_collections.ConfigDict) -> None:
    """A tiny random BERT (MiniLM's tokenizer) that runs every method in seconds."""
    c.model.init = "random"
    c.train.batch_size = 8
    c.eval.batch_size = 32
    c.train.num_steps = 6
    c.train.l0_steps = 4
    c.train.fixmask_steps = 3
    c.train.log_every = 2
    c.train.checkpoint_every = 2
    c.train.progress = False
    c.data.max_length = 16
    c.data.synthetic.num_train = 64
    c.data.synthetic.num_dev = 32
    c.data.synthetic.num_test = 32
    c.diff.keep = 0.05
    c.method.adversary.members = 2
    c.eval.leakage = False


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


def experiment_config(method: str, arg: str | None) -> ml_collections.ConfigDict:
    """The locked config of ``method`` for the ``arg`` variant."""
    opts = parse_arg(arg)
    c = base_config(method)
    set_data(c, opts["data"])
    c.method.objective = opts["objective"]
    if opts["model"] == "tiny":
        set_tiny_model(c)
    else:
        size_for_cpu(c, opts["data"])
    c.lock()
    return c
