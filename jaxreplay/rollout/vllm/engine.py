"""The vLLM rollout backend: an in-process engine and the same engine in its own process.

`VllmEngine` wraps an offline `vllm.LLM` (no tokenizer: prompts are token ids) and implements the
`RolloutWorker` protocol. `VllmWorkerProcess` runs a `VllmEngine` in a child process (a fresh
interpreter, `jaxreplay.infra.child_process`) and is a `RolloutWorker` proxy in the parent, so that W
engines can run beside the JAX trainer (vLLM and JAX must not share a process in the async
pipeline). `WorkerDied` and `GREEDY_EPS` live in `rollout.base` and are importable from here too.

Log-prob semantics (vLLM 0.32, `logprobs_mode="processed_logprobs"`, the default here): the
log-prob of each sampled token is taken from the distribution it was actually sampled from, i.e.
`log_softmax(top_k_top_p_filter(logits / temperature))` in float32, filtered tokens at -inf and
the kept ones renormalised. `logprobs_mode="raw_logprobs"` instead returns `log_softmax(logits)`
whatever the sampling settings. Greedy sampling (temperature < 1e-5, vLLM's `_SAMPLING_EPS`) puts
all its mass on the argmax, so its log-probs are 0.0 here (vLLM itself would report
`log_softmax(logits)`). The JAX sampler (`jax_sampler.py`) follows the same semantics.

Stopping: a completion ends after a token of `SamplingParams.stop_token_ids` or of the engine's
`eos_token_ids` (default: config.json's `eos_token_id`, as the JAX sampler does); that token is kept.

Weight refresh, one RPC either way, called by name through `transfer.WorkerExtension` so that
it also reaches an engine core in its own process, then a prefix-cache reset:
  - `Weights(version, shm_path=...)` (transport "shm", the default): vLLM's weight-transfer session
    with the shared-memory engine of `transfer` (tensors mapped from /dev/shm, no files);
  - `Weights(version, hf_dir=...)` (transport "file"): vLLM's in-place `reload_weights` of the
    safetensors written by `hf_io.save_hf`.
  - `Weights(version, lora_dir=...)` (LoRA, `max_lora_rank` > 0): the engine keeps its base weights
    (started from the base's HF directory) and registers the version's adapter directory (PEFT's
    format) through vLLM's own LoRA support, as a new adapter id per version (`add_lora` of
    `LoRARequest(f"v{version}", version + 1, dir)`); every later request carries that request, and
    the previous id is removed once the new one is in, which is after its last request finished
    (`generate` and `load_weights` hold one lock: vLLM would otherwise silently reload a removed id
    its running requests still use). Until the first adapter is loaded the engine refuses to
    generate (it would sample the base, not the policy).
Both keep CUDA-graph references. On CPU, vLLM keeps a packed copy of each linear weight; with tied
embeddings the LM head is not reloaded itself (its weight is the embedding's) so its packed copy
would stay stale: it is re-packed after the reload. With `weights_pending=True` the engine starts
from a directory with config.json only (vLLM `load_format="dummy"`) and must load weights before
its first request.
`generate` and `load_weights` hold one lock, so no request straddles a refresh, and every Group
carries the version of the weights that generated it.

Multi-turn trajectories (`rollout.multiturn`) reach an engine as one `generate` per turn with each
conversation so far as the prompt; prefix caching is on (`enable_prefix_caching`, vLLM's default,
set explicitly), so a turn prefills only its new observation, and a refresh resets the cache.
"""
from __future__ import annotations

import gc
import glob
import logging
import os
import threading
import time
from typing import Any, Optional, Sequence

import numpy as np

from jaxreplay.infra.child_process import ChildDied, ChildProcess
from jaxreplay.rollout.vllm.worker_side import SHM_BACKEND
from jaxreplay.rollout.base import (GREEDY_EPS, Completion, Group, SamplingParams, StaleWeights,
                                    Weights, WorkerDied, check_prompts)
from jaxreplay.tasks import tokenizer as tokenizer_lib

