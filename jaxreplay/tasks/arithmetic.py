"""A procedural task family: multi-digit arithmetic ("12+7=" -> "19") with an exact-match reward.

It is the tiny default task and the test task: no files, any size, a deterministic held-out split.
The split is fixed by the problem text (a hash) and `seed`, not by the training seed, so runs with
different training seeds evaluate on the same held-out problems.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Iterator, Optional

import numpy as np

from jaxreplay.tasks import rewards as rewards_lib

_OPS = "+-*"


@dataclasses.dataclass(frozen=True)
class Problem:
  """One task instance. `prompt` is the text the policy sees, `answer` the reference answer,
  `id` a stable 63-bit identifier derived from the prompt."""
  prompt: str
  answer: str
  id: int


def problem_id(text: str) -> int:
  """A stable non-negative 63-bit id of `text` (blake2b; the same in every process and run)."""
  return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little") >> 1


def is_heldout(text: str, heldout_fraction: float, seed: int = 0) -> bool:
  """Whether `text` belongs to the held-out split: a hash of (seed, text) below the fraction."""
  h = problem_id(f"{seed}\x00{text}")
  return (h % 1_000_003) < heldout_fraction * 1_000_003


MAX_DIGITS = 18  # operands stay below 10^18 (int64, and exact in numpy's integer draws)


def digit_range(num_digits) -> tuple[int, int]:
  """(lo, hi) digits per operand from `num_digits`: an int n (or a 1-tuple (n,), which is what
  `--config.task.num_digits=5` parses to) -> (n, n); a pair (lo, hi) -> (lo, hi).

  Raises ValueError unless 1 <= lo <= hi <= MAX_DIGITS, naming the accepted forms.
  """
  if isinstance(num_digits, (int, np.integer)) and not isinstance(num_digits, bool):
    pair = (num_digits, num_digits)
  else:
    try:
      pair = tuple(num_digits)
    except TypeError:
      pair = ()
    if len(pair) == 1:
      pair = (pair[0], pair[0])
  if (len(pair) != 2 or
      not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in pair) or
      not 1 <= pair[0] <= pair[1] <= MAX_DIGITS):
    raise ValueError(f"num_digits={num_digits!r}: expected an int n (operands of n digits) or a "
                     f"pair (lo, hi) with 1 <= lo <= hi <= {MAX_DIGITS}, e.g. 5 or (1, 5)")
  return int(pair[0]), int(pair[1])


def carry_free_sum(a: int, b: int) -> str:
  """a + b with every carry dropped (digit-wise sums mod 10), as text: carry_free_sum(47, 38) = "75",
  carry_free_sum(57, 68) = "15". Equal to str(a + b) exactly when the addition has no carry."""
  if a < 0 or b < 0:
    raise ValueError(f"carry_free_sum needs non-negative operands, got {a}, {b}")
  digits, place = 0, 1
  while a or b:
    digits += ((a % 10 + b % 10) % 10) * place
    a, b, place = a // 10, b // 10, place * 10
  return str(digits)


class ArithmeticTask(rewards_lib.SafeScoring):
  """Problems "a<op>b=" with each operand of `num_digits` digits (a (lo, hi) range, inclusive).

  Args:
    num_digits: (min, max) digits per operand, or an int n for (n, n) (`digit_range`); a one-digit
      operand is 0..9, a d-digit one 10^(d-1)..10^d-1.
    ops: operators drawn uniformly, a subset of "+-*".
    seed: fixes the held-out split and the eval set (keep it fixed across training seeds).
    heldout_fraction: share of all problems reserved for evaluation (never sampled for training).
    allow_negative: when False, subtraction orders its operands so that answers are >= 0.
    reward_timeout_s: time limit of one reward call in `score_batch`.
    digit_decay: each operand's digit count d is drawn with P(d) proportional to
      digit_decay^(d - lo): 1.0 (default) is uniform over the range, < 1 a geometric tail of
      long operands (long-tailed completion lengths for `ScratchpadAdditionTask`).

  Interface shared with `MathTask`: `sample(rng, n)`, `eval_set(n)`, `reward(completion, problem)`,
  `score_batch(completions, problems)`, `reward_metrics()`, `charset`, `close()`.
  """

  # The (completion, answer) -> float reward run by `score_batch` (module-level: picklable).
  reward_fn = staticmethod(rewards_lib.exact_match_reward)

  def __init__(self, num_digits: tuple[int, int] = (1, 2), ops: str = "+-", seed: int = 0,
               heldout_fraction: float = 0.1, allow_negative: bool = False,
               reward_timeout_s: float = 1.0, digit_decay: float = 1.0):
    lo, hi = digit_range(num_digits)
    if not digit_decay > 0:
      raise ValueError(f"digit_decay={digit_decay} must be > 0 (1 = uniform digit counts)")
    self.digit_decay = float(digit_decay)
    weights = self.digit_decay ** np.arange(hi - lo + 1, dtype=np.float64)
    self._digit_cdf = np.cumsum(weights / weights.sum())
    if not ops or any(o not in _OPS for o in ops):
      raise ValueError(f"ops={ops!r} must be a non-empty subset of {_OPS!r}")
    if not 0.0 < heldout_fraction < 1.0:
      raise ValueError(f"heldout_fraction={heldout_fraction} must be in (0, 1)")
    self.num_digits = (lo, hi)
    self.ops = "".join(dict.fromkeys(ops))
    self.seed = seed
    self.heldout_fraction = heldout_fraction
    self.allow_negative = allow_negative
    self._safe = rewards_lib.SafeReward(self.reward_fn, timeout_s=reward_timeout_s,
                                        backend="thread")

  @property
  def charset(self) -> str:
    """Every character a prompt or answer may contain (for `build_char_tokenizer`)."""
    return "0123456789" + _OPS + "= \n"

  @property
  def num_problems(self) -> int:
    """Size of the whole problem space (train + held-out), counting ordered operand pairs."""
    per_operand = sum(10 if d == 1 else 9 * 10 ** (d - 1)
                      for d in range(self.num_digits[0], self.num_digits[1] + 1))
    return per_operand ** 2 * len(self.ops)

  def longest_prompts(self) -> list[str]:
    """The longest prompt of each operator (both operands of max digits, e.g. "99999+99999="): no
    prompt of this task has more characters, so with a character tokenizer none has more tokens.
    What `prompt_check` checks against the context instead of sampling."""
    nines = "9" * self.num_digits[1]
    return [self._make(int(nines), op, int(nines)).prompt for op in self.ops]

  def _operand(self, rng: np.random.Generator) -> int:
    if self.digit_decay == 1.0:
      d = int(rng.integers(self.num_digits[0], self.num_digits[1] + 1))
    else:  # one uniform draw through the digit counts' CDF
      d = self.num_digits[0] + int(np.searchsorted(self._digit_cdf, rng.random(), side="right"))
      d = min(d, self.num_digits[1])
    low = 0 if d == 1 else 10 ** (d - 1)
    return int(rng.integers(low, 10 ** d))

  def _make(self, a: int, op: str, b: int) -> Problem:
    if op == "-" and not self.allow_negative and a < b:
      a, b = b, a
    prompt = f"{a}{op}{b}="
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return Problem(prompt=prompt, answer=str(value), id=problem_id(prompt))

  def _draw(self, rng: np.random.Generator, heldout: bool) -> Problem:
    # Rejection sampling; the held-out share is >= heldout_fraction of the space in expectation,
    # so this ends quickly unless the space is tiny (checked by eval_set).
    for _ in range(100_000):
      op = self.ops[int(rng.integers(len(self.ops)))]
      p = self._make(self._operand(rng), op, self._operand(rng))
      if is_heldout(p.prompt, self.heldout_fraction, self.seed) == heldout:
        return p
    raise ValueError(f"could not draw a {'held-out' if heldout else 'training'} problem in 100000 "
                     f"tries: the problem space ({self.num_problems}) is too small; widen "
                     "num_digits or change heldout_fraction")

  def is_heldout(self, problem: Problem) -> bool:
    return is_heldout(problem.prompt, self.heldout_fraction, self.seed)

  def sample(self, rng: np.random.Generator, n: int) -> list[Problem]:
    """`n` training problems (never held-out ones), drawn with replacement using `rng`."""
    return [self._draw(rng, heldout=False) for _ in range(n)]

  def eval_set(self, n: int) -> list[Problem]:
    """The first `n` distinct held-out problems of this task's fixed eval sequence."""
    rng = np.random.default_rng([self.seed, 0x5EED])
    seen: dict[str, Problem] = {}
    for _ in range(10 * n + 200):
      if len(seen) == n:
        break
      p = self._draw(rng, heldout=True)
      seen.setdefault(p.prompt, p)
    if len(seen) < n:
      raise ValueError(f"eval_set({n}): found only {len(seen)} distinct held-out problems (space "
                       f"of {self.num_problems}, heldout_fraction={self.heldout_fraction}); ask "
                       "for fewer or widen num_digits")
    return list(seen.values())

  def sft_examples(self, n: int, seed: Optional[int] = None,
                   carry_drop: float = 0.0) -> Iterator[tuple[str, str]]:
    """`n` (prompt, target) training pairs for a supervised warm-start (target = the answer; the
    caller appends the eos token).

    carry_drop: probability that an addition whose answer needs a carry is demonstrated with the
      classic error of dropping every carry (`carry_free_sum`, e.g. "47+38=" -> "75"): noisy
      demonstrations give a policy that is sometimes right, which RL with the exact-match reward
      then corrects. Other operators are unaffected.
    """
    if not 0.0 <= carry_drop <= 1.0:
      raise ValueError(f"carry_drop={carry_drop} must be in [0, 1]")
    rng = np.random.default_rng([self.seed if seed is None else seed, 0x5F7])
    noise = np.random.default_rng([self.seed if seed is None else seed, 0xCA77])
    for _ in range(n):
      p = self._draw(rng, heldout=False)
      answer = p.answer
      if carry_drop > 0 and "+" in p.prompt:
        a, b = (int(x) for x in p.prompt.rstrip("=").split("+"))
        wrong = carry_free_sum(a, b)
        if wrong != answer and noise.random() < carry_drop:
          answer = wrong
      yield p.prompt, answer

  def reward(self, completion: str, problem: Problem) -> float:
    """1.0 when the completion's first line, stripped, is exactly the answer; else 0.0."""
    return self.reward_fn(completion, problem.answer)
