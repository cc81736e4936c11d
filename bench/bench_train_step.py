"""Train-step tokens/s of jaxreplay vs the PyTorch + transformers GRPO step, and the fraction of peak.

Per shape, random Qwen3 weights are written once to an HF dir (`jaxreplay.models.hf_io.save_hf`) and
loaded by both jaxreplay (`hf_io.load_hf`) and `transformers.Qwen3ForCausalLM` (`torch_peer.py`);
both take the same batch (full-length rows: a prompt, then completion tokens) and run one GRPO
update per step: clipped-ratio loss with jaxreplay's default aggregation (token_mean), backward,
global-norm clipping at 1.0, AdamW (lr 1e-5, b1 0.9, b2 0.999, eps 1e-8, no weight decay). jaxreplay's
step is the one `build.build` makes from the config defaults (`trainer.logprob_chunk`,
`trainer.log_entropy`, `model.remat`; the tiny default's shape uses configs/tiny.py's values).
The step's batch is a host (numpy) batch, as in the pipeline, so the host -> device copy is timed.

Shapes (Qwen3):
  small        4 layers, hidden 128, vocab 64, B64 x T64
  wide         2 layers, hidden 1024 (Qwen3-0.6B's layer), vocab 8192, B4 x T256
  tiny_default configs/tiny.py: the `tiny` preset with the character vocabulary (20), B64 x T16
               (the length bucket of its rollouts: a prompt of <= 7 tokens and <= 6 completion tokens)

Timing is interleaved so that the machine's load hits both sides alike: `--rounds` rounds, each
timing `steps` steps of one side and then of the other (the order alternates); tokens/s come from
the median step time of each side over all rounds (`ratio`; `ratio_best` compares the fastest
step of each side, the least disturbed by other load). One process, torch.set_num_threads(cores) (the
cores XLA's CPU client uses), OMP_WAIT_POLICY=PASSIVE unless set (see below). Compilation and the first (warm-up) steps are excluded.
MFU: model FLOPs per step = 3 * ModelConfig.flops_per_token(T) * B * T (forward + backward), over
the f32 matmul peak measured in the same run (a jitted [2048, 2048] matmul, best of several, before
and after the shapes). Without torch installed the peer columns are empty.

  python bench/bench_train_step.py [--shapes small,wide,tiny_default] [--rounds 7]
      [--out bench/results/train_step.json] [--before bench/results/train_step_before.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxreplay.learner import batch as batch_lib  # noqa: E402
from jaxreplay.config import defaults  # noqa: E402
from jaxreplay.learner import optim  # noqa: E402
from jaxreplay.infra import sharding  # noqa: E402
from jaxreplay.learner import loss_fn as loss_fn_lib  # noqa: E402
from jaxreplay.learner import trainer  # noqa: E402
from jaxreplay.models import hf_io  # noqa: E402
from jaxreplay.models import presets  # noqa: E402
from jaxreplay.models import transformer  # noqa: E402

# torch's OpenMP threads spin-wait by default: on a machine where other processes take a core
# away, a step of the tiny shapes then takes ~2.6 s instead of ~80 ms. Passive waiting gives the
# peer its fair speed (XLA's CPU thread pool does not use OpenMP); set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
try:  # the peer is optional: jaxreplay does not depend on torch
  import torch  # noqa: E402
  import torch_peer  # noqa: E402
except ImportError:  # pragma: no cover - depends on the environment
  torch = torch_peer = None

LEARNING_RATE = 1e-5


def step_options(tcfg) -> dict:
  """The step's speed options from the trainer config (`trainer.step_options`); {} on library
  versions without it, so that this bench also measures the code before them."""
  return trainer.step_options(tcfg) if hasattr(trainer, "step_options") else {}


def shapes() -> dict:
  """name -> (ModelConfig, batch, seq_len, prompt_len, trainer config section)."""
  base = defaults.base_config().trainer
  tiny_cfg = _tiny_config()
  return {
      "small": (presets.tiny(num_hidden_layers=4), 64, 64, 16, base),
      "wide": (presets.qwen3_0_6b(num_hidden_layers=2, vocab_size=8192, bos_token_id=1,
                                  eos_token_id=2), 4, 256, 16, base),
      "tiny_default": (presets.tiny(vocab_size=20).replace(remat=tiny_cfg.model.remat), 64, 16, 7,
                       tiny_cfg.trainer),
  }


def _tiny_config():
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  "configs"))
  import tiny  # noqa: E402  configs/tiny.py
  return tiny.get_config()


def measure_matmul_peak(dtype, n: int, iters: int) -> float:
  """FLOP/s of a jitted [n, n] @ [n, n] matmul (best of `iters`, after a warm-up)."""
  ka, kb = jax.random.split(jax.random.PRNGKey(0))
  a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
  b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
  f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=dtype))
  f(a, b).block_until_ready()
  best = float("inf")
  for _ in range(iters):
    t0 = time.perf_counter()
    f(a, b).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 2.0 * n ** 3 / best


def synthetic_batch(cfg, batch_size: int, seq_len: int, prompt_len: int = 16,
                    seed: int = 0) -> batch_lib.Batch:
  """Full-length rows: `prompt_len` prompt tokens, the rest completion (targets = next tokens)."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, cfg.vocab_size, (batch_size, seq_len)).astype(np.int32)
  mask = np.zeros((batch_size, seq_len), np.float32)
  mask[:, min(prompt_len - 1, seq_len - 2):seq_len - 1] = 1.0
  return batch_lib.Batch(
      tokens=tokens, positions=np.tile(np.arange(seq_len, dtype=np.int32), (batch_size, 1)),
      segment_ids=np.ones((batch_size, seq_len), np.int32),
      targets=np.concatenate([tokens[:, 1:], np.zeros((batch_size, 1), np.int32)], axis=1),
      completion_mask=mask,
      behaviour_logprobs=np.where(mask > 0, -np.log(cfg.vocab_size) + 0.1 * rng.normal(
          size=mask.shape), 0.0).astype(np.float32),
      advantages=rng.normal(size=batch_size).astype(np.float32),
      rewards=np.zeros(batch_size, np.float32), policy_version=np.zeros(batch_size, np.int32))


