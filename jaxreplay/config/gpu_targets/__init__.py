"""The GPUs a config can be compiled for without one (`--compile_for=NAME`): the `TARGETS` table.

Each target is a text `stream_executor.GpuTargetConfigProto` shipped beside this file
(`NAME.txtpb`, the format of XLA's `xla/tools/hlo_opt/gpu_specs/`): what XLA:GPU's compiler needs
to compile for that GPU with no driver and no device (SM count, compute capability, memory size,
cuDNN and CUDA versions). `jax.experimental.topologies.get_topology_desc(platform="cuda",
target_config=TEXT, topology="1x1xN")` turns it into N compile-only devices
(`run.gpu_compile`).

The proto says nothing about the links between GPUs or the matmul peak; the table states them
(vendor figures, not measurements):
  nvlink_gbps   NVLink bandwidth of one GPU in one direction [GB/s]: NVLink 4 on H100 / H200 SXM,
                18 links x 25 GB/s (900 GB/s both directions together), through NVSwitch to every
                other GPU of the node
  peak_tflops   dense bf16 matmul peak of one GPU [TFLOP/s] (H100 and H200 SXM: the same chip)

This module reads text only (no JAX, no plugin): a machine without the CUDA plugin can still name
the targets and their memory.
"""
from __future__ import annotations

import dataclasses
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass(frozen=True)
class GpuTarget:
  """One GPU to compile for. memory_bytes: device memory [bytes]; memory_bandwidth: HBM [B/s];
  nvlink_gbps, peak_tflops: see the module docstring; text: the GpuTargetConfigProto."""
  name: str
  description: str
  text: str
  memory_bytes: int
  memory_bandwidth: float
  sm_count: int
  compute_capability: tuple[int, int]
  nvlink_gbps: float
  peak_tflops: float


# name -> (proto file, nvlink_gbps, peak_tflops)
TARGETS: dict[str, tuple[str, float, float]] = {
    "h100": ("h100.txtpb", 450.0, 989.0),  # H100 80GB HBM3 SXM
    "h200": ("h200.txtpb", 450.0, 989.0),  # H200 141GB HBM3e SXM
}


class UnknownTarget(ValueError):
  """A target name outside `TARGETS` (the message names the known ones)."""


def names() -> tuple[str, ...]:
  return tuple(TARGETS)


def _field(text: str, name: str, default=None) -> str:
  m = re.search(rf"\b{name}\s*:\s*(\"[^\"]*\"|[-+.\deE]+)", text)
  if m is None:
    if default is None:
      raise ValueError(f"GPU target description has no {name}")
    return default
  return m.group(1).strip('"')


def load(name: str) -> GpuTarget:
  """The target called `name` (case-insensitive); UnknownTarget naming the known ones else."""
  key = str(name).strip().lower()
  if key not in TARGETS:
    raise UnknownTarget(f"unknown GPU target {name!r}: --compile_for takes one of "
                        f"{', '.join(TARGETS)}")
  filename, nvlink_gbps, peak_tflops = TARGETS[key]
  with open(os.path.join(HERE, filename)) as f:
    text = f.read()
  cc = re.search(r"cuda_compute_capability\s*\{([^}]*)\}", text)
  cc_text = cc.group(1) if cc else ""
  return GpuTarget(
      name=key, description=_field(text, "device_description_str"), text=text,
      memory_bytes=int(_field(text, "device_memory_size")),
      memory_bandwidth=float(_field(text, "memory_bandwidth")),
      sm_count=int(_field(text, "core_count")),
      compute_capability=(int(_field(cc_text, "major", "0")), int(_field(cc_text, "minor", "0"))),
      nvlink_gbps=nvlink_gbps, peak_tflops=peak_tflops)
