"""train_and_evaluate end to end, exact resume, configs, and the user-error behaviours."""

import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from fdg_jax import trainer
from fdg_jax.trainer import evaluation

ROOT = pathlib.Path(__file__).resolve().parents[1]
METRIC_KEYS = {"epoch", "step", "train_loss", "train_accuracy", "test_loss", "test_accuracy",
               "learning_rate", "samples_per_second", "wall_time", "test_loss_se"}


def load_config(name="default.py", arg=None):
  spec = importlib.util.spec_from_file_location(f"cfg_{name}", ROOT / "configs" / name)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def tiny_config(**overrides):
  c = load_config()
  c.model_kwargs.widths = (32, 32, 32)
  c.num_stages = 2
  c.batch_size = 64
  c.num_epochs = 2
  c.checkpoint_every_steps = 7
  c.log_every_steps = 5
  c.progress_bar = False
  c.learning_rate = 0.1
  c.warmup_epochs = 0.0
  c.lr_schedule = "constant"
  for k, v in overrides.items():
    setattr(c, k, v)
  return c


def read_metrics(workdir, kind=None):
  """The rows of metrics.jsonl: evaluations (and telemetry), or the training rows with
  kind="train"."""
  with open(os.path.join(workdir, trainer.METRICS_FILE)) as f:
    rows = [json.loads(l) for l in f]
  return [r for r in rows if r.get("kind") == kind]


@pytest.mark.parametrize("algorithm", ["bp", "ddg", "fdg"])
def test_train_and_evaluate_on_digits(algorithm, tmp_path):
  c = tiny_config(algorithm=algorithm)
  result = trainer.train_and_evaluate(c, str(tmp_path))
  records = read_metrics(tmp_path)
  steps_per_epoch = 1437 // 64
  assert [r["epoch"] for r in records] == [1, 2]
  assert [r["step"] for r in records] == [steps_per_epoch, 2 * steps_per_epoch]
  for r in records:
    assert set(r) == METRIC_KEYS
    assert all(np.isfinite(v) for v in r.values())
  # Two epochs on real digits: far above the 10% of chance, and training reduces the loss.
  assert records[-1]["test_accuracy"] > 0.5
  assert records[-1]["train_loss"] < records[0]["train_loss"]
  assert result["test_accuracy"] == records[-1]["test_accuracy"]
  assert json.load(open(tmp_path / "config.json"))["algorithm"] == algorithm
  assert any(p.name.startswith("events") for p in (tmp_path / "tensorboard").iterdir())
  assert (tmp_path / "checkpoints").is_dir()


def test_eval_every_steps_adds_evaluations_between_epochs(tmp_path):
  c = tiny_config(algorithm="fdg", num_epochs=2, eval_every_steps=10)
  trainer.train_and_evaluate(c, str(tmp_path))
  steps_per_epoch = 1437 // 64
  assert [r["step"] for r in read_metrics(tmp_path)] == [10, 20, 22, 30, 40, 44]
  assert steps_per_epoch == 22


class _FixedLogits:
  """A schedule whose evaluation returns given logits, row by row of the batch fed."""

  num_stages, placement = 1, None

  def __init__(self, logits):
    self.logits, self.at = logits, 0

  def evaluate(self, state, x):
    out = self.logits[self.at:self.at + len(x)]
    self.at += len(x)
    return out


def test_the_loss_standard_error_is_over_examples(monkeypatch):
  # Sequences of 5 tokens: each example's loss is the mean over its tokens; the standard
  # error is that of the mean of the real (unmasked) examples' losses.
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(7, 5, 11)).astype(np.float32)
  labels = rng.integers(0, 11, size=(7, 5)).astype(np.int32)
  mask = np.array([1, 1, 1, 1, 1, 1, 0], np.float32)  # the padded last row
  monkeypatch.setattr(evaluation, "_fed_rows", lambda schedule, n: slice(0, n))
  batches = [{"image": np.zeros((4, 1)), "label": labels[:4], "mask": mask[:4]},
             {"image": np.zeros((3, 1)), "label": labels[4:], "mask": mask[4:]}]
  out = trainer.evaluate(_FixedLogits(logits), None, iter(batches))
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, labels[..., None], -1)[..., 0].astype(np.float64)
  per_example = nll.mean(-1)[:6]
  assert out["test_loss"] == pytest.approx(per_example.mean(), rel=1e-6)
  assert out["test_loss_se"] == pytest.approx(per_example.std(ddof=0) / np.sqrt(5), rel=1e-6)


