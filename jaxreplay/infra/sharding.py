"""Device mesh and sharding rules: the one place that lays out params, optimizer state and batches.

The mesh has three axes (big_vision / levanter style):
  data    pure data parallelism (params replicated across it),
  fsdp    data parallelism with params and optimizer state sharded across it (ZeRO-3),
  tensor  tensor (model) parallelism over attention heads / MLP columns and the vocabulary.
Batch rows are split over ("data", "fsdp"). Parameters follow `PARAM_RULES`: a tuple of
(regex, PartitionSpec) pairs matched with `re.search` against the '/'-joined path of each leaf.
Optimizer states mirror parameter paths (e.g. "opt_state/1/0/mu/layers/q_proj"), so the same rules
shard them.

Nothing is silently replicated. A parameter whose dimension a rule's mesh axes do not divide is
stored padded (`storage_shape`: that dimension rounded up to a multiple of the axes' size, the extra
entries zero): e.g. Qwen3-8B's hidden size 4096 over a 3-way fsdp axis is stored as 4098 columns, so
each of 3 devices holds 1/3 of it. The model functions slice padded leaves back to their logical
shapes (`models.layout.unpad`); the padding's gradients are zero, so Adam leaves it at zero.
`tree_shardings` raises (naming the leaf) when a leaf it is given does not divide, unless the caller
opts in to `indivisible="replicate"`. Activations (`constrain`) still drop axes that do not divide
(`fit_spec`): XLA pads those internally.
"""
from __future__ import annotations

import math
import re
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

AXIS_NAMES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# Linear kernels are [L, in, out] (layers stacked on axis 0). Column-parallel projections shard the
# output on "tensor" and the input on "fsdp"; row-parallel ones (o_proj, down_proj) the reverse.
PARAM_RULES: tuple[tuple[str, P], ...] = (
    (r"(^|/)embed_tokens$", P("tensor", "fsdp")),            # [V, D]
    (r"(^|/)lm_head$", P("fsdp", "tensor")),                 # [D, V]
    (r"layers/(q|k|v)_proj$", P(None, "fsdp", "tensor")),    # [L, D, H*hd]
    (r"layers/o_proj$", P(None, "tensor", "fsdp")),          # [L, Hq*hd, D]
    (r"layers/(gate|up)_proj$", P(None, "fsdp", "tensor")),  # [L, D, F]
    (r"layers/down_proj$", P(None, "tensor", "fsdp")),       # [L, F, D]
    (r"layers/(q|k|v)_bias$", P(None, "tensor")),            # [L, H*hd]
    (r"norm$", P()),                                         # RMSNorm weights: replicated
    # LoRA adapters {target: {"a": [L, in, r], "b": [L, r, out]}} and their Adam state: replicated
    # (small; why: learner/adapters.py).
    (r"_proj/(a|b)$", P()),
)


