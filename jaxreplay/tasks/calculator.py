"""Scratchpad addition with a calculator tool: a multi-turn task where the turns matter.

The prompt is `tasks.scratchpad`'s ("4738+2956="), and so is the answer: the worked solution,
column by column. For any column the policy may call the calculator instead of writing the sum
itself: it writes the column "x+y+c" and "?", which ends its turn, and the environment answers
"=SS" (the two-digit sum; "=!!" for a malformed call) as the next observation; the policy goes on
from there (",next column" or ";result"). A turn that calls nothing ends the episode. E.g.,
observations in brackets:

  8+6+0?[=14],3+5+1=09,7+9+0?[=16],4+2+1=07;7694

The reward is 1.0 exactly when the transcript without its "?"s is the worked solution (every
column and the result right), else 0. The calculator is always right, so a policy that calls it
and uses its result (carries the sum's tens, writes its units into the result) gets the columns
right; a column it writes itself is right only when it knows that fact.

Tool-use correctness (`CalculatorEnv.metrics`, env/tool_correct): a call is correct when it is
the right column (the problem's digits of that column, the carry the transcript's previous column
implies) and its result is used (the next column's carry is the sum's tens, or for the last column
the result's leading digit; the result's digit of that column is the sum's units).

The warm-start demonstrations (`sft_examples`) use the tool imperfectly on purpose: the noisy
teacher of `scratchpad` (misremembered facts: `slip`) calls the tool on a column with probability
`tool_rate`, at random rather than where it is unsure, and with probability `ignore_rate` ignores
the result: it carries on from its own sum for that column, which is wrong exactly when it
misremembers the fact. RL has two things to learn: call the tool where it helps, and use what it
says.
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping, Optional, Sequence

import numpy as np

from jaxreplay.tasks import arithmetic
from jaxreplay.tasks import environments
from jaxreplay.tasks import scratchpad

CALL, ERROR = "?", "!!"


def calculator_output(expression: str) -> str:
  """The calculator's answer to "x+y+c" (non-negative integers whose sum is below 100): "=SS",
  two digits; "=!!" for anything else."""
  parts = expression.split("+")
  if len(parts) != 3 or not all(p.isdigit() and len(p) <= 2 for p in parts):
    return "=" + ERROR
  total = sum(int(p) for p in parts)
  return f"={total:02d}" if total < 100 else "=" + ERROR


def strip_calls(transcript: str) -> str:
  """The transcript as a worked solution: its calls' "?" removed ("8+6+0?=14" -> "8+6+0=14")."""
  return transcript.replace(CALL, "")


def calculator_reward(transcript: str, solution: str) -> float:
  """1.0 when the transcript without its calls' "?" is exactly `solution` (stripped), else 0."""
  return float(strip_calls(transcript).strip() == solution)


class Calculator:
  """The tool: a turn ending in "?" calls it on the column written since the last "," (or the
  turn's start)."""

  def parse(self, turn: str) -> Optional[str]:
    if not turn.endswith(CALL):
      return None
    return turn[:-1].rsplit(scratchpad.SEP, 1)[-1]

  def run(self, call: str) -> str:
    return calculator_output(call)


def _operands(problem) -> tuple[int, int]:
  a, b = problem.prompt.rstrip("=").split("+")
  return int(a), int(b)


def correct_calls(transcript: str, calls: Sequence[tuple[str, str]], problem) -> int:
  """How many of `calls` ((expression, output) in order) were correct (module docstring)."""
  a, b = _operands(problem)
  true_cols = scratchpad.column_sums(a, b)
  body, _, result = strip_calls(transcript).partition(scratchpad.RESULT)
  written = body.split(scratchpad.SEP)
  # The column of each call: the separators before its "?".
  columns, at = [], 0
  for _ in calls:
    at = transcript.index(CALL, at)
    columns.append(transcript[:at].count(scratchpad.SEP))
    at += 1

  def carry_in(i: int) -> Optional[int]:
    """The carry column i was written with (None when unreadable)."""
    try:
      return int(written[i].split("=")[0].split("+")[2])
    except (IndexError, ValueError):
      return None

  correct = 0
  for (expr, out), i in zip(calls, columns):
    if i >= len(true_cols) or out == "=" + ERROR:
      continue
    x, y, _, _ = true_cols[i]
    prev = 0 if i == 0 else _column_sum(written, i - 1)
    if prev is None or expr != f"{x}+{y}+{prev // 10}":
      continue
    s = int(out[1:])
    if i + 1 < len(true_cols):
      used_carry = carry_in(i + 1) == s // 10
    else:
      used_carry = len(result) == len(true_cols) + (s >= 10)
    digit_at = len(result) - 1 - i
    used_digit = 0 <= digit_at < len(result) and result[digit_at] == str(s % 10)
    correct += int(used_carry and used_digit)
  return correct


