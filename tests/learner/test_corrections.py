"""Tests of jaxreplay.learner.corrections (the off-policy corrections) against independent float64
numpy references written with explicit loops, alone and inside both losses."""
import functools
import math

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.learner import algorithms
from jaxreplay.learner import batch as batch_lib
from jaxreplay.learner import corrections
from jaxreplay.learner import loss_fn as loss_fn_lib
from tests.helpers import tolerances

CAP, THRESHOLD = 1.8, 0.1
MODES = tuple(m for m in corrections.CORRECTIONS if m != "none")
AGGS = ("token_mean", "sequence_mean", "constant")
EPS_LOW, EPS_HIGH = 0.2, 0.28


# --------------------------------------------------------------------------- numpy references (loops)


def np_sequences(mask, segment_ids=None):
  """{sequence key: [(b, t), ...]} of the valid tokens (a row, or a (row, segment) pair)."""
  seqs = {}
  for b in range(mask.shape[0]):
    for t in range(mask.shape[1]):
      if mask[b, t] > 0:
        key = (b, 0) if segment_ids is None else (b, int(segment_ids[b, t]))
        seqs.setdefault(key, []).append((b, t))
  return seqs


def np_m2po_keep(lr, mask, threshold):
  """AReaL's M2PO mask, written out: sort valid tokens by decreasing lr^2 (ties by position) and
  mask the largest until the mean of the rest is below the threshold (one token always kept)."""
  tokens = [(float(lr[b, t]) ** 2, b * mask.shape[1] + t, b, t)
            for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t] > 0]
  tokens.sort(key=lambda x: (-x[0], x[1]))
  n = len(tokens)
  num_masked = n - 1
  for j in range(n):
    rest = [x[0] for x in tokens[j:]]
    if sum(rest) / len(rest) < threshold:
      num_masked = j
      break
  keep = np.zeros(mask.shape)
  for x in tokens[max(num_masked, 0):]:
    keep[x[2], x[3]] = 1.0
  return keep


def np_correction(mode, lp, blp, mask, cap=CAP, threshold=THRESHOLD, segment_ids=None):
  """(weights [B, T], proximal or None, aux) of `mode`, float64, one token / sequence at a time."""
  lr = np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    for t in range(mask.shape[1]):
      if mask[b, t] > 0:
        lr[b, t] = float(lp[b, t]) - float(blp[b, t])
  valid = [(b, t) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t] > 0]
  mean = lambda f: sum(f(b, t) for b, t in valid) / max(len(valid), 1)
  w = np.zeros(mask.shape)
  prox = None
  aux = {}
  if mode == "tis":
    for b, t in valid:
      w[b, t] = min(math.exp(lr[b, t]), cap)
    prox = np.where(mask > 0, lp, 0.0)
    aux = {"tis_weight_mean": mean(lambda b, t: w[b, t]),
           "tis_truncated_fraction": mean(lambda b, t: float(w[b, t] >= cap))}
  elif mode == "mis_token":
    for b, t in valid:
      w[b, t] = float(1.0 / cap <= math.exp(lr[b, t]) <= cap)
    aux = {"mis_masked_fraction": mean(lambda b, t: 1.0 - w[b, t])}
  elif mode == "mis_sequence":
    seqs = np_sequences(mask, segment_ids)
    masked_seqs = 0
    for tokens in seqs.values():
      ratio = math.exp(sum(lr[b, t] for b, t in tokens))
      keep = float(1.0 / cap <= ratio <= cap)
      masked_seqs += keep == 0.0
      for b, t in tokens:
        w[b, t] = keep
    aux = {"mis_masked_fraction": mean(lambda b, t: 1.0 - w[b, t]),
           "mis_masked_sequence_fraction": masked_seqs / max(len(seqs), 1)}
  elif mode == "m2po":
    w = np_m2po_keep(lr, mask, threshold)
    aux = {"m2po_masked_fraction": mean(lambda b, t: 1.0 - w[b, t]),
           "m2po_second_moment": mean(lambda b, t: lr[b, t] ** 2)}
  elif mode == "decoupled":
    for b, t in valid:
      ratio = math.exp(lr[b, t])
      w[b, t] = ratio if ratio <= cap else 0.0
    prox = np.where(mask > 0, lp, 0.0)
    aux = {"decoupled_weight_mean": mean(lambda b, t: w[b, t]),
           "decoupled_masked_fraction": mean(lambda b, t: float(math.exp(lr[b, t]) > cap))}
  return w, prox, aux