class JaxStep:
  """jaxreplay's train step as `build.build` makes it, on one device, from the HF dir."""

  def __init__(self, cfg, hf_dir: str, batch, tcfg):
    mesh = sharding.make_mesh((1, -1, 1))
    _, params = hf_io.load_hf(hf_dir)
    opt = optim.make_optimizer(LEARNING_RATE, b1=tcfg.b1, b2=tcfg.b2,
                               weight_decay=tcfg.weight_decay, max_grad_norm=tcfg.max_grad_norm)
    self.state = trainer.init_train_state(cfg, opt, jax.random.PRNGKey(0), params=params, mesh=mesh)
    step = trainer.make_train_step(
        cfg, opt, loss_fn_lib.make_loss_fn("grpo", aggregation=tcfg.aggregation), mesh,
        trainer.state_shardings(self.state, mesh), chunk_size=tcfg.logprob_chunk,
        **step_options(tcfg))
    self.batch = batch
    t0 = time.perf_counter()
    self.compiled = step.lower(self.state, batch).compile()
    self.compile_s = time.perf_counter() - t0

  def step(self) -> float:
    self.state, metrics = self.compiled(self.state, self.batch)
    jax.block_until_ready((self.state.params, metrics))
    return metrics


def _timed(fn, n: int) -> list[float]:
  times = []
  for _ in range(n):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return times


