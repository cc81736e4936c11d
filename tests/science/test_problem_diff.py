"""`science.problem_diff`: the per-problem comparison of two runs' eval_problems.jsonl (which
problems one run solves at the end and the other does not, by start count and kind)."""
import numpy as np
import pytest

from jaxreplay.run import eval_problems
from jaxreplay.science import problem_diff
from jaxreplay.tasks import scratchpad

PROMPTS = ["12+34=", "95+17=", "999+1=", "50+50="]


def write_run(workdir, start, end, n=8):
  log = eval_problems.ProblemLog(str(workdir))
  log.write(0, 0.0, {"n_pass1": 1, "n_samples": n, "pass1_correct": [0] * 4,
                     "passk_correct": start}, PROMPTS)
  log.write(5, 10.0, {"n_pass1": 1, "n_samples": 0, "pass1_correct": [1] * 4}, PROMPTS)
  log.write(9, 20.0, {"n_pass1": 1, "n_samples": n, "pass1_correct": [1] * 4,
                      "passk_correct": end}, PROMPTS)


def test_kind_counts_carries_and_the_teachers_misremembered_columns():
  table = scratchpad.misconceptions(**problem_diff.TEACHER)
  k = problem_diff.kind("95+17=")
  cols = scratchpad.column_sums(95, 17)  # 5+7+0=12, 9+1+1=11: two carries
  slips = [table[c[:3]][0] for c in cols if c[:3] in table]
  assert k == {"digits": 2, "carries": 2, "misremembered": len(slips),
               "teacher_p": pytest.approx(np.prod([1 - p for p in slips]))}
  assert problem_diff.kind("999+1=")["carries"] == 3 and problem_diff.kind("x") == {}
  assert [problem_diff.bin_of(c) for c in (0, 1, 3, 7, 15, 31, 32)] == [
      "0", "1", "2-3", "4-7", "8-15", "16-31", ">=32"]


def test_the_runs_compared_from_their_first_and_last_pass_at_k_rows(tmp_path, capsys):
  write_run(tmp_path / "a", start=[1, 0, 8, 3], end=[2, 0, 8, 0])
  write_run(tmp_path / "b", start=[1, 0, 8, 3], end=[0, 1, 8, 0])
  prompts, a = problem_diff.load(str(tmp_path / "a"))
  assert prompts == PROMPTS and a.steps == (0, 9) and a.n == 8
  np.testing.assert_array_equal(a.end, [2, 0, 8, 0])
  assert problem_diff.main([str(tmp_path / "a"), str(tmp_path / "b"), "--names=on,ad"]) == 0
  text = capsys.readouterr().out
  assert "solved at the end (some sample right): on 2, ad 2; at the start 3 / 3" in text
  assert "solved by on only at the end: 1" in text and "| 12+34= | 2 | 0 |" in text
  assert "solved by ad only at the end: 1" in text and "| 95+17= | 2 | 2 |" in text
  # start count 1: 12+34= (on solves it, ad lost it); 2-3: 50+50= (both lost it)
  assert "| 1 | 1 | 1.00 | 1 | 0 | 0 | 1 | 1 | 0 |" in text
  assert "| 2-3 | 1 | 3.00 | 0 | 0 | 1 | 1 | 0 | 0 |" in text
  assert "| 0 | 1 | 0.00 | 0 | 1 | 0 | 0 | 0 | 1 |" in text  # 95+17=: ad only, from 0
  bins = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| ")]
  assert bins[bins.index("| start count"):][1:5] == ["| 0", "| 1", "| 2-3", "| 8-15"]


def test_bad_input_fails_with_one_line(tmp_path):
  with pytest.raises(SystemExit):
    problem_diff.main([str(tmp_path), str(tmp_path)])
  log = eval_problems.ProblemLog(str(tmp_path / "p1"))
  log.write(0, 0.0, {"n_pass1": 1, "n_samples": 0, "pass1_correct": [1]}, ["1+1="])
  with pytest.raises(ValueError, match="no evaluation with pass@k"):
    problem_diff.load(str(tmp_path / "p1"))
  a = problem_diff.Counts(np.zeros(2, int), np.zeros(2, int), (0, 1), 4)
  b = problem_diff.Counts(np.zeros(3, int), np.zeros(3, int), (0, 1), 4)
  with pytest.raises(ValueError, match="different problems"):
    problem_diff.report(PROMPTS, a, b)
