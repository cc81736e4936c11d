"""Tests of the rewards: exact match, math-verify, and SafeReward's time limit and error counting.

The process-backend reward functions live at module level: the worker process imports this module.
"""
import logging
import os
import threading
import time

import numpy as np
import pytest

from jaxreplay.config import validation
from jaxreplay.tasks import arithmetic, math_data, rewards
from tests.helpers.deps import require

require("math_verify")


def behave(completion, answer):
  """A reward that misbehaves on request: sleeps, raises, kills its process or returns nan."""
  if completion == "sleep":
    time.sleep(60)
  if completion == "crash":
    raise RuntimeError("reward crashed")
  if completion == "die":
    os._exit(3)  # pylint: disable=protected-access
  if completion == "nan":
    return float("nan")
  if completion == "pid":
    return float(os.getpid())
  if completion == "spin":
    while True:  # a CPU-bound hang (no sleep to interrupt)
      pass
  if completion == "alloc":
    return float(len(bytearray(4 << 30)))  # one 4 GiB allocation (lazily zeroed: cheap if allowed)
  if completion == "grow":
    chunks = []
    while True:  # touched memory, 64 MiB at a time: what a runaway sympy evaluation does
      chunks.append(b"x" * (64 << 20))
  if completion == "big_int":
    return float(2 ** (2 ** 34) % 7)  # 2 GiB of digits (CPython raises MemoryError past the limit)
  return rewards.exact_match_reward(completion, answer)


def test_exact_match_reward():
  assert rewards.exact_match_reward("42", "42") == 1.0
  assert rewards.exact_match_reward("  42 \n junk", " 42") == 1.0
  assert rewards.exact_match_reward("42.0", "42") == 0.0
  assert rewards.exact_match_reward("", "42") == 0.0


EQUIVALENT = [("so the answer is \\boxed{\\frac{1}{2}}", "0.5"),
              ("\\boxed{0.5}", "\\frac{1}{2}"),
              ("We get $\\boxed{x^2+2x+1}$.", "(x+1)^2"),
              ("answer: $\\sqrt{2}$", "\\sqrt 2"),
              ("\\boxed{7}", "Hence the answer is $\\boxed{7}$.")]
DIFFERENT = [("\\boxed{3}", "4"), ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}"), ("no answer here", "7"),
             ("\\boxed{x+1}", "x-1")]


def test_math_verify_reward_in_main_and_other_threads():
  for completion, answer in EQUIVALENT:
    assert rewards.math_verify_reward(completion, answer) == 1.0, (completion, answer)
  for completion, answer in DIFFERENT:
    assert rewards.math_verify_reward(completion, answer) == 0.0, (completion, answer)
  # math-verify's own timeouts use signals, which fail outside the main thread: ours are off.
  out = []
  t = threading.Thread(target=lambda: out.extend(
      rewards.math_verify_reward(c, a) for c, a in EQUIVALENT + DIFFERENT))
  t.start()
  t.join()
  assert out == [1.0] * len(EQUIVALENT) + [0.0] * len(DIFFERENT)
  with pytest.raises(ValueError, match="reference answer"):
    rewards.math_verify_reward("\\boxed{1}", "")


def test_safe_reward_thread_backend_timeout_crash_nan():
  safe = rewards.SafeReward(behave, timeout_s=0.3, backend="thread", num_workers=2)
  t0 = time.perf_counter()
  scores = safe.score_batch(["1", "sleep", "crash", "nan", "2", "sleep"],
                            ["1", "1", "1", "1", "3", "1"])
  assert time.perf_counter() - t0 < 5.0  # two sleeps of 60 s were cut off, in parallel
  np.testing.assert_array_equal(scores, [1, 0, 0, 0, 0, 0])
  assert scores.dtype == np.float32
  assert safe.counts == {"reward/calls": 6, "reward/errors": 2, "reward/timeouts": 2,
                         "reward/memory_errors": 0, "reward/restarts": 2}
  assert safe("5", "5") == 1.0  # still serving after the abandoned threads
  safe.close()


