"""What `python -m jaxreplay.launch` tells its user at the start and at the end of a run.

  `banner(config, ...)`   the first lines, printed once the config is valid and before anything
                          heavy starts: the config file and workdir, the model and its size (from
                          its config.json or preset, no weights read), the task, the run's shape
                          (steps, B and N, the algorithm, the schedule), the devices and backends
  `summary(rows, ...)`    the last lines: how the run ended, each evaluation metric from its first
                          to its last evaluation, the wall time, and where the outputs are

Both return text (the launcher logs it); the metrics come from WORKDIR/metrics.jsonl's rows.
"""
from __future__ import annotations

import math
import os
from typing import Any, Optional, Sequence

from jaxreplay.infra import metric_writers
from jaxreplay.models import presets
from jaxreplay.models.config import ModelConfig
from jaxreplay.rollout import backend_table

# The evaluation metrics of the summary, in this order; other eval/pass@k follow.
SUMMARY_KEYS = ("eval/pass@1", "eval/pass@1_t1", "eval/entropy", "eval/mean_completion_tokens")


def _count(n: float) -> str:
  for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if n >= size:
      return f"{n / size:.3g}{unit}"
  return str(int(n))


def model_line(config) -> str:
  """The model, read from model.path's config.json (else its preset): name, family, size, dtype."""
  m = config.model
  try:
    cfg = ModelConfig.from_hf_dir(m.path) if m.path else presets.PRESETS[m.preset]()
    size = f"{_count(cfg.num_params())} params, {cfg.num_hidden_layers} layers"
    family = cfg.model_type
  except (OSError, ValueError, KeyError) as e:
    size, family = f"size unknown ({type(e).__name__})", "?"
  name = os.path.basename(os.path.normpath(m.path)) if m.path else f"preset {m.preset!r}"
  lora = f", LoRA rank {m.lora_rank}" if m.get("lora_rank", 0) else ""
  return f"{name} ({family}, {size}, {m.dtype}{lora})"


def banner(config, config_file: str, workdir: str, devices: str, resume_step: Optional[int],
           log_path: Optional[str] = None) -> str:
  """The start of a run (see the module docstring). `devices`: the trainer's devices in words
  (`config.platform.Platform.describe`); `resume_step`: the checkpoint it resumes, or None."""
  c = config
  start = (f"resuming at step {resume_step}" if resume_step is not None else "a new run")
  rollout = backend_table.resolve(c.rollout.backend)
  evaluation = backend_table.resolve_eval(c.eval.backend, rollout)
  buffer = (f"an on-policy queue (N={c.buffer.size}, B={c.buffer.batch_size})" if c.buffer.on_policy
            else f"a replay buffer of N={c.buffer.size} rollouts, B={c.buffer.batch_size} per step")
  lines = [
      f"jaxreplay: {config_file} -> {workdir} ({start})",
      f"  model    {model_line(c)}",
      f"  task     {c.task.name}" + (f" ({c.task.path})" if c.task.name == "math" else ""),
      f"  run      {c.total_steps} steps of {c.trainer.loss}, {buffer}, "
      f"{c.scheduler.kind} schedule",
      f"  devices  trainer: {devices}; rollout: {c.rollout.num_workers} {rollout} worker"
      f"{'s' if c.rollout.num_workers != 1 else ''}"
      + (f" (auto -> {rollout})" if c.rollout.backend != rollout else "")
      + (f"; evaluation on the {evaluation}" if c.eval.num_problems else "; no evaluation"),
  ]
  if log_path:
    lines.append(f"  log      {log_path}")
  return "\n".join(lines)


def _fmt(value: Any) -> str:
  if isinstance(value, float):
    return "nan" if not math.isfinite(value) else f"{value:.4g}"
  return str(value)


def eval_table(rows: Sequence[dict]) -> list[str]:
  """Each eval/* metric from its first evaluation to its last: "name  first -> last"."""
  evaluated = [r for r in rows if any(k.startswith("eval/pass@") for k in r)]
  if not evaluated:
    return []
  first, last = evaluated[0], evaluated[-1]
  keys = [k for k in SUMMARY_KEYS if k in last] + sorted(
      (k for k in last if k.startswith("eval/pass@") and k not in SUMMARY_KEYS),
      key=lambda k: (len(k), k))
  width = max(len(k) for k in keys) + 2
  head = f"step {first['step']}"
  lines = [f"  {'':<{width}}{head:>9}    step {last['step']}"]
  for k in keys:
    lines.append(f"  {k:<{width}}{_fmt(first.get(k, float('nan'))):>9} -> {_fmt(last[k])}")
  return lines


# Outputs a run leaves in its workdir, with what each is for; listed when present.
OUTPUTS = (
    ("metrics.jsonl", "a JSON row per step (python -m jaxreplay.plot WORKDIR)"),
    ("eval_problems.jsonl", "a JSON row per evaluation: each problem's correct samples"),
    ("hf", "the exported model (python -m jaxreplay.chat --model=WORKDIR/hf)"),
    ("hf_adapter", "the LoRA adapter, PEFT format (python -m jaxreplay.chat --model=BASE "
                   "--adapter=WORKDIR/hf_adapter)"),
    ("tb", "TensorBoard events (tensorboard --logdir WORKDIR/tb)"),
    ("checkpoints", "rerun the same command to resume"),
    ("run.log", "this run's full log"),
)


def summary(workdir: str, wall_s: float, ended: str, rows: Optional[Sequence[dict]] = None) -> str:
  """The end of a run: `ended` (how it ended, e.g. "finished at step 400"), the wall time, the
  eval table of `rows` (default: WORKDIR/metrics.jsonl) and the outputs present in `workdir`."""
  if rows is None:
    try:
      rows = metric_writers.read_metrics(workdir)
    except FileNotFoundError:
      rows = []
  lines = [f"{ended} in {metric_writers.format_duration(wall_s)}"]
  lines += eval_table(rows)
  present = [(name, what) for name, what in OUTPUTS if os.path.exists(os.path.join(workdir, name))]
  if present:
    lines.append(f"outputs in {workdir}:")
    width = max(len(n) for n, _ in present) + 3
    for name, what in present:
      shown = name + ("/" if os.path.isdir(os.path.join(workdir, name)) else "")
      lines.append(f"  {shown:<{width}}{what.replace('WORKDIR', workdir)}")
  return "\n".join(lines)