# Set in the engine's process before vLLM is imported (defaults; the caller's values win).
_DEFAULT_ENV = {
    # The offline engine in the calling process (~3 s start) instead of an engine-core process.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on CPU.
    "VLLM_LOGGING_LEVEL": "WARNING",
}
# CPU only (no NVIDIA device nodes): vLLM's CPU kernels announce their NUMA memory binding through
# torch's C++ warning channel at every engine start; nothing else in a CPU engine process uses that
# channel during a run. On GPU the channel carries real warnings (NCCL...) and is left alone.
if not os.path.exists("/dev/nvidiactl"):
  _DEFAULT_ENV["TORCH_CPP_LOG_LEVEL"] = "ERROR"
# Start-up warnings that say nothing about this use of vLLM: (logger, message start, why benign).
_BENIGN_STARTUP = (
    ("vllm.renderers.base", "Chat template warmup failed",
     "the engine runs without its tokenizer (token ids in and out, skip_tokenizer_init=True)"),
    ("vllm.renderers.base", "Using None for EOS token id because tokenizer is not initialized",
     "stop token ids are given with every request"),
    ("vllm.renderers.base", "Using None for BOS token id because tokenizer is not initialized",
     "prompts arrive as token ids"),
    ("vllm.v1.worker.cpu_worker", "CPU backend doesn't allow to use `torch.set_num_threads`",
     "vLLM binds its CPU threads itself"),
    ("vllm.v1.worker.cpu_worker", "%s is not found in LD_PRELOAD",
     "a speed hint for CPU serving (tcmalloc / Intel OpenMP); the CPU engine is the test backend"),
    ("vllm.engine.arg_utils", "The global random seed is set to",
     "the engine runs in its own worker process; requests carry their own seeds"),
    ("vllm.config.vllm", "Enforce eager set, disabling", "eager mode is the configured choice"),
    ("vllm.config.vllm", "TORCH_COMPILE_DISABLE is set", "set on purpose (disable_torch_compile)"),
    ("vllm.config.vllm", "Inductor compilation was disabled", "set on purpose (disable_torch_compile)"),
    ("vllm.config.vllm", "Model Runner V2 requires Triton", "CPU: the V1 runner is the CPU path"),
    ("vllm.platforms.cpu", "Triton is not installed. triton-cpu", "CPU: no Triton kernels needed"),
    ("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend",
     "CPU: no Triton kernels needed"),
)
_LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")


def _apply_default_env(env: Optional[dict[str, str]] = None) -> None:
  for key, value in _DEFAULT_ENV.items():
    os.environ.setdefault(key, value)
  os.environ.update(env or {})


class _BenignStartupWarnings(logging.Filter):
  """Drops the `_BENIGN_STARTUP` warnings of one vLLM logger (each with its reason there)."""

  def __init__(self, prefixes: Sequence[str]):
    super().__init__()
    self.prefixes = tuple(prefixes)

  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(self.prefixes)


def _silence_benign_startup_warnings() -> None:
  """Before vLLM is imported (some warn during the import; vLLM's logging set-up keeps existing
  loggers and their filters): the `_BENIGN_STARTUP` filters, and the FutureWarning of vLLM's own
  import of a deprecated torch name."""
  import warnings  # pylint: disable=g-import-not-at-top
  warnings.filterwarnings("ignore", message=r"`torch\.distributed\.reduce_op` is deprecated",
                          category=FutureWarning)
  by_logger: dict[str, list[str]] = {}
  for name, prefix, _ in _BENIGN_STARTUP:
    by_logger.setdefault(name, []).append(prefix)
  for name, prefixes in by_logger.items():
    target = logging.getLogger(name)
    if not any(isinstance(f, _BenignStartupWarnings) for f in target.filters):
      target.addFilter(_BenignStartupWarnings(prefixes))


# The worker extension (`transfer.WorkerExtension`: the reload methods called by name) lives in a
# module that imports vLLM; importing it registers the shared-memory weight-transfer engine.
WORKER_EXTENSION = "jaxreplay.rollout.vllm.transfer.WorkerExtension"


def _check_weights(weights: Weights) -> None:
  if not isinstance(weights, Weights):
    raise TypeError(f"load_weights takes a jaxreplay.rollout.base.Weights, got {type(weights)}")
  if weights.hf_dir is None and weights.shm_path is None and weights.lora_dir is None:
    raise ValueError(f"vLLM loads weights from an HF directory or a shared-memory segment (LoRA: "
                     f"an adapter directory), but this Weights handle (version {weights.version}) "
                     "has neither; publish them with ShmPublisher.publish or "
                     "FilePublisher.publish (or hf_io.save_hf; LoRA: AdapterDirPublisher) and "
                     "pass that handle")


