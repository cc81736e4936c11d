"""A run's GPU programs compiled for a GPU this machine does not have (`--compile_for=h100`).

JAX's CUDA plugin builds compile-only GPU devices from a target description
(`config.gpu_targets`, no driver, no device): `compile_devices(target, n)`. On them this module
builds, abstractly (`jax.eval_shape`: nothing is allocated), every jitted program a run of the
config runs on its trainer devices, with the run's own builders (`memory_plan.planned_mesh` over
the first T devices, `trainer.init_train_state`, `trainer.state_shardings`,
`trainer.make_train_step`, ...), and compiles each with XLA:GPU for that GPU:

  train_step      the update: the config's micro-batches, packing, remat, LoRA or full weights,
                  KL reference, the gradient gate's bound, on the worst-case batch
                  (buffer.batch_size rows of model.max_len; also with trainer.ppo_minibatches,
                  whose updates take B/m of them)
  logprob_fn      the trainer's log-probs of a training batch (the trainer / sampler mismatch)
  diagnostics     the regime diagnostics' forward + backward (log.diagnostics_every > 0)
  update_kl_probe the diagnostics' probe logits [probe, max_len, V] (log.diagnostics_probe > 0)
  publish         the weight refresh's device side: the params cast to the engines' dtype (vLLM),
                  a device copy (JAX samplers), the adapters only with LoRA
  export_check    the finite check over the params before a checkpoint / HF export
  sampler         the JAX sampler's prefill + decode loop (rollout.backend=jax)
  eval_sampler    the same for evaluation on the trainer (eval.backend "trainer")

Each compiled program gives XLA's per-device memory (`memory_analysis`: argument, output, alias,
temp bytes) and its optimized HLO (`hlo_stats`: collectives, host transfers, FLOPs). A program's
peak is what the device holds while it runs:

  peak_bytes = argument_bytes + output_bytes - alias_bytes + temp_bytes + resident_bytes

where resident_bytes are the run's other buffers alive meanwhile (the optimizer state while the
log-prob function runs, the probe's logits kept across the update, a JAX sampler's weight copy).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import time
import warnings
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxreplay.config import gpu_targets
from jaxreplay.config import host_devices
from jaxreplay.config import memory_plan
from jaxreplay.data import batch_reuse
from jaxreplay.infra import sharding
from jaxreplay.learner import adapters
from jaxreplay.learner import diagnostics
from jaxreplay.learner import optim
from jaxreplay.learner import loss_fn as loss_fn_lib
from jaxreplay.learner import trainer
from jaxreplay.learner.batch import Batch
from jaxreplay.models import lora as lora_lib
from jaxreplay.models import transformer
from jaxreplay.models.config import ModelConfig
from jaxreplay.rollout import backend_table
from jaxreplay.rollout import jax_sampler
from jaxreplay.run import hlo_stats
from jaxreplay.run import regime

PLUGIN_INSTALL = "pip install -e '.[gpu-compile]'"
NODE_GPUS = 8  # the node a topology describes: trainer and rollout GPUs of one 8-GPU server
MEMORY_KEYS = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "resident_bytes",
               "peak_bytes", "compile_seconds")


class PluginMissing(RuntimeError):
  """JAX's CUDA plugin (or the cuDNN it needs for flash attention) is not installed."""


def check_plugin(need_cudnn: bool = False) -> None:
  """Raises PluginMissing (one line naming the install command) without JAX's CUDA-13 plugin,
  or without cuDNN when a program attends with it."""
  if not host_devices.cuda_plugin_installed():
    raise PluginMissing(f"--compile_for needs JAX's CUDA plugin (no GPU needed): {PLUGIN_INSTALL}")
  if need_cudnn and not host_devices.installed("nvidia.cudnn"):
    raise PluginMissing("--compile_for: this config attends with cuDNN flash attention, whose "
                        f"library is not installed: {PLUGIN_INSTALL}")


def compile_devices(target: gpu_targets.GpuTarget, count: int = NODE_GPUS) -> list:
  """`count` compile-only devices of `target` (no driver, no GPU). Sets
  JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1: the plugin's version probe needs a driver."""
  os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  topo = topologies.get_topology_desc(platform="cuda", target_config=target.text,
                                      topology=f"1x1x{int(count)}")
  return list(topo.devices)


# ---- the run's programs, abstractly -----------------------------------------------------------

@dataclasses.dataclass
class Program:
  """One jitted program of a run: `fn.lower(*args)` with abstract args; resident_bytes: the
  run's buffers alive beside it (module docstring); donated_bytes: what it donates per device."""
  name: str
  fn: Any
  args: tuple
  resident_bytes: int = 0
  donated_bytes: int = 0
  what: str = ""


