"""`--dry_run`: the per-device memory plan of a config, built abstractly before anything is allocated.

`plan(config)` reads at most the model's config.json (no weights, no tokenizer, no engines), builds
the train state with `jax.eval_shape` on the trainer mesh (T devices: the real ones on a GPU node,
the first T emulated CPU devices elsewhere) and adds up what one trainer device holds:

  params, opt_state   the train state's shards (exact: storage shapes and shardings, padding included)
  grads               the gradient (sharded like params, in the master dtype), its accumulator with
                      micro-batches, and the optimizer update's temporaries (one params-sized array)
  activations         an estimate at one micro-batch of model.max_len tokens (see `activation_bytes`)
  eval_kv_cache       the JAX sampler's KV cache when it runs on the trainer devices (evaluation with
                      eval.backend "trainer", and rollouts with rollout.backend=jax), on one device;
                      0 when the vLLM engines evaluate (eval.backend "auto" with vLLM)
  total               their sum (plus ref_params for the KL penalty)

With LoRA (model.lora_rank > 0) params, opt_state and grads are the adapters' (replicated, in
model.lora_dtype) and `base_params` is the frozen base (sharded like full params, in
model.param_dtype); the KL reference is the base (no ref_params).

`check_fits` compares the total with devices.memory_gib x devices.memory_fraction (or the GPU's own
memory). `dry_run(config, workdir)` prints the plan with the device split and writes WORKDIR/plan.json.

`time` (`time_plan`): the trainer's stall per weight refresh against its step, both estimated from
stated constants (not measured): the publish of vLLM engines' weights is one device -> host copy of
the model in the engines' dtype at `HOST_COPY_GBPS` (the segment write runs on a background
thread), the step is its model FLOPs at full rows (remat's recomputed forward included) at
`ASSUMED_MFU` of `PEAK_TFLOPS` per trainer device. A run logs the real ones as `time/publish_s` and
`time/step_s`.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

import jax
import numpy as np

from jaxreplay.config import devices as devices_lib
from jaxreplay.models import presets
from jaxreplay.models import transformer
from jaxreplay.models.config import ModelConfig
from jaxreplay.learner import adapters
from jaxreplay.learner import optim
from jaxreplay.infra import sharding
from jaxreplay.learner import trainer
from jaxreplay.models import lora as lora_lib
from jaxreplay.rollout import backend_table

GIB = 1024 ** 3


# Stated constants of the time plan (see the module docstring), not measurements.
HOST_COPY_GBPS = 10.0  # device -> host into pageable memory over PCIe Gen5 x16 [GB/s] (pinned
                       # copies reach ~50; XLA's transfers of large arrays land between)
PEAK_TFLOPS = 989.0    # dense bf16 matmul peak of one H100 / H200 SXM [TFLOP/s]
ASSUMED_MFU = 0.4      # share of that peak a long-context train step reaches (model FLOPs)


class DoesNotFit(RuntimeError):
  """The plan's per-device total exceeds the device memory (the message names what to change)."""


def model_config(c) -> ModelConfig:
  """The model of `c` without reading weights: model.path's config.json, else the preset."""
  overrides = dict(dtype=c.model.dtype, param_dtype=c.model.param_dtype, remat=c.model.remat)
  if c.model.path:
    return ModelConfig.from_hf_dir(c.model.path, **overrides)
  return presets.PRESETS[c.model.preset](**overrides)


def planned_mesh(c, devices: Optional[list] = None):
  """The mesh a plan assumes: trainer.mesh_shape over the first T = trainer.num_devices of
  `devices` (default all), i.e. the GPU node's T trainer GPUs (`build.trainer_mesh` is the run's)."""
  devices = list(jax.devices() if devices is None else devices)
  t = int(c.trainer.num_devices)
  if len(devices) < t:
    raise ValueError(f"trainer.num_devices={t} but JAX sees {len(devices)} devices; lower "
                     "trainer.num_devices (or, for a dry run on CPU, emulate devices with "
                     f"XLA_FLAGS=--xla_force_host_platform_device_count={t})")
  return sharding.make_mesh(tuple(c.trainer.mesh_shape), devices=devices[:t])


