"""Multi-turn trajectories (`rollout.multiturn.EpisodeRunner`) on a scripted worker: one row per
trajectory with its mask and turn starts, environments that raise / hang / answer malformed
values (reward 0, counted, the call goes on), the token budget, max_turns, the statistics."""
import itertools

import numpy as np
import pytest

from jaxreplay.data import collate as collate_lib
from jaxreplay.data import experience
from jaxreplay.rollout import multiturn
from jaxreplay.rollout.base import SamplingParams
from jaxreplay.tasks import arithmetic
from jaxreplay.tasks import calculator
from jaxreplay.tasks import environments as envs
from jaxreplay.tasks import tokenizer
from tests.helpers import env_plugins
from tests.helpers.scripted_worker import (LOGPROB, ScriptedWorker, calculator_script,
                                           segments_script)

TASK = calculator.CalculatorTask(num_digits=(2, 4), seed=0)
CODEC = tokenizer.TextCodec(tokenizer.build_char_tokenizer(TASK.charset))
SAMPLING = SamplingParams(temperature=1.0, max_tokens=48, stop_token_ids=CODEC.stop_ids)


def runner(factory, max_turns=6, max_tokens=64, timeout_s=5.0, max_len=64):
  spec = envs.spec_from_factory(factory, max_turns, max_tokens, timeout_s)
  return multiturn.EpisodeRunner(spec, CODEC, max_len)


def encode(text):
  return [int(i) for i in CODEC.encode(text, add_bos=False)]


def problems(n, seed=0):
  return TASK.sample(np.random.default_rng(seed), n)


def test_calculator_trajectory_is_one_row():
  """Each trajectory: the policy's turns (mask 1, their log-probs) and the calculator's answers
  (mask 0, log-prob 0) in order, turn starts at each turn, reward 1, every call right and used."""
  probs = problems(6)
  run = runner(TASK.make_env)
  worker = ScriptedWorker(CODEC, calculator_script(probs))
  prompts = [CODEC.encode_prompt(p.prompt) for p in probs]
  groups = run.generate(worker, prompts, probs, 2, SAMPLING)
  run.close()
  assert len(groups) == 6 and all(len(g.completions) == 2 for g in groups)
  for g, p, prompt in zip(groups, probs, prompts):
    np.testing.assert_array_equal(g.prompt_tokens, prompt)
    segments = calculator.reference_trajectory(p)
    tokens, mask, starts = [], [], []
    for i, (text, trained) in enumerate(segments):
      ids = encode(text) + ([CODEC.eos_id] if i == len(segments) - 1 else [])
      if trained:
        starts.append(len(tokens))
      tokens += ids
      mask += [float(trained)] * len(ids)
    columns = sum(not trained for _, trained in segments)
    for c in g.completions:
      np.testing.assert_array_equal(c.tokens, tokens)
      np.testing.assert_array_equal(c.mask, mask)
      np.testing.assert_array_equal(c.turn_starts, starts)
      np.testing.assert_array_equal(c.logprobs, np.where(np.asarray(mask) > 0, LOGPROB, 0.0))
      assert c.finish_reason == "stop" and c.policy_tokens == sum(mask)
      assert c.episode == multiturn.EpisodeInfo(reward=1.0, status="stop", turns=columns + 1,
                                                tool_calls=columns, tool_correct=columns)
  # After the first turn each call's prompt is a conversation so far (vLLM's way): the prompt,
  # then whole turns and observations, ending with an observation.
  ends = {}
  for p in probs:
    at = p.prompt
    for text, trained in calculator.reference_trajectory(p):
      at += text
      ends.setdefault(p.prompt, set()).add(at) if not trained else None
  for seen in worker.seen:
    text = CODEC.decode(seen)
    prompt = next(q.prompt for q in probs if text.startswith(q.prompt))
    assert text == prompt or text in ends[prompt]


