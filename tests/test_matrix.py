"""The combination matrix: every schedule option against the independent simulator.

Factors: algorithm x backward policy x engine (and the fused engine's gate) x `step` or
`run` x message structure (one array, a tuple, a dict, a nested dict with a leaf of another
dtype and shape) x model state (none, BatchNorm) x dropout x dtype (float32, bfloat16
compute) x optimizer (SGD momentum, Adam, Muon, basis rotation, PipeNAG's NAdam) x
staleness remedy (none, error feedback, PipeMare's discrepancy correction, weight
prediction; each stage built by `staleness.stage_optimizer` for its delay) x shrinking. The
full product has thousands of cases, so the cases are a covering selection, built by
`covering_cases` below (deterministic, greedy): every pair of values of any two factors
appears in at least one case, and every (algorithm, backward, engine) triple appears, since
the engines hold a separate code path for each. Constraints: the SPMD engine runs FDG only,
shrinking (beta < 1) is an FDG option, and the synchronous pipelines (GPipe with M = 2
micro-batches, 1F1B with M = 4) have no backward policy (they keep each micro-batch's vjp),
no gate, and run on the fused and per-stage engines; their reference is
`simulator.simulate_microbatched`, BP on the same batches cut into M.

Every case runs 9 ticks of a 3-stage model and compares the parameters, model states and the
per-tick `updated` trace with `simulator.simulate`, fed the same stage functions (wrapped in
`precision.mixed_precision` for bfloat16). float32 agrees to 1e-5; bfloat16 to 1.5e-2
absolute (measured up to 6e-3; each side rounds to bfloat16 at different points: eager
operations in the simulator against fused XLA programs in the schedule), against weight
changes of 0.05-0.2 over the 9 ticks; basis rotation to 1e-4 (eigenvectors by float32 eigh
and QR).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fdg_jax
from fdg_jax import precision, staleness
from fdg_jax.optim import make_optimizer
from simulator import simulate, simulate_microbatched
from toy_models import NUM_CLASSES, WIDTH, assert_trees_close, batches, loss_fn

K = 3
TICKS = 9

FACTORS = {
    "algorithm": ("bp", "ddg", "fdg", "gpipe", "1f1b"),
    "backward": ("stash", "recompute"),
    "engine": ("fused/mask", "fused/cond", "per_stage", "spmd"),
    "call": ("step", "run"),
    "message": ("array", "tuple", "dict", "nested"),
    "state": ("none", "batchnorm"),
    "dropout": (False, True),
    "dtype": ("float32", "bfloat16"),
    "optimizer": ("sgd_momentum", "adam", "muon", "basis_rotation", "nadam_warmup"),
    "remedy": ("none", "error_feedback", "discrepancy_correction", "weight_prediction"),
    "beta": (1.0, 0.5),
}
# Factors whose every combination must appear (each engine has its own code per pair).
FULL = ("algorithm", "backward", "engine")


SYNC = ("gpipe", "1f1b")  # their micro-batches per tick: M = 2 (< K) and M = 4 (> K)
MICROBATCHES = {"gpipe": 2, "1f1b": 4}


def valid(case: dict) -> bool:
  if case["engine"] == "spmd" and case["algorithm"] != "fdg":
    return False
  if case["algorithm"] in SYNC and (case["backward"] != "stash" or case["engine"] not in
                                    ("fused/mask", "per_stage")):
    return False  # no delay, so no backward policy; no gate (one program, no fill)
  if case["beta"] != 1.0 and case["algorithm"] != "fdg":
    return False
  return True


def covering_cases() -> list[dict]:
  """A greedy covering array: all pairs of factor values and all `FULL` triples."""
  names = list(FACTORS)
  candidates = [dict(zip(names, values)) for values in itertools.product(*FACTORS.values())]
  candidates = [c for c in candidates if valid(c)]

  def needs(case):
    pairs = {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(names, 2)}
    return pairs | {tuple((f, case[f]) for f in FULL)}

  covers = [needs(c) for c in candidates]
  uncovered = set().union(*covers)
  chosen = []
  while uncovered:
    best = max(range(len(candidates)), key=lambda i: len(covers[i] & uncovered))
    chosen.append(candidates[best])
    uncovered -= covers[best]
  return chosen


CASES = covering_cases()


def case_id(case: dict) -> str:
  return "-".join(str(v) for v in case.values())


# ---------------------------------------------------------------------------- the model
def pack(structure, h, s):
  """The message a stage sends: its activation h [B, W] and a summary s [B]."""
  if structure == "array":
    return h
  if structure == "tuple":
    return (h, s)
  if structure == "dict":
    return {"h": h, "s": s}
  # A nested dict whose summary travels in bfloat16: a leaf of another dtype and shape.
  return {"a": {"h": h}, "aux": {"s": s.astype(jnp.bfloat16)}}


def unpack(structure, msg):
  """h + s (so that every leaf of the message carries gradient)."""
  if structure == "array":
    return msg
  if structure == "tuple":
    h, s = msg
  elif structure == "dict":
    h, s = msg["h"], msg["s"]
  else:
    h, s = msg["a"]["h"], msg["aux"]["s"]
  return h + s.astype(h.dtype)[:, None]


def make_stage(k, structure, batchnorm, dropout):
  first, last = k == 0, k == K - 1

  def apply(params, model_state, x, *, train=True, rng=None):
    h = x if first else unpack(structure, x)
    z = h @ params["w"]
    if last or not batchnorm:
      z = z + params["b"]
    if last:
      return z, model_state
    if batchnorm:  # the bias follows the normalisation (before it, its gradient would be 0)
      if train:
        mean, var = z.mean(0), z.var(0)
        model_state = {"mean": 0.9 * model_state["mean"] + 0.1 * mean.astype(jnp.float32),
                       "var": 0.9 * model_state["var"] + 0.1 * var.astype(jnp.float32)}
      else:
        mean, var = model_state["mean"], model_state["var"]
      z = (z - mean.astype(z.dtype)) / jnp.sqrt(var.astype(z.dtype) + 1e-5) + params["b"]
    a = jnp.tanh(z)
    if dropout and train and rng is not None:
      keep = jax.random.bernoulli(rng, 0.75, a.shape)
      a = jnp.where(keep, a / 0.75, 0.0).astype(a.dtype)
    return pack(structure, a, a.mean(-1)), model_state

  return apply


def build(case, seed=0):
  rng = np.random.RandomState(seed)
  stages, params, states = [], [], []
  for k in range(K):
    out = NUM_CLASSES if k == K - 1 else WIDTH
    params.append({"w": jnp.asarray(rng.randn(WIDTH, out) / np.sqrt(WIDTH), jnp.float32),
                   "b": jnp.asarray(rng.randn(out) * 0.1, jnp.float32)})
    bn = case["state"] == "batchnorm" and k < K - 1
    states.append({"mean": jnp.zeros(out), "var": jnp.ones(out)} if bn else {})
    stage = fdg_jax.Stage(apply=make_stage(k, case["message"], bn, case["dropout"]))
    if case["dtype"] != "float32":
      stage = precision.mixed_precision(stage, precision.DTYPES[case["dtype"]])
    stages.append(stage)
  loss = loss_fn if case["dtype"] == "float32" else precision.float32_loss(loss_fn)
  return stages, params, states, loss


def base_optimizer(name):
  if name == "sgd_momentum":
    return make_optimizer("sgd", 0.05, momentum=0.9, weight_decay=5e-3)
  # NAdam with PipeNAG's momentum warm-up takes small first steps: at 1e-2, a stage with few
  # updates in 9 ticks moves less than the non-vacuity check's 2x the bfloat16 tolerance.
  lr = {"adam": 1e-2, "muon": 0.02, "basis_rotation": 1e-2, "nadam_warmup": 3e-2}[name]
  # Basis rotation rotates the square hidden matrices only: the head's [6, 4] statistic
  # G G^T is rank-deficient, and any basis of its null space is an eigenbasis, so two
  # implementations may pick different ones and then rightly differ (Adam's second moments
  # live in that basis); the head stays plain Adam.
  square = lambda p: jax.tree.map(lambda a: a.ndim == 2 and a.shape[0] == a.shape[1], p)
  extra = ({"frequency": 3, "eps": 1e-3, "mask": square} if name == "basis_rotation"
           else {})
  return make_optimizer(name, lr, weight_decay=0.0, **extra)


def optimizers_for(case, delays):
  """Stage k's optimizer: the case's, with its staleness remedy for delay d_k."""
  base = base_optimizer(case["optimizer"])
  hparams = {"error_feedback": {"strength": 0.5},
             "discrepancy_correction": {"discrepancy_decay": 0.8}}.get(case["remedy"], {})
  return [staleness.stage_optimizer(case["remedy"], base, delay=d, learning_rate=None,
                                    momentum=0.9, weight_decay=0.0, hparams=hparams)
          for d in delays]


def schedule_for(case, stages, loss):
  sync = case["algorithm"] in SYNC
  kwargs = {"microbatches": MICROBATCHES[case["algorithm"]]} if sync else {
      "backward": case["backward"]}
  if case["algorithm"] == "fdg":
    kwargs["beta"] = case["beta"]
  engine = case["engine"]
  if engine.startswith("fused"):
    kwargs.update(engine="fused", **({} if sync else {"gate": engine.split("/")[1]}))
  else:
    kwargs.update(engine=engine, devices=jax.devices()[:K])
  delays = [0] * K if sync else [fdg_jax.delay(case["algorithm"], k, K) for k in range(K)]
  return fdg_jax.create(case["algorithm"], stages, loss, optimizers_for(case, delays),
                        **kwargs)


def run_case(sched, params, states, data, call):
  state = sched.init(params, states)
  trace = []
  if call == "step":
    for b in data:
      state, m = sched.step(state, b)
      trace.append([None if u is None else int(u) for u in m["updated"]])
  else:
    xs = np.stack([np.asarray(x) for x, _ in data])
    ys = np.stack([np.asarray(y) for _, y in data])
    for lo, hi in ((0, 4), (4, len(data))):
      state, m = sched.run(state, (xs[lo:hi], ys[lo:hi]))
      trace += [[None if u < 0 else int(u) for u in row] for row in np.asarray(m["updated"])]
  keys = jax.device_get([sched.stage_state(state, k)["rng"] for k in range(K)])
  return jax.device_get((sched.params(state), sched.model_states(state))), trace, keys


def test_the_selection_covers_every_pair_and_every_engine_path():
  """The covering property itself, checked by brute force against the selection."""
  names = list(FACTORS)
  every = [dict(zip(names, v)) for v in itertools.product(*FACTORS.values())]
  seen_pairs = {((a, c[a]), (b, c[b])) for c in CASES for a, b in itertools.combinations(names, 2)}
  for a, b in itertools.combinations(names, 2):
    for va, vb in itertools.product(FACTORS[a], FACTORS[b]):
      possible = any(valid(c) and c[a] == va and c[b] == vb for c in every)
      assert (((a, va), (b, vb)) in seen_pairs) == possible, (a, va, b, vb)
  triples = {tuple(c[f] for f in FULL) for c in CASES}
  for combo in itertools.product(*(FACTORS[f] for f in FULL)):
    full = dict(zip(FULL, combo), beta=1.0)
    assert (combo in triples) == valid(full), combo
  assert len(CASES) <= 36  # keeps the matrix a few minutes on 2 cores


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_combination_matches_the_simulator(case):
  stages, params, states, loss = build(case)
  sched = schedule_for(case, stages, loss)
  # Micro-batches of 4 (not 2) for the synchronous pipelines: BatchNorm over two samples makes
  # the gradient so ill-conditioned that float32 rounding moved the result by 2.5e-5 with SGD
  # and 5e-3 with rotated Adam (measured).
  data = batches(TICKS, batch_size=16 if case["algorithm"] in SYNC else 8)
  (got_params, got_states), trace, keys = run_case(sched, params, states, data, case["call"])
  if case["algorithm"] in SYNC:  # BP on the same batches, micro-batched
    ref_params, ref_states, ref_trace = simulate_microbatched(
        [s.apply for s in stages], params, states, optimizers_for(case, sched.delays), data,
        MICROBATCHES[case["algorithm"]], loss_fn=loss, keys=keys)
  else:
    ref_params, ref_states, ref_trace = simulate(
        case["algorithm"], [s.apply for s in stages], params, states,
        optimizers_for(case, sched.delays), data, beta=case["beta"],
        backward=case["backward"], loss_fn=loss, keys=keys)
  assert trace == ref_trace
  atol = 1e-5 if case["dtype"] == "float32" else 1.5e-2
  if case["optimizer"] == "basis_rotation":  # eigenvectors from float32 eigh and QR
    atol = max(atol, 1e-4)
  assert_trees_close(got_params, ref_params, atol=atol)
  assert_trees_close(got_states, ref_states, atol=atol)
  for k in range(K):  # every stage trained, so the equality above is not vacuous
    assert not np.allclose(np.asarray(got_params[k]["w"]), np.asarray(params[k]["w"]),
                           atol=2 * atol)


@pytest.mark.parametrize("devices", [1, K])
@pytest.mark.parametrize("algorithm", ["ddg", "fdg"])
def test_dict_messages_under_recompute(algorithm, devices):
  """The regression: dict activations under `recompute` failed at the first delayed
  backward (the stash kept the message's leaves, the backward took them for the message)."""
  case = dict(algorithm=algorithm, backward="recompute", message="dict", state="none",
              dropout=False, dtype="float32")
  stages, params, states, loss = build(case)
  sched = fdg_jax.create(algorithm, stages, loss, base_optimizer("sgd_momentum"),
                         backward="recompute",
                         devices=None if devices == 1 else jax.devices()[:K])
  data = batches(TICKS)
  (got, _), trace, _ = run_case(sched, params, states, data, "step")
  ref, _, ref_trace = simulate(algorithm, [s.apply for s in stages], params, states,
                               base_optimizer("sgd_momentum"), data, backward="recompute",
                               loss_fn=loss)
  assert trace == ref_trace
  assert_trees_close(got, ref, atol=1e-5)


def test_an_integer_leaf_in_a_message_is_refused_in_one_line():
  def first(params, model_state, x, *, train=True, rng=None):
    h = jnp.tanh(x @ params["w"])
    return {"h": h, "n": jnp.zeros(h.shape[0], jnp.int32)}, model_state

  def head(params, model_state, msg, *, train=True, rng=None):
    return msg["h"] @ params["w"], model_state

  rng = np.random.RandomState(0)
  params = [{"w": jnp.asarray(rng.randn(WIDTH, WIDTH), jnp.float32)},
            {"w": jnp.asarray(rng.randn(WIDTH, NUM_CLASSES), jnp.float32)}]
  sched = fdg_jax.fdg([fdg_jax.Stage(apply=first), fdg_jax.Stage(apply=head)], loss_fn,
                      optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"stage 0 sends a int32 leaf \(\['n'\]\) to stage 1"):
    sched.init(params, [{}, {}], example_batch=batches(1)[0])
