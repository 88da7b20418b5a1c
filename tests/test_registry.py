"""The schedule registry: a schedule declared once (`fdg_jax.plans.register`) runs by name
through `create`, the trainer and its config checks, like a built-in."""

import sys
import pathlib

import jax
import numpy as np
import optax
import pytest

import fdg_jax
from fdg_jax import config_check, engines, plans, trainer
from test_schedules import run_schedule, stages_of
from test_trainer import _params_equal, tiny_config
from toy_models import batches, loss_fn, make_model

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import user_plans  # noqa: E402,F401  registers fdg_copy


def test_builtins_are_declared_once_with_what_they_accept():
  assert plans.names() == ("bp", "ddg", "fdg", "gpipe", "1f1b") + tuple(
      n for n in plans.names() if n not in ("bp", "ddg", "fdg", "gpipe", "1f1b"))
  assert fdg_jax.ALGORITHMS == ("bp", "ddg", "fdg", "pipedream")
  assert plans.spec("fdg").options == ("beta", "shrink_at", "backward")
  # What runs where, the engines say (no engine list in a plan's spec).
  assert engines.plan_refusal("spmd", plans.plan("fdg", 4)) is None
  assert "chains its stages" in engines.plan_refusal("spmd", plans.plan("ddg", 4))
  assert not plans.spec("bp").delayed and plans.spec("ddg").delayed
  assert plans.spec("gpipe").microbatched and not plans.spec("gpipe").replicas
  with pytest.raises(ValueError, match="no schedule named 'fgd'; known: bp, ddg, fdg"):
    plans.spec("fgd")


def test_a_registered_plan_runs_by_name_exactly_as_the_plan_it_copies():
  K = 3
  applies, params, states = make_model("mlp", K)
  data = batches(11)
  ref, _, ref_trace, _ = run_schedule(
      fdg_jax.create("fdg", stages_of(applies), loss_fn, optax.sgd(0.05, momentum=0.9),
                     beta=0.5), params, states, data)
  got, _, trace, _ = run_schedule(
      fdg_jax.create("fdg_copy", stages_of(applies), loss_fn, optax.sgd(0.05, momentum=0.9),
                     beta=0.5), params, states, data, chunks=(4, 7))
  assert trace == ref_trace
  assert _params_equal(got, ref)
  assert fdg_jax.delay("fdg_copy", 0, K) == 2 * (K - 1)
  with pytest.raises(ValueError, match="shrink_at is an option of fdg "):
    fdg_jax.create("fdg_copy", stages_of(applies), loss_fn, optax.sgd(0.1), shrink_at="update")


def test_registration_refuses_what_cannot_work():
  with pytest.raises(ValueError, match="registered already"):
    plans.register("fdg", plans.fdg)
  with pytest.raises(ValueError, match="make_plan must be a function"):
    plans.register("neither_kind", 42)
  with pytest.raises(ValueError, match="unknown option"):
    plans.register("odd_options", plans.fdg, options=("momentum",))
  with pytest.raises(ValueError, match="plain word"):
    plans.register("two words", plans.fdg)
  assert "neither_kind" not in plans.names() and "odd_options" not in plans.names()


def test_the_trainer_runs_a_schedule_from_the_module_the_config_names(tmp_path):
  fields = dict(num_stages=3, num_epochs=1, beta=0.5)
  ref = trainer.train_and_evaluate(tiny_config(algorithm="fdg", **fields), str(tmp_path / "a"))
  got = trainer.train_and_evaluate(
      tiny_config(algorithm="fdg_copy", plan_module="user_plans", **fields), str(tmp_path / "b"))
  assert got["steps"] == ref["steps"]
  assert _params_equal(got["params"], ref["params"])


def test_config_checks_read_the_registry():
  with pytest.raises(config_check.ConfigError, match=r"^beta=0.5: gradient shrinking is an "
                     r"option of fdg and fdg_copy; use --config.beta=1.0 with ddg$"):
    config_check.validate_fields(tiny_config(algorithm="ddg", beta=0.5))
  # Which engine runs which plan, the engine says: a copy of FDG's plan runs on spmd, DDG's
  # does not.
  with pytest.raises(config_check.ConfigError, match=r"^--config.engine='spmd' runs plans "
                     r"whose calls read only the previous tick's messages \(FDG\); ddg chains"):
    config_check.validate_fields(tiny_config(algorithm="ddg", engine="spmd"))
  config_check.validate_fields(tiny_config(algorithm="fdg_copy", engine="spmd",
                                           plan_module="user_plans"))
  with pytest.raises(config_check.ConfigError, match="plan_module 'no_such_module' could not"):
    config_check.validate_fields(tiny_config(algorithm="fdg", plan_module="no_such_module"))
  with pytest.raises(config_check.ConfigError, match="unknown algorithm 'mine'"):
    config_check.validate_fields(tiny_config(algorithm="mine"))


def test_an_engine_from_outside_the_library_is_one_module_and_one_line():
  import user_engine  # noqa: F401  registers eager_test
  assert "eager_test" in engines.names()
  K = 3
  applies, params, states = make_model("mlp", K)
  data = batches(7)
  out = {}
  for engine in ("fused", "eager_test"):
    sched = fdg_jax.create("fdg", stages_of(applies), loss_fn, optax.sgd(0.05, momentum=0.9),
                           beta=0.5, engine=engine)
    assert sched.engine == engine
    out[engine] = run_schedule(sched, params, states, data)
  assert out["eager_test"][2] == out["fused"][2]  # the same ticks
  for a, b in zip(jax.tree.leaves(out["fused"][0]), jax.tree.leaves(out["eager_test"][0])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  # What it runs, it says: the trainer's check asks the engine, and so does `create`.
  config_check.validate_fields(tiny_config(algorithm="ddg", engine="eager_test"))
  with pytest.raises(ValueError, match="runs every stage on one device"):
    fdg_jax.create("fdg", stages_of(applies), loss_fn, optax.sgd(0.05),
                   devices=jax.devices()[:K], engine="eager_test")
