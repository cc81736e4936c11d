"""What runs inside a vLLM worker without importing vLLM at module level: the reload helpers shared
by the file reload and the weight-transfer engine (`transfer`), and the weight-transfer backend's
name, which the driver side (`engine`) needs without importing `transfer` (which imports vLLM)."""
from __future__ import annotations

import logging

SHM_BACKEND = "jaxreplay_shm"  # the name `transfer.register` gives `ShmWeightTransferEngine`


class _BenignReloadWarnings(logging.Filter):
  """Drops vLLM's layerwise-reload warning "<Layer>: Failed to load weights" for layers that have
  nothing to load by design: rotary embeddings (their cos/sin cache is a computed buffer, not a
  checkpoint tensor) and, when the embeddings are tied, the LM head (its weight is the embedding's).
  Every other layer's warning still shows. Whether a refresh really loaded the weights is checked
  by comparing log-probs (`run.metrics_row.MismatchProbe`, which warns when they differ)."""

  def __init__(self, tied_head: bool):
    super().__init__()
    self.tied_head = tied_head
    self.dropped = 0

  def filter(self, record: logging.LogRecord) -> bool:
    if record.msg != "%s: Failed to load weights" or not record.args:
      return True
    layer = str(record.args[0])
    benign = layer.endswith("RotaryEmbedding") or (self.tied_head and layer == "ParallelLMHead")
    self.dropped += benign
    return not benign


_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def _reload_worker_weights(worker, weights_path: str) -> None:
  """Runs inside vLLM's worker: reloads all weights from `weights_path`, re-packs a tied LM head."""
  model = worker.model_runner.get_model()
  tied = bool(getattr(model.config, "tie_word_embeddings", False))
  reload_logger = logging.getLogger(_RELOAD_LOGGER)
  if not any(isinstance(f, _BenignReloadWarnings) for f in reload_logger.filters):
    reload_logger.addFilter(_BenignReloadWarnings(tied))
  load_config = worker.vllm_config.load_config
  if str(load_config.load_format) == "dummy":  # started with stand-in weights: files from now on
    load_config.load_format = "auto"
  worker.reload_weights(weights_path=weights_path)
  _repack_tied_head(worker.model_runner.get_model())


def _repack_tied_head(model) -> None:
  """With tied embeddings the LM head is not reloaded itself (its weight is the embedding's), so
  vLLM's packed copy of it (CPU) would stay stale: re-pack it from the new embedding."""
  lm_head = getattr(model, "lm_head", None)
  quant_method = getattr(lm_head, "quant_method", None)
  if getattr(model.config, "tie_word_embeddings", False) and quant_method is not None:
    quant_method.process_weights_after_loading(lm_head)
