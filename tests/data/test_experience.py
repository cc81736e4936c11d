"""Request intake and experience building: prompts out, scored rollouts with advantages in."""
import threading

import numpy as np
import pytest

from jaxreplay.learner import losses
from jaxreplay.data.buffer import ReplayBuffer
from jaxreplay.data.experience import Intake, PromptSource, make_advantage_fn, score_groups, to_rollouts
from jaxreplay.rollout.base import Completion, Group, SamplingParams
from jaxreplay.tasks.arithmetic import Problem


class Codec:
  """Characters <-> their code points; prompts get a bos id 1."""
  pad_id = 0

  def encode_prompt(self, text):
    return np.asarray([1] + [ord(ch) for ch in text], np.int32)

  def decode(self, ids):
    return "".join(chr(i) for i in ids)


class Task:
  """Problem i is "i+i=" with answer 2i; exact match of the decoded completion."""

  def sample(self, rng, n):
    i = int(rng.integers(0, 50))
    return [Problem(prompt=f"{i}+{i}=", answer=str(2 * i), id=i) for _ in range(n)]

  def score_batch(self, texts, problems):
    return np.asarray([float(t == p.answer) for t, p in zip(texts, problems)], np.float32)


def groups_for(batch, answers_right):
  """One group per prompt of `batch`; completion j is right iff answers_right[j]."""
  groups = []
  for k, (_, problem) in enumerate(batch.meta):
    comps = []
    for right in answers_right:
      text = problem.answer if right else "x"
      tokens = np.asarray([ord(ch) for ch in text], np.int32)
      comps.append(Completion(tokens, np.full(len(tokens), -0.5, np.float32), "stop"))
    groups.append(Group(batch.prompts[k], comps, policy_version=3, prompt_index=k))
  return groups


def make_intake(capacity=64, on_policy=False, p=2, g=4):
  buf = ReplayBuffer(capacity, seed=0, consume=on_policy)
  task = Task()
  intake = Intake(task, Codec(), PromptSource(task, seed=5), buf, make_advantage_fn("grpo"),
                  SamplingParams(max_tokens=4), prompts_per_request=p, group_size=g,
                  on_policy=on_policy)
  return intake, buf


def test_prompt_source_is_deterministic_and_requeues_dropped_prompts():
  a, b = PromptSource(Task(), seed=3), PromptSource(Task(), seed=3)
  assert [p.prompt for _, p in a.take(5)] == [p.prompt for _, p in b.take(5)]
  src = PromptSource(Task(), seed=3)
  first = src.take(3)
  src.delivered([first[0][0]])
  src.dropped([first[1][0]])
  state = src.state_dict()
  assert state == {"cursor": 3, "pending": [1, 2]}  # the dropped one and the in-flight one, sorted
  again = PromptSource(Task(), seed=3)
  again.load_state_dict(state)
  taken = again.take(3)
  assert [i for i, _ in taken] == [1, 2, 3]
  assert taken[0][1].prompt == first[1][1].prompt


def test_a_restored_in_flight_request_is_pending_not_handed_out_again():
  """A checkpoint taken while prompts 4..5 were in flight: the resumed run rebuilds that request
  (the scheduler saved its completions); the next request starts at the cursor."""
  intake, _ = make_intake()
  for _ in range(3):
    intake.deliver(*(lambda b: (b, groups_for(b, [True, False, False, True])))(
        intake.next_request()))
  in_flight = intake.next_request()
  saved = intake.state_dict()
  resumed, _ = make_intake()
  resumed.load_state_dict(saved)
  again = resumed.restore_request([i for i, _ in in_flight.meta])
  assert resumed.in_flight == 8 and [i for i, _ in again.meta] == [6, 7]
  for a, b in zip(again.prompts, in_flight.prompts):
    np.testing.assert_array_equal(a, b)
  assert [i for i, _ in resumed.next_request().meta] == [8, 9]  # 6, 7 are not handed out twice
  assert resumed.prompts.state_dict() == {"cursor": 10, "pending": [6, 7, 8, 9]}


