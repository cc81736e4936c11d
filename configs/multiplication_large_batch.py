"""The update-limited regime of the multiplication task: a batch at or above the gradient noise scale.

  python -m jaxreplay.launch --config=configs/multiplication_large_batch.py --workdir=runs/mull

The second task's counterpart of `configs/scratchpad_large_batch.py`. At the warm-start
(`assets/multiplication-sft`) the gradient noise scale (diag/noise_scale, `jaxreplay.run.regime`)
is ~120-460 rollouts (median 212 over steps 1-39, smoothed 220-380; measured by `python -m
jaxreplay.launch --config=configs/multiplication.py --workdir=/tmp/noise/b256
--config.buffer.on_policy=True --config.buffer.size=256 --config.buffer.batch_size=256
--config.total_steps=40 --config.log.diagnostics_every=2 --config.eval.num_problems=32
--config.eval.every=0 --config.eval.n_samples=0`). Here B = 512 rollouts (B / noise scale ~1.5-2.5
at the start: one update's gradient is mostly signal) and N = 2048 = 4 B.

Everything else is `configs/multiplication.py`: the task, the warm-start, (W, T) = (6, 2),
mu = 6.84. The simulated costs are per update of B rollouts, so the step's training time scales
with B (16x the base's 1 device-second for 32 rollouts), and one on-policy update costs
(1 + mu) * 16 = 125.4 device-seconds. Evaluation: pass@1 (T=0.1) on all 1024 held-out problems at
every point of the compute grid (the first task's 256 were too few to place accuracy targets),
pass@k (T=1, 32 samples) at the start and at the budget (the sweeps' protocol otherwise).
"""
import importlib.util
import os

_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiplication.py")
_spec = importlib.util.spec_from_file_location("multiplication_base", _BASE)
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)

BATCH = 512


def get_config():
  c = _base.get_config()
  c.buffer.batch_size = BATCH
  c.buffer.size = 4 * BATCH
  c.scheduler.train_seconds_per_step = BATCH / 32
  c.compute_budget = 200 * (1.0 + c.scheduler.mu) * c.scheduler.train_seconds_per_step
  c.total_steps = 4000                # a cap: the budget ends every run first
  c.trainer.buckets = (72, 80)       # prompt (<= 10) + solution (<= 62) fit 72
  c.eval.pass1_problems = 0           # all of eval.num_problems
  c.log.diagnostics_every = 5
  c.checkpoint.every = 50
  return c
