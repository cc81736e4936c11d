"""The update-limited regime's winning design (issue 26): positive-bias replay at 3x the base rate.

  python -m jaxreplay.launch --config=configs/update_limited.py --workdir=runs/update_limited

`configs/scratchpad_large_batch.py` (B = 512 rollouts per step, at or above the task's gradient noise
scale at the start of training; N = 2048) with the design that won the decisive sweep
(`python -m jaxreplay.experiments --sweep=pareto --seeds=4 --out=experiments`, `experiments/results.json`
-> `sweeps.pareto.summary.families`, EXPERIMENTS.md "Replay that wins"): replay with half of each
batch drawn from rollouts of positive advantage (`buffer.positive_fraction = 0.5`) at learning rate
1.5e-4, which ended +0.016 pass@1 above the best on-policy rate at equal compute and reached the
first accuracy target with 0.66x its compute. That config stays the sweeps' neutral base; use this one
to train in the regime. Check the regime of your own run with `diag/batch_over_noise_scale` (README,
"Which regime is my run in?"): when it falls well below 1 the run is sample-limited and replay no
longer pays.
"""
import importlib.util
import os

_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scratchpad_large_batch.py")
_spec = importlib.util.spec_from_file_location("scratchpad_large_batch", _BASE)
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)


def get_config():
  c = _base.get_config()
  c.buffer.positive_fraction = 0.5
  c.trainer.learning_rate = 1.5e-4
  return c
