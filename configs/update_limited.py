"""The update-limited regime's winning design (issue 26): the adaptive reuse controller over a
positive-bias buffer, at 3x the base rate.

  python -m jaxreplay.launch --config=configs/update_limited.py --workdir=runs/update_limited

`configs/scratchpad_large_batch.py` (B = 512 rollouts per step, at or above the task's gradient noise
scale at the start of training; N = 2048) with the design that won the decisive sweep
(`python -m jaxreplay.experiments --sweep=pareto_i26 --seeds=4 --out=experiments`, `experiments/results.json`
-> `sweeps.pareto_i26.summary.families`, EXPERIMENTS.md "Issue 26"): half of the buffer holds rollouts of
positive reward (`buffer.positive_fraction = 0.5`) and the replay ratio is set online from the
measured B / noise scale (`buffer.reuse_control = "adaptive"`, `jaxreplay/data/reuse.py`) at learning
rate 1.5e-4. It ended +0.022 [+0.019, +0.025] pass@1 above the best on-policy rate at equal compute
(4 seeds) and +0.006 [-0.000, +0.013] above fixed positive-bias replay, and reached the first
accuracy target with 0.68x on-policy's compute. That config stays the sweeps' neutral base; use this
one to train in the regime. Check the regime of your own run with `diag/batch_over_noise_scale`
(docs/regimes.md); the controller lowers reuse by itself when it falls.
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
  c.buffer.reuse_control = "adaptive"
  c.trainer.learning_rate = 1.5e-4
  return c
