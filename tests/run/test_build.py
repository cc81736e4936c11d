"""`run.build`: `Parts` (a record of groups, each part read through its group: no flat aliases),
and the task a config builds (`make_task`)."""
import dataclasses

import pytest

from jaxreplay.config import validation
from jaxreplay.config.defaults import base_config
from jaxreplay.run import build as build_lib


def test_parts_are_read_through_their_groups():
  learner = build_lib.LearnerParts(model_cfg=None, mesh=None, state="s0", train_step=len,
                                   logprob_fn=None)
  data = build_lib.DataParts(task=None, codec=None, tokenizer_dir=None, buffer="buf", intake=None,
                             buckets=(8,), eval_problems=[])
  gen = build_lib.GenerationParts(rollouts=None, eval_sampler=None, sim_state=None,
                                  gen_seconds_per_rollout=1.5)
  tel = build_lib.TelemetryParts(accountant=None, metrics="m", writer=None)
  parts = build_lib.Parts(config=None, workdir="w", learner=learner, data=data, generation=gen,
                          telemetry=tel, checkpointer=None, resumed_host=None)
  assert (parts.learner.state, parts.data.buffer, parts.data.buckets, parts.telemetry.metrics,
          parts.learner.lora, parts.data.reuse, parts.generation.gen_seconds_per_rollout) == (
              "s0", "buf", (8,), "m", None, None, 1.5)
  assert parts.model_params("p") == "p"  # no LoRA: the params themselves
  # Parts' own fields are the groups and the run's record; no group field is repeated on it.
  own = {f.name for f in dataclasses.fields(build_lib.Parts)}
  assert own == {"config", "workdir", "learner", "data", "generation", "telemetry",
                 "checkpointer", "resumed_host"}
  grouped = [f.name for cls in (build_lib.LearnerParts, build_lib.DataParts,
                                build_lib.GenerationParts, build_lib.TelemetryParts)
             for f in dataclasses.fields(cls)]
  assert len(grouped) == len(set(grouped))
  assert not [name for name in grouped if hasattr(parts, name)]


def test_build_accepts_num_digits_5_and_names_bad_task_keys():
  c = base_config()
  c.task.num_digits = (5,)  # as --config.task.num_digits=5 sets it
  validation.validate_config(c)
  task = build_lib.make_task(c.task)
  assert task.num_digits == (5, 5)
  task.close()
  c.task.num_digits = (0, 3)  # a single-key rule (`key_rules`): reported before the sections
  with pytest.raises(ValueError, match=r"task.num_digits=\(0, 3\): expected a tuple of integers"):
    validation.validate_config(c)
  c.task.num_digits = (1, 3)
  c.task.max_skip_fraction = 1.5
  c.task.reward_memory_gib = 0.0
  with pytest.raises(ValueError) as e:
    validation.validate_config(c)
  assert "task.max_skip_fraction=1.5 must be in [0, 1]" in str(e.value)
  assert "task.reward_memory_gib=0.0 must be > 0" in str(e.value)