def test_train_on_tfds_dataset_under_mock_data(tmp_path):
  from test_data_tfds import mock_tfds
  c = tiny_config(dataset="cifar10", model="cnn", batch_size=16, num_epochs=1,
                  eval_batch_size=16)
  c.model_kwargs = {"channels": (4,), "hidden": 8}
  with mock_tfds(48):
    trainer.train_and_evaluate(c, str(tmp_path))
  records = read_metrics(tmp_path)
  assert len(records) == 1 and records[0]["step"] == 3
  assert 0.0 <= records[0]["test_accuracy"] <= 1.0 and np.isfinite(records[0]["test_loss"])


def _params_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb))


# During the pipeline fill, and mid-run; the SPMD engine's state is checkpointed as it is.
@pytest.mark.parametrize("stop_at,engine", [(2, "auto"), (30, "auto"), (30, "spmd")])
def test_resume_is_bitwise_exact(stop_at, engine, tmp_path):
  c = tiny_config(algorithm="fdg", num_stages=3, num_epochs=2, engine=engine)
  c.model_kwargs.widths = (16, 16, 16)
  full = trainer.train_and_evaluate(c, str(tmp_path / "full"))
  c.max_steps = stop_at
  part = trainer.train_and_evaluate(c, str(tmp_path / "resumed"))
  assert part["steps"] == stop_at
  c.max_steps = -1
  resumed = trainer.train_and_evaluate(c, str(tmp_path / "resumed"))
  assert resumed["steps"] == full["steps"]
  assert _params_equal(resumed["params"], full["params"])
  assert not _params_equal(part["params"], full["params"])
  a, b = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "resumed")
  # The interrupted run evaluated where it stopped; the rest matches the uninterrupted run.
  stopped = [r for r in b if r["step"] == stop_at]
  assert len(stopped) == 1 and stopped[0]["epoch"] == pytest.approx(stop_at / 22)
  b = [r for r in b if r["step"] != stop_at]
  assert [r["test_accuracy"] for r in a] == [r["test_accuracy"] for r in b]
  assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]


def test_engines_and_ticks_per_call_train_alike(tmp_path):
  """One tick per call on a device per stage, many per call in one fused program (its
  stages gated by conditionals, the default for this small model on CPU, or by masks), or
  in one program over the stages' devices: same run."""
  runs = {}
  for engine, ticks, gate in (("per_stage", 1, "auto"), ("fused", 8, "auto"),
                              ("fused", 8, "mask"), ("fused", 1, "auto"), ("spmd", 8, "auto")):
    c = tiny_config(algorithm="fdg", num_stages=3, num_epochs=1, engine=engine,
                    ticks_per_call=ticks, beta=0.5, gate=gate)
    c.model_kwargs.widths = (16, 16, 16)
    out = str(tmp_path / f"{engine}_{ticks}_{gate}")
    runs[engine, ticks, gate] = (trainer.train_and_evaluate(c, out), read_metrics(out))
  (ref, ref_records) = runs["per_stage", 1, "auto"]
  for key, (result, records) in runs.items():
    for a, b in zip(jax.tree.leaves(result["params"]), jax.tree.leaves(ref["params"])):
      np.testing.assert_allclose(a, b, atol=1e-5, err_msg=str(key))
    assert [r["step"] for r in records] == [r["step"] for r in ref_records]
    np.testing.assert_allclose([r["train_loss"] for r in records],
                               [r["train_loss"] for r in ref_records], rtol=1e-5)


