"""Qwen3-8B on math. The paper reports Qwen3-8B runs without a learning rate: we use Qwen2.5-7B's.

  python -m jaxreplay.launch --config=configs/qwen3_8b.py --workdir=runs/q3_8b \
      --config.model.path=/models/Qwen3-8B --config.task.path=/data/openr1_math.parquet \
      --config.buffer.size=84

Fits an H100 80GB at the paper's (W, T) = (5, 3) by XLA's own count (`--dry_run
--compile_for=h100`; bench/gpu_compile.py): what was traded for it, against the defaults,
  log.diagnostics_probe 8 -> 1   the update-KL probe keeps its log-softmax [probe, 4608, 151936]
                                 float32 on every trainer GPU across the update: 20.9 GiB at 8
                                 rollouts, 2.6 GiB at 1 (diag/update_kl is then measured on one
                                 rollout's tokens)
  log.diagnostics_splits 4 -> 5  the noise-scale estimate's micro-batches hold 4 rows per GPU, as
                                 the train step's do (5 rows took 3.4 GiB more)
"""
from jaxreplay.config.defaults import gpu_math_config


def get_config():
  c = gpu_math_config("qwen3_8b", learning_rate=6.8e-8, mu=5.28)
  c.log.diagnostics_probe = 1
  c.log.diagnostics_splits = 5
  return c
