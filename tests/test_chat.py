"""`python -m jaxreplay.chat`: an exported model (and a PEFT adapter over its base) answers prompts
as transformers (and peft) answer them, greedily."""
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxreplay import chat
from jaxreplay.models import hf_io
from jaxreplay.models import lora
from tests.helpers import tiny_runs
from tests.helpers.deps import require
from tests.helpers.paths import REPO

PROMPTS = ("12+34=", "47+38=", "5+5=")
MAX_TOKENS = 6


def _reference(model_dir, codec, adapter_dir=None):
  """Greedy answers of transformers (with peft's adapter) to PROMPTS, decoded like ours."""
  torch = require("torch")
  require("transformers")
  from transformers import AutoModelForCausalLM  # pylint: disable=g-import-not-at-top
  model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  if adapter_dir:
    model = require("peft").PeftModel.from_pretrained(model, adapter_dir)
  model.eval()
  answers = []
  for prompt in PROMPTS:
    ids = codec.encode_prompt(prompt)
    with torch.no_grad():
      out = model.generate(torch.tensor(ids[None], dtype=torch.long), max_new_tokens=MAX_TOKENS,
                           do_sample=False, eos_token_id=list(codec.stop_ids),
                           pad_token_id=codec.pad_id)
    answers.append(codec.decode(out[0, len(ids):].numpy()))
  return answers


def test_an_exported_model_answers_as_transformers_does(tiny_reference_run):
  model_dir = os.path.join(tiny_reference_run, "hf")
  bot = chat.Chat(model_dir)
  ours = [bot.answer(p, max_tokens=MAX_TOKENS)[0] for p in PROMPTS]
  assert ours == _reference(model_dir, bot.codec)
  assert all(a.strip().isdigit() for a in ours), ours  # the tiny task's answers: numbers
  sampled = bot.answer(PROMPTS[0], n=4, temperature=1.0, max_tokens=MAX_TOKENS)
  assert len(sampled) == 4


def test_an_adapter_over_its_base_answers_as_peft_does(tmp_path):
  base = tiny_runs.SFT
  cfg, params = hf_io.load_hf(base)
  spec = lora.LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
  adapters = lora.init_adapters(cfg, spec, jax.random.key(0))
  rng = np.random.default_rng(0)
  adapters = {t: {"a": np.asarray(ab["a"]), "b": rng.normal(0, 0.3, ab["b"].shape).astype(np.float32)}
              for t, ab in adapters.items()}
  adapter_dir = str(tmp_path / "hf_adapter")
  lora.save_peft(adapter_dir, cfg, spec, adapters, base_model_name_or_path=base)
  bot = chat.Chat(base, adapter=adapter_dir)
  ours = [bot.answer(p, max_tokens=MAX_TOKENS)[0] for p in PROMPTS]
  assert ours == _reference(base, bot.codec, adapter_dir)
  plain = chat.Chat(base)
  assert ours != [plain.answer(p, max_tokens=MAX_TOKENS)[0] for p in PROMPTS]  # it matters


def _chat(*args, stdin=""):
  return subprocess.run([sys.executable, "-m", "jaxreplay.chat", *args], cwd=REPO,
                        env=tiny_runs.ENV, input=stdin, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_command_answers_prompts_from_flags_and_stdin(tiny_reference_run):
  model_dir = os.path.join(tiny_reference_run, "hf")
  want = [a[0] for a in (chat.Chat(model_dir).answer(p, max_tokens=MAX_TOKENS) for p in PROMPTS)]
  out = _chat(f"--model={model_dir}", f"--max_tokens={MAX_TOKENS}", stdin="\n".join(PROMPTS) + "\n")
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.splitlines() == want and out.stderr == ""
  out = _chat(f"--model={model_dir}", f"--prompt={PROMPTS[0]}", "--num_samples=2",
              "--temperature=1.0", f"--max_tokens={MAX_TOKENS}")
  assert out.returncode == 0 and [line[:4] for line in out.stdout.splitlines()] == ["[1] ", "[2] "]
  out = _chat("--model=/nonexistent", "--prompt=1+1=")
  assert out.returncode == 2 and out.stderr.strip() == (
      "error: --model=/nonexistent is not a Hugging Face model directory (no config.json); give a "
      "run's WORKDIR/hf, or with --adapter the adapter's base model")