@pytest.mark.parametrize("name,arg", [
    ("default.py", None),
    ("cifar10.py", None),
    ("cifar10.py", "model=resnet56,k=4,algorithm=fdg,beta=0.5"),
    ("cifar10.py", "model=resnet110,k=4,algorithm=ddg"),
    ("cifar10.py", "model=wrn28_10,k=2,algorithm=fdg"),
    ("cifar10.py", "model=resnet20,k=2,algorithm=bp,runlocal=1"),
    ("lm.py", None),
    ("custom_data.py", None),
    ("cifar10.py", "model=resnet18,k=3,split=balanced"),
    ("cifar100.py", "model=resnet110,k=2,algorithm=fdg"),
    ("cifar100.py", "model=resnet18,k=2,algorithm=ddg"),
])
def test_config_files_load_and_validate(name, arg):
  c = load_config(name, arg)
  trainer.validate(c)


def test_every_config_file_is_covered():
  files = {p.name for p in (ROOT / "configs").glob("*.py")}
  assert files == {"default.py", "cifar10.py", "cifar100.py", "lm.py", "custom_data.py"}


def test_paper_betas_are_used_by_default():
  assert load_config("cifar10.py", "model=resnet56,k=4").beta == 0.5
  assert load_config("cifar10.py", "model=wrn28_10,k=2").beta == 0.7
  assert load_config("cifar10.py", "model=resnet56,k=4,algorithm=bp").beta == 1.0
  assert load_config("cifar10.py", "model=resnet56,k=4").split == "paper"


@pytest.mark.parametrize("field,value,needle", [
    ("algorithm", "zero_bubble", "algorithm"),
    ("model", "resnet9000", "unknown model"),
    ("dataset", "imagenet22k", "unknown dataset"),
    ("num_stages", 9, "exceeds"),
    ("beta", 1.5, "beta"),
    ("beta", 0.0, "beta"),
    ("split", "3,2", "split"),
    ("lr_schedule", "triangle", "lr_schedule"),
    ("split", "triangle", "split must be one of"),
    ("log_every_steps", 0, "log_every_steps"),
    ("max_steps", 0, "max_steps"),
    ("lr_gamma", 0.0, "lr_gamma"),
    ("engine", "pipelined", "engine"),
    ("gate", "sometimes", "gate"),
    ("ticks_per_call", 0, "ticks_per_call"),
    ("staleness", "magic", "unknown staleness"),
    ("telemetry_every_steps", -1, "telemetry_every_steps"),
    ("nesterov_gamma", 1.0, "nesterov_gamma"),
    ("dc_decay", 1.0, "dc_decay"),
    ("staleness_lr_power", -0.5, "staleness_lr_power"),
    ("discrepancy_decay", 1.0, "discrepancy_decay"),
    ("staleness", "dc+weight_prediction", "combine at most one"),
    ("dtype", "float16", "dtype"),
])
def test_bad_config_is_one_clear_error(field, value, needle):
  c = tiny_config(**{field: value})
  with pytest.raises(trainer.ConfigError, match=needle) as e:
    trainer.validate(c)
  assert "\n" not in str(e.value)


def test_spmd_engine_takes_fdg_only():
  for overrides, needle in (({"algorithm": "ddg"}, "read only the previous tick's messages "
                             r"\(FDG\); ddg chains its stages"),
                            ({"algorithm": "fdg", "telemetry_every_steps": 5}, "telemetry")):
    with pytest.raises(trainer.ConfigError, match=needle) as e:
      trainer.validate(tiny_config(engine="spmd", **overrides))
    assert "\n" not in str(e.value)


def test_batch_not_divisible_by_replicas():
  c = tiny_config(num_replicas=3, batch_size=64)
  with pytest.raises(trainer.ConfigError, match="multiple of num_replicas"):
    trainer.validate(c)


