"""The calculator task (`tasks.calculator`): the tool's answers, the environment's reset / step /
metrics on hand-worked trajectories, tool-use correctness, the noisy demonstrations."""
import numpy as np
import pytest

from jaxreplay.tasks import arithmetic
from jaxreplay.tasks import calculator as calc
from jaxreplay.tasks import scratchpad as sp


def problem(a: int, b: int) -> arithmetic.Problem:
  prompt = f"{a}+{b}="
  return arithmetic.Problem(prompt, sp.worked_solution(a, b), arithmetic.problem_id(prompt))


def play(env, p, turns):
  """Resets `env` on `p` and plays `turns`; returns the [(observation, reward, done)] steps."""
  assert env.reset(p) is None  # the problem's prompt is the first observation
  return [env.step(t) for t in turns]


@pytest.mark.parametrize("expression,output", [
    ("8+6+0", "=14"), ("9+9+1", "=19"), ("0+0+0", "=00"), ("3+5+1", "=09"), ("45+45+9", "=99"),
    ("50+49+1", "=!!"),  # 100: not two digits
    ("8+6", "=!!"), ("8+6+0+1", "=!!"), ("a+6+0", "=!!"), ("123+1+0", "=!!"), ("", "=!!"),
    ("-1+2+0", "=!!"), ("8+6+", "=!!")])
def test_calculator_output(expression, output):
  assert calc.calculator_output(expression) == output


def test_parse_calls():
  tool = calc.Calculator()
  assert tool.parse("8+6+0?") == "8+6+0"
  assert tool.parse(",3+5+1=09,7+9+0?") == "7+9+0"
  assert tool.parse(",4+2+1=07;7694") is None  # no "?" at the end: no call
  assert tool.run("7+9+0") == "=16"


def test_episode_using_every_result():
  """4738+2956 with the calculator on columns 1 and 3: observations "=14", "=16"; reward 1 at
  the last turn, both calls right and used."""
  env = calc.CalculatorEnv()
  p = problem(4738, 2956)
  steps = play(env, p, ["8+6+0?", ",3+5+1=09,7+9+0?", ",4+2+1=07;7694"])
  assert steps == [("=14", 0.0, False), ("=16", 0.0, False), ("", 1.0, True)]
  assert env.metrics() == {"tool_calls": 2, "tool_correct": 2}
  # The transcript without the "?"s is the worked solution.
  assert calc.strip_calls("".join(env.transcript)) == p.answer


def test_episode_ignoring_a_result():
  """The policy calls 8+6+0 (=14) but carries 0 into the next column: wrong answer, reward 0, the
  call not counted correct; a second right call that is used still counts."""
  env = calc.CalculatorEnv()
  steps = play(env, problem(4738, 2956),
               ["8+6+0?", ",3+5+0=08,7+9+0?", ",4+2+1=07;7684"])
  assert [s[1:] for s in steps] == [(0.0, False), (0.0, False), (0.0, True)]
  assert env.metrics() == {"tool_calls": 2, "tool_correct": 1}


def test_wrong_call_and_unused_digit():
  env = calc.CalculatorEnv()
  # 57+68: columns 7+8+0=15, 5+6+1=12 -> 125. The call is on the wrong digits (7+9): not correct.
  play(env, problem(57, 68), ["7+9+0?", ",5+6+1=12;125"])
  assert env.metrics() == {"tool_calls": 1, "tool_correct": 0}
  # Right call (7+8+0 -> 15), carry used, but the result's units digit is not the call's 5.
  env = calc.CalculatorEnv()
  steps = play(env, problem(57, 68), ["7+8+0?", ",5+6+1=12;124"])
  assert steps[-1] == ("", 0.0, True)
  assert env.metrics() == {"tool_calls": 1, "tool_correct": 0}
  # The last column's call: its tens are the result's leading digit.
  env = calc.CalculatorEnv()
  steps = play(env, problem(57, 68), ["7+8+0=15,5+6+1?", ";125"])
  assert steps == [("=12", 0.0, False), ("", 1.0, True)]
  assert env.metrics() == {"tool_calls": 1, "tool_correct": 1}


def test_malformed_call_and_reset_clears_state():
  env = calc.CalculatorEnv()
  steps = play(env, problem(12, 34), ["2+4+0+1?", "2+4+0=06,1+3+0=04;46"])
  assert steps[0] == ("=!!", 0.0, False)
  assert steps[1][1:] == (0.0, True)  # the malformed call stays in the transcript
  assert env.metrics() == {"tool_calls": 1, "tool_correct": 0}
  steps = play(env, problem(12, 34), ["2+4+0=06,1+3+0=04;46"])  # a new episode
  assert steps == [("", 1.0, True)]
  assert env.metrics() == {"tool_calls": 0, "tool_correct": 0}


