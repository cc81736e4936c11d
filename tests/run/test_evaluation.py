"""Tests of pass@k (against brute-force enumeration) and of evaluate() with a fake sampler."""
import functools
import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from jaxreplay.run import eval_problems, evaluation
from jaxreplay.rollout.base import Completion, Group
from jaxreplay.tasks import arithmetic, tokenizer as tok_lib


def brute_pass_at_k(n, c, k):
  """Share of the k-subsets of n samples (c correct) holding at least one correct sample."""
  samples = [True] * c + [False] * (n - c)
  subsets = list(itertools.combinations(range(n), k))
  return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_enumeration():
  for n in range(1, 9):
    for c in range(n + 1):
      for k in range(1, n + 1):
        expected = brute_pass_at_k(n, c, k)
        assert evaluation.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)
        row = np.array([[True] * c + [False] * (n - c)])
        np.testing.assert_allclose(evaluation.pass_at_k_per_problem(row, k), [expected],
                                   atol=1e-12)
  assert evaluation.pass_at_k(10, 3, 1) == pytest.approx(0.3)


def test_pass_at_k_large_n_is_stable():
  rng = np.random.default_rng(0)
  correct = rng.random((20, 256)) < rng.random((20, 1)) * 0.1
  for k in (1, 16, 100, 256):
    got = evaluation.pass_at_k_per_problem(correct, k)
    for row, g in zip(correct, got):
      n, c = len(row), int(row.sum())
      exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
      assert g == pytest.approx(float(exact), abs=1e-10)
  means = evaluation.pass_at_k_array(correct, (1, 4))
  assert means[1] == pytest.approx(correct.mean())
  assert set(means) == {1, 4}


def test_pass_at_k_errors():
  with pytest.raises(ValueError, match="1 <= k <= n"):
    evaluation.pass_at_k(4, 1, 5)
  with pytest.raises(ValueError, match="at least 8 samples"):
    evaluation.pass_at_k_per_problem(np.zeros((2, 4), bool), 8)


class FakeSampler:
  """Problem i: correct at low temperature iff i is even; at temperature 1, c_i = i % 9 of n correct.
  Token j of every completion has logprob -0.1 (j + 1); wrong completions end by length."""

  def __init__(self, codec, problems):
    self.codec, self.problems, self.calls = codec, problems, []
    self.by_prompt = {tuple(codec.encode_prompt(p.prompt)): i for i, p in enumerate(problems)}

  def completion(self, answer, ok):
    text = answer if ok else answer + "1"
    tokens = np.concatenate([self.codec.encode(text, add_bos=False), [self.codec.eos_id]])
    logprobs = -0.1 * np.arange(1, len(tokens) + 1, dtype=np.float32)
    return Completion(tokens.astype(np.int32), logprobs, "stop" if ok else "length")

  def __call__(self, prompts, n, sampling):
    self.calls.append((len(prompts), n, sampling))
    groups = []
    for j, prompt in reversed(list(enumerate(prompts))):  # out of order: evaluate sorts them
      i = self.by_prompt[tuple(prompt)]
      answer = self.problems[i].answer
      if sampling.temperature < 0.5:
        oks = [i % 2 == 0] * n
      else:
        oks = [s < i % 9 for s in range(n)]
      groups.append(Group(prompt, [self.completion(answer, ok) for ok in oks], 7, prompt_index=j))
    return groups