def make_mesh(mesh_shape: Sequence[int] = (1, -1, 1), axis_names: Sequence[str] = AXIS_NAMES,
              devices: Optional[Sequence[Any]] = None) -> Mesh:
  """A `Mesh` of `devices` (default: all) with one -1 entry in `mesh_shape` resolved to fit.

  Example: on 8 devices `make_mesh((1, -1, 1))` is an 8-way FSDP mesh of shape (1, 8, 1).
  Axis types are `Auto` (sharding propagates through jit; no explicit-sharding types).
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = [int(s) for s in mesh_shape]
  if len(shape) != len(axis_names):
    raise ValueError(f"mesh_shape={tuple(mesh_shape)} has {len(shape)} entries but axis_names="
                     f"{tuple(axis_names)} has {len(axis_names)}")
  if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
    raise ValueError(f"mesh_shape={tuple(mesh_shape)}: entries must be positive, with at most one -1")
  n = len(devices)
  if -1 in shape:
    known = math.prod(s for s in shape if s != -1)
    if n % known:
      raise ValueError(f"mesh_shape={tuple(mesh_shape)}: {n} devices are not divisible by {known}")
    shape[shape.index(-1)] = n // known
  if math.prod(shape) != n:
    raise ValueError(f"mesh_shape={tuple(shape)} needs {math.prod(shape)} devices but {n} are given; "
                     "use -1 for one axis to fit the device count")
  return jax.make_mesh(tuple(shape), tuple(axis_names), axis_types=(AxisType.Auto,) * len(shape),
                       devices=devices)


def path_str(path) -> str:
  """'/'-joined names of a `jax.tree_util` key path, e.g. 'params/layers/q_proj'."""
  parts = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      parts.append(str(k.key))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      parts.append(k.name)
    elif isinstance(k, jax.tree_util.SequenceKey):
      parts.append(str(k.idx))
    elif isinstance(k, jax.tree_util.FlattenedIndexKey):
      parts.append(str(k.key))
    else:
      parts.append(str(k))
  return "/".join(parts)


def fit_spec(spec: P, shape: Sequence[int], mesh: Mesh) -> P:
  """`spec` with the mesh axes that are absent from `mesh`, or do not divide their dimension, removed.

  A tuple entry such as ("data", "fsdp") keeps its longest prefix whose size product divides the dim.
  """
  if len(spec) > len(shape):
    raise ValueError(f"PartitionSpec {spec} has more entries than the array has dims {tuple(shape)}")
  out = []
  for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
    kept, size = [], 1
    for a in axes:
      if a not in mesh.shape or dim % (size * mesh.shape[a]):
        break
      kept.append(a)
      size *= mesh.shape[a]
    out.append(None if not kept else (kept[0] if len(kept) == 1 else tuple(kept)))
  while out and out[-1] is None:
    out.pop()
  return P(*out)


INDIVISIBLE = ("error", "replicate")


def _entry_axes(entry) -> tuple[str, ...]:
  return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def rule_spec(path: str, shape: Sequence[int], mesh: Mesh,
              rules: Sequence[tuple[str, P]] = PARAM_RULES) -> P:
  """The spec of the first rule whose regex matches `path` and whose rank fits `shape`, with axes
  absent from `mesh` removed (no divisibility check); P() when no rule matches. A rule whose spec
  has more entries than the leaf has dims is skipped (e.g. scalar optimizer counts)."""
  for pattern, spec in rules:
    if re.search(pattern, path) and len(spec) <= len(shape):
      out = []
      for entry in spec:
        axes = tuple(a for a in _entry_axes(entry) if a in mesh.shape)
        out.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
      while out and out[-1] is None:
        out.pop()
      return P(*out)
  return P()


def storage_shape(shape: Sequence[int], spec: P, mesh: Mesh) -> tuple[int, ...]:
  """`shape` with each dimension rounded up to a multiple of the product of its mesh axes in `spec`
  (equal to `shape` when every axis divides its dimension)."""
  out = []
  for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    size = math.prod(mesh.shape[a] for a in _entry_axes(entry) if a in mesh.shape)
    out.append(-(-int(dim) // size) * size)
  return tuple(out)


def storage_shapes(tree: Any, mesh: Mesh, rules: Sequence[tuple[str, P]] = PARAM_RULES) -> Any:
  """`tree` (arrays or ShapeDtypeStructs) as ShapeDtypeStructs of their padded storage shapes."""
  def one(path, leaf):
    shape = np.shape(leaf)
    spec = rule_spec(path_str(path), shape, mesh, rules)
    return jax.ShapeDtypeStruct(storage_shape(shape, spec, mesh), leaf.dtype)
  return jax.tree_util.tree_map_with_path(one, tree)


def padded_leaves(tree: Any, mesh: Mesh, rules: Sequence[tuple[str, P]] = PARAM_RULES
                  ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
  """{path: (logical shape, storage shape)} of the leaves of `tree` that `mesh` stores padded."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name, shape = path_str(path), tuple(np.shape(leaf))
    padded = storage_shape(shape, rule_spec(name, shape, mesh, rules), mesh)
    if padded != shape:
      out[name] = (shape, padded)
  return out


def pad_to(x: jax.Array, shape: Sequence[int]) -> jax.Array:
  """`x` zero-padded at the end of each dimension to `shape` (`x` itself when equal)."""
  if tuple(x.shape) == tuple(shape):
    return x
  return jax.numpy.pad(x, [(0, int(s) - int(d)) for d, s in zip(x.shape, shape)])


