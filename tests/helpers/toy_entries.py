"""Not tests: toy entries of the tables that say "a new X is one entry here" (a rollout backend in
`rollout.backend_table.BACKENDS`, a buffer sampler in `data.samplers.SAMPLERS`, a schedule in
`config.schedule_table.SCHEDULES`), which the tests add, run through the real code and remove."""
import numpy as np

from jaxreplay.config import schedule_table
from jaxreplay.rollout import backend_table
from jaxreplay.rollout.base import Completion, Group
from jaxreplay.run import schedules


class ToyWorker:
  """A rollout worker of a toy backend: uniform random completions of `length` tokens over the
  vocabulary (each token's sampler log-prob -log V), tagged with the version it holds; its noise
  does not follow a call counter (`RolloutWorker.call_count` None)."""

  call_count = None

  def __init__(self, vocab_size: int, seed: int, version: int, length: int = 4):
    self.vocab_size, self.length = int(vocab_size), int(length)
    self.rng = np.random.default_rng(seed)
    self.policy_version = int(version)
    self.calls = 0

  def generate(self, prompts, n, sampling):
    del sampling
    self.calls += 1
    lp = np.full(self.length, -np.log(self.vocab_size), np.float32)
    return [Group(np.asarray(p, np.int32),
                  [Completion(self.rng.integers(1, self.vocab_size, self.length).astype(np.int32),
                              lp, "length") for _ in range(n)], self.policy_version, prompt_index=i)
            for i, p in enumerate(prompts)]

  def load_weights(self, weights):
    self.policy_version = int(weights.version)

  def close(self):
    pass


MADE: list = []  # the toy workers made (by the backend's factory), newest last


def toy_worker(backend, index, weights):
  """The toy backend's worker factory (`Backend.workers`)."""
  MADE.append(ToyWorker(backend.model_cfg.vocab_size, backend.worker_seed(index), weights.version))
  return MADE[-1]


# A toy rollout backend: its worker + the JAX samplers' device-copy publisher, on the trainer devices.
TOY_BACKEND = backend_table.Backend(
    name="toy", title="a toy backend", workers={("local",): toy_worker},
    publishers={("local", None): "jaxreplay.rollout.backends:device_copies"},
    on_trainer_devices=True)


class OldestSampler:
  """A toy buffer sampler: the oldest B held rollouts (no randomness)."""
  consumes = False

  def draw(self, held, rng, batch_size):
    del rng
    return held.slots(np.arange(batch_size, dtype=np.int64))


def oldest_sampler(options):
  """The toy sampler's `SAMPLERS` entry (a factory of `SamplerOptions`)."""
  del options
  return OldestSampler()


class ToySchedule(schedules.SimulatedScheduler):
  """A toy schedule: the simulated one under its own kind."""
  kind = "toy"


TOY_SCHEDULE = schedule_table.ScheduleRecord(f"{__name__}:ToySchedule")