def _train_cli(workdir, *overrides, timeout=300, **popen):
  cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/default.py"),
         "--workdir", str(workdir), "--config.progress_bar=False", *overrides]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)
  return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, cwd=str(ROOT), **popen)


def test_cli_bad_config_exits_2_with_one_line(tmp_path):
  p = _train_cli(tmp_path / "run", "--config.num_stages=99")
  out, err = p.communicate(timeout=300)
  assert p.returncode == 2
  lines = [l for l in err.splitlines() if l.strip()]
  assert len(lines) == 1 and "num_stages=99" in lines[0] and "Traceback" not in err
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_nan_stops_with_one_line_and_keeps_last_good_checkpoint(tmp_path):
  # A learning rate this large diverges within a few dozen steps on digits.
  p = _train_cli(tmp_path, "--config.learning_rate=1e6", "--config.momentum=0.9",
                 "--config.lr_schedule=constant", "--config.warmup_epochs=0",
                 "--config.checkpoint_every_steps=1", "--config.log_every_steps=5",
                 "--config.num_stages=4", "--config.weight_decay=0")
  out, err = p.communicate(timeout=300)
  assert p.returncode == 1, err
  lines = [l for l in err.splitlines() if l.strip() and not l.startswith("step ")]
  assert len(lines) == 1 and "non-finite loss" in lines[0] and "Traceback" not in err
  assert "last good checkpoint" in lines[0] or "no checkpoint" in lines[0]
  ckpts = [int(d.name) for d in (tmp_path / "checkpoints").iterdir() if d.name.isdigit()]
  if "last good checkpoint" in lines[0]:
    step = int(lines[0].split("last good checkpoint: step ")[1].split()[0])
    assert max(ckpts) == step
    # The kept checkpoint is finite.
    c = trainer.Checkpointer(str(tmp_path / "checkpoints"))
    meta = c.manager.restore(step)
    c.close()
    # Parameters, optimizer states, stashes and messages in flight: all finite.
    leaves = [np.asarray(a) for a in jax.tree.leaves(meta["state"])
              if np.issubdtype(np.asarray(a).dtype, np.floating)]
    assert leaves
    assert all(np.all(np.isfinite(a)) for a in leaves)


def test_sigterm_saves_a_checkpoint_and_the_run_resumes(tmp_path):
  p = _train_cli(tmp_path, "--config.num_epochs=200", "--config.checkpoint_every_steps=100000")
  metrics = tmp_path / trainer.METRICS_FILE
  deadline = time.time() + 240
  while not (metrics.exists() and metrics.stat().st_size > 0):  # training is under way
    assert p.poll() is None and time.time() < deadline, p.communicate()[1]
    time.sleep(0.5)
  p.send_signal(signal.SIGTERM)
  out, err = p.communicate(timeout=120)
  assert p.returncode == 128 + signal.SIGTERM, err
  assert "checkpoint saved" in err
  step = int(err.split("stopped at step ")[1].split(",")[0])
  ckpts = [int(d.name) for d in (tmp_path / "checkpoints").iterdir() if d.name.isdigit()]
  assert step in ckpts and step > 0
  # Resume to just past the interruption and stop.
  p = _train_cli(tmp_path, "--config.num_epochs=200", f"--config.max_steps={step + 3}")
  out, err = p.communicate(timeout=300)
  assert p.returncode == 0, err
  assert f"resumed from step {step}" in out
  assert f"{step + 3} steps" in out


def test_plot_draws_runs(tmp_path):
  from fdg_jax import plot
  runs = []
  for alg, acc in (("bp", 0.9), ("fdg", 0.8)):
    d = tmp_path / alg
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"algorithm": alg, "num_stages": 2, "beta": 0.5}))
    (d / trainer.METRICS_FILE).write_text("".join(
        json.dumps({"epoch": e, "step": 10 * e, "wall_time": 1.5 * e, "test_accuracy": acc * e / 3,
                    "test_loss": 1.0 / e}) + "\n" for e in (1, 2, 3)))
    runs.append(str(d))
  label, records = plot.load_run(runs[1])
  assert label == "FDG K=2 β=0.5 seed=0" and len(records) == 3
  out = tmp_path / "curves.png"
  assert plot.main([*runs, "-o", str(out)]) == 0
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
  assert plot.main([str(tmp_path / "missing"), "-o", str(out)]) == 1


