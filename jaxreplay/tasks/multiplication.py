"""Written multiplication by one digit: reasoning whose length varies several-fold between problems.

Prompt "4738*7=", completion (one column per digit of the multiplicand, right to left, each written
as "x*y+carry_in=value" with a two-digit value, then ";" and the result):

  8*7+0=56,3*7+5=26,7*7+2=51,4*7+5=33;33166

The multiplicand has `num_digits` digits (a (lo, hi) range, the count drawn uniformly, as
`arithmetic.ArithmeticTask` draws operands), the multiplier is one digit in 2..9 (times 0 and 1
teach nothing). A multiplicand of n digits gives a completion of 10 n or 10 n + 1 characters,
one token each with the character tokenizer: with num_digits (2, 6), 21 to 62 tokens with eos.

How it differs from `scratchpad` addition (the experiments' first task):
- Difficulty follows length: a problem is one multiplier applied to n digits, so its chance of
  being right falls geometrically with n, and n spans 2-6 digits rather than 2-4: short problems
  are right far more often than long ones, and a policy's errors on a long problem compound.
- Facts are seen at very different rates: a column fact is (x, y, carry_in), and the carries in
  of a multiplier y run over 0..y-1, so each of the 20 facts of y = 2 turns up in about 1/20 of
  its columns and each of the 90 of y = 9 in about 1/90 (addition's 200 facts are about equally
  common): the facts RL must fix range from common to rare, and a problem's difficulty depends on
  its multiplier as well as its length.

The reward is 1.0 exactly when the completion is the worked solution (every column, the carries
and the result right, nothing else), else 0.0: the intermediate steps are checked, a right result
after a wrong or malformed column scores 0. The held-out split is `arithmetic.is_heldout` of the
prompt (fixed by the task seed).

The supervised warm-start (`sft_examples`) imitates a student with misremembered facts: the
teacher misremembers a share of the 640 column facts (x, y, carry_in) with x, y in 2..9 (times 0
and 1 are never wrong) and carry_in in 0..9 (352 of them occur in right solutions, the others only
after a slip), each with its own slip probability, and for it writes the neighbouring table entry
(x +- 1) * y + carry_in with that probability, carrying on consistently (the next carry and the
result follow the written value).
"""
from __future__ import annotations

import hashlib
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from jaxreplay.tasks import arithmetic
from jaxreplay.tasks import scratchpad

SEP, RESULT = scratchpad.SEP, scratchpad.RESULT
MULTIPLIERS = tuple(range(2, 10))  # the one-digit multipliers drawn
TABLE = tuple(range(2, 10))        # digits x, y whose column facts the teacher may misremember
CARRIES = tuple(range(10))         # carries in of those facts (0..y-1 in right solutions, up to 9
                                   # after a slip)


def column_values(a: int, y: int) -> list[tuple[int, int, int, int]]:
  """The true columns of a * y, right to left: [(x, y, carry_in, x * y + carry_in)]."""
  return _columns(a, y, lambda x, c: x * y + c)


def _columns(a: int, y: int, write: Callable[[int, int], int]):
  """Columns right to left; `write(x, carry_in) -> written value` (a student's version of the
  column); the next carry is the written value // 10."""
  if a < 0 or not 1 <= y <= 9:
    raise ValueError(f"written multiplication needs a >= 0 and a digit y in 1..9, got {a}, {y}")
  cols, carry = [], 0
  for ch in str(a)[::-1]:
    x = int(ch)
    v = write(x, carry)
    if not 0 <= v <= 99:
      raise ValueError(f"a column value must lie in [0, 99], got {v}")
    cols.append((x, y, carry, v))
    carry = v // 10
  return cols


