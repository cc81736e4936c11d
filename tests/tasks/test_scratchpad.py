"""The scratchpad-addition task: worked solutions, the exact reward, the split, the noisy teacher,
and the shipped warm-start `assets/scratchpad-sft` (what configs/scratchpad.py documents)."""
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.run import build
from jaxreplay.models import hf_io
from jaxreplay.models import presets
from jaxreplay.tasks import tokenizer
from jaxreplay.sft import greedy_exact_match
from jaxreplay.sft import noise_kwargs
from jaxreplay.tasks import arithmetic
from jaxreplay.tasks import scratchpad as sp
from tests.helpers.paths import REPO

SFT = os.path.join(REPO, "assets", "scratchpad-sft")


def _config():
  from configs import scratchpad  # pylint: disable=g-import-not-at-top
  return scratchpad.get_config()


def _reference(a: int, b: int) -> str:
  """The worked solution written out independently of `scratchpad._columns`."""
  width = max(len(str(a)), len(str(b)))
  da, db = str(a).zfill(width), str(b).zfill(width)
  cols, carry = [], 0
  for i in range(width - 1, -1, -1):
    s = int(da[i]) + int(db[i]) + carry
    cols.append(f"{da[i]}+{db[i]}+{carry}={s:02d}")
    carry = s // 10
  return ",".join(cols) + ";" + str(a + b)


def test_worked_solutions():
  assert sp.worked_solution(4738, 2956) == "8+6+0=14,3+5+1=09,7+9+0=16,4+2+1=07;7694"
  assert sp.worked_solution(473, 2956) == "3+6+0=09,7+5+0=12,4+9+1=14,0+2+1=03;3429"
  assert sp.worked_solution(999, 1) == "9+1+0=10,9+0+1=10,9+0+1=10;1000"
  assert sp.worked_solution(0, 0) == "0+0+0=00;0"
  rng = np.random.default_rng(0)
  for a, b in rng.integers(0, 10 ** 6, (300, 2)):
    sol = sp.worked_solution(int(a), int(b))
    assert sol == _reference(int(a), int(b))
    assert sp.final_answer(sol) == str(a + b)
  assert sp.final_answer("1+2+0=03") is None
  with pytest.raises(ValueError, match="non-negative"):
    sp.worked_solution(-1, 3)


def test_problems_and_charset():
  task = sp.ScratchpadAdditionTask(num_digits=(2, 4), seed=0)
  for p in task.sample(np.random.default_rng(0), 300):
    a, b = (int(x) for x in p.prompt[:-1].split("+"))
    assert p.prompt == f"{a}+{b}=" and 10 <= a < 10 ** 4 and 10 <= b < 10 ** 4
    assert p.answer == sp.worked_solution(a, b) and p.id == arithmetic.problem_id(p.prompt)
    assert set(p.prompt + p.answer) <= set(task.charset)
    assert len(p.answer) + 1 <= task.max_completion_tokens()  # + eos
  longest = sp.worked_solution(9999, 9999)
  assert len(longest) + 1 == task.max_completion_tokens()


def test_reward_is_exact():
  task = sp.ScratchpadAdditionTask(num_digits=(2, 4))
  p = task._make(4738, "+", 2956)  # pylint: disable=protected-access
  right = "8+6+0=14,3+5+1=09,7+9+0=16,4+2+1=07;7694"
  assert p.answer == right
  assert task.reward(right, p) == 1.0
  assert task.reward(right + " ", p) == 1.0  # surrounding whitespace is not part of the text
  wrong = [
      "8+6+0=14,3+5+1=09,7+9+0=16,4+2+1=07;7695",  # wrong result
      "8+6+0=14,3+5+0=08,7+9+0=16,4+2+1=07;7684",  # dropped carry, consistent result
      "8+6+0=14,3+5+1=09,7+9+0=17,4+2+1=08;8794",  # a wrong column sum
  ]
  malformed = [
      "7694",                                        # the right result without the scratchpad
      ";7694",
      "8+6+0=14,3+5+1=09,7+9+0=16;7694",            # a column missing
      "8+6+0=14,3+5+1=09,7+9+0=16,4+2+1=07",        # no result
      "8+6+0=14 3+5+1=09 7+9+0=16 4+2+1=07;7694",   # wrong separators
      "8+6=14,3+5+1=09,7+9=16,4+2+1=07;7694",       # carries not written
      "8+6+0=14,3+5+1=9,7+9+0=16,4+2+1=7;7694",     # one-digit sums
      right + ";7694", right + "0", "", "\n" + right[:-1],
  ]
  for text in wrong + malformed:
    assert task.reward(text, p) == 0.0, text
  scores = task.score_batch([right, wrong[0], malformed[0]], [p, p, p])
  assert scores.dtype == np.float32
  np.testing.assert_array_equal(scores, [1.0, 0.0, 0.0])
  assert task.reward_metrics()["reward/calls"] == 3
  task.close()