def test_safe_reward_process_backend_survives_timeout_crash_and_death():
  with rewards.SafeReward(behave, timeout_s=1.0, backend="process") as safe:
    safe.start()
    pid = safe("pid", "")
    assert safe("9", "9") == 1.0
    assert safe("crash", "") == 0.0  # an exception: the same process keeps serving
    assert safe("pid", "") == pid
    t0 = time.perf_counter()
    assert safe("sleep", "") == 0.0
    assert time.perf_counter() - t0 < 10.0
    assert safe("die", "") == 0.0  # the process exits: restarted on the next call
    new_pid = safe("pid", "")
    assert new_pid != pid
    with pytest.raises(ProcessLookupError):
      os.kill(int(pid), 0)  # the timed-out worker was killed, not leaked
    assert safe("nan", "") == 0.0
    assert safe.counts == {"reward/calls": 8, "reward/errors": 3, "reward/timeouts": 1,
                           "reward/memory_errors": 0, "reward/restarts": 2}
  with pytest.raises(ProcessLookupError):
    os.kill(int(new_pid), 0)  # close() ends the worker


def test_safe_reward_process_backend_memory_limit(caplog):
  """A call over the worker's memory limit scores 0, is counted, and the worker is restarted; the
  calls after it are scored as usual. Without the limit "alloc" would score 4294967296."""
  caplog.set_level(logging.WARNING)
  with rewards.SafeReward(behave, timeout_s=30.0, backend="process",
                          memory_limit_gib=0.25) as safe:
    safe.start()
    pid = safe("pid", "")
    scores = [safe(c, "7") for c in ("7", "alloc", "7", "grow", "big_int", "7")]
    assert scores == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert safe.counts == {"reward/calls": 7, "reward/errors": 0, "reward/timeouts": 0,
                           "reward/memory_errors": 3, "reward/restarts": 3}
    assert safe("pid", "") != pid
    with pytest.raises(ProcessLookupError):
      os.kill(int(pid), 0)  # the worker that hit the limit was killed, not left serving
  assert any("over its memory limit of 0.25 GiB" in r.getMessage() for r in caplog.records)
  # The 4 GiB allocation is cheap alone but took over 30 s on this machine beside two sweep runs
  # and the suite (memory pressure), so this call gets a long timeout: it checks the limit only.
  with rewards.SafeReward(behave, timeout_s=300.0, backend="process",
                          memory_limit_gib=None) as unlimited:
    assert unlimited("alloc", "") == float(4 << 30)  # the limit is what made "alloc" fail
  with pytest.raises(ValueError, match="memory_limit_gib"):
    rewards.SafeReward(behave, memory_limit_gib=0.0)


def test_safe_reward_process_backend_kills_a_cpu_bound_hang():
  with rewards.SafeReward(behave, timeout_s=1.0, backend="process") as safe:
    safe.start()
    pid = safe("pid", "")
    t0 = time.perf_counter()
    assert safe("spin", "") == 0.0
    assert time.perf_counter() - t0 < 10.0
    with pytest.raises(ProcessLookupError):
      os.kill(int(pid), 0)
    assert safe("4", "4") == 1.0  # a fresh worker serves the next call
    assert safe.counts["reward/timeouts"] == 1 and safe.counts["reward/restarts"] == 1


def test_safe_reward_process_backend_warmup_and_start_failures():
  with rewards.SafeReward(behave, timeout_s=5.0, backend="process",
                          warmup_args=("crash", "")) as safe:
    assert safe("3", "3") == 1.0  # a failing warm-up call is ignored
    assert safe.counts["reward/errors"] == 0
  with rewards.SafeReward(behave, timeout_s=5.0, backend="process", warmup_args=("sleep", ""),
                          start_timeout_s=0.5) as safe:
    with pytest.raises(RuntimeError, match="did not start within"):
      safe.start()
    assert safe("3", "3") == 0.0  # a worker that does not start scores 0, counted as an error
    assert safe.counts == {"reward/calls": 1, "reward/errors": 1, "reward/timeouts": 0,
                           "reward/memory_errors": 0, "reward/restarts": 1}


def test_safe_reward_rejects_unusable_functions():
  with pytest.raises(ValueError, match="picklable"):
    rewards.SafeReward(lambda c, a: 1.0, backend="process")
  with pytest.raises(ValueError, match="backend"):
    rewards.SafeReward(behave, backend="gpu")
  with pytest.raises(ValueError, match="timeout_s"):
    rewards.SafeReward(behave, timeout_s=0)