def target_model_config(c) -> ModelConfig:
  """The model as the GPU runs it: model.attention "auto" resolved as on a GPU (cuDNN flash
  attention in 16-bit compute, else XLA), since this process's own backend is the CPU."""
  cfg = memory_plan.model_config(c).replace(scan_unroll=int(c.model.get("scan_unroll", 0)))
  attention = c.model.get("attention", "auto")
  if attention == "auto":
    attention = "cudnn" if np.dtype(cfg.compute_dtype).itemsize == 2 else "xla"
  return cfg.replace(attention=attention)


def _abstract(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


def abstract_batch(rows: int, seq: int, mesh, packed: bool) -> Batch:
  """A [rows, seq] training batch of ShapeDtypeStructs, rows over the batch axes."""
  sh = NamedSharding(mesh, P(sharding.batch_axes(mesh)))
  spec = lambda dt, *shape: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
  per_row = (rows, seq) if packed else (rows,)
  return Batch(tokens=spec(jnp.int32, rows, seq), positions=spec(jnp.int32, rows, seq),
               segment_ids=spec(jnp.int32, rows, seq), targets=spec(jnp.int32, rows, seq),
               completion_mask=spec(jnp.float32, rows, seq),
               behaviour_logprobs=spec(jnp.float32, rows, seq),
               advantages=spec(jnp.float32, *per_row), rewards=spec(jnp.float32, *per_row),
               policy_version=spec(jnp.int32, *per_row))


def _bytes(tree: Any) -> int:
  """Per-device bytes of a tree of sharded ShapeDtypeStructs."""
  leaves = [x for x in jax.tree.leaves(tree) if x is not None]
  return sharding.shard_bytes(leaves, [x.sharding for x in leaves]) if leaves else 0


def _backends(c) -> tuple[str, str]:
  """The resolved rollout and evaluation backends (`rollout.backend_table`)."""
  rollout = backend_table.resolve(c.rollout.backend)
  return rollout, backend_table.resolve_eval(c.eval.backend, rollout)


def _sampler_program(name: str, cfg, policy, rows: int, c, mesh, resident: int) -> Program:
  """`jax_sampler.generate_batch` at its largest shapes: the longest prompt bucket that leaves
  room for rollout.max_tokens, a cache of model.max_len."""
  max_len = int(c.model.max_len)
  max_new = jax_sampler.output_bucket(int(c.rollout.max_tokens))
  buckets = jax_sampler.default_buckets(max_len)
  prompt = max(b for b in buckets if b <= max(max_len - int(c.rollout.max_tokens), buckets[0]))
  rep = NamedSharding(mesh, P())
  s = lambda dt, *shape: jax.ShapeDtypeStruct(shape, dt, sharding=rep)
  keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), rows))
  keys = jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=rep)
  fn = _Bound(jax_sampler.generate_batch, dict(
      cache_len=min(max_len, prompt + max_new), max_new=max_new,
      use_top_k=0 < int(c.rollout.top_k) < cfg.vocab_size, use_top_p=float(c.rollout.top_p) < 1.0))
  args = (cfg, policy, s(jnp.int32, rows, prompt), s(jnp.int32, rows), s(jnp.bool_, rows), keys,
          s(jnp.float32), s(jnp.int32), s(jnp.float32), s(jnp.int32, 8), s(jnp.int32))
  cache = min(max_len, prompt + max_new)
  return Program(name, fn, args, resident,
                 what=f"prefill {rows} x {prompt} tokens + decode to a {cache}-token KV cache")


@dataclasses.dataclass
class _Bound:
  """`fn.lower(*args)` with static keyword arguments bound (`generate_batch`'s cfg, shapes)."""
  fn: Any
  kwargs: dict

  def lower(self, *args):
    return self.fn.lower(*args, **self.kwargs)


