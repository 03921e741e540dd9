"""Train the smallest OLMo-2 model through OLMo-core's own Trainer with AdamW and the Asteria
optimizers, changing only the optimizer config.

    python3 examples/olmo_train.py                        # AdamW, Asteria-SOAP, Asteria-KL-Shampoo
    python3 examples/olmo_train.py --optim soap --steps 50 --save-folder /tmp/run   # run ...
    python3 examples/olmo_train.py --optim soap --steps 80 --save-folder /tmp/run   # ... resume

Model: ``TransformerConfig.olmo2_1M`` (d_model 12, 4 layers, 4 heads) with a byte-level vocab
(256, already a multiple of OLMo-core's padding of 128), trained on the bundled Tiny
Shakespeare corpus (examples/data/tinyshakespeare.txt), byte-tokenised at run time into a
numpy memmap under --data-dir: nothing is downloaded. With ``--dp fsdp`` (the default) the
model is sharded by OLMo-core's FSDP2 over a single-process gloo group, the setup of a real
OLMo-core run shrunk to one CPU rank.

Every run uses the same seed, initialisation and batch order; each writes OLMo-core
checkpoints to ``<save-folder>/<optim>`` (a step-0 checkpoint, every --save-interval steps, and
the last step) and, when that folder already holds one, resumes from it, as OLMo-core's Trainer
does. Prints a table (loss at the end, step time median / p99, optimizer step time median /
p99) and writes the raw numbers to --out (JSON, with the machine, versions and command).
Training uses one torch thread; on a 2-core machine Asteria's worker pool gets the other core.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, ClassVar, Optional

import numpy as np
import torch

import asteria
from asteria.olmo import AsteriaKLShampooConfig, AsteriaShampooConfig, AsteriaSOAPConfig
from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
from olmo_core.distributed.parallel import DataParallelType
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import AdamWConfig, OptimConfig
from olmo_core.train import Duration, TrainerConfig
from olmo_core.train.callbacks import Callback, CheckpointerCallback, ConsoleLoggerCallback
from olmo_core.train.train_module import (TransformerDataParallelConfig,
                                          TransformerTrainModuleConfig)

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "data", "tinyshakespeare.txt")
DEFAULT_OUT = os.path.join(HERE, "out", "olmo_train.json")
LR = 3e-3
TOKENIZER = TokenizerConfig(vocab_size=256, eos_token_id=0, pad_token_id=0)  # bytes; NUL unused
ASTERIA_RUNTIME = {"mode": "async", "staleness": 5}


def optim_configs() -> dict[str, OptimConfig]:
    """The runs: name -> optimizer config. The same lr; each method's own defaults otherwise."""
    return {
        "adamw": AdamWConfig(lr=LR, betas=(0.9, 0.95), weight_decay=0.01),
        "soap": AsteriaSOAPConfig(lr=LR, runtime=dict(ASTERIA_RUNTIME)),
        "kl-shampoo": AsteriaKLShampooConfig(lr=LR, runtime=dict(ASTERIA_RUNTIME)),
        "shampoo": AsteriaShampooConfig(lr=LR, weight_decay=0.01, runtime=dict(ASTERIA_RUNTIME)),
    }


DEFAULT_RUNS = ("adamw", "soap", "kl-shampoo")


def tokenize(data_dir: str) -> str:
    """Byte-level token ids of the corpus as a uint8 memmap (OLMo-core's numpy token format);
    written once per corpus content, atomically."""
    with open(CORPUS, "rb") as f:
        text = f.read()
    digest = hashlib.sha256(text).hexdigest()[:16]
    path = os.path.join(data_dir, f"tinyshakespeare-bytes-{digest}.npy")
    if not os.path.exists(path):
        os.makedirs(data_dir, exist_ok=True)
        ids = np.frombuffer(text, dtype=np.uint8)
        fd, tmp = tempfile.mkstemp(dir=data_dir, suffix=".tmp")
        os.close(fd)
        mm = np.memmap(tmp, dtype=np.uint8, mode="w+", shape=ids.shape)
        mm[:] = ids
        mm.flush()
        del mm
        os.replace(tmp, path)
    return path


