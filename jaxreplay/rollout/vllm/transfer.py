"""Inside a vLLM worker: weights from a shared-memory segment through vLLM's weight-transfer API.

`ShmWeightTransferEngine` is a vLLM `WeightTransferEngine` registered under the backend name
`SHM_BACKEND` (`WeightTransferEngineFactory.register_engine`, when this module is imported: vLLM
imports it in every worker process as the `worker_extension_cls` module, before the model loads).
An engine built with `weight_transfer_config=WeightTransferConfig(backend=SHM_BACKEND)` creates it
in `Worker.load_model`; one refresh is vLLM's own session on the worker:

  start_weight_update   -> initialize_layerwise_reload(model)
  update_weights(info)  -> map the segment (`weights.shm_format`) and model.load_weights(views)
  finish_weight_update  -> finalize_layerwise_reload(model, model_config), re-pack a tied LM head

`WorkerExtension.jaxreplay_load_shm(path, version)` runs that session in one RPC and returns its
phases (seconds): `load_s` (model.load_weights, the per-layer processing included), `repack_s`
(the part of it in the layers' `process_weights_after_loading`: on CPU vLLM re-packs every linear
weight for oneDNN there), `finalize_s`, and `bytes`. The layerwise reload is what makes a per-tensor
load work on CPU, where plain `load_weights` fails (the packed weights replaced the originals).

Imported only in engine processes (it imports torch and vLLM).
"""
from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from typing import Any, Optional

import numpy as np
import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from jaxreplay.rollout.weights import shm_format
from jaxreplay.rollout.vllm import direct_load
from jaxreplay.rollout.vllm.worker_side import (_RELOAD_LOGGER, SHM_BACKEND,
                                                _BenignReloadWarnings, _reload_worker_weights,
                                                _repack_tied_head)


@dataclasses.dataclass
class ShmInitInfo(WeightTransferInitInfo):
  """Nothing to rendezvous: the segments are files."""


@dataclasses.dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
  """One segment: its path and the version it must hold."""
  path: str
  version: int


_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _torch_views(reader: shm_format.SegmentReader):
  """(HF name, torch view) per tensor of `reader`'s segment (bfloat16 included). Every view shares
  one storage, the whole read-only mapping, so that shards stored side by side can be taken as one
  strided matrix; vLLM only copies from them (torch's warning about a read-only array is
  silenced)."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    whole = torch.from_numpy(np.frombuffer(reader.mapping, np.uint8))
  base = reader.address_range[0]
  flats: dict[torch.dtype, torch.Tensor] = {}
  for name, x in reader.tensors():
    dtype = _TORCH_DTYPES[x.dtype.name]
    flat = flats.get(dtype)
    if flat is None:
      flat = flats[dtype] = whole.view(dtype)
    size = x.itemsize
    yield name, flat.as_strided(x.shape, tuple(st // size for st in x.strides),
                                (x.ctypes.data - base) // size)


class _RepackTimer:
  """Seconds spent in the layers' `quant_method.process_weights_after_loading` (vLLM's CPU
  re-packing of linear weights) while installed: each method is wrapped on its instance."""

  def __init__(self, model: torch.nn.Module):
    self.seconds = 0.0
    self._patched = []
    for module in model.modules():
      method = getattr(module, "quant_method", None)
      if method is None or any(m is method for m in self._patched):
        continue
      original = method.process_weights_after_loading

      def timed(layer, _original=original):
        start = time.perf_counter()
        try:
          return _original(layer)
        finally:
          self.seconds += time.perf_counter() - start

      method.process_weights_after_loading = timed
      self._patched.append(method)

  def remove(self) -> None:
    for method in self._patched:
      del method.process_weights_after_loading  # the class's method again
    self._patched.clear()


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
  """vLLM's engine side of the shared-memory transport (see the module docstring)."""

  init_info_cls = ShmInitInfo
  update_info_cls = ShmUpdateInfo

  def __init__(self, config, vllm_config, device, model):
    super().__init__(config, vllm_config, device, model)
    self._reader: Optional[shm_format.SegmentReader] = None
    self._timer: Optional[_RepackTimer] = None
    self._phase: dict[str, float] = {}
    self.last_stats: dict[str, float] = {}
    self._direct_names: Optional[tuple[str, ...]] = None
    self._direct: Optional[direct_load.DirectCpuLoad] = None

  def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
    del init_info

  def start_weight_update(self) -> None:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload  # pylint: disable=g-import-not-at-top
    _install_reload_filter(self.model)
    self._phase = {"load_s": 0.0, "repack_s": 0.0, "finalize_s": 0.0, "bytes": 0.0}
    initialize_layerwise_reload(self.model)
    self._timer = _RepackTimer(self.model)

  def update_weights(self, update_info: dict[str, Any]) -> None:
    """As vLLM's, without the accelerator sync on CPU (the copies are synchronous there)."""
    self.receive_weights(self.parse_update_info(update_info))
    if self.device.type != "cpu":
      torch.accelerator.synchronize()

  def open_segment(self, path: str, version: int) -> None:
    """Maps and locks the segment before a session starts, so that a superseded one
    (`StaleWeights`) is refused while the model still holds its weights untouched."""
    self._close_reader()
    self._reader = shm_format.SegmentReader(path, version)

  def receive_weights(self, update_info: ShmUpdateInfo) -> None:
    """Maps the segment (unless `open_segment` did; held until `finish_weight_update`: layers
    processed at finalize may still read its views) and loads its tensors in segment (= layer)
    order."""
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check  # pylint: disable=g-import-not-at-top
    start = time.perf_counter()
    reader = self._reader
    if reader is None or reader.path != update_info.path or reader.version != update_info.version:
      self.open_segment(update_info.path, update_info.version)
    tensors = _torch_views(self._reader)
    with disable_mtp_completeness_check():
      self.model.load_weights(tensors)
    self._phase["load_s"] += time.perf_counter() - start
    self._phase["bytes"] += self._reader.nbytes

  def finish_weight_update(self) -> None:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload  # pylint: disable=g-import-not-at-top
    start = time.perf_counter()
    try:
      finalize_layerwise_reload(self.model, self.model_config)
      _repack_tied_head(self.model)
    finally:
      repack = self._timer.seconds if self._timer is not None else 0.0
      if self._timer is not None:
        self._timer.remove()
        self._timer = None
      self._close_reader()
    self._phase["finalize_s"] = time.perf_counter() - start
    self._phase["repack_s"] = repack
    self.last_stats = dict(self._phase)

  def load_direct(self, path: str, version: int) -> Optional[dict[str, float]]:
    """The refresh of `rollout.vllm.direct_load` (CPU: each linear layer re-packed straight from the
    segment), outside vLLM's session; its phases, or None where it does not apply (nothing is
    loaded then). Raises `StaleWeights` as `open_segment` does."""
    start = time.perf_counter()
    self.open_segment(path, int(version))
    try:
      names = tuple(entry[0] for entry in self._reader.header["tensors"])
      if names != self._direct_names:
        self._direct = direct_load.plan(self.model, list(names))
        self._direct_names = names
      if self._direct is None:
        return None
      self._direct.load(_torch_views(self._reader), self._reader.address_range)
      nbytes = self._reader.nbytes
    finally:
      self._close_reader()
    stats = {"load_s": time.perf_counter() - start, "repack_s": self._direct.repack_s,
             "finalize_s": 0.0, "bytes": float(nbytes), "direct": 1.0}
    self.last_stats = dict(stats)
    return stats

  def shutdown(self) -> None:
    self._close_reader()

  def _close_reader(self) -> None:
    if self._reader is not None:
      self._reader.close()
      self._reader = None