def spec_for(path: str, shape: Sequence[int], mesh: Mesh,
             rules: Sequence[tuple[str, P]] = PARAM_RULES, indivisible: str = "error") -> P:
  """The PartitionSpec of the leaf at `path` (see `rule_spec`).

  When a rule's axes do not divide a dimension of `shape`: indivisible="error" raises ValueError
  naming the leaf and the fix (store it padded: `storage_shapes`); "replicate" drops those axes
  (the leaf is then replicated over them: an explicit opt-in).
  """
  if indivisible not in INDIVISIBLE:
    raise ValueError(f"indivisible={indivisible!r}: expected one of {INDIVISIBLE}")
  spec = rule_spec(path, shape, mesh, rules)
  if storage_shape(shape, spec, mesh) == tuple(shape):
    return spec
  if indivisible == "replicate":
    return fit_spec(spec, shape, mesh)
  raise ValueError(f"cannot shard {path!r} of shape {tuple(shape)} as {spec} over mesh "
                   f"{dict(mesh.shape)}: the axes do not divide its dimensions. Store it padded "
                   f"to {storage_shape(shape, spec, mesh)} (`sharding.storage_shapes`, as "
                   "`trainer.init_train_state` does), change trainer.mesh_shape, or pass "
                   "indivisible='replicate' to replicate it over those axes")


def tree_shardings(tree: Any, mesh: Mesh, rules: Sequence[tuple[str, P]] = PARAM_RULES,
                   indivisible: str = "error") -> Any:
  """A pytree of `NamedSharding` matching `tree` (arrays or `jax.ShapeDtypeStruct`s) by path and rules.

  Works for params, optimizer states (their paths end with the param path) and whole train states.
  `indivisible` as in `spec_for` (the default raises on a leaf the mesh cannot split evenly).
  """
  def one(path, leaf):
    return NamedSharding(mesh, spec_for(path_str(path), np.shape(leaf), mesh, rules, indivisible))
  return jax.tree_util.tree_map_with_path(one, tree)


def shard_bytes(tree: Any, shardings: Any) -> int:
  """Bytes one device holds of `tree` (arrays or ShapeDtypeStructs) laid out by `shardings` (the
  largest per-device total over the mesh's devices)."""
  per_device: dict[Any, int] = {}
  for leaf, sh in zip(jax.tree.leaves(tree), jax.tree.leaves(
      shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))):
    shape = tuple(np.shape(leaf))
    nbytes = math.prod(sh.shard_shape(shape)) * np.dtype(leaf.dtype).itemsize
    for d in sh.device_set:
      per_device[d] = per_device.get(d, 0) + nbytes
  return max(per_device.values(), default=0)


def param_shardings(params_shape_tree: Any, mesh: Mesh,
                    rules: Sequence[tuple[str, P]] = PARAM_RULES, indivisible: str = "error") -> Any:
  """Shardings of a parameter pytree (see `PARAM_RULES`); an alias of `tree_shardings`."""
  return tree_shardings(params_shape_tree, mesh, rules, indivisible)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
  """The mesh axes batch rows are split over: those of ("data", "fsdp") present in `mesh`."""
  return tuple(a for a in BATCH_AXES if a in mesh.shape)


def batch_size_multiple(mesh: Mesh) -> int:
  """Batch rows must be a multiple of this (the product of the batch axes' sizes)."""
  return math.prod(mesh.shape[a] for a in batch_axes(mesh))