def test_evaluate_with_fake_sampler():
  task = arithmetic.ArithmeticTask(num_digits=(1, 2))
  codec = tok_lib.TextCodec(tok_lib.build_char_tokenizer(task.charset))
  problems = task.eval_set(27)
  sampler = FakeSampler(codec, problems)
  ks = (1, 2, 4, 8)
  per_problem = {}
  out = evaluation.evaluate(sampler, task, problems, codec, n_samples=8, ks=ks, max_tokens=12,
                            batch_size=10, seed=5, per_problem=per_problem)
  # the per-problem counts: the scripted ones, and they aggregate to the returned metrics
  assert per_problem["n_pass1"] == 1 and per_problem["n_samples"] == 8
  np.testing.assert_array_equal(per_problem["pass1_correct"], [i % 2 == 0 for i in range(27)])
  np.testing.assert_array_equal(per_problem["passk_correct"], [min(i % 9, 8) for i in range(27)])
  assert out["eval/pass@1"] == per_problem["pass1_correct"].mean()
  matrix = eval_problems.correct_matrix(per_problem["passk_correct"], 8)
  for k in ks:
    key = f"eval/pass@{k}" if k > 1 else "eval/pass@1_t1"
    assert out[key] == evaluation.pass_at_k_per_problem(matrix, k).mean(), key
  assert out["eval/pass@1"] == pytest.approx(np.mean([i % 2 == 0 for i in range(27)]))
  for k in ks:
    key = f"eval/pass@{k}" if k > 1 else "eval/pass@1_t1"
    expected = np.mean([brute_pass_at_k(8, min(i % 9, 8), k) for i in range(27)])
    assert out[key] == pytest.approx(expected), key
  # Entropy: mean over all sampled tokens of -logprob.
  lengths = np.array([[len(p.answer) + (1 if s >= i % 9 else 0) + 1 for s in range(8)]
                      for i, p in enumerate(problems)])
  total = sum(0.1 * L * (L + 1) / 2 for L in lengths.reshape(-1))
  assert out["eval/entropy"] == pytest.approx(total / lengths.sum(), rel=1e-5)
  assert out["eval/mean_completion_tokens"] == pytest.approx(lengths.mean())
  wrong = np.mean([[s >= i % 9 for s in range(8)] for i in range(27)])
  assert out["eval/truncated_fraction"] == pytest.approx(wrong)
  assert out["eval/reward_mean"] == pytest.approx(1 - wrong)
  assert out["eval/num_problems"] == 27 and out["eval/num_samples"] == 8
  # Sampling settings: 3 chunks at temperature 0.1 with n=1, then 3 at 1.0 with n=8.
  assert [(c[0], c[1], c[2].temperature) for c in sampler.calls] == (
      [(10, 1, 0.1), (10, 1, 0.1), (7, 1, 0.1), (10, 8, 1.0), (10, 8, 1.0), (7, 8, 1.0)])
  assert all(c[2].stop_token_ids == (codec.eos_id,) and c[2].max_tokens == 12
             for c in sampler.calls)
  assert sampler.calls[0][2].seed != sampler.calls[-1][2].seed


def test_evaluate_pass1_only_and_errors():
  task = arithmetic.ArithmeticTask(num_digits=(1, 1))
  codec = tok_lib.TextCodec(tok_lib.build_char_tokenizer(task.charset))
  problems = task.eval_set(4)
  sampler = FakeSampler(codec, problems)
  per_problem = {}
  out = evaluation.evaluate(sampler, task, problems, codec, n_samples=0, n_pass1=3,
                            per_problem=per_problem)
  assert per_problem["pass1_correct"].tolist() == [3, 0, 3, 0] and "passk_correct" not in per_problem
  assert set(out) == {"eval/pass@1", "eval/num_problems", "eval/seconds"}
  assert out["eval/pass@1"] == pytest.approx(0.5)
  assert sampler.calls[0][1] == 3
  with pytest.raises(ValueError, match="ks="):
    evaluation.evaluate(sampler, task, problems, codec, n_samples=4, ks=(1, 8))
  with pytest.raises(ValueError, match="groups"):
    evaluation.evaluate(lambda p, n, s: [], task, problems, codec, n_samples=0)


