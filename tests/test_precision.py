"""bfloat16 compute with float32 master weights, against the same schedules in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
import pytest

import fdg_jax
from fdg_jax import precision
from test_schedules import run_schedule, stages_of
from toy_models import batches, loss_fn, make_model

# bfloat16 keeps 8 bits of mantissa (relative rounding 2^-9 = 0.2%): after 12 ticks of SGD the
# parameters of the toy model agree with float32 to this absolute tolerance (they move by
# ~0.1-0.5 from their initial values over the run).
ATOL = 2e-2


def build(algorithm, backward, dtype, kind="mlp", K=3):
  applies, params, states = make_model(kind, K)
  stages = [precision.mixed_precision(s, dtype) for s in stages_of(applies)]
  kwargs = {"backward": backward} if algorithm != "bp" else {}
  sched = fdg_jax.create(algorithm, stages, precision.float32_loss(loss_fn),
                         optax.sgd(0.1, momentum=0.5), **kwargs)
  return sched, params, states


@pytest.mark.parametrize("algorithm,backward,kind", [
    ("bp", "stash", "mlp"), ("ddg", "stash", "bn"), ("ddg", "recompute", "mlp"),
    ("fdg", "stash", "mlp"), ("fdg", "recompute", "bn")])
def test_bfloat16_tracks_float32(algorithm, backward, kind):
  data = batches(12)
  runs = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    sched, params, states = build(algorithm, backward, dtype, kind)
    runs[dtype] = run_schedule(sched, params, states, data, chunks=(5, 7))
  (p32, s32, trace32, _), (p16, s16, trace16, state16) = runs[jnp.float32], runs[jnp.bfloat16]
  assert trace16 == trace32
  moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree.leaves(p32), jax.tree.leaves(make_model(kind, 3)[1])))
  assert moved > 0.05  # the run trained
  differ = False
  for a, b in zip(jax.tree.leaves(p16), jax.tree.leaves(p32)):
    assert a.dtype == jnp.float32  # master weights stay float32
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, rtol=0)
    differ = differ or not np.array_equal(np.asarray(a), np.asarray(b))
  assert differ  # bfloat16 was really used
  for a, b in zip(jax.tree.leaves(s16), jax.tree.leaves(s32)):
    assert a.dtype == b.dtype
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, rtol=0)


@pytest.mark.parametrize("backward", ["stash", "recompute"])
def test_bfloat16_halves_the_stash_and_the_messages(backward):
  data = batches(6)
  sizes, states = {}, {}
  for dtype in (jnp.float32, jnp.bfloat16):
    sched, params, ms = build("fdg", backward, dtype)
    *_, state = run_schedule(sched, params, ms, data)
    sizes[dtype] = sched.stash_bytes(state)
    states[dtype] = state
  # Under recompute, stage 0 stashes the batch itself, which comes in float32.
  for k in range(1 if backward == "recompute" else 0, 2):
    ring_slots = 4 * sched.ring_sizes[k]  # the int32 batch index per slot stays
    ratio = (sizes[jnp.bfloat16][k] - ring_slots) / (sizes[jnp.float32][k] - ring_slots)
    assert ratio == pytest.approx(0.5), (k, sizes)
  act = states[jnp.bfloat16]["inbox"][1]["act"][0]
  cot = states[jnp.bfloat16]["inbox"][0]["cot"]
  assert act.dtype == jnp.bfloat16 and cot.dtype == jnp.bfloat16


def test_float32_is_the_stage_itself_and_integers_pass_through():
  stage = fdg_jax.Stage(apply=lambda p, s, x, *, train=True, rng=None: (x * p, s))
  assert precision.mixed_precision(stage, jnp.float32) is stage
  tree = {"f": jnp.ones(2), "i": jnp.arange(2)}
  cast = precision.cast_floating(tree, jnp.bfloat16)
  assert cast["f"].dtype == jnp.bfloat16 and cast["i"].dtype == tree["i"].dtype


class _NormBlock(nn.Module):
  """Dense -> BatchNorm -> ReLU -> Dense -> LayerNorm: Flax's normalisation layers upcast
  their input to float32 for the statistics."""

  @nn.compact
  def __call__(self, x, train=True):
    x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Dense(32)(x)))
    return nn.LayerNorm()(nn.Dense(32)(x))


def _norm_schedule(dtype, **kwargs):
  stages = [fdg_jax.Stage.from_linen(_NormBlock()), fdg_jax.Stage.from_linen(nn.Dense(4))]
  params, states = fdg_jax.init_stages(stages, jax.random.PRNGKey(0), jnp.zeros((1, 6)))
  stages = [precision.mixed_precision(s, dtype, **kwargs) for s in stages]
  sched = fdg_jax.fdg(stages, precision.float32_loss(loss_fn), optax.sgd(0.1, momentum=0.5))
  return sched, params, states


def test_normalisation_layers_leave_no_float32_residuals():
  """With Flax's BatchNorm and LayerNorm the bfloat16 stash is at most half the float32 one
  (their float32 statistics paths are recomputed in the backward), where plain autodiff
  keeps float32 copies of the activations. The training is the same up to bfloat16
  rounding (a recomputed float32 value may round differently once cast back: XLA fuses
  the forward and the recomputation differently)."""
  data = [(x, y % 4) for x, y in batches(6, batch_size=16)]
  sizes, params = {}, {}
  for name, dtype, kwargs in (("f32", jnp.float32, {}), ("bf16", jnp.bfloat16, {}),
                              ("bf16 keep", jnp.bfloat16, {"keep_float32_residuals": True})):
    sched, p, s = _norm_schedule(dtype, **kwargs)
    p, _, _, state = run_schedule(sched, p, s, data)
    sizes[name] = sched.stash_bytes(state)[0] - 4 * sched.ring_sizes[0]
    params[name] = p
  assert sizes["bf16"] <= 0.5 * sizes["f32"], sizes
  assert sizes["bf16 keep"] > 0.6 * sizes["f32"], sizes  # what the policy removes
  for a, b, c in zip(*(jax.tree.leaves(params[n]) for n in ("bf16", "bf16 keep", "f32"))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-3, rtol=0)
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), atol=ATOL, rtol=0)