def _dp_config(**overrides):
  c = tiny_config(num_stages=2, num_epochs=1, batch_size=64, eval_batch_size=128,
                  checkpoint_every_steps=1000, **overrides)
  c.model_kwargs.widths = (16, 16)
  return c


def test_data_parallel_replicas_match_one_replica(tmp_path):
  """DP x FDG in the trainer: R=2 replicas == one pipeline fed the same global batches."""
  one = trainer.train_and_evaluate(_dp_config(num_replicas=1), str(tmp_path / "r1"))
  two = trainer.train_and_evaluate(_dp_config(num_replicas=2), str(tmp_path / "r2"))
  for a, b in zip(jax.tree.leaves(one["params"]), jax.tree.leaves(two["params"])):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
  assert abs(one["test_loss"] - two["test_loss"]) < 1e-5


def test_spmd_engine_over_replicas_trains_like_one_replica_and_resumes_exactly(tmp_path):
  """The trainer's SPMD engine over an R x K = 2 x 2 mesh (the MLP has no batch-coupled
  layers): the run of one replica on the same global batches, and a bitwise resume."""
  one = trainer.train_and_evaluate(_dp_config(num_replicas=1, algorithm="fdg"),
                                   str(tmp_path / "r1"))
  c = _dp_config(num_replicas=2, algorithm="fdg", engine="spmd")
  c.checkpoint_every_steps = 4
  two = trainer.train_and_evaluate(c, str(tmp_path / "r2"))
  for a, b in zip(jax.tree.leaves(one["params"]), jax.tree.leaves(two["params"])):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
  assert abs(one["test_loss"] - two["test_loss"]) < 1e-5
  c.max_steps = 6
  trainer.train_and_evaluate(c, str(tmp_path / "resumed"))
  c.max_steps = -1
  resumed = trainer.train_and_evaluate(c, str(tmp_path / "resumed"))
  assert resumed["steps"] == two["steps"] > 6
  assert _params_equal(resumed["params"], two["params"])


def _launch_train(workdir, cpu_devices: int, num_replicas: int, *flags):
  """train.py on `_dp_config`'s settings as 2 processes (`python -m fdg_jax.launch`)."""
  cmd = [sys.executable, "-m", "fdg_jax.launch", "--num-processes", "2", "--cpu-devices",
         str(cpu_devices), "--timeout", "240", "--", sys.executable, str(ROOT / "train.py"),
         "--config", str(ROOT / "configs/default.py"), "--workdir", str(workdir),
         "--config.progress_bar=False", f"--config.num_replicas={num_replicas}",
         "--config.num_stages=2", "--config.num_epochs=1", "--config.batch_size=64",
         "--config.eval_batch_size=128", "--config.learning_rate=0.1",
         "--config.warmup_epochs=0", "--config.lr_schedule=constant",
         "--config.model_kwargs.widths=(16,16)", *flags]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(ROOT), env=env)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  return p


def _ends_alike(workdir, single):
  multi = read_metrics(workdir)
  assert multi[-1]["step"] == single["steps"]
  assert abs(multi[-1]["test_loss"] - single["test_loss"]) < 1e-5
  assert multi[-1]["test_accuracy"] == pytest.approx(single["test_accuracy"], abs=1e-9)
  return multi


def test_two_processes_train_like_one(tmp_path):
  """train.py under `python -m fdg_jax.launch` (2 processes x 2 CPU devices, R=2, K=2)."""
  single = trainer.train_and_evaluate(_dp_config(num_replicas=2), str(tmp_path / "single"))
  _launch_train(tmp_path / "multi", 2, 2, "--config.checkpoint_every_steps=1000")
  assert len(_ends_alike(tmp_path / "multi", single)) == 1