def np_aggregate(x, mask, aggregation, normalizer=None):
  rows = [[x[b, t] for t in range(mask.shape[1]) if mask[b, t] > 0] for b in range(mask.shape[0])]
  flat = [v for r in rows for v in r]
  if aggregation == "token_mean":
    return sum(flat) / max(len(flat), 1)
  if aggregation == "sequence_mean":
    means = [sum(r) / len(r) for r in rows if r]
    return sum(means) / max(len(means), 1)
  return sum(flat) / (normalizer or mask.size)


def np_loss_and_grad(kind, mode, lp, blp, adv, mask, aggregation, normalizer=None):
  """The loss with the correction and its gradient wrt lp (float64)."""
  w, prox, _ = np_correction(mode, lp, blp, mask)
  per_token, d_token = np.zeros(mask.shape), np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    for t in range(mask.shape[1]):
      if mask[b, t] == 0:
        continue
      a = float(adv[b])
      if kind == "asymre":
        per_token[b, t] = -w[b, t] * a * float(lp[b, t])
        d_token[b, t] = -w[b, t] * a
        continue
      old = float(prox[b, t]) if prox is not None else float(blp[b, t])
      rho = math.exp(float(lp[b, t]) - old)
      unclipped, clipped = rho * a, min(max(rho, 1 - EPS_LOW), 1 + EPS_HIGH) * a
      per_token[b, t] = -w[b, t] * min(unclipped, clipped)
      d_token[b, t] = 0.0 if clipped < unclipped else -w[b, t] * a * rho
  loss = np_aggregate(per_token, mask, aggregation, normalizer)
  # d aggregate / d per_token, by cases
  counts = mask.sum(axis=1)
  rows = int(np.sum(counts > 0))
  scale = np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    for t in range(mask.shape[1]):
      if mask[b, t] > 0:
        scale[b, t] = {"token_mean": 1.0 / mask.sum(), "sequence_mean": 1.0 / (counts[b] * rows),
                       "constant": 1.0 / (normalizer or mask.size)}[aggregation]
  return loss, d_token * scale


# ----------------------------------------------------------------------------------------- inputs


def make_inputs(seed=0, num_rows=6, num_tokens=10, noise=0.5):
  """Right-padded rows (row 2 empty); behaviour log-probs off by N(0, noise) so that every mode
  masks or truncates some tokens and keeps others."""
  rng = np.random.default_rng(seed)
  mask = np.zeros((num_rows, num_tokens), np.float32)
  for b in range(num_rows):
    if b == 2:
      continue
    start = rng.integers(0, 3)
    mask[b, start:rng.integers(start + 3, num_tokens + 1)] = 1.0
  lp = (-rng.uniform(0.05, 3.0, mask.shape)).astype(np.float32)
  blp = (lp + rng.normal(0.0, noise, mask.shape)).astype(np.float32)
  return dict(logprobs=lp * mask, behaviour_logprobs=blp * mask,
              advantages=rng.normal(size=num_rows).astype(np.float32), mask=mask)


def as_batch(x):
  num_rows, num_tokens = x["mask"].shape
  ints = np.zeros((num_rows, num_tokens), np.int32)
  return batch_lib.Batch(tokens=ints, positions=ints, segment_ids=ints, targets=ints,
                         completion_mask=x["mask"], behaviour_logprobs=x["behaviour_logprobs"],
                         advantages=x["advantages"], rewards=np.zeros(num_rows, np.float32),
                         policy_version=np.zeros(num_rows, np.int32))


def options(mode):
  return corrections.OffPolicyOptions(off_policy=mode, off_policy_cap=CAP, m2po_threshold=THRESHOLD)


# ------------------------------------------------------------------------------------------ tests


class CorrectionFunctionsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(*MODES)
  def test_weights_and_aux_vs_numpy(self, mode):
    x = make_inputs(1)
    fn = self.variant(functools.partial(corrections.correct, options(mode)))
    got = fn(x["logprobs"], x["behaviour_logprobs"], x["mask"])
    w, prox, aux = np_correction(mode, x["logprobs"], x["behaviour_logprobs"], x["mask"])
    tol = tolerances.close(np.float32, 10, CAP)
    np.testing.assert_allclose(np.asarray(got.weights) * x["mask"], w, **tol)
    if prox is None:
      self.assertIsNone(got.proximal_logprobs)
    else:
      np.testing.assert_array_equal(got.proximal_logprobs, prox)
    self.assertEqual(set(got.aux), set(aux))
    for k, v in aux.items():
      self.assertEqual(got.aux[k].dtype, jnp.float32)
      np.testing.assert_allclose(got.aux[k], v, **tolerances.close(np.float32, x["mask"].size, CAP),
                                 err_msg=k)
    # the inputs exercise both outcomes of every mode
    kept = w[x["mask"] > 0]
    self.assertTrue(np.any(kept == 0) or np.any(kept == CAP), mode)
    self.assertTrue(np.any((kept > 0) & (kept < CAP)), mode)
    self.assertEqual(set(got.aux), set(corrections.CORRECTIONS[mode].aux))

  @chex.variants(with_jit=True, without_jit=True)
  def test_truncated_is_weights(self):
    rng = np.random.default_rng(5)
    lp, behaviour = (-rng.uniform(0.1, 2.0, (6, 10)).astype(np.float32) for _ in range(2))
    w = self.variant(functools.partial(corrections.truncated_is_weights, cap=1.2))(lp, behaviour)
    want = np.zeros(lp.shape)
    for b in range(6):
      for t in range(10):
        want[b, t] = min(math.exp(float(lp[b, t]) - float(behaviour[b, t])), 1.2)
    chex.assert_trees_all_close(w, want, **tolerances.close(np.float32, 1, 1.2))
    self.assertTrue(0 < np.mean(want == 1.2) < 1)
    grad = jax.grad(lambda a: jnp.sum(corrections.truncated_is_weights(a, behaviour, 2.0)))(lp)
    np.testing.assert_array_equal(grad, 0.0)
    with pytest.raises(ValueError, match="tis_cap must be > 0"):
      corrections.truncated_is_weights(lp, behaviour, 0.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_mis_sequence_on_packed_segments(self):
    x = make_inputs(2, num_rows=4, num_tokens=12)
    seg = np.zeros_like(x["mask"], np.int32)
    seg[:, :6], seg[:, 6:] = 1, 2            # two sequences per row
    mask = x["mask"].copy()
    mask[0, :] = 1.0
    fn = self.variant(lambda lp, blp, m, s: corrections.correct(options("mis_sequence"), lp, blp, m, s))
    got = fn(x["logprobs"], x["behaviour_logprobs"], mask, seg)
    w, _, aux = np_correction("mis_sequence", x["logprobs"], x["behaviour_logprobs"], mask,
                              segment_ids=seg)
    np.testing.assert_array_equal(np.asarray(got.weights) * mask, w)
    for k, v in aux.items():
      np.testing.assert_allclose(got.aux[k], v, **tolerances.close(np.float32, mask.size, max(
          abs(v), 1e-3)), err_msg=k)  # float32 reductions over the tokens vs float64 numpy
    self.assertTrue(0.0 < aux["mis_masked_sequence_fraction"] < 1.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_m2po_bound_ties_and_edges(self):
    x = make_inputs(3)
    mask = x["mask"]
    keep_fn = self.variant(functools.partial(corrections.m2po_keep, threshold=THRESHOLD))
    lr = np.asarray(x["logprobs"] - x["behaviour_logprobs"], np.float32)
    keep = np.asarray(keep_fn(lr, mask))
    np.testing.assert_array_equal(keep, np_m2po_keep(lr, mask, THRESHOLD))
    kept = keep > 0
    self.assertLess(np.mean(np.square(lr.astype(np.float64))[kept]), THRESHOLD)  # the bound holds
    self.assertTrue(np.all(np.square(lr)[(mask > 0) & ~kept] >= np.square(lr)[kept].max()))
    # ties: equal m2 everywhere above the threshold -> all but one token masked, the first kept
    # position-wise last in the stable order
    flat = np.full(mask.shape, 1.0, np.float32)
    tied = np.asarray(keep_fn(flat, mask))
    np.testing.assert_array_equal(tied, np_m2po_keep(flat, mask, THRESHOLD))
    self.assertEqual(tied.sum(), 1.0)
    # already under the threshold: nothing masked; no valid token: nothing at all
    np.testing.assert_array_equal(keep_fn(lr * 0.01, mask), mask)
    np.testing.assert_array_equal(keep_fn(lr, np.zeros_like(mask)), 0.0)

  def test_fresh_rollouts_are_left_alone(self):
    """lp == behaviour (fresh, no mismatch): every mode keeps every token with weight 1."""
    x = make_inputs(4)
    for mode in MODES:
      got = corrections.correct(options(mode), x["logprobs"], x["logprobs"], x["mask"])
      np.testing.assert_array_equal(np.asarray(got.weights)[x["mask"] > 0], 1.0, err_msg=mode)

  def test_gradients_are_stopped(self):
    x = make_inputs(5)
    for mode in MODES:
      g = jax.grad(lambda lp: jnp.sum(corrections.correct(
          options(mode), lp, x["behaviour_logprobs"], x["mask"]).weights))(x["logprobs"])
      np.testing.assert_array_equal(g, 0.0, err_msg=mode)

  def test_rank_and_dtype_errors(self):
    x = make_inputs(6)
    with pytest.raises(ValueError, match="rank"):
      corrections.mis_token_keep(x["logprobs"][0], x["mask"][0], 2.0)
    with pytest.raises(ValueError, match="dtype|type"):
      corrections.behaviour_log_ratio(x["logprobs"].astype(np.int32), x["behaviour_logprobs"],
                                      x["mask"])
    with pytest.raises(ValueError, match="shape"):
      corrections.m2po_keep(x["logprobs"], x["mask"][:, :5], 0.1)


class CorrectedLossesTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.product(mode=MODES, kind=("grpo", "asymre"))
  def test_loss_grad_and_aux_vs_numpy(self, mode, kind):
    x = make_inputs(10)
    normalizer = 45.0
    algo_options = (algorithms.GrpoOptions(eps_low=EPS_LOW, eps_high=EPS_HIGH) if kind == "grpo"
                    else algorithms.AsymreOptions())

    def fn(lp, batch):
      out = {}
      for agg in AGGS:
        f = functools.partial(algorithms.loss, kind, aggregation=agg,
                              normalizer=normalizer if agg == "constant" else None,
                              options=algo_options, off_policy=options(mode))
        out[agg] = (f(lp, batch), jax.grad(lambda a: f(a, batch)[0])(lp))
      return out

    got = self.variant(fn)(x["logprobs"], as_batch(x))
    _, _, want_aux = np_correction(mode, x["logprobs"], x["behaviour_logprobs"], x["mask"])
    n = int(x["mask"].sum())
    for agg, ((loss, aux), grad) in got.items():
      want_loss, want_grad = np_loss_and_grad(kind, mode, x["logprobs"], x["behaviour_logprobs"],
                                              x["advantages"], x["mask"], agg,
                                              normalizer if agg == "constant" else None)
      np.testing.assert_allclose(loss, want_loss, **tolerances.close(np.float32, n, 3 * CAP),
                                 err_msg=agg)
      np.testing.assert_allclose(grad, want_grad, **tolerances.close(np.float32, n, CAP),
                                 err_msg=agg)
      for k, v in want_aux.items():
        np.testing.assert_allclose(aux[k], v, **tolerances.close(np.float32, n, CAP), err_msg=k)
      if corrections.CORRECTIONS[mode].proximal and kind == "grpo":
        # the clip acts on pi_theta / pi_prox = 1: it never binds
        self.assertEqual(float(aux["clip_fraction"]), 0.0)
        self.assertEqual(float(aux["ratio_max"]), 1.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_tis_cap_alone_is_the_tis_mode(self):
    """trainer.tis_cap = C alone (the key from before issue 27) is off_policy="tis" with cap C:
    the same loss, statistics and gradient."""
    x = make_inputs(11)

    def fn(lp, batch):
      by_cap = lambda a: algorithms.loss("grpo", a, batch,
                                         off_policy=corrections.OffPolicyOptions(tis_cap=1.5))
      by_mode = lambda a: algorithms.loss("grpo", a, batch, off_policy=corrections.OffPolicyOptions(
          off_policy="tis", off_policy_cap=1.5))
      return ([by_cap(lp), by_mode(lp)],
              [jax.grad(lambda a, f=f: f(a)[0])(lp) for f in (by_cap, by_mode)])

    (cap, mode), grads = self.variant(fn)(x["logprobs"], as_batch(x))
    chex.assert_trees_all_equal(cap, mode)
    chex.assert_trees_all_equal(grads[0], grads[1])
    self.assertEqual(set(cap[1]) & {"tis_weight_mean", "tis_truncated_fraction"},
                     {"tis_weight_mean", "tis_truncated_fraction"})

  def test_decoupled_is_tis_below_the_cap_and_filters_above(self):
    """One update per batch: pi_prox = pi_theta in value, so decoupled and tis agree on every token
    whose behaviour weight is <= c; above c, tis truncates to c and decoupled masks."""
    x = make_inputs(12)
    batch = as_batch(x)
    grad = lambda mode: np.asarray(jax.grad(lambda lp: algorithms.loss(
        "grpo", lp, batch, off_policy=options(mode))[0])(x["logprobs"]))
    g_tis, g_dec = grad("tis"), grad("decoupled")
    ratio = np.exp(x["logprobs"].astype(np.float64) - x["behaviour_logprobs"])
    valid = x["mask"] > 0
    below, above = valid & (ratio <= CAP), valid & (ratio > CAP)
    self.assertTrue(below.any() and above.any())
    np.testing.assert_allclose(g_dec[below], g_tis[below], **tolerances.close(
        np.float32, x["mask"].size, tolerances.tree_scale(g_tis[below])))
    np.testing.assert_array_equal(g_dec[above], 0.0)
    self.assertTrue(np.all(g_tis[above] != 0.0))

  def test_mode_none_is_the_plain_loss(self):
    x = make_inputs(13)
    for kind in algorithms.ALGORITHMS:
      a = algorithms.loss(kind, x["logprobs"], as_batch(x))
      b = algorithms.loss(kind, x["logprobs"], as_batch(x),
                          off_policy=corrections.OffPolicyOptions("none"))
      chex.assert_trees_all_equal(a, b)


class OptionsTest(chex.TestCase):

  def test_modes_caps_and_errors(self):
    O = corrections.OffPolicyOptions
    self.assertEqual((O().mode, O(tis_cap=2.5).mode, O(tis_cap=2.5).cap), ("none", "tis", 2.5))
    self.assertEqual((O("tis").cap, O("tis", tis_cap=3.0).cap, O("m2po", 1.5).cap), (2.0, 3.0, 1.5))
    self.assertTrue(O("decoupled").uses_proximal and O(tis_cap=2.0).uses_proximal)
    self.assertFalse(O("mis_token").uses_proximal)
    with pytest.raises(ValueError, match="expected one of"):
      O("icepop")
    with pytest.raises(ValueError, match="off_policy_cap=1.0"):
      O("mis_token", off_policy_cap=1.0)
    with pytest.raises(ValueError, match="m2po_threshold=0"):
      O("m2po", m2po_threshold=0.0)
    with pytest.raises(ValueError, match="tis_cap=2.0 is the cap of trainer.off_policy='tis'"):
      O("m2po", tis_cap=2.0)
    with pytest.raises(ValueError, match="tis_cap=-1"):
      O(tis_cap=-1.0)

  def test_from_config_and_loss_fn(self):
    from jaxreplay.config import defaults  # pylint: disable=g-import-not-at-top
    t = defaults.base_config().trainer
    self.assertEqual(corrections.options_from_config(t), corrections.OffPolicyOptions())
    t.off_policy, t.off_policy_cap, t.m2po_threshold = "m2po", 3.0, 0.02
    loss_fn = loss_fn_lib.loss_fn_from_config(t)
    self.assertEqual(loss_fn.off_policy, corrections.OffPolicyOptions("m2po", 3.0, 0.02))
    hash(loss_fn)  # a jit static
    self.assertEqual(set(corrections.option_names()) - set(t), set())
    t.loss = "asymre"
    self.assertEqual(loss_fn_lib.loss_fn_from_config(t).off_policy.mode, "m2po")
    # GRPO's clip against pi_theta itself needs both clip sides > 0
    with pytest.raises(ValueError, match="off_policy='decoupled' needs eps_low > 0"):
      loss_fn_lib.make_loss_fn("grpo", algorithms.GrpoOptions(eps_low=0.0),
                           off_policy=corrections.OffPolicyOptions("decoupled"))
    loss_fn_lib.make_loss_fn("asymre", off_policy=corrections.OffPolicyOptions("decoupled"))
    loss_fn_lib.make_loss_fn("asymre", off_policy=corrections.OffPolicyOptions(tis_cap=2.0))


class PartialRolloutsTest(chex.TestCase):
  """Rollouts continued across weight refreshes (rollout.partial="continue"): every correction
  and both losses read each token's behaviour log-prob under the version that sampled it, and
  tokens masked as too stale (buffer.max_staleness) are in no term."""

  @parameterized.product(mode=("tis", "mis_token", "decoupled"), min_version=(None, 1))
  def test_losses_use_each_tokens_own_versions_logprobs(self, mode, min_version):
    from jaxreplay.data import collate  # pylint: disable=g-import-not-at-top
    from jaxreplay.models import logprobs as logprobs_lib  # pylint: disable=g-import-not-at-top
    from jaxreplay.models import presets, transformer  # pylint: disable=g-import-not-at-top
    cfg = presets.tiny()
    params = [transformer.init_params(cfg, jax.random.key(k)) for k in range(3)]  # v0, v1, now
    rng = np.random.default_rng(0)

    def full_logprobs(p, seq):
      seq = np.asarray(seq)[None]
      return np.asarray(logprobs_lib.token_logprobs(cfg, p, seq[:, :-1], seq[:, 1:]))[0]

    rollouts = []
    for i, switch in enumerate((3, 5, 0)):  # tokens at version 0 up to `switch`, then 1
      prompt = rng.integers(1, cfg.vocab_size, 4).astype(np.int32)
      completion = rng.integers(1, cfg.vocab_size, 7).astype(np.int32)
      versions = np.where(np.arange(7) < switch, 0, 1).astype(np.int32)
      seq = np.r_[prompt, completion]
      by_version = [full_logprobs(params[v], seq)[prompt.size - 1:] for v in (0, 1)]
      behaviour = np.where(versions == 0, by_version[0], by_version[1])  # as the sampler gave
      rollouts.append(batch_lib.Rollout(prompt, completion, behaviour, reward=float(i),
                                        advantage=float(rng.normal()),
                                        policy_version=int(versions.min()), group_id=0,
                                        token_versions=versions))
    batch = collate.collate(rollouts, buckets=(16,), token_versions=True,
                            min_token_version=min_version)
    lp = np.asarray(logprobs_lib.token_logprobs(cfg, params[2], batch.tokens, batch.targets))
    # The reference's behaviour log-probs, recomputed per position from the token's version.
    refs = [np.asarray(logprobs_lib.token_logprobs(cfg, params[v], batch.tokens, batch.targets))
            for v in (0, 1)]
    mask = np.zeros(batch.tokens.shape, np.float32)
    blp = np.zeros(batch.tokens.shape)
    for b, r in enumerate(rollouts):
      for j, v in enumerate(r.token_versions):
        t = r.prompt_tokens.size - 1 + j
        if min_version is None or v >= min_version:
          mask[b, t], blp[b, t] = 1.0, refs[v][b, t]
    np.testing.assert_array_equal(batch.completion_mask, mask)
    np.testing.assert_allclose(batch.behaviour_logprobs, blp,
                               **tolerances.close(np.float32, cfg.hidden_size, 10.0))
    lp = lp * mask
    n = int(mask.sum())
    for kind, algo_options in (("grpo", algorithms.GrpoOptions(eps_low=EPS_LOW, eps_high=EPS_HIGH)),
                               ("asymre", algorithms.AsymreOptions())):
      f = functools.partial(algorithms.loss, kind, aggregation="token_mean",
                            options=algo_options, off_policy=options(mode))
      (loss, _), grad = f(lp, batch), jax.grad(lambda a: f(a, batch)[0])(lp)
      want_loss, want_grad = np_loss_and_grad(kind, mode, lp, blp, batch.advantages, mask,
                                              "token_mean")
      np.testing.assert_allclose(loss, want_loss, **tolerances.close(np.float32, n, 3 * CAP))
      np.testing.assert_allclose(grad, want_grad, **tolerances.close(np.float32, n, CAP))
      assert np.all(np.asarray(grad)[mask == 0] == 0)  # masked (stale) tokens: no gradient
