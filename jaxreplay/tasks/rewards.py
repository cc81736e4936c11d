"""Rewards: exact match, math-verify equivalence, and `SafeReward`, a time-limited runner.

A reward must never kill the run: `SafeReward` scores a crash, a timeout, a non-finite value or a
dead worker as 0 and counts it ("reward/calls", "reward/errors", "reward/timeouts",
"reward/restarts"). math-verify's own timeouts use SIGALRM, which only works in the main thread, and
our rollout workers score from other threads, so we call it with its timeouts off and enforce the
limit here: in a persistent child process that is killed and restarted on timeout (backend
"process", for sympy-heavy rewards), or in a daemon thread that is abandoned on timeout (backend
"thread", for cheap rewards such as exact match, where a hang cannot be interrupted but is cut off).
"""
from __future__ import annotations

import concurrent.futures
import logging
import math
import pickle
import queue
import threading
from typing import Any, Callable, Optional, Sequence

from absl import logging as absl_logging
import numpy as np

from jaxreplay.child_process import ChildDied, ChildProcess, ChildTimeout

_MATH_VERIFY_QUIET = False


def exact_match_reward(completion: str, answer: str) -> float:
  """1.0 when the completion's first line, stripped, equals `answer` stripped; else 0.0."""
  return float(completion.split("\n", 1)[0].strip() == answer.strip())


def _gold_text(answer: str) -> str:
  # math-verify extracts LaTeX from $...$ or \boxed{...}; datasets store bare answers ("\frac{1}{2}").
  if "$" in answer or "\\boxed" in answer:
    return answer
  return f"${answer}$"


def math_verify_reward(completion: str, answer: str) -> float:
  """1.0 when math-verify finds the completion's final answer equivalent to `answer`; else 0.0.

  `answer` is the reference (a bare expression such as "\\frac{1}{2}", or text with \\boxed{});
  the completion's answer is its boxed expression, else its last parseable expression. Runs with
  math-verify's signal timeouts disabled (works in any thread): wrap it in `SafeReward` for a time
  limit. Raises ValueError when the reference itself cannot be parsed (a data problem, counted as
  an error by SafeReward).
  """
  global _MATH_VERIFY_QUIET
  from math_verify import parse, verify
  if not _MATH_VERIFY_QUIET:
    # It warns once per process that its timeouts are off: we enforce them ourselves.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    _MATH_VERIFY_QUIET = True
  gold = parse(_gold_text(answer), parsing_timeout=None)
  if not gold:
    raise ValueError(f"math-verify could not parse the reference answer {answer[:200]!r}")
  pred = parse(completion, parsing_timeout=None)
  if not pred:
    return 0.0
  return float(verify(gold, pred, timeout_seconds=None))


# ---- worker slots: one call at a time, with a deadline ---------------------------------------

class _RewardServer:
  """What a reward child process serves: `score(*args)` -> float(fn(*args)).

  The warm-up call runs at start-up: first-call imports (sympy, ...) must not eat a scored call's
  time limit. Its errors are ignored (the scored calls report theirs).
  """

  def __init__(self, fn: Callable[..., float], warmup_args: Optional[tuple]):
    self._fn = fn
    if warmup_args is not None:
      try:
        fn(*warmup_args)
      except Exception:  # pylint: disable=broad-except
        pass

  def score(self, *args) -> float:
    return float(self._fn(*args))


class _ProcessSlot:
  """A persistent child process running `fn` (a `ChildProcess`, see there why not multiprocessing);
  killed on timeout or death, restarted on the next call. Calls answer (status, value) with status
  "ok", "error" or "timeout"."""

  def __init__(self, fn: Callable[..., float], warmup_args: Optional[tuple],
               start_timeout_s: float):
    self._args = (fn, warmup_args)
    self._start_timeout_s = start_timeout_s
    self._child: Optional[ChildProcess] = None
    self.starts = 0

  def _start(self) -> None:
    """Starts the child; raises RuntimeError when it does not come up."""
    self.starts += 1
    try:
      self._child = ChildProcess(f"{__name__}:_RewardServer", self._args,
                                 startup_timeout_s=self._start_timeout_s, name="reward worker")
    except TimeoutError as e:
      raise RuntimeError(str(e)) from e

  def alive(self) -> bool:
    return self._child is not None and self._child.is_alive()

  def call(self, args: tuple, timeout_s: float) -> tuple[str, Any]:
    if not self.alive():
      self.kill()
      try:
        self._start()
      except Exception as e:  # pylint: disable=broad-except
        return "error", str(e)
    try:
      return "ok", self._child.call("score", args, timeout_s)
    except ChildTimeout:
      self.kill()
      return "timeout", None
    except ChildDied as e:
      self.kill()
      return "error", str(e)
    except Exception as e:  # pylint: disable=broad-except
      return "error", repr(e)[:500]  # raised by fn in the child: the child keeps serving

  def kill(self) -> None:
    if self._child is not None:
      self._child.kill()
    self._child = None

  def close(self) -> None:
    if self._child is not None:
      self._child.close(timeout_s=1.0)
    self._child = None


class _ThreadSlot:
  """A daemon thread running `fn`; on timeout it is abandoned (it cannot be killed) and replaced."""

  def __init__(self, fn):
    self._fn = fn
    self.starts = 0
    self._spawn()

  def _spawn(self) -> None:
    self._in, self._out = queue.SimpleQueue(), queue.SimpleQueue()
    threading.Thread(target=self._loop, args=(self._in, self._out), daemon=True,
                     name="reward-thread").start()
    self.starts += 1

  def _loop(self, inq, outq) -> None:
    while True:
      args = inq.get()
      if args is None:
        return
      try:
        outq.put(("ok", float(self._fn(*args))))
      except Exception as e:  # pylint: disable=broad-except
        outq.put(("error", repr(e)[:500]))

  def call(self, args: tuple, timeout_s: float) -> tuple[str, Any]:
    self._in.put(args)
    try:
      return self._out.get(timeout=timeout_s)
    except queue.Empty:
      self._in.put(None)  # the stuck thread exits once its call returns, if ever
      self._spawn()
      return "timeout", None

  def close(self) -> None:
    self._in.put(None)