@pytest.mark.parametrize("engine", ["auto", "spmd"])
def test_pipeline_across_processes_trains_and_resumes_like_one_process(tmp_path, engine):
  """train.py under `python -m fdg_jax.launch --num-processes 2 --cpu-devices 1`, K=2, R=1:
  stage 0 in one process, stage 1 in the other (every message crosses the processes, the
  checkpoints hold arrays each process owns alone). Stopped at step 20 (checkpointed)
  and resumed, it ends where the run of the same config on 2 devices of one process ends.
  `auto` is the per-stage engine there (a collective per message); `spmd` runs the ticks
  as one program over both processes' devices.
  """
  c = _dp_config(num_replicas=1, algorithm="fdg", engine=engine)
  c.checkpoint_every_steps = 10
  single = trainer.train_and_evaluate(c, str(tmp_path / "single"))
  every = ["--config.checkpoint_every_steps=10", f"--config.engine={engine}"]
  _launch_train(tmp_path / "multi", 1, 1, *every, "--config.max_steps=20")
  p = _launch_train(tmp_path / "multi", 1, 1, *every)
  assert "[0] resumed from step 20" in p.stdout and "[1] resumed from step 20" in p.stdout
  _ends_alike(tmp_path / "multi", single)


def _truncate_largest_file(checkpoint_dir):
  largest = max((p for p in checkpoint_dir.rglob("*") if p.is_file()),
                key=lambda p: p.stat().st_size)
  with open(largest, "r+b") as f:
    f.truncate(largest.stat().st_size // 2)


def test_corrupt_checkpoint_falls_back_to_the_one_before(tmp_path, capfd):
  c = tiny_config(algorithm="fdg", num_stages=3, num_epochs=2)
  c.model_kwargs.widths = (16, 16, 16)
  full = trainer.train_and_evaluate(c, str(tmp_path / "full"))
  c.max_steps = 30  # checkpoints at steps 28 and 30 are kept
  trainer.train_and_evaluate(c, str(tmp_path / "run"))
  _truncate_largest_file(tmp_path / "run" / "checkpoints" / "30")
  c.max_steps = -1
  capfd.readouterr()
  resumed = trainer.train_and_evaluate(c, str(tmp_path / "run"))
  out = capfd.readouterr().out
  skipped = [l for l in out.splitlines() if "does not restore" in l]
  assert len(skipped) == 1 and "checkpoint step 30" in skipped[0]
  assert "resumed from step 28" in out
  assert _params_equal(resumed["params"], full["params"])
  a, b = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "run")
  b = [r for r in b if r["step"] != 30]
  assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]
  assert len(list((tmp_path / "run" / "corrupt_checkpoints").iterdir())) == 1


def test_no_checkpoint_restores_one_line_exit_1_nothing_deleted(tmp_path):
  workdir = tmp_path / "run"
  p = _train_cli(workdir, "--config.max_steps=10", "--config.checkpoint_every_steps=5")
  assert p.wait(timeout=300) == 0
  steps = sorted(d.name for d in (workdir / "checkpoints").iterdir() if d.name.isdigit())
  assert steps == ["10", "5"]
  for step in steps:
    _truncate_largest_file(workdir / "checkpoints" / step)
  before = sorted((str(f), f.stat().st_size) for f in workdir.rglob("*") if f.is_file())
  p = _train_cli(workdir, "--config.max_steps=20", "--config.checkpoint_every_steps=5")
  out, err = p.communicate(timeout=300)
  assert p.returncode == 1
  lines = [l for l in err.splitlines() if l.strip()]
  assert len(lines) == 1 and "no checkpoint" in lines[0] and "Traceback" not in err
  after = {(str(f), f.stat().st_size) for f in workdir.rglob("*") if f.is_file()}
  assert {b for b in before if "tensorboard" not in b[0]} <= after  # nothing lost