def render(cols: Sequence[tuple[int, int, int, int]]) -> str:
  """The worked solution text of columns [(x, y, carry_in, written value)] (right to left): the
  result is read off the written values (their last digits, then the last column's tens digit when
  nonzero), so a wrong value propagates to the result as a student's would."""
  body = SEP.join(f"{x}*{y}+{c}={v:02d}" for x, y, c, v in cols)
  digits = "".join(str(v % 10) for *_, v in reversed(cols))
  last = cols[-1][3]
  return body + RESULT + (str(last // 10) if last >= 10 else "") + digits


def worked_solution(a: int, y: int) -> str:
  """The canonical completion of "a*y=" (see the module docstring)."""
  return render(column_values(a, y))


# The same result marker and exact-match reward as the scratchpad's written method.
final_answer = scratchpad.final_answer
multiplication_reward = scratchpad.scratchpad_reward


def _unit(*key) -> float:
  """A deterministic number in [0, 1) from `key` (blake2b; the same in every process)."""
  h = hashlib.blake2b(repr(("multiplication",) + key).encode(), digest_size=8).digest()
  return int.from_bytes(h, "little") / 2.0 ** 64


def misconceptions(share: float, slip_range: tuple[float, float], seed: int
                   ) -> dict[tuple[int, int, int], tuple[float, int]]:
  """The noisy teacher's misremembered facts: {(x, y, carry_in): (slip probability, wrong value)}.

  Each of the 640 column facts x * y + carry_in (x, y in `TABLE`, carry_in in `CARRIES`) is
  misremembered with probability `share`; its slip probability is uniform in `slip_range` and its
  wrong value is the neighbouring table entry (x + 1) * y + carry_in or (x - 1) * y + carry_in,
  each with probability 1/2. Fixed by `seed`.
  """
  lo, hi = slip_range
  if not 0.0 <= share <= 1.0:
    raise ValueError(f"slip={share} must be in [0, 1]")
  if not 0.0 <= lo <= hi <= 1.0:
    raise ValueError(f"slip_range={slip_range} must be (lo, hi) with 0 <= lo <= hi <= 1")
  table = {}
  for x in TABLE:
    for y in TABLE:
      for c in CARRIES:
        if _unit(seed, "share", x, y, c) >= share:
          continue
        step = 1 if _unit(seed, "dir", x, y, c) < 0.5 else -1
        table[(x, y, c)] = (lo + (hi - lo) * _unit(seed, "p", x, y, c), (x + step) * y + c)
  return table


class WrittenMultiplicationTask(arithmetic.ArithmeticTask):
  """Problems "a*y=" (a of `num_digits` digits, y in 2..9) answered with a worked column-by-column
  solution (module docstring); `Problem.answer` is that solution text.

  Args:
    num_digits: (min, max) digits of the multiplicand, the count drawn uniformly.
    seed: fixes the held-out split, the eval set and the noisy teacher's misconceptions.
    heldout_fraction: share of all problems reserved for evaluation.
    reward_timeout_s: time limit of one reward call in `score_batch`.
  """

  reward_fn = staticmethod(multiplication_reward)

  def __init__(self, num_digits: tuple[int, int] = (2, 6), seed: int = 0,
               heldout_fraction: float = 0.1, reward_timeout_s: float = 1.0):
    super().__init__(num_digits=num_digits, ops="*", seed=seed, heldout_fraction=heldout_fraction,
                     reward_timeout_s=reward_timeout_s)

  @property
  def charset(self) -> str:
    return "0123456789*+=" + SEP + RESULT

  @property
  def num_problems(self) -> int:
    """Size of the problem space (train + held-out): multiplicands times multipliers."""
    per_operand = sum(10 if d == 1 else 9 * 10 ** (d - 1)
                      for d in range(self.num_digits[0], self.num_digits[1] + 1))
    return per_operand * len(MULTIPLIERS)

  def longest_prompts(self) -> list[str]:
    """The longest prompt ("999999*9=" for 6 digits): no prompt has more characters."""
    return [f"{'9' * self.num_digits[1]}*9="]

  def max_completion_tokens(self) -> int:
    """Tokens of the longest completion with the character tokenizer: the longest worked solution
    (n columns of 8 characters, n - 1 separators, ";", a result of n + 1 digits) + eos."""
    n = self.num_digits[1]
    return 8 * n + (n - 1) + 1 + (n + 1) + 1

  def _make(self, a: int, op: str, b: int) -> arithmetic.Problem:
    del op  # always "*"
    prompt = f"{a}*{b}="
    return arithmetic.Problem(prompt=prompt, answer=worked_solution(a, b),
                              id=arithmetic.problem_id(prompt))

  def _draw(self, rng: np.random.Generator, heldout: bool) -> arithmetic.Problem:
    # Rejection sampling on the split, as `ArithmeticTask._draw`, with a one-digit multiplier.
    for _ in range(100_000):
      y = MULTIPLIERS[int(rng.integers(len(MULTIPLIERS)))]
      p = self._make(self._operand(rng), "*", y)
      if arithmetic.is_heldout(p.prompt, self.heldout_fraction, self.seed) == heldout:
        return p
    raise ValueError(f"could not draw a {'held-out' if heldout else 'training'} problem in 100000 "
                     f"tries: the problem space ({self.num_problems}) is too small; widen "
                     "num_digits or change heldout_fraction")

  def sft_examples(self, n: int, seed: Optional[int] = None, slip: float = 0.0,
                   slip_range: tuple[float, float] = (0.4, 0.95)) -> Iterator[tuple[str, str]]:
    """`n` (prompt, worked solution) training pairs for a supervised warm-start (the caller
    appends eos), drawn from the training split.

    slip: share of the 640 column facts the teacher misremembers (`misconceptions`, fixed by the
      task seed); on a column whose fact is misremembered it writes the wrong value with that
      fact's slip probability (uniform in `slip_range`), and carries on from the written value.
      With slip 0 the targets are the task's exact answers.
    """
    table = misconceptions(slip, tuple(slip_range), self.seed) if slip else {}
    rng = np.random.default_rng([self.seed if seed is None else seed, 0x5F7])
    noise = np.random.default_rng([self.seed if seed is None else seed, 0x511F])

    for _ in range(n):
      p = self._draw(rng, heldout=False)
      if not table:
        yield p.prompt, p.answer
        continue
      a, y = (int(v) for v in p.prompt[:-1].split("*"))

      def write(x, c, y=y):
        if (x, y, c) in table:
          prob, wrong = table[(x, y, c)]
          if noise.random() < prob:
            return wrong
        return x * y + c

      yield p.prompt, render(_columns(a, y, write))
