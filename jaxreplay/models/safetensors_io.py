"""The files of a Hugging Face model directory: safetensors shards, their index, the tokenizer.

Nothing here knows the parameter layout (`hf_io` maps names and layouts); this module reads and
writes tensors by HF name:

* `SafetensorsReader` reads the tensors of a directory (one file, or the shards the
  model.safetensors.index.json lists) slice by slice from memory-mapped files.
* `write_model_files` streams tensors into model.safetensors, or into
  model-0000k-of-0000N.safetensors shards plus the index (greedy split, as transformers does).
* `staged_dir` writes a directory under a temporary name and swaps it into place atomically;
  `remove_stale_staging` removes what a killed writer left of such a swap.
* `copy_tokenizer` copies the `TOKENIZER_FILES` of a tokenizer directory.

A plan entry is (HF name, shape, numpy dtype, producer): the writer calls `producer()` for the
C-contiguous tensor only when it writes it, so host memory holds one tensor at a time.
"""
from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import re
import shutil
import socket
import struct
import tempfile
import time
import uuid
from typing import Any, Callable, Iterator, Sequence

from absl import logging
import ml_dtypes  # registers bfloat16 with numpy; safetensors' numpy reader needs it
import numpy as np
from safetensors import safe_open

# (HF name, shape, numpy dtype, producer of the tensor)
PlanEntry = tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]

# safetensors dtype codes <-> numpy.
ST_TO_NP = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
            "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
            "BOOL": np.bool_}
NP_TO_ST = {np.dtype(v): k for k, v in ST_TO_NP.items()}
FLOATS = {np.dtype(t) for t in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16)}

INDEX_FILE = "model.safetensors.index.json"

# (file name, whether the file alone marks a directory as holding a tokenizer).
_TOKENIZER_TABLE = (
    ("tokenizer.json", True), ("tokenizer_config.json", True), ("special_tokens_map.json", False),
    ("added_tokens.json", False), ("vocab.json", True), ("merges.txt", False),
    ("vocab.txt", False), ("tokenizer.model", True), ("chat_template.jinja", False),
    ("chat_template.json", False))
# The files `save_hf` copies from a tokenizer directory (those present).
TOKENIZER_FILES = tuple(name for name, _ in _TOKENIZER_TABLE)
# The subset any one of which makes a directory loadable as a tokenizer (`tasks.load_tokenizer`).
TOKENIZER_MARKERS = tuple(name for name, marks in _TOKENIZER_TABLE if marks)


# ---- reading ------------------------------------------------------------------------------------


def read_index(index_path: str) -> dict[str, str]:
  """The `weight_map` (tensor name -> shard file name) of a model.safetensors.index.json."""
  try:
    with open(index_path) as f:
      weight_map = json.load(f)["weight_map"]
  except (json.JSONDecodeError, KeyError, TypeError) as e:
    raise ValueError(f"{index_path}: not a valid safetensors index (expected JSON with a "
                     f"'weight_map' of tensor name -> shard file): {e!r}") from e
  return weight_map


def shard_files(path: str) -> list[str]:
  """The safetensors files of a model dir: the index's shards, else every *.safetensors."""
  index_path = os.path.join(path, INDEX_FILE)
  if os.path.isfile(index_path):
    shards = sorted(set(read_index(index_path).values()))
    for shard in shards:
      if not os.path.isfile(os.path.join(path, shard)):
        raise FileNotFoundError(f"{index_path} lists shard {shard!r}, which is not in {path} "
                                "(an interrupted copy or download?)")
    return [os.path.join(path, s) for s in shards]
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    other = sorted(os.path.basename(f) for pattern in ("*.bin", "*.pt", "*.pth", "*.ckpt")
                   for f in glob.glob(os.path.join(path, pattern)))
    hint = (f" It has {other[:3]}: PyTorch pickle checkpoints must be converted first, e.g. "
            "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir) "
            "(writes safetensors).") if other else ""
    raise FileNotFoundError(f"{path}: no *.safetensors files.{hint}")
  return files


