"""Trains a network with BP, DDG or FDG.

    python train.py --config configs/default.py [--workdir runs/x] [--config.field=value ...]
    python train.py --config configs/cifar10.py:model=resnet56,k=4,algorithm=fdg,beta=0.5

All logic lives in `fdg_jax.trainer.train_and_evaluate`; this file parses flags and turns
user errors into one line on stderr and a non-zero exit code: 2 for a config that cannot
work, 1 for other user errors (a missing dataset, a divergence, a bad checkpoint), 3 for a
lost peer of a multi-process run, 4 for a run that stalled (`--config.stall_timeout_s`),
128 + N after signal N (checkpoint saved).
"""

import os
import re
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "Training config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default: a new one in ./runs).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  config = _CONFIG.value
  # orbax logs every checkpoint step, TFDS every probe of a data_dir: keep the console for
  # the progress bar and errors.
  logging.set_verbosity(logging.ERROR)
  # CPU devices must be requested before JAX starts its backends.
  from fdg_jax import runtime, trainer
  trainer.setup_cpu_devices(int(config.get("num_cpu_devices", 1) or 1))
  # Compiled programs persist across runs (resumes, repeats): see --config.compilation_cache.
  runtime.compile_cache.enable(config.get("compilation_cache", "auto"))
  # Joins a multi-process run (jax.distributed) when launched as one.
  runtime.initialize(peer_timeout_s=int(config.get("peer_timeout_s", 30)))
  from fdg_jax.data import DatasetNotFoundError

  workdir = _WORKDIR.value or os.path.join(
      "runs", time.strftime("%Y%m%d-%H%M%S") + f"-{config.algorithm}-k{config.num_stages}")
  resume = "resume with: " + resume_command(sys.argv, workdir)
  _STATE["resume"] = resume
  from fdg_jax.runtime import watchdog
  watchdog.RESUME_HINT["text"] = resume  # a stalled run's line, printed from its own thread
  try:
    trainer.train_and_evaluate(config, workdir)
  except trainer.ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    sys.exit(2)
  except DatasetNotFoundError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  except trainer.Interrupted as e:
    print(_SAME.sub(resume, str(e)), file=sys.stderr)
    sys.exit(128 + e.signum)
  except trainer.CheckpointError as e:
    print(f"error: {e}", file=sys.stderr)
    # The failed reads leave orbax's background tasks behind, which print tracebacks at
    # interpreter teardown; nothing is pending (the workdir was not written): end here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
  except trainer.UserError as e:
    print(_SAME.sub(resume, f"error: {e}"), file=sys.stderr)
    sys.exit(1)


_SAME = re.compile(r"(?<!re)run the same command to resume")
_STATE = {"resume": None}  # main's resume line, for a Ctrl-C that no handler catches


def stopped_at_once() -> str:
  """The line for a KeyboardInterrupt that reached the top: Ctrl-C before training's signal
  handler was in place (set-up), or a second Ctrl-C (which stops at once, even in a save)."""
  how = (_STATE["resume"] or "rerun: " + " ".join(["python", *sys.argv]))
  return ("interrupted: stopped at once (Ctrl-C during set-up, or a second Ctrl-C); the "
          "newest complete checkpoint is kept, an unfinished save is skipped on resume; " + how)


def resume_command(argv: list[str], workdir: str) -> str:
  """The command that resumes this run: argv with --workdir set to `workdir` (a run without
  --workdir got a new timestamped one, which the same command would not find again)."""
  import shlex
  args, skip = [], False
  for arg in argv[1:]:
    if skip:
      skip = False
      continue
    if arg == "--workdir":
      skip = True
      continue
    if not arg.startswith("--workdir="):
      args.append(arg)
  return shlex.join(["python", argv[0], *args, "--workdir", workdir])


def parse_flags(argv):
  """absl's parsing, but a bad flag or config file is one line and exit code 2."""
  try:
    rest = flags.FLAGS(argv)
    _CONFIG.value.get("algorithm")  # loads the config file now, inside this try
    return rest
  except (flags.Error, OSError, ValueError, TypeError, AttributeError, KeyError) as e:
    from fdg_jax.config_check import unknown_override
    config = _config_without_overrides(argv)
    text = (unknown_override(config, argv) if config is not None else None) or str(e)
    if "Traceback" in text:  # get_config raised: its own message is the last line
      text = text.strip().splitlines()[-1]
    message = " ".join(text.split())  # ml_collections' messages span several lines
    print(f"config error: {message}", file=sys.stderr)
    sys.exit(2)


def _config_without_overrides(argv):
  """The config that --config names, before its --config.* overrides (None if it does not
  load): to name an override that fails."""
  import importlib.util
  path = "configs/default.py"
  for i, arg in enumerate(argv):
    if arg == "--config" and i + 1 < len(argv):
      path = argv[i + 1]
    elif arg.startswith("--config="):
      path = arg.split("=", 1)[1]
  file, _, variant = path.partition(":")
  try:
    spec = importlib.util.spec_from_file_location("_config_module", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variant) if variant else module.get_config()
  except Exception:  # noqa: BLE001  then the flag's own error is what is shown
    return None


if __name__ == "__main__":
  try:
    from fdg_jax.runtime import peers
    if peers.is_multiprocess_env() and not os.environ.get(peers.CHILD_ENV):
      # One process of several: train in a child, so that a lost peer (whose news JAX turns
      # into an abort of this process) ends it with one line and exit code 3.
      sys.exit(peers.supervise(sys.argv))
    app.run(main, flags_parser=parse_flags)
  except KeyboardInterrupt:
    print(stopped_at_once(), file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + 2)  # orbax's and the loader's threads may be mid-write: no teardown
