"""What a compiled program's optimized HLO text says about one step: collectives, host transfers,
FLOPs, each counted per device and per call, loops included.

`parse(hlo)` splits the text of `compiled.as_text()` into computations and instructions;
`multiplicities` says how often each computation runs per call of the program: a while loop's body
runs its `known_trip_count` times per execution of the loop (XLA annotates the trip counts of
`lax.scan`s: the layer scan, the micro-batch scan, the log-prob chunks), a fusion's or a call's
computation once per execution of its caller. Then:

  collectives(hlo)      per kind (all-gather, reduce-scatter, all-reduce, all-to-all,
                        collective-permute): executions and bytes per call, and the bytes one
                        device sends on a ring of n devices (all-gather: (n-1)/n of the gathered
                        result; reduce-scatter: (n-1)/n of the reduced operand; all-reduce: twice
                        that; all-to-all: (n-1)/n; collective-permute: all of it)
  host_transfers(hlo)   instructions that move data between host and device inside the program:
                        send / recv, infeed / outfeed, host callbacks (custom calls to Python),
                        host-memory (S(5)) buffers
  flops(hlo)            matmul FLOPs: 2 x output elements x contracted size of every dot (fused
                        or not) and cuBLAS custom call, and cuDNN flash attention (forward: two
                        [T, S] x head_dim matmuls per head, half of them under a causal mask; its
                        backward 2.5x that: five matmuls against two)

Element-wise work is not counted: on these models it is < 2% of the matmul FLOPs.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Optional

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4,
               "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8,
               "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1,
               "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(DTYPE_BYTES, key=len, reverse=True)) +
                    r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation|"
                     r"branch_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')

# collective opcode -> (kind, ring traffic factor f(n) on the counted bytes)
COLLECTIVES = {
    "all-gather": "all-gather", "all-gather-start": "all-gather",
    "reduce-scatter": "reduce-scatter", "reduce-scatter-start": "reduce-scatter",
    "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
    "all-to-all": "all-to-all",
    "collective-permute": "collective-permute", "collective-permute-start": "collective-permute",
}
_TRAFFIC = {
    "all-gather": lambda n: (n - 1) / n,          # of the gathered result
    "reduce-scatter": lambda n: (n - 1) / n,      # of the reduced operand (n x the result)
    "all-reduce": lambda n: 2 * (n - 1) / n,      # reduce-scatter + all-gather
    "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
}
_HOST_OPS = ("send", "recv", "send-done", "recv-done", "infeed", "outfeed", "host-compute")
_HOST_TARGET = re.compile(r"callback|host", re.I)


@dataclasses.dataclass
class Instruction:
  name: str
  shape: str      # the result shape's text (an array or a tuple)
  opcode: str
  operands: list  # operand names
  attrs: str      # everything after the operand list


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """(dtype, dims) of every array in a shape's text, in order (tuples flattened)."""
  return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(shape)]


def nbytes(shape: str) -> int:
  return int(sum(DTYPE_BYTES[dt] * math.prod(dims) for dt, dims in arrays(shape)))


def _split_operands(rest: str) -> tuple[str, str]:
  """(operand text, attributes) of what follows an opcode's '('."""
  depth = 1
  for i, ch in enumerate(rest):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      return rest[:i], rest[i + 1:]
  return rest, ""


def parse(hlo: str) -> tuple[dict[str, list[Instruction]], str]:
  """({computation: [instructions]}, the entry computation's name) of an HLO module's text."""
  comps: dict[str, list[Instruction]] = {}
  entry, current = "", None
  for line in hlo.splitlines():
    m = _HEADER.match(line)
    if m:
      current = m.group(2)
      comps[current] = []
      if m.group(1):
        entry = current
      continue
    if current is None:
      continue
    if line.strip() == "}":
      current = None
      continue
    m = _INSTRUCTION.match(line)
    if m:
      name, shape, opcode, rest = m.groups()
      operand_text, attrs = _split_operands(rest)
      comps[current].append(Instruction(name, shape, opcode,
                                        re.findall(r"%([^\s,()]+)", operand_text), attrs))
  return comps, entry


def _called(ins: Instruction) -> list[str]:
  out = []
  for group in _CALLED.findall(ins.attrs):
    out += [n.lstrip("%") for n in re.findall(r"%?[\w.\-]+", group.strip("{}"))]
  return out


def multiplicities(comps: dict[str, list[Instruction]], entry: str) -> tuple[dict[str, int], bool]:
  """(executions of each computation per call of the entry, whether every loop's trip count was
  known; an unknown one counts once)."""
  edges: dict[str, list[tuple[str, int]]] = {name: [] for name in comps}
  known = True
  for comp, instructions in comps.items():
    for ins in instructions:
      factor = 1
      if ins.opcode == "while":
        trip = _TRIP.search(ins.attrs)
        known &= trip is not None
        factor = int(trip.group(1)) if trip else 1
      edges[comp] += [(callee, factor) for callee in _called(ins) if callee in comps]
  callers = collections.Counter(callee for out in edges.values() for callee, _ in out)
  mult: dict[str, int] = collections.defaultdict(int)
  mult[entry] = 1
  ready = [name for name in comps if callers[name] == 0]  # Kahn's order: callers first
  while ready:
    comp = ready.pop()
    for callee, factor in edges[comp]:
      mult[callee] += mult[comp] * factor
      callers[callee] -= 1
      if callers[callee] == 0:
        ready.append(callee)
  return dict(mult), known