def _column_sum(written: Sequence[str], i: int) -> Optional[int]:
  try:
    return int(written[i].split("=")[1])
  except (IndexError, ValueError):
    return None


class CalculatorEnv(environments.ToolEnvironment):
  """The calculator environment of `CalculatorTask` (module docstring)."""

  tools = (Calculator(),)
  stop_texts = (CALL,)

  def score(self, transcript: str, problem) -> float:
    return calculator_reward(transcript, problem.answer)

  def metrics(self) -> Mapping[str, float]:
    transcript = "".join(self.transcript)
    try:
      correct = correct_calls(transcript, self.calls, self.problem)
    except (ValueError, IndexError):
      correct = 0
    return {"tool_calls": len(self.calls), "tool_correct": correct}


class CalculatorTask(scratchpad.ScratchpadAdditionTask):
  """`scratchpad`'s addition with the calculator environment (`make_env`); problems, the held-out
  split and answers are the scratchpad task's."""

  reward_fn = staticmethod(calculator_reward)

  @property
  def charset(self) -> str:
    return super().charset + CALL + ERROR[0]

  def make_env(self) -> CalculatorEnv:
    """A fresh environment (the run's `EnvSpec.factory`)."""
    return CalculatorEnv()

  def max_completion_tokens(self) -> int:
    """Tokens of the longest trajectory after the prompt: the worked solution with every column
    called (one "?" more per column) + eos."""
    return super().max_completion_tokens() + self.num_digits[1]

  def sft_examples(self, n: int, seed: Optional[int] = None, carry_drop: float = 0.0,
                   slip: float = 0.0, slip_range: tuple[float, float] = (0.4, 0.95),
                   tool_rate: float = 0.5, ignore_rate: float = 0.3
                   ) -> Iterator[tuple[str, list[tuple[str, bool]]]]:
    """`n` (prompt, segments) demonstrations: segments [(text, trained)] in order, the policy's
    (trained) and the calculator's answers (not trained); the caller appends eos to the last.

    slip, slip_range, carry_drop: the scratchpad teacher's noise (`ScratchpadAdditionTask.
      sft_examples`). tool_rate: probability of calling the calculator on a column.
    ignore_rate: probability that the teacher, having called it, carries on from its own sum.
    """
    for name, value in (("carry_drop", carry_drop), ("tool_rate", tool_rate),
                        ("ignore_rate", ignore_rate)):
      if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value} must be in [0, 1]")
    table = scratchpad.misconceptions(slip, tuple(slip_range), self.seed) if slip else {}
    base = self.seed if seed is None else seed
    rng = np.random.default_rng([base, 0x5F7])
    noise = np.random.default_rng([base, 0xCA1C])
    for _ in range(n):
      p = self._draw(rng, heldout=False)
      a, b = _operands(p)
      yield p.prompt, demonstration(a, b, table, noise, carry_drop, tool_rate, ignore_rate)


def demonstration(a: int, b: int, table: Mapping, noise: np.random.Generator, carry_drop: float,
                  tool_rate: float, ignore_rate: float) -> list[tuple[str, bool]]:
  """One noisy teacher trajectory of "a+b=" as segments [(text, trained)] (see `sft_examples`)."""
  da, db = str(a)[::-1], str(b)[::-1]
  segments: list[list[Any]] = [["", True]]
  carry, sums = 0, []
  for i in range(max(len(da), len(db))):
    x = int(da[i]) if i < len(da) else 0
    y = int(db[i]) if i < len(db) else 0
    c = 0 if carry and carry_drop and noise.random() < carry_drop else carry
    own = x + y + c
    if (x, y, c) in table and noise.random() < table[(x, y, c)][0]:
      own = table[(x, y, c)][1]
    prefix = scratchpad.SEP if i else ""
    if noise.random() < tool_rate:
      segments[-1][0] += f"{prefix}{x}+{y}+{c}{CALL}"
      segments.append([calculator_output(f"{x}+{y}+{c}"), False])
      segments.append(["", True])
      used = own if noise.random() < ignore_rate else x + y + c
    else:
      segments[-1][0] += f"{prefix}{x}+{y}+{c}={own:02d}"
      used = own
    sums.append(used)
    carry = used // 10
  digits = "".join(str(s % 10) for s in reversed(sums))
  segments[-1][0] += scratchpad.RESULT + ("1" if sums[-1] >= 10 else "") + digits
  return [(text, trained) for text, trained in segments if text or trained]


def reference_trajectory(problem: arithmetic.Problem) -> list[tuple[str, bool]]:
  """The clean trajectory that calls the calculator on every column and uses every result."""
  a, b = _operands(problem)
  return demonstration(a, b, {}, np.random.default_rng(0), 0.0, 1.0, 0.0)
