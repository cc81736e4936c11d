"""Multi-digit addition with a written scratchpad: completions of tens of tokens, an exact reward.

Prompt "4738+2956=", completion (one column per digit, right to left, each written as
"x+y+carry_in=sum" with a two-digit sum, then ";" and the result):

  8+6+0=14,3+5+1=09,7+9+0=16,4+2+1=07;7694

A shorter operand is padded with 0 digits ("473+2956=" -> "3+6+0=09,7+5+0=12,4+9+1=14,0+2+1=03;
3429"); a final carry becomes the leading digit of the result. With operands of d digits a
completion has 10 d + (0 or 1) characters, one token each with the character tokenizer (+ eos).

The reward is 1.0 exactly when the completion is this worked solution (every column and the
result right, nothing else), else 0.0: a right result after a wrong or malformed scratchpad scores
0. The held-out split is `arithmetic.is_heldout` of the prompt (fixed by the task seed).

The supervised warm-start (`sft_examples`) can imitate a student with misremembered addition
facts: the teacher misremembers a fixed share of the 200 column facts (x, y, carry_in), each with
its own slip probability, and writes sum +-1 for it with that probability, carrying on consistently
(the next carry and the result follow the written sum). A policy trained on it is right on the
problems that avoid its strongest misconceptions; RL with the exact-match reward has many separate
facts to fix, the rare and strongly held ones slowly, so held-out accuracy keeps rising for a long
time instead of jumping once.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from jaxreplay.tasks import arithmetic

SEP, RESULT = ",", ";"


def column_sums(a: int, b: int) -> list[tuple[int, int, int, int]]:
  """The true columns of a + b, right to left: [(x, y, carry_in, x + y + carry_in)]."""
  return _columns(a, b, lambda x, y, c: (c, x + y + c))


def _columns(a: int, b: int, write: Callable[[int, int, int], tuple[int, int]]):
  """Columns right to left; `write(x, y, carry) -> (written carry_in, written sum)` (a student's
  version of the column); the next carry is the written sum // 10."""
  if a < 0 or b < 0:
    raise ValueError(f"scratchpad addition needs non-negative operands, got {a}, {b}")
  da, db = str(a)[::-1], str(b)[::-1]
  cols, carry = [], 0
  for i in range(max(len(da), len(db))):
    x = int(da[i]) if i < len(da) else 0
    y = int(db[i]) if i < len(db) else 0
    c, s = write(x, y, carry)
    if not 0 <= s <= 19:
      raise ValueError(f"a column sum must lie in [0, 19], got {s}")
    cols.append((x, y, c, s))
    carry = s // 10
  return cols


def render(cols: Sequence[tuple[int, int, int, int]]) -> str:
  """The worked solution text of columns [(x, y, carry_in, written_sum)] (right to left): the
  result is read off the written sums (their last digits, then a final carry), so a wrong sum
  propagates to the result as a student's would."""
  body = SEP.join(f"{x}+{y}+{c}={s:02d}" for x, y, c, s in cols)
  digits = "".join(str(s % 10) for *_, s in reversed(cols))
  result = ("1" if cols[-1][3] >= 10 else "") + digits
  return body + RESULT + result


def worked_solution(a: int, b: int) -> str:
  """The canonical completion of "a+b=" (see the module docstring)."""
  return render(column_sums(a, b))


def final_answer(completion: str) -> Optional[str]:
  """The result after the last ";" of a completion, or None when there is none."""
  if RESULT not in completion:
    return None
  return completion.rsplit(RESULT, 1)[1].strip()


def scratchpad_reward(completion: str, solution: str) -> float:
  """1.0 when `completion`, stripped of surrounding whitespace, is exactly `solution` (the worked
  solution: every column and the result); else 0.0."""
  return float(completion.strip() == solution)


def _unit(*key) -> float:
  """A deterministic number in [0, 1) from `key` (blake2b; the same in every process)."""
  h = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
  return int.from_bytes(h, "little") / 2.0 ** 64


