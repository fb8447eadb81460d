"""Generates docs/_static/tuner.png and the tuner table of docs/tuning.md.

Runs the K tuner (:func:`loopkit.tools.tune.sweep`) on the built-in demo target (a small MLP,
batch 64) on this machine's default JAX device(s), K = 1, 2, 4, ..., 1024, best of
``--repeats`` measurements of at least ``--min-secs`` each, and prints a Markdown table with
the command, machine and date to paste into docs/tuning.md.

Run: python docs/scripts/make_tuner_plot.py [--out docs/_static/tuner.png] [--repeats 3]
"""

import argparse
import datetime
import os
import platform

import jax

import loopkit
from loopkit.observe import goodput
from loopkit.tools import tune


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "_static",
                                               "tuner.png"))
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--min-secs", type=float, default=1.0)
  p.add_argument("--goodput-steps", type=int, default=200_000)
  p.add_argument("--ks", default=",".join(str(k) for k in tune.DEFAULT_KS))
  args = p.parse_args()
  ks = [int(k) for k in args.ks.split(",")]
  devices = jax.devices()
  result = tune.sweep(tune.demo_target, ks=ks, calls=3, min_secs=args.min_secs,
                      repeats=args.repeats, verbose=True)
  machine = (f"{os.cpu_count()}-core CPU ({platform.machine()}), "
             f"{len(devices)} JAX {devices[0].platform} device(s), jax {jax.__version__}")
  tune.plot(result, args.out, title=f"loopkit.tools.tune demo MLP on {os.cpu_count()}-core CPU: "
                                    f"recommended K={result.recommended}")
  print(f"command: python docs/scripts/make_tuner_plot.py --repeats {args.repeats} "
        f"--min-secs {args.min_secs:g}")
  print(f"machine: {machine}")
  print(f"date: {datetime.date.today().isoformat()}")
  print()
  print(result.table())
  print(f"\nplot written to {os.path.normpath(args.out)}")

  # A run at the recommended K with the goodput summary (for the docs' example output).
  train_step, state, batches = tune.demo_target()
  k = result.recommended
  loop = loopkit.TrainLoop(train_step, iterations_per_loop=k,
                           hooks=[loopkit.observe.GoodputHook(log_summary=False)])
  num_steps = max(100 * k, args.goodput_steps)
  loop.run(state, batches, num_steps=num_steps)
  print(f"\ngoodput of a {num_steps}-step run of the demo at K={k}:")
  print(goodput.summarize(loop.ledger).table())


if __name__ == "__main__":
  main()
