"""The shipped GPU target descriptions (`config.gpu_targets`): read without JAX or the plugin."""
import os
import re

import pytest

from jaxreplay.config import gpu_targets

GIB = 2 ** 30


def test_h100_and_h200_read_from_their_protos():
  h100, h200 = gpu_targets.load("h100"), gpu_targets.load("H200")
  assert h100.memory_bytes == 84929347584 and round(h100.memory_bytes / GIB, 1) == 79.1
  assert h200.memory_bytes == 150754820096 and round(h200.memory_bytes / GIB, 1) == 140.4
  for t in (h100, h200):
    assert t.compute_capability == (9, 0) and t.sm_count == 132
    assert t.nvlink_gbps == 450.0 and t.peak_tflops == 989.0
    assert 'platform_name: "CUDA"' in t.text and "dnn_version_info" in t.text
  assert h100.description == "NVIDIA H100 80GB HBM3" and h200.description == "NVIDIA H200"
  assert h200.memory_bandwidth > h100.memory_bandwidth == 3.35232e12


def test_every_table_row_has_its_file_and_every_file_a_row():
  files = {f for f in os.listdir(gpu_targets.HERE) if f.endswith(".txtpb")}
  assert files == {row[0] for row in gpu_targets.TARGETS.values()}
  assert gpu_targets.names() == ("h100", "h200")


def test_unknown_target_names_the_known_ones():
  with pytest.raises(gpu_targets.UnknownTarget, match=r"'a100'.*h100, h200") as e:
    gpu_targets.load("a100")
  assert "\n" not in str(e.value)


def test_the_targets_ship_as_package_data():
  with open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml")) as f:
    text = f.read()
  assert re.search(r'"jaxreplay\.config\.gpu_targets"\s*=\s*\["\*\.txtpb"\]', text)