def misconceptions(share: float, slip_range: tuple[float, float], seed: int
                   ) -> dict[tuple[int, int, int], tuple[float, int]]:
  """The noisy teacher's misremembered facts: {(x, y, carry_in): (slip probability, wrong sum)}.

  Each of the 200 facts is misremembered with probability `share`; its slip probability is uniform
  in `slip_range` and its wrong sum is the true sum + 1 or - 1 (kept in [0, 19]). Fixed by `seed`.
  """
  lo, hi = slip_range
  if not 0.0 <= share <= 1.0:
    raise ValueError(f"slip={share} must be in [0, 1]")
  if not 0.0 <= lo <= hi <= 1.0:
    raise ValueError(f"slip_range={slip_range} must be (lo, hi) with 0 <= lo <= hi <= 1")
  table = {}
  for x in range(10):
    for y in range(10):
      for c in range(2):
        if _unit(seed, "share", x, y, c) >= share:
          continue
        s = x + y + c
        step = 1 if _unit(seed, "dir", x, y, c) < 0.5 else -1
        wrong = s + step if 0 <= s + step <= 19 else s - step
        table[(x, y, c)] = (lo + (hi - lo) * _unit(seed, "p", x, y, c), wrong)
  return table


class ScratchpadAdditionTask(arithmetic.ArithmeticTask):
  """Problems "a+b=" (operands of `num_digits` digits, a (lo, hi) range) answered with a worked
  column-by-column solution (module docstring); `Problem.answer` is that solution text.

  Args:
    num_digits: (min, max) digits per operand, each operand's count drawn uniformly (or with a
      geometric tail: `digit_decay` < 1, see `ArithmeticTask`).
    seed: fixes the held-out split, the eval set and the noisy teacher's misconceptions.
    heldout_fraction: share of all problems reserved for evaluation.
    reward_timeout_s: time limit of one reward call in `score_batch`.
  """

  reward_fn = staticmethod(scratchpad_reward)

  def __init__(self, num_digits: tuple[int, int] = (3, 5), seed: int = 0,
               heldout_fraction: float = 0.1, reward_timeout_s: float = 1.0,
               digit_decay: float = 1.0):
    super().__init__(num_digits=num_digits, ops="+", seed=seed, heldout_fraction=heldout_fraction,
                     reward_timeout_s=reward_timeout_s, digit_decay=digit_decay)

  @property
  def charset(self) -> str:
    return "0123456789+=" + SEP + RESULT

  def max_completion_tokens(self) -> int:
    """Tokens of the longest completion with the character tokenizer: the longest worked solution
    (d columns of 8 characters, d - 1 separators, ";", a result of d + 1 digits) + eos."""
    d = self.num_digits[1]
    return 8 * d + (d - 1) + 1 + (d + 1) + 1

  def _make(self, a: int, op: str, b: int) -> arithmetic.Problem:
    prompt = f"{a}+{b}="
    return arithmetic.Problem(prompt=prompt, answer=worked_solution(a, b),
                              id=arithmetic.problem_id(prompt))

  def sft_examples(self, n: int, seed: Optional[int] = None, carry_drop: float = 0.0,
                   slip: float = 0.0, slip_range: tuple[float, float] = (0.4, 0.95)
                   ) -> Iterator[tuple[str, str]]:
    """`n` (prompt, worked solution) training pairs for a supervised warm-start (the caller
    appends eos), drawn from the training split.

    slip: share of the 200 column facts the teacher misremembers (`misconceptions`, fixed by the
      task seed); on a column with a misremembered fact it writes the wrong sum with that fact's
      slip probability (uniform in `slip_range`), and carries on from the written sum.
    carry_drop: probability that the teacher forgets a carry (writes carry_in 0 in the next
      column) after a column whose written sum is >= 10.
    With both 0 the targets are the task's exact answers.
    """
    if not 0.0 <= carry_drop <= 1.0:
      raise ValueError(f"carry_drop={carry_drop} must be in [0, 1]")
    table = misconceptions(slip, tuple(slip_range), self.seed) if slip else {}
    rng = np.random.default_rng([self.seed if seed is None else seed, 0x5F7])
    noise = np.random.default_rng([self.seed if seed is None else seed, 0x511F])

    def write(x, y, c):
      if c and carry_drop and noise.random() < carry_drop:
        c = 0  # the carry is forgotten
      if (x, y, c) in table:
        p, wrong = table[(x, y, c)]
        if noise.random() < p:
          return c, wrong
      return c, x + y + c

    for _ in range(n):
      p = self._draw(rng, heldout=False)
      if not (slip or carry_drop):
        yield p.prompt, p.answer
        continue
      a, b = (int(v) for v in p.prompt[:-1].split("+"))
      yield p.prompt, render(_columns(a, b, write))
