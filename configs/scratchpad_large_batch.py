"""The update-limited regime of the scratchpad task: a batch at or above the gradient noise scale.

  python -m jaxreplay.launch --config=configs/scratchpad_large_batch.py --workdir=runs/spl
  python -m jaxreplay.experiments --sweep=pareto --out=experiments

`configs/scratchpad.py` trains on B = 32 rollouts per step, 10-20x below this task's gradient noise
scale (diag/noise_scale, `jaxreplay.run.regime`: 150-850 rollouts, median ~400, measured by
`python -m jaxreplay.launch --config=configs/scratchpad.py --workdir=/tmp/noise/b256
--config.buffer.on_policy=True --config.buffer.size=256 --config.buffer.batch_size=256
--config.total_steps=40 --config.log.diagnostics_every=2 --config.eval.num_problems=0`): each
batch gradient is mostly noise, progress is bought with fresh samples, and replay cannot pay
there. Here B = 512 rollouts (at or above the noise scale: one update's gradient is mostly signal)
and N = 2048, so updates, not samples, are what is scarce (EXPERIMENTS.md, "Replay that wins").

Everything else is `configs/scratchpad.py`: the task, the warm-start, (W, T) = (6, 2), mu = 6.84.
The simulated costs are per update of B rollouts, so the step's training time scales with B (16x
the base's 1 device-second for 32 rollouts), and one on-policy update costs (1 + mu) * 16 =
125.4 device-seconds; the budget is 100 of them. Evaluation: pass@1 (T=0.1) on 256 held-out
problems at the compute grid's inner points, all 1024 with pass@k (T=1, 32 samples) at the start
and at the budget (`eval.pass1_problems`; the sweeps' protocol otherwise).
"""
import importlib.util
import os

_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scratchpad.py")
_spec = importlib.util.spec_from_file_location("scratchpad_base", _BASE)
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)

BATCH = 512


def get_config():
  c = _base.get_config()
  c.buffer.batch_size = BATCH
  c.buffer.size = 4 * BATCH
  c.scheduler.train_seconds_per_step = BATCH / 32
  c.compute_budget = 100 * (1.0 + c.scheduler.mu) * c.scheduler.train_seconds_per_step
  c.total_steps = 2000                # a cap: the budget ends every run first
  c.trainer.buckets = (48, 64)
  c.eval.pass1_problems = 256
  c.log.diagnostics_every = 5
  c.checkpoint.every = 50
  return c