def _group_size(attrs: str, num_partitions: int) -> int:
  """Devices per replica group of a collective's attributes."""
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
  if m:
    sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
    return math.prod(sizes.get(a, 1) for a in re.findall(r"'([^']+)'", m.group(2)))
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
  if m:
    return int(m.group(2))
  m = re.search(r"replica_groups=\{\{([^}]*)\}", attrs)
  if m:
    return len(m.group(1).split(","))
  m = re.search(r"source_target_pairs=", attrs)
  return 2 if m else num_partitions


def _collective_bytes(ins: Instruction, kind: str, n: int) -> int:
  """The bytes a collective's traffic factor applies to (module docstring)."""
  parts = arrays(ins.shape)
  size = lambda xs: int(sum(DTYPE_BYTES[dt] * math.prod(d) for dt, d in xs))
  if ins.opcode in ("all-gather-start", "reduce-scatter-start"):  # (operands..., results...)
    parts = parts[len(parts) // 2:]
  elif ins.opcode == "collective-permute-start":  # (operand, result, contexts...)
    parts = parts[:1]
  return size(parts) * (n if kind == "reduce-scatter" else 1)


def collectives(hlo: str) -> dict:
  """Collectives per call of the program (module docstring): {"by_kind": {kind: {"count",
  "bytes", "traffic_bytes", "group_sizes"}}, "traffic_bytes": total, "trip_counts_known"}."""
  comps, entry = parse(hlo)
  mult, known = multiplicities(comps, entry)
  m = re.search(r"num_partitions=(\d+)", hlo)
  partitions = int(m.group(1)) if m else 1
  out: dict[str, dict] = {}
  for comp, instructions in comps.items():
    times = mult.get(comp, 0)
    for ins in instructions:
      kind = COLLECTIVES.get(ins.opcode)
      if kind is None or not times:
        continue
      n = _group_size(ins.attrs, partitions)
      if n <= 1:
        continue
      b = _collective_bytes(ins, kind, n)
      rec = out.setdefault(kind, {"count": 0, "bytes": 0, "traffic_bytes": 0, "group_sizes": []})
      rec["count"] += times
      rec["bytes"] += times * b
      rec["traffic_bytes"] += int(times * b * _TRAFFIC[kind](n))
      if n not in rec["group_sizes"]:
        rec["group_sizes"].append(n)
  return {"by_kind": out, "traffic_bytes": sum(r["traffic_bytes"] for r in out.values()),
          "trip_counts_known": known}


def host_transfers(hlo: str) -> list[str]:
  """Host <-> device movement inside the program (module docstring), one entry per instruction."""
  comps, _ = parse(hlo)
  found = []
  for comp, instructions in comps.items():
    for ins in instructions:
      target = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
      if ins.opcode in _HOST_OPS:
        found.append(f"{ins.opcode} {ins.name} in {comp}")
      elif ins.opcode == "custom-call" and target and _HOST_TARGET.search(target.group(1)):
        found.append(f"custom-call {target.group(1)} {ins.name} in {comp}")
      elif "S(5)" in ins.shape:
        found.append(f"host-memory buffer {ins.name} ({ins.opcode}) in {comp}")
  return found


def _dims(text: str, key: str) -> list[int]:
  m = re.search(rf'"?{key}"?\s*[:=]\s*(?:\[|\{{)([^\]}}]*)', text)
  return [int(x) for x in re.findall(r"\d+", m.group(1))] if m else []


def _dot_flops(out_shape: str, lhs_shape: Optional[str], contracting: list[int]) -> float:
  out = arrays(out_shape)
  lhs = arrays(lhs_shape) if lhs_shape else []
  if not out or not lhs:
    return 0.0
  k = math.prod(lhs[0][1][d] for d in contracting if d < len(lhs[0][1]))
  return 2.0 * math.prod(out[0][1]) * k


def _attention_flops(ins: Instruction) -> float:
  """cuDNN flash attention (`__cudnn$fmha...`): 4 B H T S hd forward (halved when causal), 2.5x
  that for the backward."""
  m = re.search(r'"intermediate_tensor_shape".*?"dimensions":\s*\[([^\]]*)\]', ins.attrs)
  q = re.search(r"operand_layout_constraints=\{\s*\w+\[([\d,]*)\]", ins.attrs)
  if not m or not q:
    return 0.0
  b, h, t, s = (int(x) for x in re.findall(r"\d+", m.group(1))[:4])
  hd = int(q.group(1).split(",")[-1])
  flops = 4.0 * b * h * t * s * hd
  if re.search(r'"mask_type":\s*"[A-Z_]*CAUSAL', ins.attrs):
    flops /= 2
  return flops * (2.5 if "Backward" in ins.attrs.split("custom_call_target=")[1][:80] else 1.0)


def flops(hlo: str) -> dict:
  """Matmul FLOPs per call of the program, per device (module docstring): {"dot", "attention",
  "total", "trip_counts_known"}."""
  comps, entry = parse(hlo)
  mult, known = multiplicities(comps, entry)
  dot = attention = 0.0
  for comp, instructions in comps.items():
    times = mult.get(comp, 0)
    if not times:
      continue
    shapes = {ins.name: ins.shape for ins in instructions}
    for ins in instructions:
      if ins.opcode == "dot" and ins.operands:
        dot += times * _dot_flops(ins.shape, shapes.get(ins.operands[0]),
                                  _dims(ins.attrs, "lhs_contracting_dims"))
      elif ins.opcode == "custom-call":
        target = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
        name = target.group(1) if target else ""
        if name.startswith("__cudnn$fmha"):
          attention += times * _attention_flops(ins)
        elif "gemm" in name or "matmul" in name:
          dot += times * _dot_flops(ins.shape, shapes.get(ins.operands[0]) if ins.operands
                                    else None, _dims(ins.attrs, "lhs_contracting_dimensions"))
  return {"dot": dot, "attention": attention, "total": dot + attention, "trip_counts_known": known}