class SafetensorsReader:
  """Tensors from the *.safetensors files of a directory, read slice by slice with safe_open.

  The files stay open (memory-mapped) until `stack` closes. Checks that no tensor is in two files
  and that the index, when present, names the file each tensor is in.
  """

  def __init__(self, path: str, stack: contextlib.ExitStack):
    self.path = path
    self._file_of: dict[str, str] = {}
    self._handles = {}
    for file in shard_files(path):
      try:
        handle = stack.enter_context(safe_open(file, framework="numpy"))
      except Exception as e:  # safetensors raises its own SafetensorError for corrupt headers.
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from e
      self._handles[file] = handle
      for name in handle.keys():
        if name in self._file_of:
          raise ValueError(f"tensor {name!r} is in both {self._file_of[name]} and {file}")
        self._file_of[name] = file
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index_path):
      for name, shard in read_index(index_path).items():
        actual = self._file_of.get(name)
        if actual != os.path.join(path, shard):
          where = "no shard holds it" if actual is None else f"it is in {actual}"
          raise ValueError(f"{index_path}: weight_map puts {name!r} in {shard}, but {where}")

  def names(self) -> list[str]:
    return list(self._file_of)

  def _slice(self, name):
    return self._handles[self._file_of[name]].get_slice(name)

  def shape(self, name) -> tuple[int, ...]:
    return tuple(self._slice(name).get_shape())

  def dtype(self, name):
    """The numpy dtype, or the safetensors code (a str) when numpy has no such dtype."""
    code = self._slice(name).get_dtype()
    return np.dtype(ST_TO_NP[code]) if code in ST_TO_NP else code

  def where(self, name) -> str:
    return self._file_of[name]

  def read(self, name, index) -> np.ndarray:
    """`tensor[index]` (a tuple of slices) read from the file."""
    return self._slice(name)[index]


# ---- writing ------------------------------------------------------------------------------------


def _nbytes(entry: PlanEntry) -> int:
  return math.prod(entry[1]) * entry[2].itemsize


def write_safetensors(path: str, plan: Sequence[PlanEntry]) -> None:
  """Writes one safetensors file, producing and writing one tensor at a time."""
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
  offset = 0
  for entry in plan:
    name, shape, dt, _ = entry
    header[name] = {"dtype": NP_TO_ST[dt], "shape": list(shape),
                    "data_offsets": [offset, offset + _nbytes(entry)]}
    offset += _nbytes(entry)
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # safetensors pads the header to 8 bytes with spaces
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name, shape, dt, produce in plan:
      x = produce()
      if x.shape != shape or x.dtype != dt:
        raise AssertionError(f"{name}: produced {x.shape} {x.dtype}, planned {shape} {dt}")
      f.write(x.reshape(-1).view(np.uint8).data)


def split_shards(plan: Sequence[PlanEntry], max_shard_bytes: int) -> list[list[PlanEntry]]:
  """Greedy split in order, as transformers does; a tensor larger than the limit sits alone."""
  shards, size = [[]], 0
  for entry in plan:
    nbytes = _nbytes(entry)
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(entry)
    size += nbytes
  return shards


def write_model_files(directory: str, plan: Sequence[PlanEntry], max_shard_bytes: int) -> None:
  """Writes model.safetensors, or shards of at most `max_shard_bytes` (bytes) plus the index."""
  shards = split_shards(plan, max_shard_bytes)
  if len(shards) == 1:
    write_safetensors(os.path.join(directory, "model.safetensors"), shards[0])
    return
  weight_map, total = {}, 0
  for k, shard in enumerate(shards):
    fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
    write_safetensors(os.path.join(directory, fname), shard)
    for entry in shard:
      weight_map[entry[0]] = fname
      total += _nbytes(entry)
  index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
  with open(os.path.join(directory, INDEX_FILE), "w") as f:
    json.dump(index, f, indent=2)


# Names of the swap's leftovers in the parent directory: `.<base>.tmp-<pid>@<host>-<random>` (the
# staged directory) and `.<base>.old-<pid>@<host>-<hex>` (the replaced one, deleted after the swap).
# Older versions wrote `.<base>.tmp-<random>` / `.<base>.old-<hex>`, without the writer.
_STAGING_RE = re.compile(r"^\.(?P<base>.+)\.(?P<kind>tmp|old)-"
                         r"(?:(?P<pid>\d+)@(?P<host>[A-Za-z0-9._-]+)-)?[a-z0-9_]{8}$")