def batch_rule_errors(c, mesh) -> list[str]:
  """The divisibility rules of batches on `mesh`, each broken one as a message with valid values."""
  rows = sharding.batch_size_multiple(mesh)
  k = int(c.trainer.num_microbatches)
  b = int(c.buffer.batch_size)
  if k < 1:
    return [f"trainer.num_microbatches={k} must be >= 1"]
  m = int(c.trainer.get("ppo_minibatches", 1))
  if b % (rows * k) == 0 and m > 1 and b % m == 0 and (b // m) % (rows * k):
    return [f"trainer.ppo_minibatches={m}: minibatches of B/m = {b // m} rollouts must be a "
            f"multiple of data*fsdp*num_microbatches = {rows}*{k} = {rows * k} (mesh "
            f"{dict(mesh.shape)}): lower ppo_minibatches or num_microbatches"]
  if b % (rows * k) == 0:
    return []
  per_device = b // rows if b % rows == 0 else None
  valid_k = [d for d in range(1, per_device + 1) if per_device % d == 0] if per_device else []
  near_b = sorted({max(rows * k, b - b % (rows * k)), b - b % (rows * k) + rows * k} - {0})
  fix = (f"valid trainer.num_microbatches for B={b} on data*fsdp={rows}: "
         f"{', '.join(map(str, valid_k))}; " if valid_k else "")
  return [f"buffer.batch_size={b} must be a multiple of data*fsdp*num_microbatches = {rows}*{k} = "
          f"{rows * k} (mesh {dict(mesh.shape)} over {mesh.size} trainer devices): {fix}or "
          f"buffer.batch_size in {near_b}"]


def activation_bytes(cfg: ModelConfig, rows: int, seq_len: int, chunk: int,
                     flash_attention: bool = False, dense_bias: bool = False) -> int:
  """Estimated temporaries of one device's forward + backward over a micro-batch of `rows`
  sequences of `seq_len` tokens, besides the gradients (the train step's and the diagnostics').

  Per row: the residual stream [seq_len, D] kept per layer for the backward (model.remat) and the
  log-prob chunk's f32 logits [chunk, V]. Fixed: three f32 [V, D] arrays for the vocabulary
  matmuls (the embedding's scattered gradient, the LM head's gathered weight and its gradient),
  four with an untied LM head. Without model.remat every layer also keeps its working set in the
  compute dtype (q, k, v, attention output, two norms' outputs, four [rows, T, F] MLP arrays;
  cuDNN's dense bias, its gradient and the bool mask of packed rows with `dense_bias`). Without
  flash attention one layer's f32 scores [rows, Hq, T, T] (three of them) come on top.
  Calibrated against XLA:GPU's compiled temporaries of the four GPU configs (bf16, remat,
  packed, cuDNN; bench/gpu_compile.py): 0.6B, 3B and 7B within 5% at 2 to 10 rows per device,
  8B 17% above what XLA keeps when its memory limit (0.8 x the device memory less the program's
  arguments) does not bind, its scheduler and rematerialization trading the rest.
  """
  cb = np.dtype(cfg.compute_dtype).itemsize
  tokens = rows * seq_len
  hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  d, v = cfg.hidden_size, cfg.vocab_size
  stream = tokens * d * cb
  scores = 0 if flash_attention else 3 * rows * hq * seq_len * seq_len * 4
  layers = cfg.num_hidden_layers
  if cfg.remat:
    body = layers * stream + scores
  else:
    work = tokens * ((2 * hq + 2 * hkv) * hd + 4 * cfg.intermediate_size + 2 * d) * cb
    bias = 2 * rows * seq_len * seq_len * cb + rows * seq_len * seq_len if dense_bias else 0
    body = layers * (stream + work + bias + scores)
  logits = rows * min(chunk, seq_len) * v * 4
  vocab = (3 if cfg.tie_word_embeddings else 4) * d * v * 4
  return int(body + logits + vocab)


def forward_bytes(cfg: ModelConfig, rows: int, seq_len: int, chunk: int) -> int:
  """Estimated temporaries of a forward pass without gradients over `rows` x `seq_len` tokens
  (the log-prob function, the update-KL probe): the log-prob chunk's f32 logits [rows, chunk, V]
  and one layer's stream and MLP activation [rows, T, D + F] in the compute dtype (XLA:GPU of
  the four GPU configs at 20 rows: within 15%)."""
  cb = np.dtype(cfg.compute_dtype).itemsize
  tokens = rows * seq_len
  return int(rows * min(chunk, seq_len) * cfg.vocab_size * 4
             + tokens * (cfg.hidden_size + cfg.intermediate_size) * cb)


def kv_cache_bytes(cfg: ModelConfig, rows: int, max_len: int) -> int:
  """Bytes of a KV cache of `rows` sequences of `max_len` tokens (K and V, every layer)."""
  cb = np.dtype(cfg.compute_dtype).itemsize
  return int(2 * cfg.num_hidden_layers * rows * max_len * cfg.num_key_value_heads * cfg.head_dim * cb)


def device_memory_bytes(c) -> Optional[int]:
  """Usable bytes of one trainer device: devices.memory_gib x memory_fraction when set, else the
  GPU's own limit (jax memory_stats), else None (CPU: no check)."""
  if c.devices.memory_gib > 0:
    return int(c.devices.memory_gib * GIB * c.devices.memory_fraction)
  dev = jax.devices()[0]
  if dev.platform == "gpu":
    stats = dev.memory_stats() or {}
    if "bytes_limit" in stats:
      return int(stats["bytes_limit"])
  return None


def plan(c, devices: Optional[list] = None, device_memory: Optional[int] = None
         ) -> dict[str, Any]:
  """The memory plan of config `c` (see the module docstring); a JSON-ready dict. `devices`: the
  devices to plan the mesh on (default JAX's); `device_memory`: usable bytes of one trainer device
  (default `device_memory_bytes(c)`)."""
  cfg = model_config(c)
  mesh = planned_mesh(c, devices)
  errors = batch_rule_errors(c, mesh)
  if errors:
    raise ValueError("invalid config:\n  " + "\n  ".join(errors))
  t = c.trainer
  optimizer = optim.make_optimizer(t.learning_rate, warmup_steps=t.warmup_steps,
                                   total_steps=c.total_steps, schedule=t.schedule,
                                   weight_decay=t.weight_decay, b1=t.b1, b2=t.b2,
                                   max_grad_norm=t.max_grad_norm)
  spec = lora_lib.spec_from_config(c.model)
  if spec is None:
    state = jax.eval_shape(lambda: trainer.init_train_state(
        cfg, optimizer, jax.random.PRNGKey(0), mesh=mesh, with_ref_params=t.kl_coef != 0.0))
  else:
    state = jax.eval_shape(lambda: adapters.init_adapter_state(
        cfg, spec, optimizer, jax.random.PRNGKey(0), mesh))
  shardings = trainer.state_shardings(state, mesh)
  params = sharding.shard_bytes(state.params, shardings.params)
  opt_state = sharding.shard_bytes(state.opt_state, shardings.opt_state)
  # The gradient (in the params' dtype, sharded like them) and its f32 accumulator with
  # micro-batches; the optimizer update runs in place on GPUs (`trainer.SKIP_MODES` "select").
  grads = params + (_f32_bytes(state.params, shardings.params) if t.num_microbatches > 1 else 0)
  rows = c.buffer.batch_size // sharding.batch_size_multiple(mesh) // t.num_microbatches
  # model.attention "auto" is cuDNN flash attention on GPU in bfloat16: the plan is the GPU's.
  attention = c.model.get("attention", "einsum")
  flash = attention == "cudnn" or (attention == "auto" and c.model.dtype == "bfloat16")
  # Packed rows reach cuDNN as a dense segment mask (a bias and its gradient); unpacked rows as
  # lengths (`transformer.cudnn_call_args`).
  dense_bias = flash and bool(t.get("pack", False))
  activations = activation_bytes(cfg, rows, c.model.max_len, t.logprob_chunk, flash, dense_bias)
  kv = 0
  rollout_backend = backend_table.resolve(c.rollout.backend)
  backend = backend_table.record(rollout_backend)
  eval_backend = backend_table.resolve_eval(c.eval.backend, rollout_backend)
  if c.eval.num_problems and eval_backend == "trainer":
    kv = kv_cache_bytes(cfg, c.eval.batch_size or c.rollout.sampler_batch_size, c.model.max_len)
  if backend.on_trainer_devices:  # rollouts are sampled on the trainer devices too
    kv = max(kv, kv_cache_bytes(cfg, c.rollout.sampler_batch_size, c.model.max_len))
  ref = sharding.shard_bytes(state.ref_params, shardings.ref_params) if state.ref_params else 0
  per_device = dict(params=params, opt_state=opt_state, grads=grads, activations=activations,
                    eval_kv_cache=kv)
  if ref:
    per_device["ref_params"] = ref
  if spec is not None:  # the frozen base, sharded and padded as full params would be
    storage = sharding.storage_shapes(
        jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0))), mesh)
    per_device["base_params"] = sharding.shard_bytes(storage,
                                                     sharding.param_shardings(storage, mesh))
  per_device["total"] = sum(per_device.values())
  programs = program_bytes(c, cfg, per_device, rows, flash, dense_bias, rollout_backend,
                           eval_backend, sharding.batch_size_multiple(mesh),
                           _f32_bytes(state.params, shardings.params))
  peak_program = max(programs, key=programs.get)
  padded = sharding.padded_leaves(
      jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0))), mesh)
  limit = device_memory_bytes(c) if device_memory is None else int(device_memory)
  lora = None if spec is None else {
      "rank": spec.rank, "alpha": spec.alpha, "targets": list(spec.targets), "dtype": spec.dtype,
      "adapter_params": lora_lib.num_params(cfg, spec)}
  out = {
      "model": {"preset": c.model.preset, "path": c.model.path, "params": cfg.num_params(),
                "dtype": c.model.dtype, "param_dtype": c.model.param_dtype, "remat": c.model.remat},
      "devices": {"trainer_devices": int(t.num_devices), "mesh": dict(mesh.shape),
                  "platform": mesh.devices.flat[0].platform,
                  "rollout_workers": int(c.rollout.num_workers), "rollout_backend": rollout_backend, "eval_backend": eval_backend},
      "micro_batch": {"rows_per_device": int(rows), "tokens_per_row": int(c.model.max_len),
                      "num_microbatches": int(t.num_microbatches), "flash_attention": flash,
                      "attention_dense_bias": dense_bias},
      "per_device_bytes": {k: int(v) for k, v in per_device.items()},
      "programs": {k: int(v) for k, v in programs.items()},
      "peak": {"analytic_bytes": int(programs[peak_program]), "analytic_program": peak_program},
      "params_fraction_per_device": per_device.get("base_params", params) / max(
          1, cfg.num_params() * np.dtype(cfg.params_dtype).itemsize),
      "padded_leaves": {k: {"logical": list(a), "storage": list(b)} for k, (a, b) in padded.items()},
      "device_memory_bytes": limit,
      "fits": None if limit is None else bool(programs[peak_program] <= limit),
      "time": time_plan(c, cfg, rollout_backend),
  }
  if lora is not None:
    out["lora"] = lora
  return out