def bench_shape(name, cfg, batch_size, seq_len, prompt_len, tcfg, rounds, steps, workdir):
  """Both steps on one shape, interleaved; returns the result row (peak fractions added later)."""
  hf_dir = os.path.join(workdir, name)
  hf_io.save_hf(cfg, transformer.init_params(cfg, jax.random.PRNGKey(1)), hf_dir)
  batch = synthetic_batch(cfg, batch_size, seq_len, prompt_len)
  jx = JaxStep(cfg, hf_dir, batch, tcfg)
  first = jx.step()  # warm-up; its loss is the loss at the initial weights
  row = {"name": name, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
         "vocab": cfg.vocab_size, "params": cfg.num_params(), "batch": batch_size,
         "seq_len": seq_len, "logprob_chunk": int(tcfg.logprob_chunk),
         "step_options": step_options(tcfg), "remat": bool(cfg.remat),
         "compile_s": jx.compile_s, "jax_first_loss": float(first["loss"])}
  sides = {"jax": jx.step}
  if torch_peer is not None:
    settings = torch_peer.PeerSettings(learning_rate=LEARNING_RATE, b1=tcfg.b1, b2=tcfg.b2,
                                       weight_decay=tcfg.weight_decay,
                                       max_grad_norm=tcfg.max_grad_norm)
    pt = torch_peer.TorchGrpoStep(hf_dir, batch, settings)
    row["torch_first_loss"] = pt.step()  # warm-up
    row["first_loss_abs_diff"] = abs(row["torch_first_loss"] - row["jax_first_loss"])
    sides["torch"] = pt.step
  times = {side: [] for side in sides}
  for r in range(rounds):
    order = list(sides) if r % 2 == 0 else list(sides)[::-1]
    for side in order:
      times[side].extend(_timed(sides[side], steps))
  tokens = batch_size * seq_len
  flops = 3.0 * cfg.flops_per_token(seq_len) * tokens
  row["model_flops_per_step"] = flops
  for side, ts in times.items():
    step_s = statistics.median(ts)
    row[f"{side}_step_s"] = step_s
    row[f"{side}_step_s_all"] = ts
    row[f"{side}_tokens_per_s"] = tokens / step_s
  row["step_s"] = row["jax_step_s"]  # the key bench_buffer.py reads
  if "torch" in times:
    row["ratio"] = row["jax_tokens_per_s"] / row["torch_tokens_per_s"]
    # Best step of each side: the least disturbed by other load (torch's OpenMP threads stall
    # more than XLA's when a core is taken away, so the median ratio flatters jaxreplay there).
    row["ratio_best"] = min(times["torch"]) / min(times["jax"])
  return row


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", default="small,wide,tiny_default")
  parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
  parser.add_argument("--steps", type=int, default=0,
                      help="timed steps per side per round (0: by shape, ~0.5-1 s per round)")
  parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                    "results", "train_step.json"))
  parser.add_argument("--before", default="",
                      help="a JSON this bench wrote earlier, kept under 'before' in --out")
  args = parser.parse_args(argv)
  if torch is not None:
    torch.set_num_threads(args.threads)
  table = shapes()
  names = [s for s in args.shapes.split(",") if s]
  unknown = set(names) - set(table)
  if unknown:
    parser.error(f"unknown shapes {sorted(unknown)}; expected some of {sorted(table)}")
  default_steps = {"small": 4, "wide": 2, "tiny_default": 20}

  peaks = [measure_matmul_peak(jnp.float32, 2048, 5)]
  rows = []
  with tempfile.TemporaryDirectory() as workdir:
    for name in names:
      cfg, b, t, prompt_len, tcfg = table[name]
      rows.append(bench_shape(name, cfg, b, t, prompt_len, tcfg, args.rounds,
                              args.steps or default_steps.get(name, 3), workdir))
  peaks.append(measure_matmul_peak(jnp.float32, 2048, 5))
  peak = max(peaks)
  for row in rows:
    for side in ("jax", "torch"):
      if f"{side}_step_s" in row:
        row[f"{side}_frac_of_peak"] = row["model_flops_per_step"] / row[f"{side}_step_s"] / peak

  result = {
      "backend": jax.default_backend(), "host": platform.node(), "cpu_count": os.cpu_count(),
      "jax": jax.__version__, "torch": None if torch is None else torch.__version__,
      "torch_threads": args.threads if torch is not None else None,
      "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
      "rounds": args.rounds, "measured_f32_peak_tflops": peak / 1e12,
      "peaks_tflops": [p / 1e12 for p in peaks], "command": " ".join(sys.argv), "results": rows,
  }
  if args.before:
    with open(args.before) as f:
      result["before"] = json.load(f)
  print(f"measured f32 matmul peak: {peak / 1e12:.4f} TFLOP/s (torch threads {args.threads})")
  header = (f"{'shape':13s} {'params':>7s} {'B x T':>8s} {'jax tok/s':>10s} {'torch tok/s':>11s} "
            f"{'ratio':>6s} {'best':>5s} {'jax of peak':>11s} {'torch of peak':>13s} "
            f"{'|dloss|':>8s}")
  print(header)
  print("-" * len(header))
  for r in rows:
    peer = r.get("torch_tokens_per_s")
    print(f"{r['name']:13s} {r['params'] / 1e6:6.2f}M {r['batch']:>3d}x{r['seq_len']:<4d} "
          f"{r['jax_tokens_per_s']:10.0f} {peer or float('nan'):11.0f} "
          f"{r.get('ratio', float('nan')):6.2f} {r.get('ratio_best', float('nan')):5.2f} "
          f"{100 * r['jax_frac_of_peak']:10.1f}% "
          f"{100 * r.get('torch_frac_of_peak', float('nan')):12.1f}% "
          f"{r.get('first_loss_abs_diff', float('nan')):8.1e}")
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {args.out}")
  return result


if __name__ == "__main__":
  main()