def programs(c, mesh) -> list[Program]:
  """The jitted programs a run of config `c` runs on its trainer devices (module docstring),
  built abstractly on `mesh`."""
  cfg = target_model_config(c)
  t = c.trainer
  optimizer = optim.make_optimizer(t.learning_rate, warmup_steps=t.warmup_steps,
                                   total_steps=c.total_steps, schedule=t.schedule,
                                   weight_decay=t.weight_decay, b1=t.b1, b2=t.b2,
                                   max_grad_norm=t.max_grad_norm)
  lr_fn = optim.make_schedule(t.learning_rate, t.warmup_steps, c.total_steps, t.schedule)
  loss_fn = loss_fn_lib.loss_fn_from_config(t)
  processing = trainer.logprob_processing(c)
  spec = lora_lib.spec_from_config(c.model)
  base = None
  if spec is None:
    state = jax.eval_shape(lambda: trainer.init_train_state(
        cfg, optimizer, jax.random.PRNGKey(0), mesh=mesh, with_ref_params=t.kl_coef != 0.0))
  else:
    logical = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))
    storage = sharding.storage_shapes(logical, mesh)
    base_sh = sharding.param_shardings(storage, mesh)
    base = adapters.FrozenBase(spec=spec, params=_abstract(storage, base_sh), shardings=base_sh,
                               path="", sha256="")
    state = jax.eval_shape(lambda: adapters.init_adapter_state(
        cfg, spec, optimizer, jax.random.PRNGKey(0), mesh))
  state_sh = trainer.state_shardings(state, mesh)
  state = _abstract(state, state_sh)
  policy = state.params if base is None else base.model_params(state.params)
  rows, seq = int(c.buffer.batch_size), int(c.model.max_len)
  packed = bool(t.get("pack", False))
  batch = abstract_batch(rows, seq, mesh, packed)
  opt_bytes = _bytes(state.opt_state)
  ref_bytes = _bytes(state.ref_params) if state.ref_params is not None else 0
  param_bytes = _bytes(state.params)
  rollout_backend, eval_backend = _backends(c)
  backend = backend_table.record(rollout_backend)
  # A sampler on the trainer devices holds a device copy of the published params
  # (rollout.weights.DeviceCopyPublisher).
  sampler_copy = param_bytes if backend.on_trainer_devices else 0

  # The regime diagnostics and their update-KL probe (run.regime), as build.py makes them.
  diag_splits = regime.splits_for(rows, sharding.batch_size_multiple(mesh),
                                  int(c.log.diagnostics_splits)) if c.log.diagnostics_every else 0
  probe_rows = int(c.log.diagnostics_probe) if c.log.diagnostics_every else 0
  probe_out = (probe_rows * seq * cfg.vocab_size * 4) if probe_rows else 0  # replicated f32
  out = []
  # The gradient gate's step (buffer.reuse_control "gradient_gate") takes its bound, a scalar.
  gated = c.buffer.get("reuse_control", "off") == batch_reuse.GATE_CONTROL
  step = trainer.make_train_step(cfg, optimizer, loss_fn, mesh, state_sh,
                                 num_microbatches=t.num_microbatches, chunk_size=t.logprob_chunk,
                                 learning_rate_fn=lr_fn, logprob_processing=processing, lora=base,
                                 **trainer.step_options(t),
                                 gate_leaf=trainer.gate_leaf(cfg) if gated else None)
  step_args = (state, batch) + ((jax.ShapeDtypeStruct((), jnp.float32),) if gated else ())
  out.append(Program("train_step", step, step_args, sampler_copy + probe_out,
                     donated_bytes=_bytes(state),
                     what=f"{rows} rows x {seq} tokens{' packed' if packed else ''} in "
                          f"{int(t.num_microbatches)} micro-batches"))
  logprob_fn = trainer.make_logprob_fn(cfg, mesh, state_sh.params, chunk_size=t.logprob_chunk,
                                       logprob_processing=processing, lora=base)
  out.append(Program("logprob_fn", logprob_fn, (state.params, batch),
                     opt_bytes + ref_bytes + sampler_copy, what=f"{rows} rows x {seq} tokens"))
  if diag_splits >= 2:
    fn = diagnostics.make_diagnostics_fn(
        cfg, loss_fn, mesh, state_sh.params, splits=diag_splits, chunk_size=t.logprob_chunk,
        logprob_remat=trainer.step_options(t)["logprob_remat"], logprob_processing=processing,
        lora=base)
    out.append(Program("diagnostics", fn, (state.params, state.ref_params, batch),
                       opt_bytes + sampler_copy,
                       what=f"{rows} rows in {diag_splits} micro-batches, no update"))
  if probe_rows and jax.process_count() == 1:
    fn = diagnostics.make_probe_fn(cfg, mesh, state_sh.params, lora=base)
    probe = abstract_batch(probe_rows, seq, mesh, packed=False)
    probe = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                        sharding=sharding.replicated(mesh)), probe)
    out.append(Program("update_kl_probe", fn, (state.params, probe),
                       opt_bytes + ref_bytes + sampler_copy + probe_out,
                       what=f"log-softmax [{probe_rows}, {seq}, {cfg.vocab_size}] float32, "
                            "replicated (one kept across the update)"))
  publish_dtype = _publish_dtype(c, backend)
  if backend.on_trainer_devices:
    cast = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=state_sh.params)
    what = "a device copy of the params for the JAX samplers"
  else:
    dtype = jnp.dtype(publish_dtype)
    cast = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(dtype), p),
                   out_shardings=state_sh.params)
    what = f"the params cast to the engines' {publish_dtype} before the host copy"
  out.append(Program("publish", cast, (state.params,), opt_bytes + ref_bytes + sampler_copy,
                     what=what if base is None else what + " (the adapters only)"))
  check = jax.jit(lambda p: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x))
                                               for x in jax.tree.leaves(p)])))
  out.append(Program("export_check", check, (state.params,), opt_bytes + ref_bytes + sampler_copy,
                     what="all params finite, before a checkpoint or HF export"))
  if backend.on_trainer_devices:
    out.append(_sampler_program("sampler", cfg, policy, int(c.rollout.sampler_batch_size), c,
                                mesh, opt_bytes + ref_bytes + sampler_copy))
  if eval_backend == "trainer" and c.eval.num_problems:
    out.append(_sampler_program("eval_sampler", cfg, policy,
                                int(c.eval.batch_size or c.rollout.sampler_batch_size), c, mesh,
                                opt_bytes + ref_bytes + sampler_copy))
  return out