def _install_reload_filter(model) -> None:
  tied = bool(getattr(model.config, "tie_word_embeddings", False))
  reload_logger = logging.getLogger(_RELOAD_LOGGER)
  if not any(isinstance(f, _BenignReloadWarnings) for f in reload_logger.filters):
    reload_logger.addFilter(_BenignReloadWarnings(tied))


def register() -> None:
  """Registers `ShmWeightTransferEngine` as `SHM_BACKEND` (once per process)."""
  if SHM_BACKEND not in WeightTransferEngineFactory._registry:  # pylint: disable=protected-access
    WeightTransferEngineFactory.register_engine(SHM_BACKEND, ShmWeightTransferEngine)


register()


class WorkerExtension:
  """Mixed into vLLM's worker class (`worker_extension_cls`), so that a refresh is called by name
  and reaches the worker wherever it runs (`collective_rpc` with a function only works with the
  engine core in the caller's process: vLLM serialises RPCs to its own engine-core process without
  pickle)."""

  def jaxreplay_reload_weights(self, weights_path: str) -> None:
    """transport "file": vLLM's `reload_weights` from an HF directory."""
    _reload_worker_weights(self, weights_path)

  def jaxreplay_load_shm(self, path: str, version: int, direct: bool = True) -> dict[str, Any]:
    """transport "shm": the segment at `path` loaded, by `rollout.vllm.direct_load` where it applies
    (`direct`; CPU engines) else by one session of vLLM's weight-transfer API; its phases
    (`direct` 1.0 or 0.0 among them).

    A superseded segment is refused before anything is loaded (weights untouched) and reported as
    a status, {"stale": 1.0, "message": ...}, not raised: an exception raised here reaches a
    driver whose engine core runs in its own process (vLLM's GPU default) as a plain `Exception`
    with the type lost, so the caller (`VllmEngine.load_weights`) re-raises `StaleWeights` itself.
    """
    try:
      return self._jaxreplay_load_shm(path, version, direct)
    except shm_format.StaleWeights as e:
      return {"stale": 1.0, "message": str(e)}

  def _jaxreplay_load_shm(self, path: str, version: int, direct: bool) -> dict[str, float]:
    start = time.perf_counter()
    if direct:
      stats = self.weight_transfer_engine.load_direct(path, int(version))
      if stats is not None:
        stats["engine_s"] = time.perf_counter() - start
        return stats
    self.weight_transfer_engine.open_segment(path, int(version))
    self.start_weight_update()
    try:
      self.update_weights({"path": path, "version": int(version)})
    except BaseException:
      try:
        self.finish_weight_update()  # leave the session closed; the error is the one to report
      except Exception:  # pylint: disable=broad-except
        pass
      raise
    self.finish_weight_update()
    stats = dict(self.weight_transfer_engine.last_stats)
    stats["direct"] = 0.0
    stats["engine_s"] = time.perf_counter() - start
    return stats