def _f32_bytes(tree: Any, shardings: Any) -> int:
  """Per-device bytes of `tree` (laid out by `shardings`) in float32: a gradient accumulator."""
  return sharding.shard_bytes(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, np.float32),
                                           tree), shardings)


def diagnostics_splits(rows: int, multiple: int, preferred: int) -> int:
  """The regime diagnostics' micro-batches of a `rows`-row batch (as `run.regime.splits_for`):
  the largest k <= preferred (>= 2) with rows % (k * multiple) == 0, else 0 (off)."""
  return next((k for k in range(int(preferred), 1, -1) if rows % (k * multiple) == 0), 0)


def program_bytes(c, cfg: ModelConfig, per_device: dict[str, int], rows: int,
                  flash: bool, dense_bias: bool, rollout_backend: str, eval_backend: str,
                  multiple: int, grads_f32: int) -> dict[str, int]:
  """The analytic peak per device of each program a run of `c` runs on its trainer devices (the
  programs `run.gpu_compile` compiles, which gives XLA's count): what the program holds
  (arguments, outputs, temporaries) plus the run's buffers alive meanwhile (the optimizer state,
  the update-KL probe's logits kept across the update, a JAX sampler's copy of the weights).

  `per_device`: the plan's parts (params, opt_state, grads, activations, ref_params,
  base_params); `rows`: the train step's rows per device per micro-batch; `grads_f32`: a float32
  gradient's bytes (the diagnostics' accumulator)."""
  seq, chunk = int(c.model.max_len), int(c.trainer.logprob_chunk)
  state = (per_device["params"] + per_device["opt_state"] + per_device.get("ref_params", 0)
           + per_device.get("base_params", 0))
  backend = backend_table.record(rollout_backend)
  copy = per_device["params"] if backend.on_trainer_devices else 0  # DeviceCopyPublisher's
  batch_rows = int(c.buffer.batch_size)
  probe = int(c.log.diagnostics_probe) if c.log.diagnostics_every else 0
  probe_out = probe * seq * cfg.vocab_size * 4  # log-softmax [probe, T, V] f32, replicated
  out = {"train_step": state + per_device["grads"] + per_device["activations"] + probe_out + copy,
         "logprob_fn": state + copy + forward_bytes(cfg, batch_rows // multiple, seq, chunk)}
  splits = diagnostics_splits(batch_rows, multiple, c.log.diagnostics_splits) \
      if c.log.diagnostics_every else 0
  if splits >= 2:
    out["diagnostics"] = (state + per_device["params"] + grads_f32 + copy + activation_bytes(
        cfg, batch_rows // multiple // splits, seq, chunk, flash, dense_bias))
  if probe:  # its output and the one kept from before the update; the forward's layers, twice
    out["update_kl_probe"] = state + copy + 2 * probe_out + 2 * probe * seq * (
        cfg.hidden_size + cfg.intermediate_size) * np.dtype(cfg.compute_dtype).itemsize
  cast = per_device["params"]
  if backend.dtype_key:  # engines load the weights in their own dtype
    engine_dtype = c.rollout.get(backend.dtype_key, "auto")
    dtype = "bfloat16" if engine_dtype == "auto" else engine_dtype  # the GPU engines' (auto)
    itemsize = np.dtype(jax.numpy.dtype(dtype)).itemsize
    cast = per_device["params"] * itemsize // np.dtype(cfg.params_dtype).itemsize
  out["publish"] = state + copy + cast
  out["export_check"] = state + copy
  samplers = {"sampler": int(c.rollout.sampler_batch_size)} if backend.on_trainer_devices else {}
  if eval_backend == "trainer" and c.eval.num_problems:
    samplers["eval_sampler"] = int(c.eval.batch_size or c.rollout.sampler_batch_size)
  for name, n in samplers.items():  # the KV cache, the prompt's forward, the logits of a step
    out[name] = (state + copy + kv_cache_bytes(cfg, n, seq) + n * seq * (
        cfg.hidden_size + cfg.intermediate_size) * np.dtype(cfg.compute_dtype).itemsize
        + 2 * n * cfg.vocab_size * 4)
  return {k: int(v) for k, v in out.items()}


def time_plan(c, cfg: ModelConfig, rollout_backend: str) -> dict[str, Any]:
  """The trainer's publish stall against its step (see the module docstring); JSON-ready.
  `rollout_backend`: resolved; workers off the trainer devices (its record) get a host copy."""
  backend = backend_table.record(rollout_backend)
  t = c.trainer
  tokens = int(c.buffer.batch_size) * int(c.model.max_len)
  per_token = 3 * cfg.flops_per_token(int(c.model.max_len))  # forward + backward (2x forward)
  if cfg.remat:
    per_token += cfg.flops_per_token(int(c.model.max_len))  # the recomputed forward
  step_s = tokens * per_token / (int(t.num_devices) * PEAK_TFLOPS * 1e12 * ASSUMED_MFU)
  if not backend.on_trainer_devices:  # a host copy in the workers' dtype
    engine_dtype = c.rollout.get(backend.dtype_key, "auto") if backend.dtype_key else "auto"
    dtype = engine_dtype if engine_dtype != "auto" else (
        "bfloat16" if c.model.dtype == "bfloat16" else "float32")
    nbytes = cfg.num_params() * np.dtype(jax.numpy.dtype(dtype)).itemsize
    how = (f"one device -> host copy of the model in {dtype} at {HOST_COPY_GBPS:g} GB/s on the "
           "trainer's thread; the segment write is in the background")
    stall = nbytes / (HOST_COPY_GBPS * 1e9)
  else:
    nbytes, stall, dtype = 0, 0.0, c.model.param_dtype
    how = "device copies for the in-process JAX samplers (no host copy)"
  every = int(c.rollout.refresh_every)
  return {"publish_bytes": int(nbytes), "publish_dtype": dtype, "publish_stall_s": stall,
          "publish": how, "step_s": step_s, "step_tokens": tokens,
          "step": (f"{tokens} tokens (buffer.batch_size x model.max_len: full rows) x "
                   f"{per_token / 1e9:.3g} GFLOP at {ASSUMED_MFU:g} of {PEAK_TFLOPS:g} TFLOP/s on "
                   f"{int(t.num_devices)} devices"),
          "refresh_every": every,
          "publish_fraction": stall / (stall + every * step_s) if step_s > 0 else 0.0,
          "assumed": {"host_copy_gbps": HOST_COPY_GBPS, "peak_tflops": PEAK_TFLOPS,
                      "mfu": ASSUMED_MFU}}


# What lowers each compiled program's peak (`check_fits` with XLA's numbers).
PROGRAM_FIXES = {
    "train_step": "more trainer.num_microbatches, model.remat=True, a smaller "
                  "trainer.logprob_chunk or model.max_len, more trainer devices "
                  "(trainer.num_devices)",
    "logprob_fn": "a smaller trainer.logprob_chunk or buffer.batch_size, more trainer devices",
    "diagnostics": "more log.diagnostics_splits, or log.diagnostics_every=0",
    "update_kl_probe": "a smaller log.diagnostics_probe (0: no update KL)",
    "publish": "more trainer devices (trainer.num_devices)",
    "export_check": "more trainer devices (trainer.num_devices)",
    "sampler": "a smaller rollout.sampler_batch_size or model.max_len",
    "eval_sampler": "a smaller eval.batch_size or model.max_len",
}


def with_compiled_fit(p: dict[str, Any]) -> dict[str, Any]:
  """Adds XLA's side to a plan holding "compiled" ({program: record with "peak_bytes"}):
  "peak" = {"analytic_bytes", "xla_bytes", "xla_program", "xla_over_analytic"}, and "fits" judged
  by XLA's largest peak ("fits_analytic" keeps the analytic verdict). Returns `p`."""
  name, rec = max(p["compiled"].items(), key=lambda kv: kv[1]["peak_bytes"])
  analytic = p["peak"]["analytic_bytes"]
  p["peak"].update({"xla_bytes": int(rec["peak_bytes"]), "xla_program": name,
                    "xla_over_analytic": rec["peak_bytes"] / max(1, analytic)})
  limit = p["device_memory_bytes"]
  p["fits_analytic"] = p["fits"]
  p["fits"] = None if limit is None else bool(rec["peak_bytes"] <= limit)
  if limit is not None:
    p["peak"]["spare_fraction"] = 1.0 - rec["peak_bytes"] / limit
  return p


def check_fits(p: dict[str, Any]) -> None:
  """Raises DoesNotFit, naming the largest parts and what lowers them, when the plan's total
  (XLA's largest program peak when the plan holds compiled programs) exceeds the device memory."""
  if p["fits"] is not False:
    return
  if "compiled" in p:
    name = p["peak"]["xla_program"]
    rec = p["compiled"][name]
    raise DoesNotFit(
        f"{name} needs {rec['peak_bytes'] / GIB:.1f} GiB per trainer device by XLA's count "
        f"(arguments {rec['argument_bytes'] / GIB:.1f}, temporaries {rec['temp_bytes'] / GIB:.1f}"
        f", other buffers alive {rec['resident_bytes'] / GIB:.1f} GiB) but "
        f"{p['device_memory_bytes'] / GIB:.1f} GiB are usable on {p['target']['name']} at "
        f"devices.memory_fraction={p['target']['memory_fraction']:g}. Lower it with "
        f"{PROGRAM_FIXES.get(name, 'more trainer devices')}, or raise devices.memory_fraction")
  name = p["peak"]["analytic_program"]
  parts = {k: v for k, v in p["per_device_bytes"].items() if k != "total"}
  top = ", ".join(f"{k} {v / GIB:.1f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
  raise DoesNotFit(
      f"the plan's {name} needs {p['peak']['analytic_bytes'] / GIB:.1f} GiB per trainer device but "
      f"{p['device_memory_bytes'] / GIB:.1f} GiB are usable (the train step's parts: {top} GiB). "
      f"Lower it with {PROGRAM_FIXES.get(name, 'more trainer devices')}, or raise "
      "devices.memory_fraction (`--compile_for=h100` gives XLA's own count)")


def format_plan(p: dict[str, Any], split: Optional[devices_lib.GpuSplit] = None) -> str:
  """A human-readable table of the plan."""
  d = p["devices"]
  lora = p.get("lora")
  lines = [f"model: {p['model']['preset'] if not p['model']['path'] else p['model']['path']} "
           f"({p['model']['params'] / 1e9:.2f}B params, {p['model']['dtype']} compute, "
           f"{p['model']['param_dtype']} {'frozen base' if lora else 'master weights'})",
           f"trainer: T={d['trainer_devices']} {d['platform']} devices, mesh {d['mesh']}; "
           f"rollout: W={d['rollout_workers']} {d['rollout_backend']} workers"]
  if lora:
    lines.append(f"LoRA: rank {lora['rank']} (alpha {lora['alpha']:g}) on {','.join(lora['targets'])}"
                 f": {lora['adapter_params'] / 1e6:.1f}M adapter params in {lora['dtype']} "
                 "(params / opt_state / grads below are the adapters')")
  if split is not None:
    lines.append(f"GPUs: trainer {','.join(split.trainer)}; workers {','.join(split.workers)} "
                 f"({split.per_worker} per worker)")
  mb = p["micro_batch"]
  lines.append(f"micro-batch: {mb['rows_per_device']} rows x {mb['tokens_per_row']} tokens per "
               f"device, {mb['num_microbatches']} micro-batches per step")
  lines.append(f"{'per device':<16}{'GiB':>10}")
  for k, v in p["per_device_bytes"].items():
    lines.append(f"{k:<16}{v / GIB:>10.2f}")
  limit = p["device_memory_bytes"]
  if "compiled" in p:
    lines += _format_compiled(p)
  else:
    lines.append(f"peak per device (analytic): {p['peak']['analytic_bytes'] / GIB:.2f} GiB in "
                 f"{p['peak']['analytic_program']} (" + ", ".join(
                     f"{k} {v / GIB:.1f}" for k, v in p["programs"].items()) + " GiB)")
  lines.append(f"usable memory: {'unknown (set devices.memory_gib)' if limit is None else f'{limit / GIB:.2f} GiB'}"
               f"; fits: {p['fits']}")
  if "time" in p:
    tp = p["time"]
    lines.append(f"refresh stall (estimate): {tp['publish_stall_s']:.2f} s per publish "
                 f"({tp['publish_bytes'] / 1e9:.1f} GB) vs a step of ~{tp['step_s']:.1f} s: "
                 f"{100 * tp['publish_fraction']:.1f}% of the trainer's time at refresh_every="
                 f"{tp['refresh_every']}")
    if "compute_s" in tp:
      lines.append(f"step on {tp['target']} (compiled): {tp['step_flops_per_device'] / 1e12:.0f} "
                   f"TFLOP per device -> {tp['compute_s']:.1f} s at MFU {ASSUMED_MFU:g}; "
                   f"collectives {tp['comm_traffic_bytes_per_device'] / 1e9:.0f} GB per device -> "
                   f"{tp['comm_s']:.2f} s at {tp['assumed']['nvlink_gbps']:g} GB/s NVLink ("
                   + ", ".join(f"{k} {v['count']}x {v['bytes'] / 1e9:.0f} GB"
                               for k, v in tp["collectives"].items()) + ")")
  lines.append(f"params per device: {p['params_fraction_per_device']:.3f} of the model"
               f"{'; padded leaves: ' + ', '.join(p['padded_leaves']) if p['padded_leaves'] else ''}")
  return "\n".join(lines)


def _format_compiled(p: dict[str, Any]) -> list[str]:
  """The compiled programs' table (XLA's per-device bytes) and the analytic-vs-XLA line."""
  t = p["target"]
  lines = [f"compiled for {t['name']} ({t['description']}, {t['memory_bytes'] / GIB:.1f} GiB), "
           "per device GiB:",
           f"  {'program':<16}{'args':>8}{'out':>8}{'alias':>8}{'temp':>8}{'other':>8}{'peak':>8}"
           f"{'analytic':>10}{'compile s':>11}"]
  for name, r in p["compiled"].items():
    analytic = p["programs"].get(name)
    lines.append(f"  {name:<16}" + "".join(
        f"{r[k] / GIB:>8.2f}" for k in ("argument_bytes", "output_bytes", "alias_bytes",
                                         "temp_bytes", "resident_bytes", "peak_bytes"))
        + (f"{analytic / GIB:>10.2f}" if analytic is not None else f"{'-':>10}")
        + f"{r['compile_seconds']:>11.1f}")
  pk = p["peak"]
  lines.append(f"peak per device: analytic {pk['analytic_bytes'] / GIB:.2f} GiB, XLA "
               f"{pk['xla_bytes'] / GIB:.2f} GiB ({pk['xla_program']}; XLA / analytic "
               f"{pk['xla_over_analytic']:.2f})"
               + (f"; {100 * pk['spare_fraction']:.1f}% of the usable memory to spare"
                  if "spare_fraction" in pk else ""))
  return lines


def dry_run(c, workdir: str, split: Optional[devices_lib.GpuSplit] = None) -> dict[str, Any]:
  """Plans `c`, prints the plan, writes WORKDIR/plan.json and raises DoesNotFit when it does not
  fit. Nothing is loaded or started."""
  return write_and_check(plan(c), workdir, split)


def write_and_check(p: dict[str, Any], workdir: str,
                    split: Optional[devices_lib.GpuSplit] = None) -> dict[str, Any]:
  """Writes plan `p` (with the GPU split) to WORKDIR/plan.json, prints it and raises DoesNotFit
  when it does not fit; returns it."""
  if split is not None:
    p["devices"]["trainer_gpus"] = list(split.trainer)
    p["devices"]["worker_gpus"] = list(split.workers)
  os.makedirs(workdir, exist_ok=True)
  tmp = os.path.join(workdir, "plan.json.tmp")
  with open(tmp, "w") as f:
    json.dump(p, f, indent=1)
  os.replace(tmp, os.path.join(workdir, "plan.json"))
  print(format_plan(p, split), flush=True)
  check_fits(p)
  return p