def test_heldout_and_training_problems_never_overlap():
  task = sp.ScratchpadAdditionTask(num_digits=(2, 4), seed=0)
  evalset = task.eval_set(1024)
  assert len({p.prompt for p in evalset}) == 1024
  assert all(task.is_heldout(p) for p in evalset)
  train = task.sample(np.random.default_rng(1), 5000)
  assert not {p.prompt for p in train} & {p.prompt for p in evalset}
  assert not any(task.is_heldout(p) for p in train)
  sft_prompts = {q for q, _ in task.sft_examples(3000, slip=0.5, carry_drop=0.2)}
  assert not sft_prompts & {p.prompt for p in evalset}
  assert sp.ScratchpadAdditionTask(num_digits=(2, 4), seed=0).eval_set(64) == evalset[:64]
  # The split is the arithmetic task's (hash of the prompt and seed): the same for both tasks.
  assert arithmetic.ArithmeticTask(num_digits=(2, 4), ops="+").eval_set(64) == [
      arithmetic.Problem(p.prompt, sp.final_answer(p.answer), p.id) for p in evalset[:64]]


def test_noisy_teacher():
  task = sp.ScratchpadAdditionTask(num_digits=(2, 4))
  clean = list(task.sft_examples(2000, seed=1))
  assert clean == list(task.sft_examples(2000, seed=1, slip=0.0, carry_drop=0.0))
  assert all(t == sp.worked_solution(*(int(x) for x in q[:-1].split("+"))) for q, t in clean)
  table = sp.misconceptions(0.3, (0.4, 0.95), seed=0)
  assert 40 <= len(table) <= 80  # ~30% of 200 facts
  for (x, y, c), (prob, wrong) in table.items():
    assert 0.4 <= prob <= 0.95 and abs(wrong - (x + y + c)) == 1 and 0 <= wrong <= 19
  assert sp.misconceptions(0.3, (0.4, 0.95), seed=0) == table
  noisy = list(task.sft_examples(2000, seed=1, slip=0.3))
  assert [q for q, _ in noisy] == [q for q, _ in clean]  # same prompts, only targets differ
  slips = seen = 0
  for (_, right), (_, target) in zip(clean, noisy):
    body, result = target.split(";")
    cols = [(int(c[0]), int(c[2]), int(c[4]), int(c[6:8])) for c in body.split(",")]
    assert len(cols) == right.count(",") + 1
    carry = 0
    for x, y, c, s in cols:
      assert c == carry  # carries follow the written sums
      if (x, y, c) in table:
        seen += 1
        slips += s != x + y + c
        assert s in (x + y + c, table[(x, y, c)][1])
      else:
        assert s == x + y + c
      carry = s // 10
    assert target == sp.render(cols)  # the result is read off the written sums
  mean_p = np.mean([prob for prob, _ in table.values()])
  assert abs(slips / seen - mean_p) < 0.08, (slips / seen, mean_p)
  dropped = list(task.sft_examples(2000, seed=1, carry_drop=1.0))
  assert all("+1=" not in t for _, t in dropped)  # every carry forgotten
  with pytest.raises(ValueError, match="carry_drop"):
    next(task.sft_examples(1, carry_drop=1.5))
  with pytest.raises(ValueError, match="slip"):
    next(task.sft_examples(1, slip=2.0))


def test_config_builds_the_task_and_sft_noise():
  c = _config()
  task = build.make_task(c.task)
  assert isinstance(task, sp.ScratchpadAdditionTask)
  assert task.num_digits == tuple(c.task.num_digits)
  assert c.rollout.max_tokens >= task.max_completion_tokens()
  noise = noise_kwargs(c.sft, "scratchpad")
  assert set(noise) <= {"slip", "slip_range", "carry_drop"}
  noisy = dict(c.sft, slip=0.3, slip_range=(0.4, 0.9), carry_drop=0.0)
  assert noise_kwargs(noisy, "scratchpad") == {"slip": 0.3, "slip_range": (0.4, 0.9)}
  with pytest.raises(ValueError, match="slip"):
    noise_kwargs(noisy, "arithmetic")
  task.close()


# ---- the shipped warm-start -----------------------------------------------------------------


@pytest.fixture(scope="module")
def warm_start():
  cfg, params = hf_io.load_hf(SFT, dtype=jnp.float32)
  return cfg, params, tokenizer.load_tokenizer(SFT)


def test_warm_start_tokenizer_matches_model_and_task(warm_start):
  cfg, _, codec = warm_start
  tokenizer.check_tokenizer_matches_model(codec, cfg)
  c = _config()
  assert cfg.num_hidden_layers == presets.PRESETS[c.model.preset]().num_hidden_layers
  task = build.make_task(c.task)
  for p in task.eval_set(16):
    assert codec.decode(codec.encode_prompt(p.prompt)) == p.prompt
    assert codec.decode(codec.encode(p.answer, add_bos=False)) == p.answer
    assert 3 not in codec.encode(p.prompt + p.answer)  # no <unk>
  task.close()


def test_warm_start_greedy_accuracy_in_documented_range(warm_start):
  cfg, params, codec = warm_start
  c = _config()
  task = build.make_task(c.task)
  problems = task.eval_set(512)
  right = greedy_exact_match(cfg, params, codec, [(p.prompt, p.answer) for p in problems],
                             c.model.max_len)
  lo, hi = WARM_START_GREEDY
  assert lo < right.mean() < hi, right.mean()
  cols = np.array([p.answer.count(",") + 1 for p in problems])
  # Short problems are easier: fewer columns, fewer chances of a misremembered fact.
  assert right[cols == cols.min()].mean() > right[cols == cols.max()].mean()
  task.close()


WARM_START_GREEDY = (0.15, 0.45)  # held-out greedy exact match of assets/scratchpad-sft
