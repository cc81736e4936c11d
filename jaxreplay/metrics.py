"""Metrics outputs: `DIR/metrics.jsonl`, TensorBoard events in `DIR/tb`, and a progress line.

Each JSONL line is one JSON object {"step": int, name: value, ...}. Values are converted to Python
floats / ints (numpy and JAX scalars included); non-finite floats are written as null (strict JSON)
and left out of TensorBoard (a NaN there is a warning per value; e.g. reward_mean is NaN on steps
without fresh rollouts, by design). TensorBoard names keep to its charset: "eval/pass@1" is
"eval/pass_1" there (`tensorboard_name`). Resuming at step S keeps lines with step <= S and drops the rest, so a
resumed run never duplicates steps; TensorBoard is told to purge events after S as well.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import re
import time
from typing import Any, Callable, Mapping, Optional, Sequence

from absl import logging
import numpy as np

METRICS_FILE = "metrics.jsonl"


def to_python(value: Any) -> Any:
  """A JSON-friendly version of `value`: numpy/JAX scalars and 0-d arrays -> int / float / bool;
  strings kept; other values (lists, arrays of several elements) -> str-free lists or repr."""
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  if isinstance(value, numbers.Integral):
    return int(value)
  if isinstance(value, numbers.Real):
    return float(value)
  if isinstance(value, str) or value is None:
    return value
  if hasattr(value, "shape") and hasattr(value, "dtype"):  # numpy / jax arrays
    arr = np.asarray(value)
    if arr.ndim == 0 or arr.size == 1:
      return to_python(arr.reshape(()).item())
    return [to_python(v) for v in arr.reshape(-1).tolist()]
  if isinstance(value, (list, tuple)):
    return [to_python(v) for v in value]
  return repr(value)


def _json_safe(value: Any) -> Any:
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, list):
    return [_json_safe(v) for v in value]
  return value


def tensorboard_name(key: str) -> str:
  """`key` in TensorBoard's charset ([A-Za-z0-9_./-]): other characters become "_"."""
  return re.sub(r"[^A-Za-z0-9_./-]", "_", key)


def read_metrics(workdir_or_file: str) -> list[dict]:
  """The rows of a metrics.jsonl (given the file or its run directory); malformed lines (a line
  cut by a crash) are skipped."""
  path = workdir_or_file
  if os.path.isdir(path):
    path = os.path.join(path, METRICS_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} not found: expected a run directory holding {METRICS_FILE}")
  rows = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        continue
      if isinstance(row, dict):
        rows.append(row)
  return rows


