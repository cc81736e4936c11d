"""`build.Parts`: a record of groups, each part read through its group (no flat aliases)."""
import dataclasses

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
