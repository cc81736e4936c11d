"""Qwen2.5-7B on OpenR1-Math-220k: the paper's main setting (N=84, (W,T)=(5,3), G=16, lr 6.8e-8).

  python -m jaxreplay.launch --config=configs/qwen2_5_7b.py --workdir=runs/q25_7b \
      --config.model.path=/models/Qwen2.5-7B --config.task.path=/data/openr1_math.parquet

Fits an H100 80GB at (W, T) = (5, 3) by XLA's own count (`--dry_run --compile_for=h100`;
bench/gpu_compile.py): what was traded for it, against the defaults,
  log.diagnostics_probe 8 -> 1   the update-KL probe keeps its log-softmax [probe, 4608, 152064]
                                 float32 on every trainer GPU across the update: 20.9 GiB at 8
                                 rollouts, 2.6 GiB at 1 (diag/update_kl is then measured on one
                                 rollout's tokens)
  log.diagnostics_splits 4 -> 5  the noise-scale estimate's micro-batches hold 4 rows per GPU, as
                                 the train step's do
"""
from jaxreplay.config.defaults import gpu_math_config


def get_config():
  c = gpu_math_config("qwen2_5_7b", learning_rate=6.8e-8, mu=5.28)
  c.log.diagnostics_probe = 1
  c.log.diagnostics_splits = 5
  return c