class MetricsWriter:
  """Appends one row per `write(step, metrics)` to `workdir/metrics.jsonl` (flushed each time) and
  scalars to TensorBoard under `workdir/tb`.

  Args:
    workdir: the run directory (created if missing).
    resume_step: when resuming from a checkpoint at this step, rows with step > resume_step are
      dropped first (`truncate_after`) and TensorBoard purges later events.
    tensorboard: write TensorBoard events too.
  """

  def __init__(self, workdir: str, resume_step: Optional[int] = None, tensorboard: bool = True,
               enabled: bool = True):
    self.workdir = workdir
    self.path = os.path.join(workdir, METRICS_FILE)
    self.enabled = enabled
    self._file = None
    self._tb = None
    if not enabled:  # a non-primary trainer process: rows are formed but not written
      return
    os.makedirs(workdir, exist_ok=True)
    if resume_step is not None:
      self.truncate_after(resume_step)
    self._file = open(self.path, "a", encoding="utf-8")
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      purge = None if resume_step is None else resume_step + 1
      self._tb = SummaryWriter(os.path.join(workdir, "tb"), purge_step=purge)

  def truncate_after(self, step: int) -> int:
    """Drops rows with step > `step` (and malformed lines) from metrics.jsonl, atomically.
    Returns the number of rows kept."""
    if not self.enabled:
      return 0
    if getattr(self, "_file", None) is not None:
      self._file.flush()
    if not os.path.isfile(self.path):
      return 0
    kept = [row for row in read_metrics(self.path) if int(row.get("step", -1)) <= step]
    tmp = self.path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      for row in kept:
        f.write(json.dumps(row) + "\n")
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, self.path)
    if getattr(self, "_file", None) is not None:  # reopen: the old handle points at the old file
      self._file.close()
      self._file = open(self.path, "a", encoding="utf-8")
    return len(kept)

  def write(self, step: int, metrics: Mapping[str, Any]) -> dict:
    """Writes one row {"step": step, **metrics}; returns the row as written (Python values)."""
    row = {"step": int(step)}
    for k, v in metrics.items():
      row[str(k)] = to_python(v)
    if not self.enabled:
      return row
    self._file.write(json.dumps({k: _json_safe(v) for k, v in row.items()}) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in row.items():
        if (k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v)):
          self._tb.add_scalar(tensorboard_name(k), v, global_step=row["step"])
    return row

  def flush(self) -> None:
    if self._file is not None:
      self._file.flush()
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None

  def __enter__(self) -> "MetricsWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def format_duration(seconds: float) -> str:
  """"1h02m03s" / "4m05s" / "6s"; "?" when not finite."""
  if not math.isfinite(seconds):
    return "?"
  s = int(round(max(seconds, 0.0)))
  h, rem = divmod(s, 3600)
  m, s = divmod(rem, 60)
  if h:
    return f"{h}h{m:02d}m{s:02d}s"
  return f"{m}m{s:02d}s" if m else f"{s}s"


class ProgressLogger:
  """Logs a line every `every_s` seconds: step/total, steps/s, ETA and a few metrics.

  Rate and ETA are measured from the first update on (its time includes start-up and compilation,
  which would make the first ETA hours long), so the first line says "ETA ?"; a resumed run's rate
  counts only its own steps.
  """

  def __init__(self, total_steps: int, every_s: float = 30.0, start_step: int = 0,
               keys: Sequence[str] = ("reward_mean", "eval/pass@1", "loss", "compute/gamma"),
               clock: Callable[[], float] = time.monotonic):
    self.total_steps, self.every_s, self.start_step = total_steps, every_s, start_step
    self.keys = tuple(keys)
    self._clock = clock
    self._t0 = clock()
    self._last = -math.inf
    self._latest: dict[str, Any] = {}
    self._first: Optional[tuple[float, int]] = None  # (time, step) of the first update

  def line(self, step: int) -> str:
    now = self._clock()
    elapsed = now - self._t0
    if self._first is None:
      self._first = (now, step)
    t_first, step_first = self._first
    rate = (step - step_first) / (now - t_first) if now > t_first and step > step_first else 0.0
    eta = (self.total_steps - step) / rate if rate > 0 else math.inf
    pct = 100.0 * step / self.total_steps if self.total_steps else 0.0
    parts = [f"step {step}/{self.total_steps} ({pct:.1f}%)", f"{rate:.3g} steps/s",
             f"ETA {format_duration(eta)}", f"elapsed {format_duration(elapsed)}"]
    for k in self.keys:
      v = self._latest.get(k)
      if isinstance(v, (int, float)) and not isinstance(v, bool):
        parts.append(f"{k}={v:.4g}")
    return " | ".join(parts)

  def update(self, step: int, metrics: Optional[Mapping[str, Any]] = None,
             force: bool = False) -> Optional[str]:
    """Records `metrics` (the latest value of each key is shown); logs and returns the line when
    `every_s` has passed since the last one, at the last step, or when `force`."""
    for k, v in (metrics or {}).items():
      if k in self.keys:
        self._latest[k] = to_python(v)
    now = self._clock()
    if self._first is None:
      self._first = (now, step)
    if not (force or step >= self.total_steps or now - self._last >= self.every_s):
      return None
    self._last = now
    text = self.line(step)
    logging.info("%s", text)
    return text