def test_intake_delivers_scored_rollouts_with_group_advantages():
  intake, buf = make_intake()
  batch = intake.next_request()
  assert len(batch.prompts) == 2 and batch.n == 4 and intake.in_flight == 8
  np.testing.assert_array_equal(batch.prompts[0], Codec().encode_prompt(batch.meta[0][1].prompt))
  intake.deliver(batch, groups_for(batch, [True, False, False, True]))
  assert intake.in_flight == 0 and len(buf) == 8
  rollouts = buf.contents()
  assert [r.group_id for r in rollouts] == [0] * 4 + [1] * 4
  rewards = np.asarray([r.reward for r in rollouts], np.float32).reshape(2, 4)
  np.testing.assert_array_equal(rewards, [[1, 0, 0, 1], [1, 0, 0, 1]])
  np.testing.assert_allclose(np.asarray([r.advantage for r in rollouts]).reshape(2, 4),
                             np.asarray(losses.grpo_advantages(rewards)), rtol=1e-6)
  assert all(r.policy_version == 3 for r in rollouts)
  np.testing.assert_array_equal(intake.take_fresh_rewards(), rewards.reshape(-1))
  assert intake.take_fresh_rewards().size == 0
  intake.deliver(intake.next_request(), groups_for(batch, [True] * 4))
  assert [r.group_id for r in buf.contents()][-4:] == [3] * 4  # group ids keep counting


def test_on_policy_intake_waits_while_the_queue_is_full_and_drops_requeue():
  intake, buf = make_intake(capacity=16, on_policy=True)
  first, second = intake.next_request(), intake.next_request()
  assert first is not None and second is not None
  assert intake.next_request() is None  # 8 + 8 in flight fill the queue of 16
  intake.dropped(second, RuntimeError("worker died"))
  assert intake.in_flight == 8
  third = intake.next_request()
  assert [i for i, _ in third.meta] == [i for i, _ in second.meta]  # the lost prompts come back
  intake.deliver(first, groups_for(first, [True, False, True, False]))
  assert intake.next_request() is None  # 8 held + 8 in flight
  buf.sample(8)  # the trainer consumes the queue
  assert intake.next_request() is not None


def test_deliver_is_all_or_nothing_and_state_round_trips():
  intake, buf = make_intake()
  batch = intake.next_request()
  bad = groups_for(batch, [True, False, True, False])
  bad[1].completions.pop()  # groups of different sizes: nothing may reach the buffer
  with pytest.raises(ValueError, match="different sizes"):
    intake.deliver(batch, bad)
  assert len(buf) == 0 and intake.in_flight == 0
  state = intake.state_dict()
  other, _ = make_intake()
  other.load_state_dict(state)
  assert other.next_group_id == intake.next_group_id
  assert [i for i, _ in other.next_request().meta] == [0, 1]  # undelivered prompts handed out again


def test_score_groups_and_to_rollouts():
  intake, _ = make_intake()
  batch = intake.next_request()
  groups = groups_for(batch, [False, True, True, True])
  rewards = score_groups(groups, [p for _, p in batch.meta], Task(), Codec())
  np.testing.assert_array_equal(rewards, [[0, 1, 1, 1]] * 2)
  rollouts = to_rollouts(groups, rewards, np.zeros_like(rewards), [7, 8])
  assert [r.group_id for r in rollouts] == [7] * 4 + [8] * 4
  assert [r.reward for r in rollouts] == [0.0, 1.0, 1.0, 1.0] * 2