def test_resume_with_changed_fields_says_so_and_records_it(tmp_path, capfd):
  c = tiny_config(num_epochs=1, max_steps=5)
  trainer.train_and_evaluate(c, str(tmp_path))
  c.max_steps, c.learning_rate = 10, 0.05
  capfd.readouterr()
  trainer.train_and_evaluate(c, str(tmp_path))
  lines = [l for l in capfd.readouterr().out.splitlines() if "changed config" in l]
  assert len(lines) == 1
  assert "learning_rate 0.1 -> 0.05" in lines[0] and "max_steps 5 -> 10" in lines[0]
  records = [json.loads(l) for l in open(tmp_path / trainer.CONFIG_CHANGES_FILE)]
  assert records[-1]["changes"] == {"learning_rate": [0.1, 0.05], "max_steps": [5, 10]}
  assert json.load(open(tmp_path / "config.json"))["learning_rate"] == 0.1  # as started


def test_setup_builds_the_model_once_and_describes_the_run(tmp_path, monkeypatch):
  from fdg_jax import models
  calls = []
  create = models.create

  def counting_create(*args, **kwargs):
    calls.append(args)
    return create(*args, **kwargs)

  monkeypatch.setattr(models, "create", counting_create)
  c = tiny_config(algorithm="fdg", num_stages=2, batch_size=64)
  run = trainer.setup(c, str(tmp_path))
  assert len(calls) == 1
  assert len(run.stages) == 2 and len(run.boundaries) == 1  # the K-1 cut points
  assert 0 < run.boundaries[0] < run.model.num_blocks
  assert run.steps_per_epoch == 1437 // 64
  assert run.total_steps == 2 * run.steps_per_epoch
  assert run.schedule.algorithm == "fdg" and run.example[0].shape == (64, 8, 8, 1)


