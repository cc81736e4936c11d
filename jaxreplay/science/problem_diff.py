"""Which held-out problems two runs solve: their eval_problems.jsonl rows compared per problem.

  python -m jaxreplay.science.problem_diff RUN_A RUN_B [--names=onpolicy,adaptive]

RUN_A and RUN_B are run directories holding eval_problems.jsonl (`run.eval_problems`) over the
same held-out problems. For each problem: its correct samples of n at the first and at the last
evaluation that drew the pass@k samples ("start", "end"), in each run; with scratchpad addition
prompts "a+b=" also its kind (`kind`: digits, carries, and the columns whose fact the warm-start's
noisy teacher misremembers, with the probability that teacher writes the whole problem right).

Printed (markdown): the problems each run solves at the end (some sample right) that the other
does not, and every problem by its start count (how rare its correct answers were at the start):
how many of them each run solves at the end, how many it lost (solved at the start, not at the
end), and the same by digits, carries and misremembered columns. A loss of rare
correct answers shows as problems with a low start count solved by A and not by B at the end.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from typing import Callable, Optional, Sequence

import numpy as np

from jaxreplay.run import eval_problems
from jaxreplay.tasks import scratchpad

# configs/scratchpad.py's warm-start: 30% of the 200 column facts misremembered, slip in
# [0.4, 0.95], fixed by the task seed 0.
TEACHER = dict(share=0.3, slip_range=(0.4, 0.95), seed=0)
# Start-count bins (inclusive ranges of correct samples of n at the first pass@k evaluation).
BINS = ((0, 0), (1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 1 << 30))


@dataclasses.dataclass(frozen=True)
class Counts:
  """One run's per-problem correct counts of n samples: int [P] at the first and last pass@k
  evaluation, their steps, n."""
  start: np.ndarray
  end: np.ndarray
  steps: tuple[int, int]
  n: int


def load(workdir: str) -> tuple[list[str], Counts]:
  """(the prompts, the run's `Counts`) from `workdir`/eval_problems.jsonl."""
  rows = eval_problems.read_rows(workdir)
  passk = [r for r in rows if "passk_correct" in r]
  if not passk:
    raise ValueError(f"{workdir}: no evaluation with pass@k samples in {eval_problems.FILE}; "
                     "run with eval.per_problem=True and eval.n_samples > 0")
  first, last = passk[0], passk[-1]
  if first["n_samples"] != last["n_samples"]:
    raise ValueError(f"{workdir}: n_samples {first['n_samples']} at the start, "
                     f"{last['n_samples']} at the end")
  return eval_problems.problem_prompts(rows), Counts(
      np.asarray(first["passk_correct"]), np.asarray(last["passk_correct"]),
      (int(first["step"]), int(last["step"])), int(first["n_samples"]))


def kind(prompt: str, teacher: Optional[dict] = None) -> dict:
  """A scratchpad addition prompt "a+b=": {"digits" (the longer operand's), "carries" (columns
  with a carry out), "misremembered" (columns whose fact (x, y, carry_in) the teacher
  misremembers), "teacher_p" (the probability it writes every column right)}; {} for other prompts."""
  match = re.fullmatch(r"(\d+)\+(\d+)=", prompt)
  if not match:
    return {}
  a, b = int(match.group(1)), int(match.group(2))
  cols = scratchpad.column_sums(a, b)
  table = scratchpad.misconceptions(**dict(TEACHER, **(teacher or {})))
  slips = [table[(x, y, c)][0] for x, y, c, _ in cols if (x, y, c) in table]
  return {"digits": max(len(match.group(1)), len(match.group(2))),
          "carries": sum(s >= 10 for *_, s in cols), "misremembered": len(slips),
          "teacher_p": float(np.prod([1.0 - p for p in slips]))}


def bin_of(count: int) -> str:
  for lo, hi in BINS:
    if lo <= count <= hi:
      return f"{lo}" if lo == hi else (f">={lo}" if hi >= 1 << 30 else f"{lo}-{hi}")
  raise ValueError(count)


def _table(title: str, header: Sequence[str], rows: Sequence[Sequence]) -> list[str]:
  return [f"\n{title}\n", "| " + " | ".join(header) + " |", "|" + "---|" * len(header),
          *("| " + " | ".join(str(x) for x in row) + " |" for row in rows)]


def _group_rows(keys: Sequence, a: Counts, b: Counts,
                order: Optional[Sequence] = None) -> list[list]:
  """Per group key (in `order`, default sorted): problems, mean start count, solved at the end by A
  / by B, lost by A / by B (solved at the start, not at the end), solved by A only / by B only."""
  keys = np.asarray(keys, dtype=object)
  out = []
  for key in (order or sorted(set(keys.tolist()))):
    m = keys == key
    if not m.any():
      continue
    sa, sb = a.end[m] > 0, b.end[m] > 0
    out.append([key, int(m.sum()), f"{a.start[m].mean():.2f}", int(sa.sum()), int(sb.sum()),
                int(((a.start[m] > 0) & ~sa).sum()), int(((b.start[m] > 0) & ~sb).sum()),
                int((sa & ~sb).sum()), int((sb & ~sa).sum())])
  return out


def report(prompts: Sequence[str], a: Counts, b: Counts, names: tuple[str, str] = ("A", "B"),
           kind_fn: Callable[[str], dict] = kind) -> str:
  """The comparison's markdown (module docstring)."""
  p = len(a.end)
  if not (len(b.end) == len(a.start) == len(b.start) == p <= len(prompts)) or a.n != b.n:
    raise ValueError(f"the runs evaluated different problems or n: {len(a.end)} / {len(b.end)} "
                     f"problems, n = {a.n} / {b.n}")
  na, nb = names
  kinds = [kind_fn(s) for s in prompts[:p]]
  lines = [f"{p} problems, n = {a.n} samples; {na} evaluations at steps {a.steps}, "
           f"{nb} at steps {b.steps}",
           f"solved at the end (some sample right): {na} {int((a.end > 0).sum())}, "
           f"{nb} {int((b.end > 0).sum())}; at the start {int((a.start > 0).sum())} / "
           f"{int((b.start > 0).sum())}"]
  header = ["problem", "digits", "carries", "misremembered", "teacher_p",
            f"{na} start", f"{na} end", f"{nb} start", f"{nb} end"]
  for title, mask in ((f"solved by {na} only at the end", (a.end > 0) & (b.end == 0)),
                      (f"solved by {nb} only at the end", (b.end > 0) & (a.end == 0))):
    idx = np.flatnonzero(mask)
    idx = idx[np.lexsort((a.start[idx], a.end[idx]))]
    rows = [[prompts[i], *(f"{kinds[i][k]:.3f}" if k == "teacher_p" else kinds[i].get(k, "")
                           for k in ("digits", "carries", "misremembered", "teacher_p")),
             a.start[i], a.end[i], b.start[i], b.end[i]] for i in idx]
    lines += _table(f"{title}: {len(idx)}", header, rows)
  group_header = ["problems", "mean start", f"{na} solves", f"{nb} solves", f"{na} lost",
                  f"{nb} lost", f"{na} only", f"{nb} only"]
  lines += _table(f"by the start count of correct samples of {a.n} ({na}'s first evaluation)",
                  ["start count", *group_header],
                  _group_rows([bin_of(c) for c in a.start], a, b, [bin_of(lo) for lo, _ in BINS]))
  if all(kinds):
    for key in ("digits", "carries", "misremembered"):
      lines += _table(f"by {key}", [key, *group_header],
                      _group_rows([k[key] for k in kinds], a, b))
  return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxreplay.science.problem_diff",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("run_a")
  parser.add_argument("run_b")
  parser.add_argument("--names", default="A,B", help="the two runs' names in the tables")
  args = parser.parse_args(argv)
  names = tuple(args.names.split(","))
  if len(names) != 2:
    parser.error(f"--names={args.names}: give two names, e.g. --names=onpolicy,adaptive")
  for run in (args.run_a, args.run_b):
    if not os.path.isfile(os.path.join(run, eval_problems.FILE)):
      parser.error(f"{run} holds no {eval_problems.FILE}: give run directories of runs with "
                   "eval.per_problem=True")
  prompts_a, a = load(args.run_a)
  prompts_b, b = load(args.run_b)
  if prompts_a != prompts_b:
    parser.error("the two runs evaluated different held-out problems")
  print(report(prompts_a, a, b, names))
  return 0


if __name__ == "__main__":
  sys.exit(main())