def test_intake_is_thread_safe_under_concurrent_delivery():
  intake, buf = make_intake(capacity=4096)
  batches = [intake.next_request() for _ in range(40)]

  def deliver(bs):
    for b in bs:
      intake.deliver(b, groups_for(b, [True, False, True, False]))
  threads = [threading.Thread(target=deliver, args=(batches[k::4],)) for k in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(buf) == 320 and intake.in_flight == 0
  assert sorted({r.group_id for r in buf.contents()}) == list(range(80))


def test_deliver_with_rewards_scored_beforehand_lands_the_same_rollouts():
  """The async pool scores in its `prepare` stage (`Intake.score`, outside any lock) and hands the
  rewards to `deliver`: the same rollouts, advantages and group ids as scoring inside `deliver`."""
  a, buf_a = make_intake()
  b, buf_b = make_intake()
  for right in ([True, False, False, True], [False, False, True, True]):
    batch_a, batch_b = a.next_request(), b.next_request()
    groups_a, groups_b = groups_for(batch_a, right), groups_for(batch_b, right)
    a.deliver(batch_a, groups_a)
    rewards = b.score(batch_b, groups_b)
    np.testing.assert_array_equal(rewards, [right] * 2)  # [P, G]
    b.deliver(batch_b, groups_b, rewards=rewards)
  assert a.next_group_id == b.next_group_id == 4 and a.in_flight == b.in_flight == 0
  state_a, state_b = buf_a.state_dict(), buf_b.state_dict()
  assert len(state_a["reward"]) == 16 and set(state_a) == set(state_b)
  for key in state_a:
    np.testing.assert_array_equal(state_a[key], state_b[key], err_msg=key)
  np.testing.assert_array_equal(a.take_fresh_rewards(), b.take_fresh_rewards())


def test_multi_turn_requests_land_as_trajectories_and_count_for_the_metrics_rows():
  """A calculator request: its rollouts keep their masks, the intake counts the trajectories
  (env/* cumulative, means over those delivered since the last row) and checkpoints the fresh
  ones."""
  from jaxreplay.rollout import base  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout import multiturn  # pylint: disable=g-import-not-at-top
  from jaxreplay.tasks import calculator, environments, tokenizer  # pylint: disable=g-import-not-at-top
  from tests.helpers.scripted_worker import ScriptedWorker, calculator_script  # pylint: disable=g-import-not-at-top
  task = calculator.CalculatorTask(num_digits=(2, 3), seed=0)
  codec = tokenizer.TextCodec(tokenizer.build_char_tokenizer(task.charset))
  runner = multiturn.EpisodeRunner(environments.spec_from_factory(task.make_env, 6, 64, 5.0),
                                   codec, 64)
  buf = ReplayBuffer(64, seed=0)
  intake = Intake(task, codec, PromptSource(task, seed=5), buf, make_advantage_fn("grpo"),
                  SamplingParams(max_tokens=48, stop_token_ids=codec.stop_ids),
                  prompts_per_request=2, group_size=3, episodes=runner)
  assert intake.env_metrics()["env/episodes"] == 0.0
  batch = intake.next_request()
  assert batch.episodes is not None and batch.episodes.problems == tuple(p for _, p in batch.meta)
  worker = ScriptedWorker(codec, calculator_script([p for _, p in batch.meta]))
  groups = base.generate_request(worker, batch.prompts, batch.n, batch.sampling, batch.episodes)
  intake.deliver(batch, groups)
  runner.close()
  held = buf.contents()
  assert len(held) == 6 and all(r.num_turns > 1 and r.reward == 1.0 for r in held)
  calls = sum(c.episode.tool_calls for g in groups for c in g.completions)
  state = intake.state_dict()
  assert len(state["fresh_episodes"]) == 6
  m = intake.env_metrics()
  assert m["env/episodes"] == 6.0 and m["env/tool_calls"] == float(calls) > 0
  assert m["env/errors"] == m["env/timeouts"] == m["env/budget_cuts"] == 0.0
  assert m["env/turns_mean"] == calls / 6 + 1 and m["env/tool_correct"] == 1.0
  again = intake.env_metrics()  # nothing new: counts stay, means are NaN
  assert again["env/episodes"] == 6.0 and np.isnan(again["env/turns_mean"])
  intake.load_state_dict(state)
  assert intake.env_metrics()["env/turns_mean"] == m["env/turns_mean"]