def _publish_dtype(c, backend: backend_table.Backend) -> str:
  """The dtype weights reach the rollout workers in on a GPU: the engines' own dtype key
  (rollout.vllm_dtype "auto": bfloat16 for vLLM); a JAX sampler's copy keeps the params' dtype."""
  if not backend.dtype_key:
    return c.model.param_dtype
  dtype = c.rollout.get(backend.dtype_key, "auto")
  return "bfloat16" if dtype == "auto" else dtype


# ---- compiling ----------------------------------------------------------------------------------

@contextlib.contextmanager
def captured_stderr():
  """Collects what native code writes to fd 2 meanwhile (XLA's C++ warnings); yields a list that
  holds the text afterwards."""
  out: list[str] = []
  with tempfile.TemporaryFile(mode="w+b") as tmp:
    saved = os.dup(2)
    os.dup2(tmp.fileno(), 2)
    try:
      yield out
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      tmp.seek(0)
      out.append(tmp.read().decode(errors="replace"))


def compile_program(program: Program) -> tuple[dict[str, Any], str]:
  """Compiles `program` for its devices; returns (its record: MEMORY_KEYS, the donation and HLO
  findings, XLA's warnings; the optimized HLO text)."""
  start = time.perf_counter()
  with warnings.catch_warnings(record=True) as caught, captured_stderr() as err:
    warnings.simplefilter("always")
    compiled = program.fn.lower(*program.args).compile()
  seconds = time.perf_counter() - start
  m = compiled.memory_analysis()
  hlo = compiled.as_text()
  rec = {"argument_bytes": int(m.argument_size_in_bytes),
         "output_bytes": int(m.output_size_in_bytes),
         "alias_bytes": int(m.alias_size_in_bytes), "temp_bytes": int(m.temp_size_in_bytes),
         "resident_bytes": int(program.resident_bytes)}
  rec["peak_bytes"] = (rec["argument_bytes"] + rec["output_bytes"] - rec["alias_bytes"]
                       + rec["temp_bytes"] + rec["resident_bytes"])
  rec["compile_seconds"] = round(seconds, 2)
  rec["what"] = program.what
  messages = [str(w.message) for w in caught]
  unusable = [msg for msg in messages if "donated buffers were not usable" in msg]
  rec["donation"] = {"donated_bytes": int(program.donated_bytes), "unusable": unusable,
                     "all_used": not unusable and rec["alias_bytes"] >= program.donated_bytes}
  rec["host_transfers"] = hlo_stats.host_transfers(hlo)
  xla = [line.strip() for line in "".join(err).splitlines()
         if "rematerialization" in line or "memory" in line.lower()]
  if xla:
    rec["xla_warnings"] = xla
  return rec, hlo


