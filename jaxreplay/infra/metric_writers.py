"""Metrics outputs: `DIR/metrics.jsonl`, TensorBoard events in `DIR/tb`, optionally Weights &
Biases (`WandbLogger`, config log.wandb_*), and a progress line.

Each JSONL line is one JSON object {"step": int, name: value, ...}. Values are converted to Python
floats / ints (numpy and JAX scalars included); non-finite floats are written as null (strict JSON)
and left out of TensorBoard (a NaN there is a warning per value; e.g. reward_mean is NaN on steps
without fresh rollouts, by design). TensorBoard names keep to its charset: "eval/pass@1" is
"eval/pass_1" there (`tensorboard_name`). Resuming at step S keeps lines with step <= S and drops the rest, so a
resumed run never duplicates steps; TensorBoard is told to purge events after S as well.
W&B gets the same rows (finite numbers only) with "step" as their x axis; a resumed run continues
the same W&B run (its id is kept in DIR/wandb_run_id), where the steps after S appear a second time.
"""
from __future__ import annotations

import dataclasses
import importlib.util
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
  return read_jsonl(path)


def read_jsonl(path: str) -> list[dict]:
  """The JSON-object lines of the file `path`; malformed lines (a line cut by a crash) skipped."""
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


def rewrite_jsonl(path: str, rows: Sequence[Mapping[str, Any]]) -> None:
  """Replaces the file `path` by `rows`, one JSON line each, atomically (tmp file, fsync, rename)."""
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _scalars(row: Mapping[str, Any]) -> dict[str, float]:
  """The finite int / float values of a row (what TensorBoard and W&B receive)."""
  return {k: v for k, v in row.items()
          if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


WANDB_MODES = ("online", "offline")
WANDB_RUN_ID_FILE = "wandb_run_id"


@dataclasses.dataclass(frozen=True)
class WandbSettings:
  """Where and how a run logs to Weights & Biases (config keys log.wandb_*).

  project: the W&B project (log.wandb_project; empty means no W&B, see `wandb_settings`).
  mode: "online" (streams to the server; needs `wandb login` or WANDB_API_KEY) or "offline"
    (writes DIR/wandb/offline-run-*/, upload later with `wandb sync`).
  entity: the W&B team or user ("" = your default entity).
  run_name: the run's display name ("" = the workdir's name).
  config: the run config logged with the run (a plain dict).
  """
  project: str
  mode: str = "online"
  entity: str = ""
  run_name: str = ""
  config: Optional[dict] = None

  def __post_init__(self):
    if not self.project:
      raise ValueError("WandbSettings needs a project (config log.wandb_project)")
    if self.mode not in WANDB_MODES:
      raise ValueError(f"log.wandb_mode={self.mode!r}: expected one of {WANDB_MODES} (offline "
                       "writes DIR/wandb for a later `wandb sync`)")


def wandb_config_errors(log) -> list[str]:
  """Problems of the log.wandb_* keys of a config's `log` section (the fail-fast check before a
  build)."""
  if not log.wandb_project:
    return []
  errors = []
  if log.wandb_mode not in WANDB_MODES:
    errors.append(f"log.wandb_mode={log.wandb_mode!r}: expected one of {WANDB_MODES}")
  if importlib.util.find_spec("wandb") is None:
    errors.append(f"log.wandb_project={log.wandb_project!r} needs the wandb package: pip install "
                  "'jaxreplay[wandb]', or set log.wandb_project='' (JSONL and TensorBoard only)")
  return errors


def wandb_settings(log, run_config: Optional[dict] = None) -> Optional[WandbSettings]:
  """The W&B settings of a config's `log` section, or None when log.wandb_project is "";
  `run_config` (the whole config as a dict) is what the W&B run records as its config."""
  if not log.wandb_project:
    return None
  return WandbSettings(project=log.wandb_project, mode=log.wandb_mode, entity=log.wandb_entity,
                       run_name=log.wandb_run_name, config=run_config)


class WandbLogger:
  """One W&B run for a workdir: `log(row)` sends a metrics row, `close()` finishes the run.

  wandb is imported here, only when a run asks for it. Rows are logged with their "step" as the x
  axis of every chart (`define_metric("*", step_metric="step")`), so a resumed run that logs steps
  again is accepted (W&B drops rows whose own step goes back). The run id is kept in
  `workdir/wandb_run_id`: with resume=True the run continues, otherwise a fresh run replaces it.
  """

  def __init__(self, settings: WandbSettings, workdir: str, resume: bool = False):
    try:
      import wandb  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError(f"log.wandb_project={settings.project!r} needs the wandb package: pip "
                        "install 'jaxreplay[wandb]' (or set log.wandb_project='' to log to "
                        "metrics.jsonl and TensorBoard only)") from e
    id_path = os.path.join(workdir, WANDB_RUN_ID_FILE)
    run_id = None
    if resume and os.path.isfile(id_path):
      with open(id_path, encoding="utf-8") as f:
        run_id = f.read().strip() or None
    self._run = wandb.init(
        project=settings.project, entity=settings.entity or None, mode=settings.mode,
        name=settings.run_name or os.path.basename(os.path.abspath(workdir)), dir=workdir,
        config=settings.config, id=run_id, resume="allow" if run_id else None)
    self.run_id = self._run.id
    with open(id_path, "w", encoding="utf-8") as f:
      f.write(self.run_id + "\n")
    self._run.define_metric("step")
    self._run.define_metric("*", step_metric="step")

  def log(self, row: Mapping[str, Any]) -> None:
    """Logs the finite numbers of `row` (which holds "step")."""
    self._run.log(_scalars(row))

  def close(self) -> None:
    if self._run is not None:
      self._run.finish()
      self._run = None


class MetricsWriter:
  """Appends one row per `write(step, metrics)` to `workdir/metrics.jsonl` (flushed each time),
  scalars to TensorBoard under `workdir/tb` and, when asked, to a W&B run.

  Args:
    workdir: the run directory (created if missing).
    resume_step: when resuming from a checkpoint at this step, rows with step > resume_step are
      dropped first (`truncate_after`) and TensorBoard purges later events.
    tensorboard: write TensorBoard events too.
    enabled: False on non-primary trainer processes (rows are formed, nothing is written).
    wandb: log to Weights & Biases too (`wandb_settings(config.log, run config dict)`); None: not
      (wandb not imported).
  """

  def __init__(self, workdir: str, resume_step: Optional[int] = None, tensorboard: bool = True,
               enabled: bool = True, wandb: Optional[WandbSettings] = None):
    self.workdir = workdir
    self.path = os.path.join(workdir, METRICS_FILE)
    self.enabled = enabled
    self._file = None
    self._tb = None
    self._wandb = None
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
    if wandb is not None:
      self._wandb = WandbLogger(wandb, workdir, resume=resume_step is not None)

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
    rewrite_jsonl(self.path, kept)
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
      for k, v in _scalars(row).items():
        if k != "step":
          self._tb.add_scalar(tensorboard_name(k), v, global_step=row["step"])
    if self._wandb is not None:
      self._wandb.log(row)
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
    if self._wandb is not None:
      self._wandb.close()
      self._wandb = None

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
  """Logs a line every `every_s` seconds: step/total, steps/s, ETA and a few metrics; and a line
  per evaluation (`evaluated`).

  Rate and ETA are measured from the first update on (its time includes start-up and compilation,
  which would make a rate from the logger's creation far too slow): the first update prints
  nothing (unless forced, or the last step) and the second prints at once, with an ETA. A resumed
  run's rate counts only its own steps.
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
    last_step = force or step >= self.total_steps
    if self._first is None:
      self._first = (now, step)
      if not last_step:
        return None  # no rate yet: the next update prints
    if not (last_step or now - self._last >= self.every_s):
      return None
    self._last = now
    text = self.line(step)
    logging.info("%s", text)
    return text

  def evaluated(self, step: int, metrics: Mapping[str, Any],
                keys: Sequence[str] = ("eval/pass@1", "eval/pass@1_t1", "eval/entropy")) -> str:
    """Logs and returns the line of an evaluation: step, the eval/* values of `keys` and every
    pass@k, and its seconds ("eval/seconds")."""
    values = {k: to_python(v) for k, v in metrics.items()}
    shown = [k for k in keys if k in values] + sorted(
        (k for k in values if k.startswith("eval/pass@") and k not in keys),
        key=lambda k: (len(k), k))
    parts = [f"{k[len('eval/'):]} {values[k]:.3f}" for k in shown
             if isinstance(values[k], (int, float)) and not isinstance(values[k], bool)]
    seconds = values.get("eval/seconds")
    took = f" ({format_duration(seconds)})" if isinstance(seconds, (int, float)) else ""
    text = f"eval at step {step}: " + (" | ".join(parts) or "no metrics") + took
    logging.info("%s", text)
    return text