def test_trajectories_become_masked_rollouts():
  """A trajectory's rollout keeps its mask and turn starts; collate gives its observation tokens
  completion_mask 0 and behaviour log-prob 0 (unpacked and packed)."""
  probs = problems(3, seed=1)
  run = runner(TASK.make_env)
  groups = run.generate(ScriptedWorker(CODEC, calculator_script(probs)),
                        [CODEC.encode_prompt(p.prompt) for p in probs], probs, 2, SAMPLING)
  run.close()
  rewards = experience.score_groups(groups, probs, TASK, CODEC)
  np.testing.assert_array_equal(rewards, np.ones((3, 2), np.float32))
  rollouts = experience.to_rollouts(groups, rewards, np.zeros((3, 2), np.float32), [0, 1, 2])
  for r, c in zip(rollouts, [c for g in groups for c in g.completions]):
    np.testing.assert_array_equal(r.completion_mask, c.mask)
    np.testing.assert_array_equal(r.turn_starts, c.turn_starts)
    assert r.num_turns == len(c.turn_starts) > 1 and r.policy_tokens == int(c.mask.sum())
  for pack in (False, True):
    batch = collate_lib.collate(rollouts, buckets=(64, 128), pack=pack)
    # The flat completion targets in rollout order (their positions: behaviour log-prob != 0
    # or an environment token) carry exactly the rollouts' masks.
    assert float(batch.completion_mask.sum()) == sum(r.policy_tokens for r in rollouts)
    in_policy = batch.completion_mask > 0
    np.testing.assert_array_equal(batch.behaviour_logprobs[in_policy], LOGPROB)
    np.testing.assert_array_equal(batch.behaviour_logprobs[~in_policy], 0.0)


def _mixed(bad):
  """A factory alternating Countdown and the broken `bad` (the start-up check takes one)."""
  count = itertools.count()
  return lambda: bad() if next(count) % 2 == 1 else env_plugins.countdown()


def countdown_script(text, sample):
  del sample
  # "0", then after Countdown's "=" the prompt's first char (each test problem's answer starts
  # with it): "12+34=" "0" "=" "1".
  return "0" if text.count("=") < 2 else text[0]


@pytest.mark.parametrize("bad,status", [
    (env_plugins.raising_step, "env_error"),
    (env_plugins.malformed_step, "env_error"),
    (env_plugins.nan_reward_step, "env_error"),
    (env_plugins.raising_reset, "env_error"),
    (env_plugins.other_prompt_reset, "env_error"),
    (env_plugins.raising_metrics, "env_error"),
    (env_plugins.hanging_step, "env_timeout"),
])
def test_broken_environment_scores_zero_and_is_counted(bad, status):
  """Rows of a broken environment score 0 with their status; the others in the same call are
  untouched; the call returns (the run goes on)."""
  probs = [arithmetic.Problem("12+34=", "1", 1), arithmetic.Problem("40+2=", "4", 2)]
  run = runner(_mixed(bad), timeout_s=0.5)
  prompts = [CODEC.encode_prompt(p.prompt) for p in probs]
  groups = run.generate(ScriptedWorker(CODEC, countdown_script), prompts, probs, 2, SAMPLING)
  run.close()
  infos = multiturn.episode_infos(groups)
  # Rows were built in order after the start-up check: the even rows (0, 2) got `bad`.
  statuses = [i.status for i in infos]
  assert statuses == [status, "stop", status, "stop"]
  assert [i.reward for i in infos] == [0.0, 1.0, 0.0, 1.0]
  if status == "env_error":
    assert all(infos[r].error for r in (0, 2))
  counts = multiturn.counts(infos)
  assert counts["env/episodes"] == 4
  assert counts["env/errors"] == (2 if status == "env_error" else 0)
  assert counts["env/timeouts"] == (2 if status == "env_timeout" else 0)
  rewards = experience.score_groups(groups, probs, TASK, CODEC)
  np.testing.assert_array_equal(rewards, [[0.0, 1.0], [0.0, 1.0]])
  for c in [c for g in groups for c in g.completions]:
    assert c.mask[0] == 1 and c.tokens.shape == c.mask.shape == c.logprobs.shape


def test_factory_failing_mid_run_is_an_error_row():
  count = itertools.count()

  def flaky():
    if next(count) == 1:
      raise OSError("no environment for you")
    return env_plugins.countdown()
  probs = [arithmetic.Problem("12+34=", "1", 1)]
  run = runner(flaky)
  groups = run.generate(ScriptedWorker(CODEC, countdown_script),
                        [CODEC.encode_prompt(probs[0].prompt)], probs, 2, SAMPLING)
  run.close()
  infos = multiturn.episode_infos(groups)
  assert [i.status for i in infos] == ["env_error", "stop"]
  assert "no environment for you" in infos[0].error and infos[0].reward == 0.0