def _check_hf_dir(hf_dir: str, weights: bool = True) -> None:
  if not os.path.isfile(os.path.join(hf_dir, "config.json")):
    raise FileNotFoundError(f"{hf_dir!r} has no config.json; write it with "
                            "hf_io.save_hf(cfg, params, dir) or FilePublisher.publish")
  if weights and not glob.glob(os.path.join(hf_dir, "*.safetensors")):
    raise FileNotFoundError(f"{hf_dir!r} has no *.safetensors weights; write it with hf_io.save_hf "
                            "(or start the engine with weights_pending=True and load a segment)")


def request_seed(engine_seed: int, sampling_seed: int, call_index: int, prompt_index: int) -> int:
  """The vLLM seed of one prompt's request (its n samples use seed + 0..n-1), in [0, 2**31).

  Distinct per call and prompt so that repeated calls with the same SamplingParams draw fresh
  samples, yet a run is reproducible from (engine seed, sequence of calls).
  """
  state = np.random.SeedSequence([engine_seed, sampling_seed, call_index, prompt_index])
  return int(state.generate_state(1, np.uint32)[0] >> 1)


class VllmEngine:
  """An in-process offline vLLM engine behind the `RolloutWorker` protocol (no call counter: each
  request is seeded by `request_seed`, `call_count` is None).

  Args:
    hf_dir: a directory written by `hf_io.save_hf` (config.json + safetensors), or with
      `weights_pending` one with config.json only (`ShmPublisher.model_dir`).
    policy_version: the version tag of the weights in `hf_dir`.
    weights_pending: start with random stand-in weights (vLLM `load_format="dummy"`); `generate`
      refuses to run until `load_weights` has loaded real ones.
    max_model_len: the longest prompt + completion, in tokens.
    max_num_seqs: how many sequences vLLM batches at once.
    dtype: vLLM's compute dtype ("float32" on CPU, "bfloat16" on GPU).
    seed: the engine seed; request seeds derive from it (see `request_seed`).
    eos_token_ids: ids that always end a completion, on top of `SamplingParams.stop_token_ids`;
      None means config.json's `eos_token_id` (when set), () disables.
    enforce_eager: no CUDA graphs / torch.compile of the model (start-up in seconds on CPU); the
      run picks it per platform (`workers.vllm_engine_settings`: eager on CPU, graphs on GPU).
    logprobs_mode: "processed_logprobs" (default, see the module docstring) or "raw_logprobs".
    disable_torch_compile: turns torch.compile off in this process. vLLM compiles small sampler
      helpers with inductor, which costs ~15 s on the first request on a small CPU machine.
    env: environment variables set before vLLM is imported (defaults: in-process engine core,
      `VLLM_CPU_KVCACHE_SPACE=1` GiB, warnings-only logging).
    engine_kwargs: more `vllm.LLM` keyword arguments (e.g. `gpu_memory_utilization`,
      `tensor_parallel_size`).
    max_lora_rank: > 0: serve LoRA adapters of rank up to this (vLLM `enable_lora`; one of vLLM's
      allowed values, `models.lora.vllm_max_lora_rank`; one adapter at a time); `hf_dir` holds the
      base and policy versions arrive as `Weights(lora_dir=...)`. On CPU vLLM then runs eager (no compilation)
      and its LoRA kernels gather the adapters per token: decoding is ~2x slower.
  """

  call_count = None  # `RolloutWorker.call_count`: no noise stream follows the calls

  def __init__(self, hf_dir: str, *, policy_version: int = 0, max_model_len: int = 1024,
               max_num_seqs: int = 256, dtype: str = "float32", seed: int = 0,
               eos_token_ids: Optional[Sequence[int]] = None,
               enforce_eager: bool = True, logprobs_mode: str = "processed_logprobs",
               disable_torch_compile: bool = True, env: Optional[dict[str, str]] = None,
               engine_kwargs: Optional[dict[str, Any]] = None, weights_pending: bool = False,
               max_lora_rank: int = 0):
    _check_hf_dir(hf_dir, weights=not weights_pending)
    if logprobs_mode not in _LOGPROBS_MODES:
      raise ValueError(f"logprobs_mode={logprobs_mode!r}; expected one of {_LOGPROBS_MODES}")
    _apply_default_env(env)
    _silence_benign_startup_warnings()
    if disable_torch_compile:
      os.environ["TORCH_COMPILE_DISABLE"] = "1"
    import torch  # pylint: disable=g-import-not-at-top
    if disable_torch_compile:
      torch._dynamo.config.disable = True  # pylint: disable=protected-access
    import vllm  # pylint: disable=g-import-not-at-top
    from jaxreplay.rollout.vllm import api_surface  # pylint: disable=g-import-not-at-top
    api_surface.check()  # every vLLM name the engine and its refreshes use, before weights move
    from vllm.config import WeightTransferConfig  # pylint: disable=g-import-not-at-top
    from vllm.inputs import TokensPrompt  # pylint: disable=g-import-not-at-top
    from jaxreplay.rollout.vllm import transfer  # pylint: disable=g-import-not-at-top
    transfer.register()  # this process's factory (an engine-core process imports it itself)
    self._vllm = vllm
    self._tokens_prompt = TokensPrompt
    self.seed = int(seed)
    self.eos_token_ids = (tokenizer_lib.model_eos_ids(hf_dir) if eos_token_ids is None
                          else tuple(int(e) for e in eos_token_ids))
    self.max_model_len = int(max_model_len)
    self.logprobs_mode = logprobs_mode
    self.policy_version = int(policy_version)
    self._lock = threading.Lock()
    self._calls = 0
    self.num_generated_tokens = 0
    self.generate_seconds = 0.0
    self.last_update_seconds = 0.0
    # shm refreshes on CPU: re-pack each linear layer straight from the segment
    # (`rollout.vllm.direct_load`); False keeps vLLM's generic layerwise reload (for comparisons).
    self.direct_load = True
    self.last_update_phases: dict[str, float] = {}
    self._has_weights = not weights_pending and not max_lora_rank  # LoRA: after the first adapter
    self.max_lora_rank = int(max_lora_rank)
    self._lora_request = None  # the adapter of the current version (LoRA)
    start = time.perf_counter()
    kwargs = dict(model=hf_dir, skip_tokenizer_init=True, dtype=dtype, seed=self.seed,
                  enforce_eager=enforce_eager, logprobs_mode=logprobs_mode,
                  max_model_len=self.max_model_len, max_num_seqs=max_num_seqs,
                  use_tqdm_on_load=False, worker_extension_cls=WORKER_EXTENSION,
                  enable_prefix_caching=True,  # multi-turn: each turn re-sends the conversation
                  weight_transfer_config=WeightTransferConfig(backend=SHM_BACKEND))
    if weights_pending:
      kwargs["load_format"] = "dummy"
    if self.max_lora_rank:
      kwargs.update(enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=1,
                    max_cpu_loras=2)
    kwargs.update(engine_kwargs or {})
    self._llm = vllm.LLM(**kwargs)
    self.startup_seconds = time.perf_counter() - start
    self.vocab_size = int(self._llm.llm_engine.model_config.get_vocab_size())

  # ---- RolloutWorker ------------------------------------------------------------------------

  def generate(self, prompts: Sequence[np.ndarray], n: int, sampling: SamplingParams) -> list[Group]:
    """Samples `n` completions per prompt (int32 [Lp] arrays); one Group per prompt, in order.

    Each Completion has tokens int32 [L] and the sampler's log-probs float32 [L] of those tokens
    (nats, processed semantics by default); a sampled stop token is kept as the last token.
    """
    prompts = self._check_prompts(prompts, n, sampling)
    with self._lock:
      llm = self._require_open()
      if not self._has_weights:
        raise RuntimeError("this engine started with weights_pending=True (or for LoRA) and has "
                           "loaded no weights (adapter) yet; call load_weights first")
      version = self.policy_version
      call_index = self._calls
      self._calls += 1
      requests = [self._tokens_prompt(prompt_token_ids=p.tolist()) for p in prompts]
      # vLLM refuses n > 1 when greedy: the n completions are one argmax path, copied.
      greedy = sampling.temperature < GREEDY_EPS
      params = [self._vllm_sampling(sampling, 1 if greedy else n,
                                    request_seed(self.seed, sampling.seed, call_index, i))
                for i in range(len(prompts))]
      start = time.perf_counter()
      outputs = llm.generate(requests, params, use_tqdm=False, lora_request=self._lora_request)
      self.generate_seconds += time.perf_counter() - start
      groups = [self._to_group(p, out, n, version, i, greedy)
                for i, (p, out) in enumerate(zip(prompts, outputs))]
      self.num_generated_tokens += sum(len(c.tokens) for g in groups for c in g.completions)
    return groups

  def load_weights(self, weights: Weights) -> dict[str, float]:
    """Loads `weights` in one RPC (its shm segment, else its hf_dir); later groups carry
    `weights.version`. Waits until the publisher has written them. Returns the refresh's phases
    [s] (`last_update_phases`: shm: load_s, repack_s, finalize_s, engine_s, bytes; both: total_s).

    Raises ValueError when the handle has neither, FileNotFoundError when the directory holds no
    config.json or safetensors, `rollout.base.StaleWeights` when the segment was reused for a newer
    version (the engine then keeps its previous weights). The engine side reports that as a status
    (`transfer.WorkerExtension.jaxreplay_load_shm`) and it is raised here, so that its type
    survives an engine core in its own process (`VLLM_ENABLE_V1_MULTIPROCESSING=1`).
    """
    _check_weights(weights)
    weights.wait()
    if weights.lora_dir is not None:
      return self._load_adapter(weights)
    if weights.shm_path is None:
      _check_hf_dir(weights.hf_dir)
    with self._lock:
      llm = self._require_open()
      start = time.perf_counter()
      if weights.shm_path is not None:
        results = llm.collective_rpc(
            "jaxreplay_load_shm", args=(weights.shm_path, int(weights.version),
                                        bool(self.direct_load)))
        stale = [r for r in results if r.get("stale")]
        if stale:  # reported as a status by every rank's worker: raised here, in this process
          raise StaleWeights(str(stale[0].get("message", "")) or
                             f"weight segment {weights.shm_path!r} no longer holds version "
                             f"{weights.version}")
        phases = dict(results[0])
      else:
        llm.collective_rpc("jaxreplay_reload_weights", args=(os.path.abspath(weights.hf_dir),))
        phases = {}
      if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache after a weight reload")
      self.policy_version = int(weights.version)
      self._has_weights = True
      self.last_update_seconds = time.perf_counter() - start
      phases["total_s"] = self.last_update_seconds
      self.last_update_phases = phases
    return dict(phases)

  def _load_adapter(self, weights: Weights) -> dict[str, float]:
    """LoRA: registers `weights.lora_dir` as adapter id version + 1, then removes the previous id
    (no request of it is running: this holds the engine's lock); returns {"total_s", "bytes"}.
    Raises `StaleWeights` when the directory is gone (its publisher kept newer versions only)."""
    if not self.max_lora_rank:
      raise ValueError(f"weights of version {weights.version} are a LoRA adapter, but this engine "
                       "was started without LoRA (VllmEngine(max_lora_rank=r))")
    from vllm.lora.request import LoRARequest  # pylint: disable=g-import-not-at-top
    path = os.path.abspath(weights.lora_dir)
    request = LoRARequest(f"v{int(weights.version)}", int(weights.version) + 1, path)
    with self._lock:
      llm = self._require_open()
      start = time.perf_counter()
      old = self._lora_request
      if old is None or old.lora_int_id != request.lora_int_id:
        if not os.path.isdir(path):
          raise StaleWeights(f"adapter directory {path} (version {weights.version}) is gone: "
                             "newer versions replaced it")
        try:
          llm.llm_engine.add_lora(request)
        except Exception as e:  # pylint: disable=broad-except
          if not os.path.isdir(path):  # deleted while vLLM read it
            raise StaleWeights(f"adapter directory {path} (version {weights.version}) was "
                               "removed while loading") from e
          raise
        if old is not None:
          llm.llm_engine.remove_lora(old.lora_int_id)
      if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache after an adapter refresh")
      self._lora_request = request
      self.policy_version = int(weights.version)
      self._has_weights = True
      self.last_update_seconds = time.perf_counter() - start
      nbytes = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
      self.last_update_phases = {"total_s": self.last_update_seconds, "bytes": float(nbytes)}
    return dict(self.last_update_phases)

  def loaded_adapters(self) -> list[int]:
    """LoRA: the adapter ids vLLM holds (one after each refresh)."""
    with self._lock:
      return sorted(self._require_open().llm_engine.list_loras())

  def close(self) -> None:
    """Shuts the engine down and frees its memory; a new engine can then start in this process."""
    with self._lock:
      llm, self._llm = self._llm, None
    if llm is None:
      return
    try:
      llm.llm_engine.engine_core.shutdown()
    finally:
      del llm
      gc.collect()
      from vllm.distributed import parallel_state  # pylint: disable=g-import-not-at-top
      parallel_state.destroy_model_parallel()
      parallel_state.destroy_distributed_environment()

  def stats(self) -> dict[str, float]:
    """Counters: policy_version, generated tokens, seconds in generate / last refresh / start-up."""
    return {"policy_version": self.policy_version, "num_generated_tokens": self.num_generated_tokens,
            "generate_seconds": self.generate_seconds, "last_update_seconds": self.last_update_seconds,
            "startup_seconds": self.startup_seconds, "pid": os.getpid()}

  # ---- helpers ------------------------------------------------------------------------------

  def _require_open(self):
    if self._llm is None:
      raise RuntimeError("this VllmEngine is closed; create a new one")
    return self._llm

  def _check_prompts(self, prompts, n, sampling) -> list[np.ndarray]:
    if not isinstance(sampling, SamplingParams):
      raise TypeError(
          f"sampling must be a jaxreplay.rollout.base.SamplingParams, got {type(sampling)}")
    if n < 1:
      raise ValueError(f"n={n} must be >= 1")
    if len(prompts) == 0:
      raise ValueError("generate() got no prompts")
    return check_prompts(prompts, self.vocab_size, self.max_model_len, sampling.max_tokens,
                         max_len_name="max_model_len")

  def _vllm_sampling(self, sampling: SamplingParams, n: int, seed: int):
    # ignore_eos: without a tokenizer vLLM knows no EOS; `stop_token_ids` carries ours.
    stop = sorted(set(sampling.stop_token_ids) | set(self.eos_token_ids))
    return self._vllm.SamplingParams(
        n=n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
        max_tokens=sampling.max_tokens, stop_token_ids=stop,
        ignore_eos=True, seed=seed, logprobs=0, detokenize=False)

  @staticmethod
  def _to_group(prompt: np.ndarray, out, n: int, version: int, index: int, greedy: bool) -> Group:
    completions = []
    for o in sorted(out.outputs, key=lambda o: o.index):
      tokens = np.asarray(o.token_ids, np.int32)
      if o.logprobs is None or len(o.logprobs) != len(tokens):
        raise RuntimeError(f"vLLM returned {0 if o.logprobs is None else len(o.logprobs)} log-prob "
                           f"entries for {len(tokens)} tokens")
      logprobs = np.asarray([step[t].logprob for step, t in zip(o.logprobs, o.token_ids)], np.float32)
      if greedy:
        logprobs = np.zeros_like(logprobs)
      if o.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a request with reason {o.finish_reason!r}")
      completions.append(Completion(tokens=tokens, logprobs=logprobs, finish_reason=o.finish_reason))
    if greedy and len(completions) == 1:
      completions += [Completion(c.tokens.copy(), c.logprobs.copy(), c.finish_reason)
                      for c in completions * (n - 1)]
    if len(completions) != n:
      raise RuntimeError(f"vLLM returned {len(completions)} completions, expected n={n}")
    return Group(prompt_tokens=prompt, completions=completions, policy_version=version,
                 prompt_index=index)


