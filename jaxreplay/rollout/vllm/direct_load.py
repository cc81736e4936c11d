"""Inside a CPU vLLM worker: a refresh that packs each linear layer straight from the segment.

vLLM's generic reload (`initialize_layerwise_reload` / `model.load_weights` /
`finalize_layerwise_reload`, the fallback in `transfer`) materialises every layer's weight in
a fresh tensor, copies the segment into it, lets the layer re-pack it for oneDNN, copies the result
back into the original storage and frees the fresh tensor: on CPU, where a linear layer keeps only
its packed copy, that is two page-faulting allocations and two extra passes over every byte, and
the input embedding is re-packed although only the LM head multiplies by it.

`DirectCpuLoad` does the part vLLM's CPU kernels need and nothing else:

  linear layers (unquantized, tensor-parallel size 1): the [in, out] kernel of the layer (the
    segment's view; fused layers such as qkv_proj / gate_up_proj: their shards concatenated into
    one reused scratch buffer) is handed to the layer's own `process_weights_after_loading`, which
    re-packs it into a new oneDNN handle (`ops.create_onednn_mm` copies; the layer keeps no
    reference to the segment, checked);
  every other tensor (norms, embeddings, biases, an untied LM head): the model's own
    `load_weights`, which copies each into its parameter in place;
  the LM head (tied or not): re-packed from its new weight.

A segment that stores kernels in the trainer's [in, out] layout (`ShmPublisher(kernel_layout=
"jax")`) gives contiguous [in, out] views, which is what oneDNN's re-pack reads best; one in HF
layout works too (the fused shards are then concatenated along the output rows).

`plan(model, names)` decides once per model whether the direct load applies: CPU platform, every
linear layer unquantized with tensor-parallel size 1, oneDNN available, and every linear layer's
weight (all of its shards) present in the segment. Otherwise it returns None and `transfer`
keeps vLLM's generic reload.

Imported only in engine processes (it imports torch and vLLM).
"""
from __future__ import annotations

import time
from typing import Iterable, Optional

import torch


def _plain_cpu_linear(module: torch.nn.Module) -> bool:
  """An unquantized vLLM linear layer on one tensor-parallel rank (re-packed by oneDNN on CPU)."""
  from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod  # pylint: disable=g-import-not-at-top
  return (isinstance(module, LinearBase) and type(module.quant_method) is UnquantizedLinearMethod
          and int(getattr(module, "tp_size", 1)) == 1)


def _onednn_branch(n: int, k: int, dtype: torch.dtype) -> bool:
  """Whether vLLM's CPU dispatch packs an [n, k] weight of `dtype` with oneDNN (which copies it
  into its own memory), as `dispatch_cpu_unquantized_gemm` decides."""
  from vllm import _custom_ops as ops  # pylint: disable=g-import-not-at-top
  from vllm.model_executor.layers import utils as layer_utils  # pylint: disable=g-import-not-at-top
  from vllm.platforms import CpuArchEnum, current_platform  # pylint: disable=g-import-not-at-top
  if current_platform.is_zen_cpu() and hasattr(torch.ops, "zentorch"):
    return False
  if layer_utils.check_cpu_sgl_kernel(n, k, dtype):
    return False
  onednn = bool(ops._supports_onednn)  # pylint: disable=protected-access
  return onednn and current_platform.get_cpu_architecture() != CpuArchEnum.POWERPC


