"""`run.evaluator.Evaluator`: the evaluation hook's rule, the trainer and engine paths (one result
either way), the eval-call counter of the host state, pass@1-only grid points."""
import types

import ml_collections
import numpy as np

from jaxreplay.rollout.base import Completion, Group, Weights
from jaxreplay.run import eval_problems
from jaxreplay.run import hooks as hooks_lib
from jaxreplay.run.evaluator import Evaluator
from jaxreplay.tasks import arithmetic, tokenizer as tok_lib


class Worker:
  """Answers problem i right iff i is even, at any temperature; counts its calls when `counting`
  (a JAX sampler's noise stream), else has no counter (a vLLM engine)."""

  def __init__(self, codec, problems, counting):
    self.codec, self.calls, self.loaded = codec, [], []
    self.by_prompt = {tuple(codec.encode_prompt(p.prompt)): (i, p.answer)
                      for i, p in enumerate(problems)}
    self.call_count = 0 if counting else None

  def load_weights(self, weights):
    self.loaded.append(weights)

  def generate(self, prompts, n, sampling):
    self.calls.append((len(prompts), n, sampling.temperature, self.call_count))
    if self.call_count is not None:
      self.call_count += 1
    groups = []
    for j, prompt in enumerate(prompts):
      i, answer = self.by_prompt[tuple(prompt)]
      text = answer if i % 2 == 0 else answer + "1"
      tokens = np.concatenate([self.codec.encode(text, add_bos=False),
                               [self.codec.eos_id]]).astype(np.int32)
      comp = Completion(tokens, np.full(len(tokens), -0.5, np.float32), "stop")
      groups.append(Group(prompt, [comp] * n, 3, prompt_index=j))
    return groups


def make_parts(sampler, problems, task, codec, compute=0.0, problem_log=None, **eval_overrides):
  c = ml_collections.ConfigDict({
      "seed": 0,
      "eval": {"n_samples": 4, "ks": (1, 2, 4), "temperature_pass1": 0.0,
               "temperature_passk": 1.0, "top_p": 1.0, "compute_grid": (), "passk_grid": (),
               "every": 2, "pass1_problems": 0},
      "rollout": {"max_tokens": 8}})
  c.eval.update(eval_overrides)
  return types.SimpleNamespace(
      config=c, data=types.SimpleNamespace(task=task, codec=codec, eval_problems=problems,
                                           intake=types.SimpleNamespace(episodes=None)),
      generation=types.SimpleNamespace(eval_sampler=sampler),
      telemetry=types.SimpleNamespace(problems=problem_log, metrics=types.SimpleNamespace(
          compute_seconds=lambda: compute)))


def setup():
  task = arithmetic.ArithmeticTask(num_digits=(1, 1))
  codec = tok_lib.TextCodec(tok_lib.build_char_tokenizer(task.charset))
  return task, codec, task.eval_set(6)


def test_trainer_and_engine_paths_give_one_result_and_count_their_calls():
  task, codec, problems = setup()
  sampler = Worker(codec, problems, counting=True)
  on_trainer = Evaluator(make_parts(sampler, problems, task, codec))
  want = on_trainer.evaluate(4, {"w": 1}, lambda: None, None, 1)
  assert sampler.loaded[0].version == 4 and on_trainer.calls == sampler.call_count == 2
  assert want["eval/pass@1"] == 0.5 and on_trainer.last == want

  engine = Worker(codec, problems, counting=False)
  jobs_seen = []

  def run_jobs(weights, fns):
    jobs_seen.append((weights.version, len(fns)))
    return [fn(engine) for fn in fns]

  on_engines = Evaluator(make_parts(None, problems, task, codec))
  on_engines.calls = 10  # a resumed run's counter (host state "eval_calls")
  got = on_engines.evaluate(4, None, lambda: Weights(4), run_jobs, job_parallelism=2)
  strip = lambda m: {k: v for k, v in m.items() if k != "eval/seconds"}
  assert strip(got) == strip(want)
  # pass@1 and pass@k requests, each split into one chunk per worker (6 problems / 2)
  assert jobs_seen == [(4, 4)] and [c[:3] for c in engine.calls] == [
      (3, 4, 0.0), (3, 4, 0.0), (3, 4, 1.0), (3, 4, 1.0)]
  assert on_engines.calls == 14


def test_the_hook_rule_and_pass1_only_points():
  task, codec, problems = setup()
  sampler = Worker(codec, problems, counting=True)
  evaluator = Evaluator(make_parts(sampler, problems, task, codec, compute=15.0,
                                   compute_grid=(10.0, 20.0), passk_grid=(20.0,), every=0,
                                   pass1_problems=2))
  assert evaluator.start() and not evaluator.passk_due  # 0.0 is not a pass@k point
  assert evaluator.due(hooks_lib.StepInfo(3)) and not evaluator.passk_due  # 10 crossed, not 20
  out = evaluator.evaluate(3, {}, lambda: None, None, 1)
  assert out["eval/num_problems"] == 2 and "eval/pass@4" not in out  # the pass@1 subset
  assert not evaluator.due(hooks_lib.StepInfo(4))
  assert evaluator.due(hooks_lib.StepInfo(5, finished=True)) and evaluator.passk_due
  out = evaluator.evaluate(5, {}, lambda: None, None, 1)
  assert out["eval/num_problems"] == 6 and "eval/pass@4" in out


def test_each_evaluation_appends_its_per_problem_counts(tmp_path):
  task, codec, problems = setup()
  log = eval_problems.ProblemLog(str(tmp_path))
  evaluator = Evaluator(make_parts(Worker(codec, problems, counting=True), problems, task, codec,
                                   compute=15.0, problem_log=log, compute_grid=(10.0, 20.0),
                                   passk_grid=(20.0,), every=0, pass1_problems=2))
  assert evaluator.start() and not evaluator.passk_due  # 0.0 is a pass@1-only point: 2 problems
  evaluator.evaluate(0, {}, lambda: None, None, 1)
  evaluator.due(hooks_lib.StepInfo(5, finished=True))  # the last evaluation draws pass@k
  out = evaluator.evaluate(5, {}, lambda: None, None, 1)
  rows = eval_problems.read_rows(str(tmp_path))
  assert [(r["step"], r["compute_seconds"], r["n_pass1"], r["n_samples"]) for r in rows] == [
      (0, 15.0, 4, 0), (5, 15.0, 4, 4)]
  # the worker answers problem i right iff i is even, at every temperature
  assert rows[0]["pass1_correct"] == [4, 0] and "passk_correct" not in rows[0]
  assert rows[1]["pass1_correct"] == [4, 0, 4, 0, 4, 0] == [4 * (i % 2 == 0) for i in range(6)]
  assert rows[1]["passk_correct"] == [4, 0, 4, 0, 4, 0]
  assert rows[0]["problems"] == [p.prompt for p in problems[:2]]
  assert rows[1]["problems"] == [p.prompt for p in problems]
  assert out["eval/pass@1"] == np.mean(rows[1]["pass1_correct"]) / 4
