"""`run.eval_problems`: the per-problem evaluation rows (one per evaluation, prompts listed once),
their counts against the pass@k they aggregate to, and resume truncation."""
import json

import numpy as np
import pytest

from jaxreplay.run import eval_problems, evaluation
from jaxreplay.run.evaluation import pass_at_k_per_problem


def counts(pass1, passk=None, n_pass1=4, n_samples=8):
  out = {"n_pass1": n_pass1, "n_samples": n_samples if passk is not None else 0,
         "pass1_correct": np.asarray(pass1)}
  if passk is not None:
    out["passk_correct"] = np.asarray(passk)
  return out


def test_rows_list_the_prompts_once_and_pass1_only_points_are_a_prefix(tmp_path):
  log = eval_problems.ProblemLog(str(tmp_path))
  prompts = ["1+2=", "3+4=", "5+6="]
  log.write(0, 0.0, counts([4, 0, 1], [8, 0, 3]), prompts)
  log.write(2, 5.5, counts([3, 1]), prompts[:2])  # a pass@1-only point: the first 2 problems
  log.write(4, 11.0, counts([4, 2, 0], [7, 1, 0]), prompts)
  rows = eval_problems.read_rows(str(tmp_path))
  assert [r["step"] for r in rows] == [0, 2, 4]
  assert rows[0]["problems"] == prompts and all("problems" not in r for r in rows[1:])
  assert "passk_correct" not in rows[1] and rows[1]["n_samples"] == 0
  assert rows[2] == {"step": 4, "compute_seconds": 11.0, "n_pass1": 4, "n_samples": 8,
                     "pass1_correct": [4, 2, 0], "passk_correct": [7, 1, 0]}
  assert eval_problems.problem_prompts(rows) == prompts
  with pytest.raises(ValueError, match="2 prompts for 3"):
    log.write(6, 12.0, counts([1, 1, 1]), prompts[:2])


def test_a_later_row_with_more_problems_lists_them_all(tmp_path):
  log = eval_problems.ProblemLog(str(tmp_path))
  log.write(0, 0.0, counts([1]), ["a"])  # step 0 at a pass@1-only point: the subset
  log.write(3, 2.0, counts([1, 0, 1], [2, 0, 5]), ["a", "b", "c"])
  log.write(5, 4.0, counts([1, 1, 1], [3, 1, 5]), ["a", "b", "c"])
  rows = eval_problems.read_rows(str(tmp_path))
  assert [r.get("problems") for r in rows] == [["a"], ["a", "b", "c"], None]
  assert eval_problems.problem_prompts(rows) == ["a", "b", "c"]
  quiet = eval_problems.ProblemLog(str(tmp_path / "other"), enabled=False)  # process > 0
  assert quiet.write(0, 0.0, counts([1]), ["a"])["problems"] == ["a"]
  assert not (tmp_path / "other").exists()


def test_resume_drops_the_rows_after_the_resumed_step_and_a_fresh_run_starts_empty(tmp_path):
  workdir = str(tmp_path)
  log = eval_problems.ProblemLog(workdir)
  prompts = ["1+1=", "2+2="]
  for step in (0, 3, 6):
    log.write(step, float(step), counts([step % 4, 1], [step, 2]), prompts)
  with open(log.path, "a") as f:
    f.write('{"step": 9, "pass1_')  # a line cut by a crash
  resumed = eval_problems.ProblemLog(workdir, resume_step=4)
  assert [r["step"] for r in eval_problems.read_rows(workdir)] == [0, 3]
  resumed.write(6, 6.0, counts([2, 1], [6, 2]), prompts)  # the prompts are listed already
  rows = eval_problems.read_rows(workdir)
  assert [r["step"] for r in rows] == [0, 3, 6] and "problems" not in rows[2]
  with open(log.path) as f:
    assert all(json.loads(line) for line in f)  # the cut line is gone
  eval_problems.ProblemLog(workdir)  # a fresh run in the used workdir
  assert eval_problems.read_rows(workdir) == []
  fresh = eval_problems.ProblemLog(workdir, resume_step=0)  # resumed to before any row: relists
  fresh.write(1, 1.0, counts([0, 0]), prompts)
  assert eval_problems.read_rows(workdir)[0]["problems"] == prompts


def test_counts_give_back_the_pass_at_k_of_the_samples():
  rng = np.random.default_rng(0)
  correct = rng.random((40, 16)) < rng.random((40, 1))
  matrix = eval_problems.correct_matrix(correct.sum(axis=1), 16)
  assert matrix.shape == (40, 16) and (matrix.sum(axis=1) == correct.sum(axis=1)).all()
  for k in (1, 2, 4, 8, 16):
    np.testing.assert_array_equal(pass_at_k_per_problem(matrix, k),
                                  pass_at_k_per_problem(correct, k))
  assert evaluation.pass_at_k_array(matrix, (4,)) == evaluation.pass_at_k_array(correct, (4,))