def test_math_task_scores_from_a_worker_thread(tmp_path):
  (tmp_path / "d.jsonl").write_text(
      '{"problem": "half of one?", "answer": "\\\\frac{1}{2}"}\n'
      '{"problem": "two squared?", "answer": "4"}\n')
  problems = math_data.load_math_dataset(str(tmp_path / "d.jsonl"), template="plain")
  task = math_data.MathTask(problems, problems, reward_timeout_s=10.0, num_reward_workers=1)
  completions = [c for c, _ in EQUIVALENT[:2]] + ["\\boxed{4}", "\\boxed{5}"]
  targets = [problems[0], problems[0], problems[1], problems[1]]
  out = []
  t = threading.Thread(target=lambda: out.append(task.score_batch(completions, targets)))
  t.start()
  t.join()
  np.testing.assert_array_equal(out[0], [1, 1, 1, 0])
  assert task.reward("\\boxed{2^2}", problems[1]) == 1.0
  assert task.reward_metrics()["reward/calls"] == 5
  assert task.reward_metrics()["reward/errors"] == 0
  task.close()


def test_arithmetic_task_reward_matches_score_batch():
  task = arithmetic.ArithmeticTask(num_digits=(1, 2), ops="+-*")
  probs = task.sample(np.random.default_rng(0), 50)
  completions = [p.answer if i % 3 else p.answer + "1" for i, p in enumerate(probs)]
  expected = [task.reward(c, p) for c, p in zip(completions, probs)]
  np.testing.assert_array_equal(task.score_batch(completions, probs), expected)
  assert sum(expected) == sum(1 for i in range(50) if i % 3)
  task.close()


# ---- reward plug-ins (task.reward_fn) ---------------------------------------------------------


def _problems(tmp_path):
  (tmp_path / "d.jsonl").write_text('{"problem": "1+1?", "answer": "2"}\n'
                                    '{"problem": "3+4?", "answer": "7"}\n')
  return math_data.load_math_dataset(str(tmp_path / "d.jsonl"), template="plain")


def test_reward_plugin_runs_in_reward_processes_with_a_time_limit(tmp_path):
  problems = _problems(tmp_path)
  task = math_data.MathTask(problems, problems, reward_timeout_s=2.0, num_reward_workers=2,
                            reward_fn="tests.helpers.reward_plugins:digits")
  try:
    scores = task.score_batch(["the sum is 2", "it is 8", "7", "sleep"],
                              [problems[0], problems[0], problems[1], problems[1]])
    np.testing.assert_array_equal(scores, [1, 0, 1, 0])  # "sleep" ran past 2 s: 0
    metrics = task.reward_metrics()
    assert (metrics["reward/calls"], metrics["reward/timeouts"]) == (4, 1)
    pid_score = task.reward("pid", problems[0])
    assert pid_score >= 1000 and pid_score != 1000 + os.getpid() % 1000  # another process
  finally:
    task.close()


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_here:score", "cannot import module 'no_such_module_here'"),
    ("tests.helpers.reward_plugins:missing", "has no attribute 'missing'"),
    ("tests.helpers.reward_plugins", "expected 'module:function'"),
    ("tests.helpers.reward_plugins:one_argument", r"cannot be called as fn\(completion: str, answer: str\)"),
    ("tests.helpers.reward_plugins:returns_text", "warm-up call .* failed: ValueError"),
    ("tests.helpers.reward_plugins:raises", "warm-up call .* failed: KeyError"),
])
def test_a_bad_reward_plugin_fails_at_build_naming_the_fix(tmp_path, spec, message):
  problems = _problems(tmp_path)
  with pytest.raises(ValueError, match=message):
    math_data.MathTask(problems, problems, reward_timeout_s=5.0, reward_fn=spec)


