"""A rollout worker that writes scripted turns (tests of multi-turn trajectories without a model).

`ScriptedWorker(codec, script)`: `generate(prompts, n, sampling)` decodes each prompt (a problem's
prompt, or a conversation so far) and writes `script(text, sample) -> next turn text` as tokens,
with the codec's eos appended unless the turn already ends at one of `sampling.stop_token_ids`;
cut at `sampling.max_tokens` (finish reason "length"), each token's log-prob `LOGPROB`. It counts
its generate calls (`calls`) and keeps the prompts it was given (`seen`).

`segments_script({prompt: segments})` plays given trajectories (segments [(text, trained)] as
`calculator.reference_trajectory` writes them): the turn after k observations is the k-th turn;
`calculator_script(problems)` plays each problem's reference trajectory (every column called,
every result used).
"""
import dataclasses

import numpy as np

from jaxreplay.rollout.base import Completion, Group
from jaxreplay.tasks import calculator

LOGPROB = -0.25


@dataclasses.dataclass
class ScriptedWorker:
  codec: object
  script: object
  policy_version: int = 0
  call_count: int = None
  calls: int = 0

  def __post_init__(self):
    self.seen = []

  def _turn(self, text: str, sample: int, sampling) -> Completion:
    ids = [int(i) for i in self.codec.encode(self.script(text, sample), add_bos=False)]
    if not ids or ids[-1] not in sampling.stop_token_ids:
      ids.append(self.codec.eos_id)
    cut = len(ids) > sampling.max_tokens
    ids = ids[:sampling.max_tokens]
    return Completion(tokens=np.asarray(ids, np.int32),
                      logprobs=np.full(len(ids), LOGPROB, np.float32),
                      finish_reason="length" if cut else "stop")

  def generate(self, prompts, n, sampling):
    self.calls += 1
    groups = []
    for i, p in enumerate(prompts):
      self.seen.append(np.asarray(p, np.int32))
      text = self.codec.tokenizer.decode([int(t) for t in p], skip_special_tokens=True)
      groups.append(Group(prompt_tokens=np.asarray(p, np.int32),
                          completions=[self._turn(text, j, sampling) for j in range(n)],
                          policy_version=self.policy_version, prompt_index=i))
    return groups

  def load_weights(self, weights):
    self.policy_version = weights.version

  def close(self):
    pass


def segments_script(trajectories):
  """script(conversation, sample) playing `trajectories` {prompt text: segments}."""

  def script(text, sample):
    del sample
    prompt = next(q for q in trajectories if text.startswith(q))
    done = text[len(prompt):]
    segments = trajectories[prompt]
    full = "".join(seg for seg, _ in segments)
    at = 0
    for seg, trained in segments:
      if trained and at == len(done) and full[:at] == done:
        return seg
      at += len(seg)
    raise AssertionError(f"the conversation {text!r} is not on its scripted trajectory")
  return script


def calculator_script(problems):
  """script(conversation, sample) playing each problem's reference trajectory."""
  return segments_script({p.prompt: calculator.reference_trajectory(p) for p in problems})
