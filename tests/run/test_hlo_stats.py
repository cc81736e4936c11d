"""`run.hlo_stats` on a written-out HLO module (exact counts) and on programs XLA:CPU compiled here
(loops, collectives, dots and host callbacks as XLA prints them)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxreplay.infra import sharding
from jaxreplay.run import hlo_stats

# A 4-device module: a loop of 5 steps that all-gathers a [4, 32] bf16 shard, multiplies it in a
# fused dot and reduce-scatters the f32 product; then one all-reduce and one host callback. The
# callees are printed after their callers on purpose (the count must not depend on the order).
MODULE = """HloModule jit_f, is_scheduled=true, entry_computation_layout={()->f32[]}, num_partitions=4

ENTRY %main.1 (x: bf16[4,32], y: f32[8]) -> (f32[8], f32[]) {
  %x = bf16[4,32]{1,0} parameter(0)
  %y = f32[8]{0} parameter(1)
  %init = (s32[], bf16[4,32]{1,0}) tuple(%c0, %x)
  %loop = (s32[], bf16[4,32]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"},"known_init_step":{"init":"0","step":"1"}}
  %ar = f32[8]{0} all-reduce(%y), channel_id=3, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=%add
  %cb = f32[] custom-call(%y), custom_call_target="xla_ffi_python_gpu_callback", api_version=API_VERSION_TYPED_FFI
  ROOT %out = (f32[8]{0}, f32[]) tuple(%ar, %cb)
}

%body (p: (s32[], bf16[4,32])) -> (s32[], bf16[4,32]) {
  %p = (s32[], bf16[4,32]{1,0}) parameter(0)
  %gte = bf16[4,32]{1,0} get-tuple-element(%p), index=1
  %ag = (bf16[4,32]{1,0}, bf16[16,32]{1,0}) all-gather-start(%gte), channel_id=1, replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0'}, dimensions={0}, use_global_device_ids=true
  %agd = bf16[16,32]{1,0} all-gather-done(%ag)
  %w = bf16[32,64]{1,0} constant({...})
  %f = f32[16,64]{1,0} fusion(%agd, %w), kind=kCustom, calls=%fused_dot
  %rs = f32[4,64]{1,0} reduce-scatter(%f), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%add
  ROOT %t = (s32[], bf16[4,32]{1,0}) tuple(%i, %gte)
}

%cond (q: (s32[], bf16[4,32])) -> pred[] {
  %q = (s32[], bf16[4,32]{1,0}) parameter(0)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%fused_dot (parameter_0: bf16[16,32], parameter_1: bf16[32,64]) -> f32[16,64] {
  %parameter_0 = bf16[16,32]{1,0} parameter(0)
  %parameter_1 = bf16[32,64]{1,0} parameter(1)
  ROOT %dot.1 = f32[16,64]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""


def test_counts_of_a_written_out_module():
  comps, entry = hlo_stats.parse(MODULE)
  assert entry == "main.1" and set(comps) == {"main.1", "body", "cond", "fused_dot", "add"}
  mult, known = hlo_stats.multiplicities(comps, entry)
  assert known and mult["body"] == mult["cond"] == mult["fused_dot"] == 5
  assert mult["add"] == 5 + 1  # the reduce-scatter's reduction in the loop, the all-reduce's
  c = hlo_stats.collectives(MODULE)["by_kind"]
  ag = 16 * 32 * 2  # the gathered result
  assert c["all-gather"] == {"count": 5, "bytes": 5 * ag, "traffic_bytes": 5 * ag * 3 // 4,
                             "group_sizes": [4]}
  rs = 4 * 64 * 4 * 4  # the reduced operand: 4 x the [4, 64] f32 result
  assert c["reduce-scatter"] == {"count": 5, "bytes": 5 * rs, "traffic_bytes": 5 * rs * 3 // 4,
                                 "group_sizes": [4]}
  assert c["all-reduce"] == {"count": 1, "bytes": 32, "traffic_bytes": 48, "group_sizes": [4]}
  f = hlo_stats.flops(MODULE)
  assert f["dot"] == 5 * 2 * 16 * 64 * 32 and f["attention"] == 0
  assert hlo_stats.host_transfers(MODULE) == [
      "custom-call xla_ffi_python_gpu_callback cb in main.1"]


def test_unknown_trip_count_is_reported():
  text = MODULE.replace('backend_config={"known_trip_count":{"n":"5"},', "backend_config={")
  assert hlo_stats.collectives(text)["trip_counts_known"] is False
  assert hlo_stats.collectives(text)["by_kind"]["all-gather"]["count"] == 1


def test_cudnn_attention_flops():
  fwd = ('%a = (bf16[2,4,64,32]{3,1,2,0}, f32[2,4,64]{2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), '
         'custom_call_target="__cudnn$fmhaSoftmax", operand_layout_constraints={bf16[2,64,4,32]'
         '{3,2,1,0}, bf16[2,64,2,32]{3,2,1,0}}, backend_config={"cudnn_fmha_backend_config": '
         '{"intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["2", "4", "64", '
         '"64"]}, "mask_type": "CAUSAL"}}')
  module = (f"HloModule m\n\nENTRY %e (q: bf16[2,64,4,32]) -> bf16[2,4,64,32] {{\n  {fwd}\n"
            f"  {fwd.replace('%a =', '%b =').replace('Softmax', 'SoftmaxBackward')}\n}}\n")
  f = hlo_stats.flops(module)
  one = 4 * 2 * 4 * 64 * 64 * 32 / 2  # two matmuls per head, causal half
  assert f["attention"] == one * (1 + 2.5) and f["dot"] == 0


def _mesh():
  return sharding.make_mesh((1, 8, 1), devices=jax.devices()[:8])


def test_a_compiled_scan_counts_its_collectives_and_dots_per_step():
  """XLA:CPU's own text: a 3-step scan that gathers a sharded weight and multiplies by it."""
  mesh = _mesh()
  rows, d = 16, 64
  w_sh = NamedSharding(mesh, P(None, "fsdp"))
  x_sh = NamedSharding(mesh, P("fsdp"))

  def f(x, ws):
    def body(h, w):
      w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))  # all-gather per step
      return jnp.tanh(h @ w), None
    return jax.lax.scan(body, x, ws)[0]

  x = jax.ShapeDtypeStruct((rows, d), jnp.float32, sharding=x_sh)
  ws = jax.ShapeDtypeStruct((3, d, d), jnp.float32, sharding=w_sh)
  hlo = jax.jit(f, out_shardings=x_sh).lower(x, ws).compile().as_text()
  c = hlo_stats.collectives(hlo)
  assert c["trip_counts_known"]
  ag = c["by_kind"]["all-gather"]
  assert ag["count"] == 3 and ag["bytes"] == 3 * d * d * 4 and ag["group_sizes"] == [8]
  assert hlo_stats.flops(hlo)["dot"] == 3 * 2 * (rows // 8) * d * d  # each device's rows
  assert hlo_stats.host_transfers(hlo) == []


def test_a_host_callback_inside_a_program_is_found():
  def f(x):
    jax.debug.callback(lambda v: None, x.sum())
    return x * 2
  hlo = jax.jit(f).lower(jnp.ones(4)).compile().as_text()
  found = hlo_stats.host_transfers(hlo)
  assert len(found) == 1 and "callback" in found[0], found


@pytest.mark.parametrize("shape,expected", [
    ("f32[2,3]{1,0}", 24), ("(bf16[4]{0}, s32[], pred[2,2]{1,0})", 8 + 4 + 4), ("f32[]", 4),
    ("(f32[0]{0})", 0)])
def test_shape_bytes(shape, expected):
  assert hlo_stats.nbytes(shape) == expected
  assert np.isclose(sum(hlo_stats.DTYPE_BYTES[dt] * np.prod(d, dtype=np.int64)
                        for dt, d in hlo_stats.arrays(shape)), expected)
