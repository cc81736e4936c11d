"""jaxreplay: RL post-training of LLMs in JAX with an experience-replay buffer.

The package is layered (WORKSPACE.md draws the map):
  config/    defaults, validation, device split, memory plan
  models/    Qwen3 / Qwen2.5 / Llama as pure functions over a parameter pytree, HF conversion
  tasks/     problems, prompts, rewards, tokenizers
  learner/   losses, algorithms, batch, optimizer, the jitted train step
  data/      the replay buffer, collate, the experience intake
  rollout/   rollout workers (JAX sampler, vLLM, Ray), the pool, weight publishers
  run/       build, the pipeline, the schedules, evaluation, metrics rows, compute accounting
  infra/     sharding, checkpoints, child processes, safety, the step channel, metric writers
  science/   sweeps, statistics, plots, reports, Theorem 4.5's design, the noise probe
Entry points: `python -m jaxreplay.launch | sft | experiments | plot`.

Import modules by their path (`from jaxreplay.data import buffer`); the packages import nothing,
so that `import jaxreplay` (or a layer) stays cheap and optional dependencies (vLLM, torch, Ray)
load only when used.
"""

__version__ = "0.1.0"