def test_budget_cuts_between_whole_tokens_and_marks_the_row():
  """Budgets that (a) leave no room for an observation: it is not appended, the trajectory ends
  after the policy's turn; (b) cut a turn short of max_tokens: finish "budget". Either way reward
  0, counted in env/budget_cuts, never longer than the budget."""
  p = arithmetic.Problem("4738+2956=", "8+6+0=14,3+5+1=09,7+9+0=16,4+2+1=07;7694", 1)
  prompt = CODEC.encode_prompt(p.prompt)
  turn0 = len(encode("8+6+0?"))
  script = calculator_script([p])
  for budget in (len(prompt) + turn0 + 2,        # "=14" (3 tokens) does not fit
                 len(prompt) + turn0 + 3 + 5):   # the 2nd turn ",3+5+1?" is cut at 5 tokens
    run = runner(TASK.make_env, max_tokens=budget)
    (group,) = run.generate(ScriptedWorker(CODEC, script), [prompt], [p], 1, SAMPLING)
    run.close()
    (c,) = group.completions
    assert c.finish_reason == "budget" and c.episode.status == "budget"
    assert c.episode.reward == 0.0 and multiturn.counts([c.episode])["env/budget_cuts"] == 1
    assert len(prompt) + len(c.tokens) <= budget and c.mask[-1] == 1.0
    full = encode("8+6+0?=14,3+5+1?=09")
    np.testing.assert_array_equal(c.tokens, full[:len(c.tokens)])  # a prefix, token-aligned
  # The second budget cut the second turn at exactly the budget.
  assert len(prompt) + len(c.tokens) == budget


def test_turn_over_max_tokens_is_length_and_unseen_by_the_environment():
  p = arithmetic.Problem("4738+2956=", "8+6+0=14,3+5+1=09,7+9+0=16,4+2+1=07;7694", 1)
  seen = []

  class Recording(calculator.CalculatorEnv):
    def step(self, turn):
      seen.append(turn)
      return super().step(turn)
  run = runner(Recording)
  script = segments_script({p.prompt: [("8+6+0?", True), ("=14", False),
                                       (",3+5+1=09,7+9+0=16,4+2+1=07;7694", True)]})
  (group,) = run.generate(ScriptedWorker(CODEC, script),
                          [CODEC.encode_prompt(p.prompt)], [p], 1,
                          SamplingParams(max_tokens=8, stop_token_ids=CODEC.stop_ids))
  run.close()
  (c,) = group.completions
  # Turn 0 "8+6+0?" (6 tokens) fits; turn 1 (31 tokens + eos) is cut at 8 tokens.
  assert c.episode.status == "length" and c.episode.reward == 0.0 and c.episode.turns == 2
  assert seen == ["8+6+0?"] and len(c.tokens) == 6 + 3 + 8


def test_max_turns_keeps_the_rewards_so_far():
  probs = [arithmetic.Problem("12+34=", "1", 1)]
  run = runner(env_plugins.countdown, max_turns=1)
  (group,) = run.generate(ScriptedWorker(CODEC, countdown_script),
                          [CODEC.encode_prompt(probs[0].prompt)], probs, 1, SAMPLING)
  run.close()
  (c,) = group.completions
  assert c.episode.status == "max_turns" and c.episode.turns == 1 and c.episode.reward == 0.0
  assert c.mask.min() == 1.0  # the observation after the last allowed turn is not appended


def test_statistics_of_trajectories():
  infos = [multiturn.EpisodeInfo(1.0, "stop", 3, tool_calls=2, tool_correct=2),
           multiturn.EpisodeInfo(0.0, "env_error", 1, error="boom"),
           multiturn.EpisodeInfo(0.0, "env_timeout", 2, tool_calls=1),
           multiturn.EpisodeInfo(0.0, "budget", 4, tool_calls=3, tool_correct=1)]
  assert multiturn.counts(infos) == {"env/episodes": 4, "env/errors": 1, "env/timeouts": 1,
                                     "env/budget_cuts": 1, "env/tool_calls": 6}
  m = multiturn.means(infos)
  assert m["env/turns_mean"] == 2.5 and m["env/tool_calls_mean"] == 1.5
  assert m["env/tool_correct"] == 0.5
  assert m["env/stop_fraction"] == m["env/budget_fraction"] == 0.25
  assert m["env/length_fraction"] == 0.0
  empty = multiturn.means([])
  assert all(np.isnan(v) for v in empty.values())
  assert multiturn.EpisodeInfo(**infos[1].to_dict()) == infos[1]


def test_stop_text_must_be_one_token():
  class TwoTokenStop(env_plugins.Countdown):
    stop_texts = ("?=",)
  with pytest.raises(ValueError, match="is 2 tokens"):
    runner(TwoTokenStop)
  run = runner(TASK.make_env)
  assert run.turn_stop_ids == tuple(encode("?"))
  assert set(run.sampling(SAMPLING).stop_token_ids) == set(CODEC.stop_ids) | set(encode("?"))
  run.close()
