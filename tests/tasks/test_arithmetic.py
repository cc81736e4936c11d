"""The procedural arithmetic task (`tasks.arithmetic`): correct problems, the exact reward, the
deterministic disjoint split, SFT examples (and their dropped carries), digit ranges."""
import numpy as np
import pytest

from jaxreplay.tasks import arithmetic
from tests.helpers.deps import require

transformers = require("transformers")


def test_arithmetic_problems_are_correct():
  task = arithmetic.ArithmeticTask(num_digits=(1, 3), ops="+-*", seed=3)
  for p in task.sample(np.random.default_rng(0), 300):
    a, rest = p.prompt[:-1], p.prompt[-1]
    assert rest == "="
    assert str(eval(a)) == p.answer  # pylint: disable=eval-used
    assert int(p.answer) >= 0  # allow_negative=False orders subtraction operands
    assert p.id == arithmetic.problem_id(p.prompt)
    assert set(p.prompt + p.answer) <= set(task.charset)


def test_arithmetic_reward_is_exact():
  task = arithmetic.ArithmeticTask()
  p = arithmetic.Problem("12+7=", "19", 0)
  assert task.reward("19", p) == 1.0
  assert task.reward(" 19 \nsomething else", p) == 1.0  # up to the first newline, stripped
  for wrong in ["190", "1 9", "19.0", "", "\n19", "-19", "019", "9"]:
    assert task.reward(wrong, p) == 0.0, wrong
  scores = task.score_batch(["19", "18", "19\n"], [p, p, p])
  assert scores.dtype == np.float32
  np.testing.assert_array_equal(scores, [1.0, 0.0, 1.0])
  assert task.reward_metrics() == {"reward/calls": 3, "reward/errors": 0, "reward/timeouts": 0,
                                   "reward/memory_errors": 0, "reward/restarts": 0}
  task.close()


def test_arithmetic_splits_disjoint_and_deterministic():
  task = arithmetic.ArithmeticTask(num_digits=(1, 2), ops="+-", seed=0, heldout_fraction=0.2)
  evalset = task.eval_set(200)
  assert len({p.prompt for p in evalset}) == 200
  assert all(task.is_heldout(p) for p in evalset)
  train = task.sample(np.random.default_rng(1), 2000)
  assert not {p.prompt for p in train} & {p.prompt for p in evalset}
  assert not any(task.is_heldout(p) for p in train)
  # Same seed -> same eval set; the eval set does not depend on the training rng.
  assert arithmetic.ArithmeticTask(seed=0, heldout_fraction=0.2).eval_set(200) == evalset
  assert task.sample(np.random.default_rng(1), 50) == train[:50]
  assert task.sample(np.random.default_rng(2), 50) != train[:50]
  other = arithmetic.ArithmeticTask(seed=1, heldout_fraction=0.2).eval_set(200)
  assert {p.prompt for p in other} != {p.prompt for p in evalset}
  # The held-out share of the whole space is close to the fraction (space of 2 * 100^2 problems).
  prompts = [f"{a}{op}{b}=" for a in range(100) for b in range(100) for op in "+-"]
  share = np.mean([arithmetic.is_heldout(q, 0.2, 0) for q in prompts])
  assert abs(share - 0.2) < 0.01


def test_arithmetic_eval_set_too_small_and_bad_args():
  task = arithmetic.ArithmeticTask(num_digits=(1, 1), ops="+", heldout_fraction=0.05)
  assert task.num_problems == 100
  with pytest.raises(ValueError, match="distinct held-out problems"):
    task.eval_set(50)
  with pytest.raises(ValueError, match="ops"):
    arithmetic.ArithmeticTask(ops="/")
  with pytest.raises(ValueError, match="num_digits"):
    arithmetic.ArithmeticTask(num_digits=(3, 2))


def test_arithmetic_sft_examples():
  task = arithmetic.ArithmeticTask(num_digits=(2, 2), ops="+-*")
  pairs = list(task.sft_examples(100))
  assert len(pairs) == 100 and pairs == list(task.sft_examples(100))
  for prompt, target in pairs:
    assert str(eval(prompt[:-1])) == target  # pylint: disable=eval-used
    assert not arithmetic.is_heldout(prompt, task.heldout_fraction, task.seed)