def test_build_wires_reward_fn_eval_path_and_reward_workers(tmp_path):
  from jaxreplay.run import build  # pylint: disable=g-import-not-at-top
  from jaxreplay.config.defaults import base_config  # pylint: disable=g-import-not-at-top
  _problems(tmp_path)
  (tmp_path / "eval.jsonl").write_text('{"problem": "5+5?", "answer": "10"}\n')
  c = base_config()
  c.task.name = "math"
  c.task.path = str(tmp_path / "d.jsonl")
  c.task.eval_path = str(tmp_path / "eval.jsonl")
  c.task.reward_fn = "tests.helpers.reward_plugins:digits"
  c.task.num_reward_workers = 3
  validation.validate_config(c)
  task = build.make_task(c.task)
  try:
    assert [p.answer for p in task.heldout] == ["10"] and len(task.train) == 2
    assert task.heldout_sources == [f"{tmp_path / 'eval.jsonl'}:1"]
    assert task._safe.num_workers == 3  # pylint: disable=protected-access
    assert task.score_batch(["= 10", "9"], task.heldout * 2).tolist() == [1.0, 0.0]
  finally:
    task.close()
  c.task.eval_path = str(tmp_path / "missing.jsonl")
  c.task.reward_fn = "tests.helpers.reward_plugins.digits"
  c.task.num_reward_workers = 0
  with pytest.raises(ValueError) as e:
    validation.validate_config(c)
  assert "task.eval_path=" in str(e.value) and "does not exist" in str(e.value)
  assert "task.reward_fn='tests.helpers.reward_plugins.digits': expected 'module:function'" in str(e.value)
  assert "task.num_reward_workers=0 must be >= 1" in str(e.value)
  c = base_config()
  c.task.reward_fn = "tests.helpers.reward_plugins:digits"
  with pytest.raises(ValueError, match="task.reward_fn=.* is only read by task.name='math'"):
    validation.validate_config(c)


# ---- concurrent deliveries score in parallel (off the pool's sink lock) ------------------------


class _OneTokenWorker:
  """A rollout worker whose completions are one token."""

  def __init__(self, token):
    self.policy_version = 0
    self.token = token

  def generate(self, prompts, n, sampling):
    from jaxreplay.rollout.base import Completion, Group  # pylint: disable=g-import-not-at-top
    return [Group(np.asarray(p), [Completion(np.asarray([self.token], np.int32),
                                             np.zeros(1, np.float32), "length")
                                  for _ in range(n)], 0, i) for i, p in enumerate(prompts)]

  def load_weights(self, weights):
    self.policy_version = weights.version

  def close(self):
    pass


class _Hooks:
  """The pipeline side of `AsyncScheduler` for deliveries only: done once `n` rollouts landed."""

  def __init__(self, intake, n):
    self.intake, self.n = intake, n

  def done(self):
    return len(self.intake.buffer) >= self.n

  def latest_weights(self):
    from jaxreplay.rollout.base import Weights  # pylint: disable=g-import-not-at-top
    return Weights(0)

  def generated(self, groups, seconds):
    pass

  def can_train(self):
    return False


def test_async_deliveries_score_in_parallel_reward_processes(tmp_path, monkeypatch):
  """Two workers' deliveries, one completion each, scored by a reward that only returns 1.0 when
  both calls are inside it at the same time (in two reward processes). Scoring under the pool's
  sink lock would serialise them: the first call's wait runs out and scores 0.0."""
  from jaxreplay.data import experience  # pylint: disable=g-import-not-at-top
  from jaxreplay.data.buffer import ReplayBuffer  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout.base import SamplingParams  # pylint: disable=g-import-not-at-top
  from jaxreplay.run.schedules import AsyncScheduler  # pylint: disable=g-import-not-at-top
  from jaxreplay.tasks import tokenizer as tok_lib  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("JAXREPLAY_TEST_RENDEZVOUS", str(tmp_path))  # read by the reward processes
  problems = _problems(tmp_path)
  task = math_data.MathTask(problems, problems, reward_timeout_s=60.0, num_reward_workers=2,
                            reward_fn="tests.helpers.reward_plugins:rendezvous")
  try:
    task._safe.start()  # pylint: disable=protected-access  (both processes up before the race)
    codec = tok_lib.TextCodec(tok_lib.build_char_tokenizer(task.charset + "0123456789"))
    intake = experience.Intake(task, codec, experience.PromptSource(task, seed=0),
                               ReplayBuffer(16, seed=0), experience.make_advantage_fn("asymre"),
                               SamplingParams(max_tokens=1), prompts_per_request=1, group_size=1)
    token = int(codec.encode("2", add_bos=False)[0])
    AsyncScheduler(lambda i, weights: _OneTokenWorker(token), num_workers=2).run(_Hooks(intake, 2))
    rewards_seen = intake.take_fresh_rewards()
    assert len(rewards_seen) >= 2
    assert 0.0 not in rewards_seen.tolist()
    assert rewards_seen.tolist().count(1.0) == 2  # the two rendezvous calls met
    pids = {(tmp_path / f"ticket{i}").read_text() for i in range(2)}
    assert len(pids) == 2  # in two reward processes
  finally:
    task.close()
