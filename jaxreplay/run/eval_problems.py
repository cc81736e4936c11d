"""Per-problem evaluation records: `<workdir>/eval_problems.jsonl` (config `eval.per_problem`).

One JSON row per evaluation, appended (and flushed) when the evaluation ends:

  {"step": int, "compute_seconds": float (the run's compute axis at the evaluation),
   "n_pass1": int, "n_samples": int (0: a pass@1-only point),
   "pass1_correct": [int] * P (problem j's correct low-temperature samples, 0..n_pass1),
   "passk_correct": [int] * P (problem j's correct samples of the n_samples, 0..n_samples;
                               absent where n_samples is 0),
   "problems": [str] * P (the prompts; only where the file has not listed this many yet)}

Problem j of every row is the same held-out problem: a pass@1-only point evaluates the first
`eval.pass1_problems` of the set (a prefix), so its P is smaller and its j-th count is still
problem j's. "problems" appears on the first row of the file and on any later row that evaluates
more problems than listed so far (then it lists them all); problem j is the j-th prompt of the
newest list (`read_rows` / `problem_prompts`). pass@k of a row is
`evaluation.pass_at_k_per_problem` over its counts (`passk_correct` -> a bool [P, n_samples] matrix
whose row j has that many True), the same as the metrics row's eval/pass@k.

Resume: rows after the resumed step are dropped first (`truncate_after`, as the metrics writer
does), so a resumed run's file holds each evaluation once; a fresh run in a used workdir starts an
empty file.
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import numpy as np

from jaxreplay.infra import metric_writers

FILE = "eval_problems.jsonl"


def read_rows(path: str) -> list[dict]:
  """The rows of an eval_problems.jsonl (the file or its run directory); lines cut by a crash are
  skipped."""
  if os.path.isdir(path):
    path = os.path.join(path, FILE)
  return [row for row in metric_writers.read_jsonl(path) if "step" in row]


def problem_prompts(rows: Sequence[dict]) -> list[str]:
  """The held-out prompts of the rows' problems (the longest "problems" list of the file)."""
  lists = [row["problems"] for row in rows if "problems" in row]
  return max(lists, key=len) if lists else []


def correct_matrix(counts: Sequence[int], n: int) -> np.ndarray:
  """bool [P, n]: row j holds counts[j] True (the pass@k estimators read only the count)."""
  counts = np.asarray(counts, dtype=np.int64)
  return np.arange(n)[None, :] < counts[:, None]


class ProblemLog:
  """Appends one row per evaluation to `workdir/eval_problems.jsonl` (module docstring).

  Args:
    workdir: the run directory (created if missing).
    resume_step: resuming from a checkpoint at this step: rows with step > resume_step are dropped
      first; None: a fresh run, the file starts empty.
    enabled: False on non-primary trainer processes (nothing is written).
  """

  def __init__(self, workdir: str, resume_step: Optional[int] = None, enabled: bool = True):
    self.path = os.path.join(workdir, FILE)
    self.enabled = enabled
    self._listed = 0  # prompts listed in the file so far
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self.truncate_after(-1 if resume_step is None else resume_step)

  def truncate_after(self, step: int) -> int:
    """Drops rows with step > `step` (and malformed lines), atomically. Returns the rows kept."""
    if not self.enabled:
      return 0
    kept = ([row for row in read_rows(self.path) if int(row["step"]) <= step]
            if os.path.isfile(self.path) else [])
    metric_writers.rewrite_jsonl(self.path, kept)
    self._listed = len(problem_prompts(kept))
    return len(kept)

  def write(self, step: int, compute_seconds: float, counts: dict, prompts: Sequence[str]) -> dict:
    """Appends the row of the evaluation at `step`; `counts` is `evaluation.evaluate_problems`'s
    (int [P] "pass1_correct", optional "passk_correct", "n_pass1", "n_samples"); `prompts` the
    evaluated problems' prompts (P of them). Returns the row."""
    p = len(counts["pass1_correct"])
    if len(prompts) != p:
      raise ValueError(f"ProblemLog.write: {len(prompts)} prompts for {p} problem counts")
    row = {"step": int(step), "compute_seconds": float(compute_seconds),
           "n_pass1": int(counts["n_pass1"]), "n_samples": int(counts["n_samples"]),
           "pass1_correct": [int(x) for x in counts["pass1_correct"]]}
    if "passk_correct" in counts:
      row["passk_correct"] = [int(x) for x in counts["passk_correct"]]
    if p > self._listed:
      row["problems"] = [str(x) for x in prompts]
    if not self.enabled:
      return row
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(json.dumps(row) + "\n")
    self._listed = max(self._listed, p)
    return row