class Recorder(Callback):
    """Per-step train loss, step time (batch + optimizer step) and optimizer step time."""

    priority: ClassVar[int] = 10  # before the checkpointer: a save is not part of a step

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.step_s: list[float] = []
        self.optim_s: list[float] = []
        self.first_step: Optional[int] = None

    def pre_step(self, batch: dict[str, Any]) -> None:
        self._t0 = time.perf_counter()
        if self.first_step is None:
            self.first_step = self.step

    def pre_optim_step(self) -> None:
        self._t1 = time.perf_counter()

    def post_train_batch(self) -> None:
        t = time.perf_counter()
        self.step_s.append(t - self._t0)
        self.optim_s.append(t - self._t1)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if "train/CE loss" in metrics:
            self.losses[step] = float(metrics["train/CE loss"])


def forget_world_mesh() -> None:
    """OLMo-core builds one world mesh per process (TransformerTrainModule calls
    ``build_world_mesh``, which refuses a second); this script trains several models in one
    process, so each run starts without the previous run's mesh."""
    import olmo_core.distributed.parallel as parallel

    parallel._WORLD_MESH = None


def build_trainer(optim: OptimConfig, *, steps: int, save_folder: str, data_dir: str,
                  dp: str = "fsdp", batch: int = 8, seq: int = 128, save_interval: int = 0,
                  seed: int = 0, n_layers: int = 4):
    """An OLMo-core Trainer for the run; returns (trainer, recorder). The caller has prepared
    the training environment (``prepare_training_environment``, which for ``dp="fsdp"`` sets up
    a process group)."""
    forget_world_mesh()
    torch.manual_seed(seed)
    model = TransformerConfig.olmo2_1M(vocab_size=TOKENIZER.padded_vocab_size(),
                                       n_layers=n_layers).build(init_device="cpu")
    dataset = NumpyFSLDatasetConfig(tokenizer=TOKENIZER, paths=[tokenize(data_dir)],
                                    sequence_length=seq, work_dir=data_dir).build()
    loader = NumpyDataLoaderConfig(global_batch_size=batch * seq, seed=seed, work_dir=data_dir,
                                   num_workers=0).build(dataset)
    train_module = TransformerTrainModuleConfig(
        rank_microbatch_size=batch * seq, max_sequence_length=seq, optim=optim,
        dp_config=(TransformerDataParallelConfig(name=DataParallelType.fsdp)
                   if dp == "fsdp" else None),
    ).build(model, device=torch.device("cpu"))
    recorder = Recorder()
    trainer = TrainerConfig(
        save_folder=save_folder, max_duration=Duration.steps(steps), metrics_collect_interval=1,
        callbacks={
            "recorder": recorder,
            "checkpointer": CheckpointerCallback(save_interval=save_interval or None,
                                                 save_async=False),
            "console_logger": ConsoleLoggerCallback(log_interval=max(steps, 1)),
        },
    ).build(train_module, loader)
    return trainer, recorder


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def train(name: str, optim: OptimConfig, args: argparse.Namespace, save_folder: str) -> dict:
    trainer, rec = build_trainer(optim, steps=args.steps, save_folder=save_folder,
                                 data_dir=args.data_dir, dp=args.dp, batch=args.batch,
                                 seq=args.seq, save_interval=args.save_interval, seed=args.seed,
                                 n_layers=args.layers)
    t0 = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - t0
    opt = trainer.train_module.optim
    stats = opt.asteria_stats() if hasattr(opt, "asteria_stats") else {}
    if hasattr(opt, "close"):
        opt.close()
    losses = [rec.losses[s] for s in sorted(rec.losses)]
    ms = [1e3 * t for t in rec.step_s]
    oms = [1e3 * t for t in rec.optim_s]
    out = {
        "optim_config": optim.as_config_dict(),
        "resumed_from_step": (rec.first_step - 1) if rec.first_step is not None else args.steps,
        "steps": sorted(rec.losses),
        "losses": losses,
        "final_loss": statistics.mean(losses[-10:]) if losses else None,
        "step_ms": ms, "optim_ms": oms,
        "step_median_ms": statistics.median(ms) if ms else None,
        "step_p99_ms": pct(ms, 0.99) if ms else None,
        "optim_median_ms": statistics.median(oms) if oms else None,
        "optim_p99_ms": pct(oms, 0.99) if oms else None,
        "wall_s": wall,
        "asteria_stats": stats,
    }
    if ms:
        print(f"  [{name:>10}] steps {out['resumed_from_step'] + 1}..{args.steps}  "
              f"loss {out['final_loss']:.4f}  step {out['step_median_ms']:.1f} ms (median)",
              flush=True)
    return out


