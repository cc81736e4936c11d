"""The supervised warm-start: the CLI writes a loadable HF dir, and the shipped checkpoint is what
configs/tiny.py documents (right on about half of the held-out problems, wrong by dropping carries)."""
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxreplay.models import hf_io
from jaxreplay.models.config import ModelConfig
from jaxreplay.tasks import tokenizer
from jaxreplay.sft import greedy_exact_match
from jaxreplay.tasks import arithmetic
from tests.helpers.paths import REPO
import pytest

pytestmark = pytest.mark.slow  # end to end: `pytest -m 'not slow'` skips them

SFT = os.path.join(REPO, "assets", "tiny-arith-sft")


def _greedy_answers(cfg, params, codec, problems):
  return greedy_exact_match(cfg, params, codec, [(p.prompt, p.answer) for p in problems], 32)


def test_sft_cli_writes_loadable_model(tmp_path):
  out = tmp_path / "sft"
  env = dict(os.environ, XLA_FLAGS="")
  env.pop("JAX_PLATFORMS", None)  # the sft picks the CPU itself, as the launcher does
  proc = subprocess.run(
      [sys.executable, "-m", "jaxreplay.sft", f"--config={REPO}/configs/tiny.py", f"--out={out}",
       "--sft_steps=25", "--config.sft.batch=32", "--config.sft.carry_drop=0.5"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "sft/greedy_accuracy" in proc.stdout
  # The console as the launcher's: no TPU probe line, no absl prefix on the progress lines.
  assert "tpu" not in proc.stderr.lower(), proc.stderr[-2000:]
  assert not re.search(r"^[IWEF]\d{4} ", proc.stderr, re.M), proc.stderr[-2000:]
  assert re.search(r"^sft step 1/25 loss ", proc.stderr, re.M), proc.stderr[-2000:]
  cfg, params = hf_io.load_hf(str(out), dtype=jnp.float32)
  ref_cfg = ModelConfig.from_hf_dir(SFT)
  assert cfg.replace(dtype=ref_cfg.dtype) == ref_cfg.replace(dtype=ref_cfg.dtype)
  codec = tokenizer.load_tokenizer(str(out))
  tokenizer.check_tokenizer_matches_model(codec, cfg)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


def test_sft_rejects_carry_drop_on_math(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "jaxreplay.sft", f"--config={REPO}/configs/tiny.py",
       f"--out={tmp_path / 'x'}", "--config.task.name=math", "--config.task.path=/nonexistent"],
      cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
      timeout=120)
  assert proc.returncode != 0 and "carry_drop" in proc.stderr


def test_sft_too_few_steps_is_one_line(tmp_path):
  """Steps not above the 20 warm-up steps: one line and exit 2 (it was optax's traceback about a
  negative cosine decay), nothing written."""
  proc = subprocess.run(
      [sys.executable, "-m", "jaxreplay.sft", f"--config={REPO}/configs/tiny.py",
       f"--out={tmp_path / 'x'}", "--sft_steps=5"],
      cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
      timeout=120)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines() == [
      "error: sft.steps=5 must be > 20 (the learning rate's warm-up steps); e.g. --sft_steps=30"]
  assert os.listdir(tmp_path) == []


def test_shipped_warm_start_is_sometimes_right_and_drops_carries():
  cfg, params = hf_io.load_hf(SFT, dtype=jnp.float32)
  codec = tokenizer.load_tokenizer(SFT)
  task = arithmetic.ArithmeticTask(num_digits=(1, 2), ops="+")
  problems = task.eval_set(512)
  right = _greedy_answers(cfg, params, codec, problems)
  # What greedy decoding says instead, for problems it gets wrong: compare with the carry-free sum.
  carry_free = [arithmetic.carry_free_sum(*(int(x) for x in p.prompt[:-1].split("+")))
                for p in problems]
  has_carry = [c != p.answer for c, p in zip(carry_free, problems)]
  has_carry = np.asarray(has_carry)
  assert 0.45 < right.mean() < 0.7, right.mean()          # "right on about half" (0.56 measured)
  assert right[~has_carry].mean() > 0.9                     # no-carry problems: learned
  assert right[has_carry].mean() < 0.6                      # carry problems: often wrong
  fooled = _greedy_answers(cfg, params, codec, [
      arithmetic.Problem(prompt=p.prompt, answer=c, id=p.id)
      for p, c, h in zip(problems, carry_free, has_carry) if h])
  # Most wrong greedy answers on carry problems are exactly the dropped-carry sum.
  assert fooled.sum() > 0.7 * (~right[has_carry]).sum(), (fooled.sum(), (~right[has_carry]).sum())