def test_evaluate_through_generate_many_equals_generate_fn():
  task = arithmetic.ArithmeticTask(num_digits=(1, 2))
  codec = tok_lib.TextCodec(tok_lib.build_char_tokenizer(task.charset))
  problems = task.eval_set(13)
  settings = dict(n_samples=4, ks=(1, 2, 4), max_tokens=12, batch_size=5, seed=3)
  direct = FakeSampler(codec, problems)
  want = evaluation.evaluate(direct, task, problems, codec, **settings)
  many = FakeSampler(codec, problems)
  batches = []

  def generate_many(requests):  # runs them last-first, as parallel engines may finish
    batches.append(requests)
    out = {j: many(*r) for j, r in reversed(list(enumerate(requests)))}
    return [out[j] for j in range(len(requests))]

  got = evaluation.evaluate(None, task, problems, codec, generate_many=generate_many, **settings)
  assert {k: v for k, v in got.items() if k != "eval/seconds"} == (
      {k: v for k, v in want.items() if k != "eval/seconds"})
  assert len(batches) == 1  # every request at once: pass@1 chunks first, then pass@k ones
  assert [(len(p), n, s.temperature) for p, n, s in batches[0]] == (
      [(c[0], c[1], c[2].temperature) for c in direct.calls])
  with pytest.raises(ValueError, match="3 results for 6 requests"):
    evaluation.evaluate(None, task, problems, codec, generate_many=lambda r: r[:3], **settings)
  with pytest.raises(ValueError, match="generate_fn or generate_many"):
    evaluation.evaluate(None, task, problems, codec, **settings)


def test_engine_jobs_draw_eval_noise_from_the_eval_counter_and_restore_the_workers():
  class Counting:
    def __init__(self):
      self.call_count, self.seen = 41, []

    def generate(self, prompts, n, sampling):
      self.seen.append((self.call_count, len(prompts), n, sampling.temperature))
      self.call_count += 1
      return ["groups"]

  class Plain:  # a vLLM engine proxy: no call counter
    call_count = None

    def __init__(self):
      self.calls = 0

    def generate(self, prompts, n, sampling):
      self.calls += 1
      return [n]

  from jaxreplay.rollout.base import SamplingParams
  requests = [([np.array([1, 2])], 1, SamplingParams(temperature=0.1)),
              ([np.array([1, 3])] * 2, 4, SamplingParams(temperature=1.0))]
  jobs = evaluation.engine_jobs(requests, first_call=7)
  worker = Counting()
  assert [job(worker) for job in jobs] == [["groups"], ["groups"]]
  assert worker.seen == [(7, 1, 1, 0.1), (8, 2, 4, 1.0)] and worker.call_count == 41
  plain = Plain()
  assert [job(plain) for job in jobs] == [[1], [4]] and plain.calls == 2



def test_multi_turn_evaluation_scores_trajectories_and_reports_their_tool_use():
  """Calculator episodes on a scripted worker (every column called, every result used): pass@1
  and pass@k are 1, eval/env/* describe the pass@1 trajectories, and the entropy and token count
  are over the policy's tokens only (observations carry log-prob 0)."""
  from jaxreplay.rollout import base, multiturn  # pylint: disable=g-import-not-at-top
  from jaxreplay.tasks import calculator, environments, tokenizer  # pylint: disable=g-import-not-at-top
  from tests.helpers.scripted_worker import LOGPROB, ScriptedWorker, calculator_script  # pylint: disable=g-import-not-at-top
  task = calculator.CalculatorTask(num_digits=(2, 3), seed=0)
  codec = tokenizer.TextCodec(tokenizer.build_char_tokenizer(task.charset))
  runner = multiturn.EpisodeRunner(environments.spec_from_factory(task.make_env, 6, 64, 5.0),
                                   codec, 64)
  problems = task.eval_set(6)
  worker = ScriptedWorker(codec, calculator_script(problems))
  out = evaluation.evaluate(functools.partial(base.generate_request, worker), task, problems,
                            codec, n_samples=2, ks=(1, 2), max_tokens=48, prefix="eval/",
                            episodes=runner)
  runner.close()
  assert out["eval/pass@1"] == out["eval/pass@2"] == 1.0
  columns = [len(calculator.reference_trajectory(p)) // 2 for p in problems]
  assert out["eval/env/tool_correct"] == 1.0 and out["eval/env/stop_fraction"] == 1.0
  assert out["eval/env/tool_calls_mean"] == pytest.approx(np.mean(columns))
  assert out["eval/env/turns_mean"] == pytest.approx(np.mean(columns) + 1)
  assert out["eval/entropy"] == pytest.approx(-LOGPROB)
  policy = [sum(len(codec.encode(t, add_bos=False)) for t, trained in
                calculator.reference_trajectory(p) if trained) + 1 for p in problems]  # + eos
  assert out["eval/mean_completion_tokens"] == pytest.approx(np.mean(policy))
