"""Tasks: problems, prompts and rewards, plus the tokenizer interface (`tokenizer.TextCodec`).

Every task has `sample(rng, n)`, `eval_set(n)`, `reward(completion, problem)`,
`score_batch(completions, problems)`, `reward_metrics()`, `charset` and `close()`.
Modules: `arithmetic` (the procedural task), `scratchpad` (addition with worked solutions),
`multiplication` (multiplication by one digit with worked solutions), `math_data` (datasets from
files), `rewards`, `tokenizer`, `prompt_check`; `make_task` below.
"""
from jaxreplay.tasks import arithmetic, math_data, multiplication, scratchpad


def make_task(name: str, **kwargs):
  """"arithmetic" -> ArithmeticTask(**kwargs); "scratchpad" -> ScratchpadAdditionTask(**kwargs);
  "multiplication" -> WrittenMultiplicationTask(**kwargs); "math" -> MathTask.from_files(**kwargs)
  (needs `path`)."""
  if name == "arithmetic":
    return arithmetic.ArithmeticTask(**kwargs)
  if name == "scratchpad":
    return scratchpad.ScratchpadAdditionTask(**kwargs)
  if name == "multiplication":
    return multiplication.WrittenMultiplicationTask(**kwargs)
  if name == "math":
    if "path" not in kwargs:
      raise ValueError("make_task('math') needs path=<local .jsonl/.json/.parquet file or dir>")
    return math_data.MathTask.from_files(**kwargs)
  raise ValueError(f"unknown task {name!r}; expected 'arithmetic', 'scratchpad', "
                   "'multiplication' or 'math'")