def table(runs: dict[str, dict]) -> str:
    head = (f"{'optimizer':>11} | {'loss@end':>8} | {'step med ms':>11} | {'step p99 ms':>11} | "
            f"{'opt med ms':>10} | {'opt p99 ms':>10}")
    lines = [head, "-" * len(head)]

    def f(v, spec):
        return format(v, spec) if v is not None else "-"

    for name, r in runs.items():
        lines.append(f"{name:>11} | {f(r['final_loss'], '8.4f')} | "
                     f"{f(r['step_median_ms'], '11.1f')} | {f(r['step_p99_ms'], '11.1f')} | "
                     f"{f(r['optim_median_ms'], '10.1f')} | {f(r['optim_p99_ms'], '10.1f')}")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="train to this step (default 300)")
    p.add_argument("--optim", default=",".join(DEFAULT_RUNS),
                   help=f"'all', or a comma list of {', '.join(optim_configs())} "
                        f"(default {','.join(DEFAULT_RUNS)})")
    p.add_argument("--save-folder", default=None,
                   help="checkpoint root (one folder per optimizer); a run resumes from the "
                        "latest checkpoint found there (default: a temporary folder)")
    p.add_argument("--save-interval", type=int, default=0,
                   help="save a checkpoint every N steps (default: step 0 and the last only)")
    p.add_argument("--dp", choices=("fsdp", "none"), default="fsdp",
                   help="OLMo-core FSDP2 over a single-process gloo group, or none")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "asteria-olmo-data"),
                   help="where the byte-tokenised corpus and OLMo-core's index files go")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    p.add_argument("--verbose", action="store_true", help="keep OLMo-core's INFO logging")
    args = p.parse_args(argv)
    known = optim_configs()
    args.runs = list(known) if args.optim == "all" else [s.strip() for s in args.optim.split(",")]
    for r in args.runs:
        if r not in known:
            p.error(f"unknown --optim {r!r}; allowed: all, {', '.join(known)}")
    return args


def main(argv: Optional[list[str]] = None) -> dict:
    from olmo_core.train import prepare_training_environment, teardown_training_environment

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.verbose:
        logging.getLogger("olmo_core").setLevel(logging.WARNING)
    prepare_training_environment(seed=args.seed, backend="cpu:gloo" if args.dp == "fsdp" else None)
    temp_root = None if args.save_folder else tempfile.mkdtemp(prefix="olmo-train-")
    root = args.save_folder or temp_root
    configs = optim_configs()
    runs: dict[str, dict] = {}
    try:
        for name in args.runs:
            runs[name] = train(name, configs[name], args, os.path.join(root, name))
    finally:
        if temp_root is not None:
            shutil.rmtree(temp_root, ignore_errors=True)
        teardown_training_environment()
    print()
    print(table(runs))
    import importlib.metadata

    result = {
        "command": [sys.executable] + sys.argv if argv is None else ["olmo_train.main"] + argv,
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "torch_threads": args.threads},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "olmo_core": importlib.metadata.version("ai2-olmo-core"), "asteria": asteria.__version__},
        "setup": {"model": f"olmo2_1M(n_layers={args.layers}), vocab {TOKENIZER.vocab_size}",
                  "batch": args.batch, "seq": args.seq, "steps": args.steps, "dp": args.dp,
                  "corpus": os.path.relpath(CORPUS, os.path.dirname(HERE)), "lr": LR},
        "runs": runs,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