def test_task_charset_and_reference_trajectories():
  task = calc.CalculatorTask(num_digits=(2, 4), seed=0)
  assert calc.CALL in task.charset and "!" in task.charset
  for p in task.sample(np.random.default_rng(1), 50):
    segments = calc.reference_trajectory(p)
    turns = [text for text, trained in segments if trained]
    observations = [text for text, trained in segments if not trained]
    env = task.make_env()
    steps = play(env, p, turns)
    assert [s[0] for s in steps[:-1]] == observations
    assert steps[-1] == ("", 1.0, True)
    n_cols = len(sp.column_sums(*(int(x) for x in p.prompt[:-1].split("+"))))
    assert env.metrics() == {"tool_calls": n_cols, "tool_correct": n_cols}
    text = "".join(t for t, _ in segments)
    assert set(text) <= set(task.charset)
    assert len(p.prompt) + len(text) + 1 <= len(p.prompt) + task.max_completion_tokens()


def test_noisy_demonstrations():
  """The teacher's rates: calls on ~tool_rate of the columns, ignores ~ignore_rate of the results
  (only visible when it misremembers); with no noise every demonstration scores 1."""
  task = calc.CalculatorTask(num_digits=(3, 3), seed=0)
  clean = list(task.sft_examples(200, seed=3, tool_rate=0.5, ignore_rate=0.0))
  calls = columns = 0
  for prompt, segments in clean:
    p = problem(*map(int, prompt[:-1].split("+")))
    env = task.make_env()
    steps = play(env, p, [t for t, trained in segments if trained])
    assert steps[-1][1:] == (1.0, True)
    calls += env.metrics()["tool_calls"]
    columns += 3  # 3-digit operands: 3 columns (a carry out adds a result digit, no column)
  assert 0.4 < calls / columns < 0.6
  noisy = list(task.sft_examples(300, seed=3, slip=0.3, tool_rate=0.5, ignore_rate=0.3))
  wins = []
  for prompt, segments in noisy:
    env = task.make_env()
    steps = play(env, problem(*map(int, prompt[:-1].split("+"))),
                 [t for t, trained in segments if trained])
    wins.append(steps[-1][1])
  assert 0.05 < np.mean(wins) < 0.95  # imperfect on purpose, not hopeless
  for name in ("tool_rate", "ignore_rate", "carry_drop"):
    with pytest.raises(ValueError, match=name):
      next(task.sft_examples(1, **{name: 1.5}))


# ---- the shipped warm-start assets/calculator-sft (configs/multiturn.py) ------------------------

# When built (configs/multiturn.py): sft/greedy_accuracy 0.504, 0.05 calls per greedy episode (its
# demonstrations call on half the columns, so greedy decoding mostly writes the sum itself), the
# few calls right and used (sft/tool_correct 1.0): a policy that is often wrong from misremembered
# facts and under-uses the calculator that would fix them, with headroom for RL.
WARM_START_GREEDY = (0.35, 0.7)
WARM_START_TOOL_CALLS_MAX = 0.5


def _config():
  import runpy  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  from tests.helpers.paths import REPO  # pylint: disable=g-import-not-at-top
  return runpy.run_path(os.path.join(REPO, "configs", "multiturn.py"))["get_config"]()


def test_warm_start_matches_its_config_and_plays_imperfectly():
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxreplay import sft  # pylint: disable=g-import-not-at-top
  from jaxreplay.models import hf_io, presets  # pylint: disable=g-import-not-at-top
  from jaxreplay.run import build  # pylint: disable=g-import-not-at-top
  from jaxreplay.tasks import tokenizer  # pylint: disable=g-import-not-at-top
  c = _config()
  cfg, params = hf_io.load_hf(c.model.path, dtype=jnp.float32)
  codec = tokenizer.load_tokenizer(c.model.path)
  tokenizer.check_tokenizer_matches_model(codec, cfg)
  assert cfg.num_hidden_layers == presets.PRESETS[c.model.preset]().num_hidden_layers
  task = build.make_task(c.task)
  assert isinstance(task, calc.CalculatorTask)
  for p in task.eval_set(16):
    text = "".join(t for t, _ in calc.reference_trajectory(p))
    assert codec.decode(codec.encode(p.prompt + text, add_bos=False)) == p.prompt + text
    assert tokenizer.UNK_ID not in codec.encode(p.prompt + text)
  stats = sft.episode_accuracy(cfg, params, codec, task, task.eval_set(256), c.model.max_len,
                               max_turns=c.task.env_max_turns)
  lo, hi = WARM_START_GREEDY
  assert lo < stats["sft/greedy_accuracy"] < hi, stats
  assert 0 < stats["sft/tool_calls_mean"] < WARM_START_TOOL_CALLS_MAX, stats
  assert stats["sft/turns_mean"] == pytest.approx(1 + stats["sft/tool_calls_mean"]), stats
  assert stats["sft/tool_correct"] > 0.5, stats
  task.close()