def test_carry_free_sum_against_digitwise_reference():
  rng = np.random.default_rng(0)
  for a, b in [(47, 38), (57, 68), (50, 50), (12, 7), (0, 0), (99, 1), *rng.integers(0, 10**4, (200, 2))]:
    a, b = int(a), int(b)
    da, db = str(a).zfill(6), str(b).zfill(6)
    expect = str(int("".join(str((int(x) + int(y)) % 10) for x, y in zip(da, db))))
    assert arithmetic.carry_free_sum(a, b) == expect
    no_carry = all(int(x) + int(y) < 10 for x, y in zip(da, db))
    assert (arithmetic.carry_free_sum(a, b) == str(a + b)) == no_carry
  with pytest.raises(ValueError, match="non-negative"):
    arithmetic.carry_free_sum(-1, 2)


def test_arithmetic_sft_examples_carry_drop():
  task = arithmetic.ArithmeticTask(num_digits=(1, 2), ops="+")
  clean = list(task.sft_examples(3000, seed=1))
  noisy = list(task.sft_examples(3000, seed=1, carry_drop=0.5))
  assert [p for p, _ in clean] == [p for p, _ in noisy]          # same prompts, only targets differ
  carries = wrong = 0
  for (prompt, answer), (_, target) in zip(clean, noisy):
    a, b = (int(x) for x in prompt[:-1].split("+"))
    assert answer == str(a + b)
    has_carry = arithmetic.carry_free_sum(a, b) != answer
    carries += has_carry
    if target != answer:
      wrong += 1
      assert has_carry and target == arithmetic.carry_free_sum(a, b)
  assert 0.45 < wrong / carries < 0.55                            # binomial sd ~0.012 here
  assert all(t == a for (_, a), (_, t) in zip(clean, task.sft_examples(3000, seed=1, carry_drop=0.0)))
  with pytest.raises(ValueError, match="carry_drop"):
    next(task.sft_examples(1, carry_drop=1.5))


def test_digit_range_and_num_digits_5():
  assert arithmetic.digit_range(5) == (5, 5)
  assert arithmetic.digit_range((5,)) == (5, 5)  # what --config.task.num_digits=5 parses to
  assert arithmetic.digit_range([2, 4]) == (2, 4)
  assert arithmetic.digit_range(np.int64(3)) == (3, 3)
  for bad in (0, 19, (3, 2), (1, 2, 3), (), "5", 2.0, True, (1, 19)):
    with pytest.raises(ValueError, match=r"expected an int n .* 1 <= lo <= hi <= 18"):
      arithmetic.digit_range(bad)
  for num_digits in (5, (5,)):
    task = arithmetic.ArithmeticTask(num_digits=num_digits, ops="+-*")
    assert task.num_digits == (5, 5)
    for p in task.sample(np.random.default_rng(0), 50) + task.eval_set(10):
      a, b = (int(x) for x in p.prompt[:-1].replace("*", "+").replace("-", "+").split("+"))
      assert 10_000 <= min(a, b) and max(a, b) <= 99_999
    task.close()


def test_digit_decay_draws_digit_counts_geometrically():
  """task.digit_decay: P(d digits) ~ decay^(d - lo), exactly (chi-square against it; the uniform
  draw of digit_decay=1 is rejected), and 1.0 keeps the uniform draw's problems as they were."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  decay, (lo, hi) = 0.5, (1, 5)
  task = arithmetic.ArithmeticTask(num_digits=(lo, hi), ops="+", digit_decay=decay)
  rng = np.random.default_rng(0)
  digits = np.array([len(str(task._operand(rng))) for _ in range(20000)])  # pylint: disable=protected-access
  counts = np.bincount(digits, minlength=hi + 1)[lo:]
  want = decay ** np.arange(hi - lo + 1)
  want = want / want.sum() * counts.sum()
  assert stats.chisquare(counts, want).pvalue > 1e-3
  assert stats.chisquare(counts, np.full(hi - lo + 1, counts.sum() / (hi - lo + 1))).pvalue < 1e-9
  uniform = arithmetic.ArithmeticTask(num_digits=(lo, hi), ops="+")
  assert arithmetic.ArithmeticTask(num_digits=(lo, hi), ops="+", digit_decay=1.0).sample(
      np.random.default_rng(1), 30) == uniform.sample(np.random.default_rng(1), 30)
  with pytest.raises(ValueError, match="digit_decay"):
    arithmetic.ArithmeticTask(digit_decay=0.0)