# ---- the engine in its own process ------------------------------------------------------------


class VllmWorkerProcess:
  """A `VllmEngine` in a child process, behind a `RolloutWorker` proxy.

  The child is a fresh interpreter (`jaxreplay.infra.child_process.ChildProcess`), not a multiprocessing
  spawn: it never re-imports the caller's `__main__`, so a calling script needs no
  `if __name__ == "__main__":` guard. Commands (generate / load_weights / ping / close) go over a
  pipe, one at a time. A dead child (killed, crashed, pipe EOF) or a request past
  `request_timeout_s` (the child is then killed) raises `WorkerDied`; the proxy is then unusable and
  the caller makes a new one. Errors raised inside the child (e.g. ValueError for a bad prompt) are
  re-raised here with the child's traceback as a note. On CPU, W workers on one machine may be
  pinned to distinct cores with `env={"VLLM_CPU_OMP_THREADS_BIND": "0-3"}` and so on.

  Args:
    hf_dir, **engine_kwargs: as for `VllmEngine` (keyword arguments must be picklable).
    startup_timeout_s: raise TimeoutError (and kill the child) when the engine is not ready by then.
    request_timeout_s: None waits for each request as long as the child lives.
    env: environment variables for the child, set before it starts (so before it imports vLLM), e.g.
      `VLLM_CPU_OMP_THREADS_BIND`.
  """

  call_count = None  # `RolloutWorker.call_count`: the engine's, none

  def __init__(self, hf_dir: str, *, startup_timeout_s: float = 300.0,
               request_timeout_s: Optional[float] = None, env: Optional[dict[str, str]] = None,
               **engine_kwargs):
    _check_hf_dir(hf_dir, weights=not engine_kwargs.get("weights_pending", False))
    engine_kwargs["hf_dir"] = hf_dir
    self.policy_version = int(engine_kwargs.get("policy_version", 0))
    self.request_timeout_s = request_timeout_s
    start = time.perf_counter()
    try:
      self._child = ChildProcess("jaxreplay.rollout.vllm.engine:VllmEngine", kwargs=engine_kwargs,
                                 env=env, startup_timeout_s=startup_timeout_s, name="vLLM worker")
    except TimeoutError:
      raise TimeoutError(f"the vLLM worker process did not start within {startup_timeout_s:.0f} s; "
                         "raise --config.rollout.vllm_startup_timeout_s (a loaded machine, or cold "
                         "torch.compile + CUDA-graph capture of several engines, needs longer) or "
                         "check its log") from None
    except ChildDied as e:
      raise WorkerDied(str(e)) from e
    try:
      stats = self.ping(max(startup_timeout_s - (time.perf_counter() - start), 30.0))
    except BaseException:
      self._child.kill()
      raise
    self.startup_seconds = time.perf_counter() - start
    self.engine_startup_seconds = stats["startup_seconds"]

  @property
  def pid(self) -> int:
    return self._child.pid

  def is_alive(self) -> bool:
    return self._child.is_alive()

  def generate(self, prompts: Sequence[np.ndarray], n: int, sampling: SamplingParams) -> list[Group]:
    """As `VllmEngine.generate`, run in the child; raises WorkerDied when the child is gone."""
    prompts = [np.asarray(p) for p in prompts]
    return self._call("generate", (prompts, n, sampling), self.request_timeout_s)

  def load_weights(self, weights: Weights) -> dict[str, float]:
    """As `VllmEngine.load_weights`, run in the child (it gets version, hf_dir and shm_path, once
    the publisher has written them); returns the refresh's phases."""
    _check_weights(weights)
    phases = self._call("load_weights", (weights.portable(),), self.request_timeout_s)
    self.policy_version = int(weights.version)
    return phases

  def loaded_adapters(self) -> list[int]:
    """As `VllmEngine.loaded_adapters`, run in the child."""
    return self._call("loaded_adapters", (), self.request_timeout_s)

  def ping(self, timeout_s: float = 30.0) -> dict[str, float]:
    """The child's `VllmEngine.stats()`; raises WorkerDied when it does not answer in time."""
    return self._call("stats", (), timeout_s)

  def close(self, timeout_s: float = 10.0) -> None:
    """Asks the child to shut its engine down; kills it when it does not exit within `timeout_s`."""
    self._child.close(timeout_s)

  def kill(self) -> None:
    """Kills the child now (safe from any thread, also while a request is in flight)."""
    self._child.kill()

  def _call(self, method: str, args: tuple, timeout_s: Optional[float]):
    try:
      return self._child.call(method, args, timeout_s)
    except ChildDied as e:
      raise WorkerDied(str(e)) from e