def batch_spec(ndim: int, mesh: Mesh, row_dim: int = 0) -> P:
  """PartitionSpec with rows (dim `row_dim`) over the batch axes, other dims replicated."""
  entries: list[Any] = [None] * ndim
  entries[row_dim] = batch_axes(mesh)
  return P(*entries)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Sharding of one batch array of rank `ndim`: rows over ("data", "fsdp"), the rest replicated."""
  return NamedSharding(mesh, batch_spec(ndim, mesh))


def batch_shardings(mesh: Mesh, batch: Any) -> Any:
  """A pytree of shardings for `batch` (e.g. a `Batch`): each array's rows over ("data", "fsdp").

  Raises ValueError when a row count is not a multiple of `batch_size_multiple(mesh)`.
  """
  multiple = batch_size_multiple(mesh)

  def one(path, x):
    shape = np.shape(x)
    if not shape or shape[0] % multiple:
      raise ValueError(f"batch field {path_str(path)!r} has shape {shape}: its rows must be a multiple "
                       f"of data*fsdp = {multiple} for mesh {dict(mesh.shape)}; pad the batch or "
                       "change the mesh")
    return batch_sharding(mesh, len(shape))
  return jax.tree_util.tree_map_with_path(one, batch)


def global_batch(batch: Any, mesh: Mesh) -> Any:
  """A host batch as global arrays on `mesh` (rows over ("data", "fsdp")).

  Single-process: returned as is (jit places numpy inputs itself). Multi-process (jax.distributed):
  every process holds the same full batch; each builds its addressable row slices with
  `jax.make_array_from_callback`, which is what a jitted step over a multi-host mesh needs.
  """
  if jax.process_count() == 1:
    return batch
  shardings = batch_shardings(mesh, batch)
  return jax.tree.map(
      lambda x, sh: jax.make_array_from_callback(np.shape(x), sh, lambda idx, x=x: np.asarray(x)[idx]),
      batch, shardings)


def host_local(tree: Any) -> Any:
  """Every leaf as a full host numpy array on each process (for samplers, exports, metrics).

  Single-process: `jax.device_get`. Multi-process: `process_allgather` (a collective: every process
  must call it at the same point of the program)."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return multihost_utils.process_allgather(tree, tiled=True)


def local_params(tree: Any) -> Any:
  """Params a process-local sampler can use: the tree itself when single-process (no copy, no
  host round trip), else `host_local` (a collective)."""
  return tree if jax.process_count() == 1 else host_local(tree)


def assert_same_on_all_processes(values: np.ndarray, what: str) -> None:
  """Fails when `values` (a small array) differs between processes, naming `what` diverged."""
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  multihost_utils.assert_equal(np.asarray(values), f"{what} differs between trainer processes: "
                               "the host pipelines diverged (every process must run the same "
                               "deterministic schedule: scheduler.kind='simulated')")


def constrain(x: jax.Array, mesh: Mesh, spec: P) -> jax.Array:
  """`with_sharding_constraint` of an activation inside jit (spec fitted to x's shape and the mesh)."""
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, fit_spec(spec, x.shape, mesh)))


def describe(tree: Any) -> dict[str, str]:
  """{path: 'shape spec'} of a pytree of sharded arrays or ShapeDtypeStructs (for logs)."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    sharding = getattr(leaf, "sharding", None)
    spec = getattr(sharding, "spec", None)
    out[path_str(path)] = f"{tuple(np.shape(leaf))} {spec}"
  return out


def under_mesh(fn, mesh: Mesh):
  """`fn` traced with `mesh` as the abstract mesh in context, so that model code (which gets no
  mesh) can constrain activations with `constrain_rows`; the jitted train step, log-prob and
  diagnostics functions wrap their bodies with it."""
  def wrapped(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args, **kwargs)
  wrapped.__name__ = getattr(fn, "__name__", "fn")
  return wrapped


def constrain_rows(*xs: jax.Array) -> tuple[jax.Array, ...]:
  """Each x with its rows (dim 0) over the batch axes of the abstract mesh in context
  (`under_mesh`), when they divide them; unchanged outside one. Why: XLA may shard a projection's
  output over heads when the head count divides the fsdp axis (Llama-3.2-3B's 24 query heads at
  T=3) and keep the key/value rows over the batch, which cuDNN attention's partitioner refuses
  ("Query, key and value should have same sharding")."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return xs
  axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
  n = math.prod(mesh.shape[a] for a in axes)
  if not axes or n == 1:
    return xs
  return tuple(jax.lax.with_sharding_constraint(x, P(axes)) if x.shape[0] % n == 0 else x
               for x in xs)