class DirectCpuLoad:
  """The direct refresh of one CPU model (see the module docstring); built by `plan`."""

  def __init__(self, model: torch.nn.Module, targets: dict[str, tuple[str, int, int]]):
    self.model = model
    self.modules = dict(model.named_modules())
    self.targets = targets  # HF weight name -> (vLLM linear module name, shard index, shards)
    self._scratch: Optional[torch.Tensor] = None
    self.repack_s = 0.0

  def _buffer(self, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """A reused buffer of `shape` (its pages stay mapped between refreshes)."""
    numel = shape[0] * shape[1]
    if self._scratch is None or self._scratch.dtype != dtype or self._scratch.numel() < numel:
      self._scratch = torch.empty(numel, dtype=dtype)
    return self._scratch[:numel].view(shape)

  def _kernel(self, shards: list[torch.Tensor]) -> torch.Tensor:
    """The layer's [in, out] kernel from its HF-shaped [out_i, in] shards (views of the segment):
    one strided view where the segment holds the shards side by side (as `ShmPublisher` writes
    both layouts: q/k/v kernels in adjacent columns, or HF tensors in adjacent rows), else the
    shards concatenated into a reused buffer."""
    kernels = [s.t() for s in shards]
    if len(kernels) == 1:
      return kernels[0]
    k, n = kernels[0].shape[0], sum(x.shape[1] for x in kernels)
    first = kernels[0]
    adjacent, address = True, first.data_ptr()
    for x in kernels:
      adjacent &= x.stride() == first.stride() and x.data_ptr() == address
      address += x.shape[1] * x.stride(1) * x.element_size()
    if adjacent:
      return first.as_strided((k, n), first.stride())
    if all(x.is_contiguous() for x in kernels):
      return torch.cat(kernels, dim=1, out=self._buffer((k, n), first.dtype))
    return torch.cat(shards, dim=0, out=self._buffer((n, k), first.dtype)).t()

  def _pack(self, name: str, shards: list[torch.Tensor], segment: tuple[int, int]) -> None:
    module = self.modules[name]
    kernel = self._kernel(shards)
    n, k = kernel.shape[1], kernel.shape[0]
    want = (int(module.output_size_per_partition), int(module.input_size_per_partition))
    if (n, k) != want:
      raise ValueError(f"{name}: the segment's shards make a [{n}, {k}] weight, the layer holds "
                       f"{list(want)}")
    weight = kernel.t()
    if not _onednn_branch(n, k, weight.dtype):
      weight = weight.contiguous().clone()  # the other CPU kernels may keep the tensor they get
    start = time.perf_counter()
    module.weight = torch.nn.Parameter(weight, requires_grad=False)
    module.quant_method.process_weights_after_loading(module)
    self.repack_s += time.perf_counter() - start
    if _aliases(module.weight, segment):  # oneDNN refused the weight: vLLM fell back to F.linear
      module.weight = torch.nn.Parameter(module.weight.detach().clone(), requires_grad=False)

  def load(self, tensors: Iterable[tuple[str, torch.Tensor]], segment: tuple[int, int]) -> None:
    """Loads one segment's tensors (HF name, HF-shaped torch view) into the model. `segment` is
    the (address, bytes) of its mapping: no layer may keep a view of it afterwards."""
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check  # pylint: disable=g-import-not-at-top
    self.repack_s = 0.0
    pending: dict[str, list[Optional[torch.Tensor]]] = {}
    rest = []
    for hf_name, tensor in tensors:
      target = self.targets.get(hf_name)
      if target is None:
        rest.append((hf_name, tensor))
        continue
      module_name, index, count = target
      shards = pending.setdefault(module_name, [None] * count)
      shards[index] = tensor
      if all(s is not None for s in shards):
        self._pack(module_name, pending.pop(module_name), segment)
    if pending:
      raise ValueError(f"the segment lacks shards of {sorted(pending)}")
    with disable_mtp_completeness_check():
      self.model.load_weights(rest)  # copies into the parameters in place
    lm_head = getattr(self.model, "lm_head", None)
    method = getattr(lm_head, "quant_method", None)
    if method is not None:
      start = time.perf_counter()
      method.process_weights_after_loading(lm_head)  # its oneDNN copy of the (new) head weight
      self.repack_s += time.perf_counter() - start


def _aliases(tensor: torch.Tensor, segment: tuple[int, int]) -> bool:
  address, nbytes = segment
  return tensor.numel() > 0 and address <= tensor.data_ptr() < address + nbytes


def plan(model: torch.nn.Module, names: list[str]) -> Optional[DirectCpuLoad]:
  """A `DirectCpuLoad` for `model` and a segment of HF tensors `names`, or None where the direct
  load does not apply (see the module docstring)."""
  from vllm.platforms import current_platform  # pylint: disable=g-import-not-at-top
  if not current_platform.is_cpu():
    return None
  from vllm.model_executor.layers.linear import LinearBase  # pylint: disable=g-import-not-at-top
  modules = dict(model.named_modules())
  linear = {name for name, m in modules.items() if isinstance(m, LinearBase)}
  if not linear or not all(_plain_cpu_linear(modules[name]) for name in linear):
    return None  # quantized / tensor-parallel layers: vLLM's own loaders know them
  packed = dict(getattr(model, "packed_modules_mapping", None) or {})
  shard_of = {shard: (fused, i, len(shards)) for fused, shards in packed.items()
              for i, shard in enumerate(shards)}
  targets: dict[str, tuple[str, int, int]] = {}
  shards_seen: dict[str, set[int]] = {}
  shard_count: dict[str, int] = {}
  for hf_name in names:
    if not hf_name.endswith(".weight"):
      continue
    parent, _, leaf = hf_name[:-len(".weight")].rpartition(".")
    fused, index, count = shard_of.get(leaf, (leaf, 0, 1))
    module_name = f"{parent}.{fused}" if parent else fused
    if module_name in linear:
      targets[hf_name] = (module_name, index, count)
      shards_seen.setdefault(module_name, set()).add(index)
      shard_count[module_name] = count
  if {name for name, got in shards_seen.items() if len(got) == shard_count[name]} != linear:
    return None  # a linear layer the segment does not fill whole: vLLM's name mapping knows more
  first = modules[min(linear)]
  dtype = getattr(first, "params_dtype", torch.float32)
  if not _onednn_branch(int(first.output_size_per_partition), int(first.input_size_per_partition),
                        dtype):
    return None  # the other CPU kernels keep an unpacked weight: the generic reload is as good
  return DirectCpuLoad(model, targets)