_LEGACY_STAGING_AGE_S = 3600.0  # a leftover without a writer pid is removed once this old (seconds)


def _writer_tag() -> str:
  """`<pid>@<host>`: who writes a staging directory (host: no '/' or '@')."""
  host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"
  return f"{os.getpid()}@{host}"


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # exists, owned by another user
  return True


def remove_stale_staging(parent_dir: str) -> list[str]:
  """Removes leftovers of killed `staged_dir` / `swap_into_place` writers in `parent_dir`.

  A leftover is removed when its name says its writer ran on this host and that pid is dead, or
  (older names, no writer) when it is over `_LEGACY_STAGING_AGE_S` old; a replaced `.old-` directory
  only while its `out_dir` exists (otherwise it is the one complete copy). Each removal is logged.
  Returns the removed paths.
  """
  try:
    names = sorted(os.listdir(parent_dir))
  except FileNotFoundError:
    return []
  host = _writer_tag().split("@", 1)[1]
  removed = []
  for name in names:
    m = _STAGING_RE.match(name)
    path = os.path.join(parent_dir, name)
    if not m or not os.path.isdir(path) or os.path.islink(path):
      continue
    if m["pid"] is not None:
      if m["host"] != host or _pid_alive(int(m["pid"])):
        continue
      why = f"its writer, pid {m['pid']}, is gone"
    else:
      try:
        age = time.time() - os.path.getmtime(path)
      except OSError:
        continue
      if age < _LEGACY_STAGING_AGE_S:
        continue
      why = f"no writer recorded, {age / 3600:.1f} h old"
    if m["kind"] == "old" and not os.path.isdir(os.path.join(parent_dir, m["base"])):
      logging.warning("kept %s: the replaced copy of %s, which is missing (a writer was killed "
                      "mid-swap); rename it back to %s to recover it", path, m["base"], m["base"])
      continue
    shutil.rmtree(path, ignore_errors=True)
    logging.info("removed %s, a partial directory swap of %s (%s)", path, m["base"], why)
    removed.append(path)
  return removed


def swap_into_place(tmp: str, out_dir: str) -> None:
  """Renames `tmp` to `out_dir`; an existing `out_dir` is moved aside first, then deleted.

  A reader sees the old directory, briefly none, or the new one; never a partial one.
  """
  if not os.path.lexists(out_dir):
    os.rename(tmp, out_dir)
    return
  if not os.path.isdir(out_dir) or os.path.islink(out_dir):
    raise ValueError(f"{out_dir} exists and is not a directory; refusing to replace it")
  parent, base = os.path.split(out_dir)
  old = os.path.join(parent, f".{base}.old-{_writer_tag()}-{uuid.uuid4().hex[:8]}")
  os.rename(out_dir, old)
  os.rename(tmp, out_dir)
  shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_dir(out_dir: str) -> Iterator[str]:
  """Yields a new temporary directory next to `out_dir`, swapped into place (mode 0755) on exit.

  When the body raises, the temporary directory is deleted and `out_dir` is left as it was.
  Leftovers of killed writers in the parent directory are removed first (`remove_stale_staging`).
  """
  out_dir = os.path.abspath(out_dir)
  parent, base = os.path.split(out_dir)
  os.makedirs(parent, exist_ok=True)
  remove_stale_staging(parent)
  tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-{_writer_tag()}-", dir=parent)
  try:
    yield tmp
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
    swap_into_place(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def copy_tokenizer(tokenizer_dir: str, dest: str) -> list[str]:
  """Copies the `TOKENIZER_FILES` present in `tokenizer_dir` to `dest`; returns their names."""
  if not os.path.isdir(tokenizer_dir):
    raise FileNotFoundError(f"tokenizer_dir {tokenizer_dir} is not a directory")
  found = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(tokenizer_dir, n))]
  if not found:
    raise ValueError(f"tokenizer_dir {tokenizer_dir} has none of the tokenizer files "
                     f"{list(TOKENIZER_FILES)}; save one with tokenizer.save_pretrained(dir)")
  for n in found:
    shutil.copyfile(os.path.join(tokenizer_dir, n), os.path.join(dest, n))
  return found