def step_time(hlo: str, c, cfg, target: gpu_targets.GpuTarget) -> dict[str, Any]:
  """The train step's predicted compute and communication seconds on `target` (plan.json
  "time"): FLOPs of the compiled step (`hlo_stats.flops`; the model's own count when the HLO
  shows none) at `memory_plan.ASSUMED_MFU` of the target's peak, and the collectives' ring
  traffic at its NVLink bandwidth."""
  counted = hlo_stats.flops(hlo)
  coll = hlo_stats.collectives(hlo)
  t = int(c.trainer.num_devices)
  tokens = int(c.buffer.batch_size) * int(c.model.max_len)
  per_token = (4 if cfg.remat else 3) * cfg.flops_per_token(int(c.model.max_len))
  model_flops = tokens * per_token / t
  if counted["total"] > 0:
    flops, source = counted["total"], ("hlo: the compiled step's dots and cuDNN attention, loops "
                                       "counted by their trip counts")
  else:
    flops, source = model_flops, "model: flops_per_token x tokens (remat included) / T"
  peak = target.peak_tflops * 1e12
  compute_s = flops / (peak * memory_plan.ASSUMED_MFU)
  comm_s = coll["traffic_bytes"] / (target.nvlink_gbps * 1e9)
  kinds = {k: {"count": int(v["count"]), "bytes": int(v["bytes"]),
               "traffic_bytes": int(v["traffic_bytes"]), "group_sizes": v["group_sizes"],
               "seconds": v["traffic_bytes"] / (target.nvlink_gbps * 1e9)}
           for k, v in sorted(coll["by_kind"].items())}
  return {"target": target.name,
          "step_flops_per_device": float(flops), "flops_source": source,
          "model_flops_per_device": float(model_flops),
          "hlo_flops": {"dot": counted["dot"], "attention": counted["attention"]},
          "compute_s": compute_s,
          "collectives": kinds,
          "comm_traffic_bytes_per_device": int(coll["traffic_bytes"]),
          "comm_s": comm_s,
          "comm_fraction_if_not_overlapped": comm_s / (comm_s + compute_s) if compute_s else 0.0,
          "trip_counts_known": bool(counted["trip_counts_known"] and coll["trip_counts_known"]),
          "assumed": {"peak_tflops": target.peak_tflops, "mfu": memory_plan.ASSUMED_MFU,
                      "nvlink_gbps": target.nvlink_gbps,
                      "comm": "ring collectives at the NVLink peak of one direction, "
                              "not overlapped with compute (an upper bound on their exposed time)"}}


def compile_all(c, target: gpu_targets.GpuTarget, log: Optional[Callable[[str], None]] = None
                ) -> tuple[dict[str, Any], dict[str, Any], Any]:
  """Compiles every program of `c` for `target` (module docstring). Returns ({program: record},
  the train step's time record, the compile devices)."""
  cfg = target_model_config(c)
  check_plugin(need_cudnn=cfg.attention == "cudnn")
  devices = compile_devices(target, max(NODE_GPUS, int(c.trainer.num_devices)))
  mesh = memory_plan.planned_mesh(c, devices)
  records, time_rec = {}, {}
  for program in programs(c, mesh):
    rec, hlo = compile_program(program)
    records[program.name] = rec
    if log is not None:
      log(f"compiled {program.name} for {target.name}: peak {rec['peak_bytes'] / 2**30:.2f} GiB "
          f"per device ({rec['compile_seconds']:.0f} s)")
    if program.name == "train_step":
      time_rec = step_time(hlo, c, cfg, target)
  return records, time_rec, devices


def dry_run(c, workdir: str, target_name: str, split=None) -> dict[str, Any]:
  """`--dry_run --compile_for=NAME`: the analytic plan on the target's devices plus every program
  compiled for it; prints both, writes WORKDIR/plan.json and raises `memory_plan.DoesNotFit`
  when XLA's largest peak exceeds devices.memory_fraction x the target's memory (or
  devices.memory_gib x memory_fraction when set)."""
  target = gpu_targets.load(target_name)
  check_plugin(need_cudnn=target_model_config(c).attention == "cudnn")
  compiled, time_rec, devices = compile_all(c, target, log=lambda line: print(line, flush=True))
  limit = (memory_plan.device_memory_bytes(c) if c.devices.memory_gib > 0
           else int(target.memory_bytes * c.devices.memory_fraction))
  p = memory_plan.plan(c, devices, device_memory=limit)
  p["target"] = {"name": target.name, "description": target.description,
                 "memory_bytes": target.memory_bytes, "memory_fraction": c.devices.memory_fraction,
                 "nvlink_gbps": target.nvlink_gbps, "peak_tflops": target.peak_tflops}
  p["compiled"] = compiled
  p["time"].update(time_rec)
  memory_plan.with_compiled_fit(p)
  return memory_plan.write_and_check(p, workdir, split)
