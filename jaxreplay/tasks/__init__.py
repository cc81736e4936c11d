"""Tasks: problems, prompts and rewards, plus the tokenizer interface (`TextCodec`).

Every task has `sample(rng, n)`, `eval_set(n)`, `reward(completion, problem)`,
`score_batch(completions, problems)`, `reward_metrics()`, `charset` and `close()`.
"""
from jaxreplay.tasks.arithmetic import ArithmeticTask, Problem, is_heldout, problem_id
from jaxreplay.tasks.math_data import (PROMPT_TEMPLATES, MathTask, load_math_dataset,
                                       split_heldout)
from jaxreplay.tasks.rewards import (PluginReward, SafeReward, exact_match_reward,
                                     import_reward_fn, math_verify_reward)
from jaxreplay.tasks.multiplication import WrittenMultiplicationTask, multiplication_reward
from jaxreplay.tasks.scratchpad import ScratchpadAdditionTask, scratchpad_reward, worked_solution
from jaxreplay.tasks.tokenizer import (CHAT_TEMPLATE_MODES, TextCodec, build_char_tokenizer,
                                       check_tokenizer_matches_model, has_chat_template,
                                       load_tokenizer, model_eos_ids, use_chat_template_mode)

__all__ = [
    "ArithmeticTask", "CHAT_TEMPLATE_MODES", "MathTask", "PluginReward", "Problem",
    "PROMPT_TEMPLATES", "SafeReward", "ScratchpadAdditionTask", "TextCodec",
    "WrittenMultiplicationTask", "build_char_tokenizer", "check_tokenizer_matches_model",
    "exact_match_reward", "has_chat_template", "import_reward_fn", "is_heldout",
    "load_math_dataset", "load_tokenizer", "make_task", "math_verify_reward", "model_eos_ids",
    "multiplication_reward", "problem_id", "scratchpad_reward", "split_heldout",
    "use_chat_template_mode", "worked_solution",
]


def make_task(name: str, **kwargs):
  """"arithmetic" -> ArithmeticTask(**kwargs); "scratchpad" -> ScratchpadAdditionTask(**kwargs);
  "multiplication" -> WrittenMultiplicationTask(**kwargs); "math" -> MathTask.from_files(**kwargs)
  (needs `path`)."""
  if name == "arithmetic":
    return ArithmeticTask(**kwargs)
  if name == "scratchpad":
    return ScratchpadAdditionTask(**kwargs)
  if name == "multiplication":
    return WrittenMultiplicationTask(**kwargs)
  if name == "math":
    if "path" not in kwargs:
      raise ValueError("make_task('math') needs path=<local .jsonl/.json/.parquet file or dir>")
    return MathTask.from_files(**kwargs)
  raise ValueError(f"unknown task {name!r}; expected 'arithmetic', 'scratchpad', "
                   "'multiplication' or 'math'")