class SafeReward:
  """Runs `fn(*args) -> float` with a time limit; failures score 0.0 and are counted.

  Args:
    fn: the reward, e.g. `math_verify_reward(completion, answer)`. With backend "process" it must
      be picklable (a module-level function).
    timeout_s: limit per call, seconds of wall time.
    backend: "process" (killable child processes) or "thread" (daemon threads, for cheap rewards).
    num_workers: parallel slots; `score_batch` spreads a batch over them.
    warmup_args: arguments of one call each new worker process makes before accepting work.
    start_timeout_s: how long a starting child process may take.

  Thread-safe: several rollout threads may score at once (each call takes a free slot).
  """

  def __init__(self, fn: Callable[..., float], timeout_s: float = 5.0, backend: str = "process",
               num_workers: int = 1, warmup_args: Optional[tuple] = None,
               start_timeout_s: float = 120.0):
    if timeout_s <= 0:
      raise ValueError(f"timeout_s={timeout_s} must be > 0")
    if num_workers < 1:
      raise ValueError(f"num_workers={num_workers} must be >= 1")
    if backend == "process":
      if getattr(fn, "__module__", None) == "__main__":
        raise ValueError(f"backend='process' runs {fn!r} in a fresh interpreter, which cannot import "
                         "__main__: define it in an importable module, or use backend='thread'")
      try:
        pickle.dumps((fn, warmup_args))
      except Exception as e:  # pylint: disable=broad-except
        raise ValueError(f"backend='process' needs a picklable reward function (module-level), "
                         f"got {fn!r}: {e}; or use backend='thread'") from e
      self._slots = [_ProcessSlot(fn, warmup_args, start_timeout_s) for _ in range(num_workers)]
    elif backend == "thread":
      self._slots = [_ThreadSlot(fn) for _ in range(num_workers)]
    else:
      raise ValueError(f"backend={backend!r}; expected 'process' or 'thread'")
    self.fn, self.timeout_s, self.backend, self.num_workers = fn, timeout_s, backend, num_workers
    self._free: queue.Queue = queue.Queue()
    for slot in self._slots:
      self._free.put(slot)
    self._lock = threading.Lock()
    self._counts = {"reward/calls": 0, "reward/errors": 0, "reward/timeouts": 0}
    self._dispatch = (concurrent.futures.ThreadPoolExecutor(num_workers, "reward-dispatch")
                      if num_workers > 1 else None)
    self._closed = False

  def __call__(self, *args) -> float:
    """The reward of one call; 0.0 on error, timeout or a non-finite value."""
    if self._closed:
      raise RuntimeError("SafeReward is closed")
    slot = self._free.get()
    try:
      status, value = slot.call(args, self.timeout_s)
    finally:
      self._free.put(slot)
    if status == "ok" and not math.isfinite(value):
      status, value = "error", f"non-finite reward {value}"
    with self._lock:
      self._counts["reward/calls"] += 1
      if status == "timeout":
        self._counts["reward/timeouts"] += 1
      elif status != "ok":
        self._counts["reward/errors"] += 1
    if status == "ok":
      return value
    absl_logging.log_every_n_seconds(
        absl_logging.WARNING, "reward %s scored 0 (%s): %s", 30, getattr(self.fn, "__name__", "fn"),
        status, value if status != "timeout" else f"over {self.timeout_s} s")
    return 0.0

  def score_batch(self, completions: Sequence[str], targets: Sequence[Any]) -> np.ndarray:
    """float32 [N] rewards of `fn(completions[i], targets[i])`, spread over the workers."""
    if len(completions) != len(targets):
      raise ValueError(f"score_batch: {len(completions)} completions but {len(targets)} targets")
    if self._dispatch is None or len(completions) <= 1:
      out = [self(c, t) for c, t in zip(completions, targets)]
    else:
      out = list(self._dispatch.map(self, completions, targets))
    return np.asarray(out, dtype=np.float32).reshape(len(completions))

  def start(self) -> None:
    """Starts the child processes now (otherwise on first use)."""
    for slot in self._slots:
      if isinstance(slot, _ProcessSlot) and not slot.alive():
        slot.kill()
        slot._start()  # pylint: disable=protected-access

  @property
  def counts(self) -> dict[str, int]:
    """Cumulative counters: calls, errors, timeouts, and worker restarts (beyond the first start)."""
    with self._lock:
      counts = dict(self._counts)
    counts["reward/restarts"] = sum(max(s.starts - 1, 0) for s in self._slots)
    return counts

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    if self._dispatch is not None:
      self._dispatch.shutdown(wait=True)
    for slot in self._slots:
      slot.close()

  def __enter__(self) -> "SafeReward":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __del__(self):
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except
      pass


class SafeScoring:
  """The scoring half of the task interface, for a task holding a `SafeReward` in `self._safe`
  whose function takes (completion, answer)."""

  _safe: SafeReward

  def score_batch(self, completions: Sequence[str], problems: Sequence[Any]) -> np.ndarray:
    """float32 [N] time-limited rewards (errors and timeouts score 0 and are counted)."""
    return self._safe.score_batch(completions, [p.answer for p in problems])

  def reward_metrics(self) -> dict[str, int]:
    return self._safe.counts

  def close(self) -> None:
    self._safe.close()