def test_trainer_functions_stay_short():
  import ast
  files = sorted((ROOT / "fdg_jax" / "trainer").glob("*.py"))
  assert len(files) > 1  # the trainer's package
  lengths = {f"{path.stem}.{n.name}": n.end_lineno - n.lineno + 1 for path in files
             for n in ast.walk(ast.parse(path.read_text()))
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
  assert lengths and max(lengths.values()) <= 80, sorted(lengths.items(), key=lambda kv: -kv[1])[:3]


def test_spike_compensation_needs_heavy_ball_sgd():
  with pytest.raises(trainer.ConfigError, match="optimizer=sgd"):
    trainer.validate(tiny_config(staleness="spike_compensation", optimizer="adam"))
  with pytest.raises(trainer.ConfigError, match="momentum"):
    trainer.validate(tiny_config(staleness="spike_compensation", momentum=0.0))


@pytest.mark.parametrize("method", ["dc", "weight_prediction"])
def test_staleness_method_with_telemetry_resumes_bitwise(method, tmp_path):
  c = tiny_config(algorithm="fdg", num_stages=3, num_epochs=2, staleness=method,
                  telemetry_every_steps=10, momentum=0.9, learning_rate=0.02)
  c.model_kwargs.widths = (16, 16, 16)
  full = trainer.train_and_evaluate(c, str(tmp_path / "full"))
  c.max_steps = 25
  trainer.train_and_evaluate(c, str(tmp_path / "resumed"))
  c.max_steps = -1
  resumed = trainer.train_and_evaluate(c, str(tmp_path / "resumed"))
  assert _params_equal(resumed["params"], full["params"])
  rows = [r for r in read_metrics(tmp_path / "full") if "grad_cosine" in r]
  assert [r["step"] for r in rows] == [10, 20, 30, 40]
  for r in rows:
    assert len(r["weight_discrepancy"]) == 3 and r["weight_discrepancy"][2] is None
    assert r["grad_cosine"][2] is None
    assert all(0 < d < 1 for d in r["weight_discrepancy"][:2])
    assert all(-1 <= x <= 1 for x in r["grad_cosine"][:2])
  again = [r for r in read_metrics(tmp_path / "resumed") if "grad_cosine" in r]
  assert again == rows  # the telemetry of a resumed run is the uninterrupted run's
  # Turning telemetry off changes what a checkpoint holds: refused in one line.
  c.telemetry_every_steps = 0
  with pytest.raises(trainer.ConfigError, match="telemetry"):
    trainer.train_and_evaluate(c, str(tmp_path / "resumed"))
  from fdg_jax import plot
  out = tmp_path / "staleness.png"
  assert plot.main([str(tmp_path / "full"), "--telemetry", "-o", str(out)]) == 0
  assert out.stat().st_size > 10_000


def test_bfloat16_run_tracks_float32(tmp_path):
  runs = {}
  for dtype in ("float32", "bfloat16"):
    c = tiny_config(algorithm="fdg", num_stages=3, num_epochs=2, dtype=dtype)
    runs[dtype] = trainer.train_and_evaluate(c, str(tmp_path / dtype))
  assert all(a.dtype == np.float32 for a in jax.tree.leaves(runs["bfloat16"]["params"]))
  assert runs["float32"]["test_accuracy"] > 0.5  # chance: 0.1
  # Two epochs of a tiny net: still noisy (the parameter-level tolerance is in test_precision).
  assert runs["bfloat16"]["test_accuracy"] > 0.5
  assert abs(runs["bfloat16"]["test_accuracy"] - runs["float32"]["test_accuracy"]) < 0.1
  assert not _params_equal(runs["bfloat16"]["params"], runs["float32"]["params"])


def test_language_model_trains_on_the_offline_corpus(tmp_path):
  c = load_config("lm.py")
  c.model_kwargs = {"seq_len": 16, "dim": 32, "depth": 2, "num_heads": 2}
  c.seq_len, c.text_max_bytes = 16, 20_000
  c.num_stages, c.batch_size, c.eval_batch_size = 3, 16, 64
  c.num_epochs, c.max_steps, c.progress_bar = 1, 30, False
  c.learning_rate = 3e-3
  result = trainer.train_and_evaluate(c, str(tmp_path))
  (record,) = read_metrics(tmp_path)
  assert record["step"] == 30 and np.isfinite(record["test_loss"])
  assert record["test_perplexity"] == pytest.approx(np.exp(record["test_loss"]))
  assert record["test_loss"] < np.log(256)  # better than uniform over bytes
  assert result["params"][0]["block_0"]["tokens"]["embedding"].shape == (256, 32)


def test_vit_trains_on_digits(tmp_path):
  c = tiny_config(algorithm="fdg", num_stages=3, num_epochs=1, model="vit", optimizer="adam",
                  learning_rate=1e-3, momentum=0.0, max_steps=12)
  c.model_kwargs = {"input_shape": (8, 8, 1), "patch_size": 2, "dim": 16, "depth": 2,
                    "num_heads": 2}
  result = trainer.train_and_evaluate(c, str(tmp_path))
  assert result["steps"] == 12 and np.isfinite(result["test_loss"])


def test_data_workers_train_bitwise_alike(tmp_path):
  runs = [trainer.train_and_evaluate(
      tiny_config(algorithm="fdg", num_epochs=1, data_workers=w), str(tmp_path / f"w{w}"))
      for w in (0, 2)]
  assert _params_equal(runs[0]["params"], runs[1]["params"])


def test_telemetry_under_several_processes_is_refused_up_front(monkeypatch):
  from fdg_jax import config_check
  c = tiny_config(telemetry_every_steps=5)
  trainer.validate(c)  # one process: fine
  monkeypatch.setattr(config_check, "_process_count", lambda: 2)
  with pytest.raises(trainer.ConfigError, match="single-process runs only") as e:
    trainer.validate(c)
  assert "\n" not in str(e.value)
