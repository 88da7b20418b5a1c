"""Runs one program as N JAX processes on this machine (a local multi-host run).

    python -m fdg_jax.launch --num-processes 2 --cpu-devices 2 -- python train.py ...

Each process gets JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, which
`fdg_jax.runtime.initialize()` (called first thing in the program) hands to
`jax.distributed.initialize`. With `--cpu-devices M` each process runs on M CPU devices
(JAX_PLATFORMS=cpu, JAX_NUM_CPU_DEVICES=M). Output lines are prefixed with "[i]". If one
process fails, the others are stopped (they would otherwise wait forever in a collective);
the exit status is the first non-zero one.

On a real cluster start one process per host yourself with the same three variables (the
coordinator is process 0's "host:port"), or use SLURM / Open MPI, which JAX detects.

`--pin` holds process i to one core (the i-th of the cores this launcher may use), so that
N processes on an N-core machine are N parallel devices rather than threads that share the
cores. SIGTERM or SIGINT to the launcher is passed on to every process, which then stops
at a checkpoint (the trainer's), given `--grace` seconds before it is killed.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from fdg_jax.runtime.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID


def free_port() -> int:
  """A TCP port that was free a moment ago (good enough on a test machine)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def process_env(process_id: int, num_processes: int, coordinator: str,
                cpu_devices: int | None = None, base: dict | None = None) -> dict:
  """The environment of process `process_id` of a local run."""
  env = dict(os.environ if base is None else base)
  env.update({ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: str(num_processes),
              ENV_PROCESS_ID: str(process_id), "PYTHONUNBUFFERED": "1"})
  if cpu_devices:
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(cpu_devices))
  return env


def pinned_cores(num_processes: int) -> list[int]:
  """The core of each process under --pin: the launcher's usable cores in order, cycled."""
  cores = sorted(os.sched_getaffinity(0))
  return [cores[i % len(cores)] for i in range(num_processes)]


def launch(command: list[str], num_processes: int, *, cpu_devices: int | None = None,
           port: int | None = None, timeout_s: float | None = None, prefix: bool = True,
           env: dict | None = None, pin: bool = False, grace_s: float = 5.0) -> int:
  """Starts `command` as `num_processes` processes, waits for all, returns the exit status.

  Stops every process when one fails, on timeout (status 124), on Ctrl-C and on SIGTERM
  (each process gets SIGTERM, then SIGKILL after `grace_s`). `pin`: process i runs on one
  core only (`pinned_cores`), set before it starts.
  """
  coordinator = f"127.0.0.1:{port or free_port()}"
  cores = pinned_cores(num_processes) if pin else [None] * num_processes
  procs = []
  previous = _term_as_interrupt()
  for i in range(num_processes):
    procs.append(subprocess.Popen(
        command, env=process_env(i, num_processes, coordinator, cpu_devices, env),
        stdout=subprocess.PIPE if prefix else None,
        stderr=subprocess.STDOUT if prefix else None, text=True, start_new_session=True,
        preexec_fn=None if cores[i] is None else _pin_to(cores[i])))
  pumps = []
  if prefix:
    for i, p in enumerate(procs):
      t = threading.Thread(target=_pump, args=(p.stdout, f"[{i}] "), daemon=True)
      t.start()
      pumps.append(t)
  deadline = None if timeout_s is None else time.monotonic() + timeout_s
  status = 0
  try:
    while [p.poll() for p in procs].count(None):  # polls every process (any() would stop)
      failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
      if failed:
        status = failed[0]
        break
      if deadline is not None and time.monotonic() > deadline:
        print(f"fdg_jax.launch: timed out after {timeout_s} s; stopping", file=sys.stderr)
        status = 124
        break
      time.sleep(0.05)
    else:
      status = next((p.returncode for p in procs if p.returncode), 0)
  except KeyboardInterrupt:
    status = 130
  finally:
    _stop(procs, grace_s)
    for t in pumps:
      t.join(timeout=5)
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)
  return status


def _pin_to(core: int):
  return lambda: os.sched_setaffinity(0, {core})


def _term_as_interrupt():
  """SIGTERM to the launcher stops its processes as Ctrl-C does (main thread only)."""
  def handler(signum, frame):
    del signum, frame
    raise KeyboardInterrupt
  try:
    return signal.signal(signal.SIGTERM, handler)
  except ValueError:
    return None


def _pump(stream, prefix: str) -> None:
  for line in stream:
    sys.stdout.write(prefix + line)
    sys.stdout.flush()


def _stop(procs, grace_s: float = 5.0) -> None:
  """SIGTERM to each still-running process group, then SIGKILL after `grace_s`."""
  alive = [p for p in procs if p.poll() is None]
  try:  # the processes are stopping: a further SIGTERM or Ctrl-C must not orphan them
    for s in (signal.SIGTERM, signal.SIGINT):
      signal.signal(s, signal.SIG_IGN)
  except ValueError:  # not the main thread
    pass
  for p in alive:
    _signal(p, signal.SIGTERM)
  end = time.monotonic() + grace_s
  for p in alive:
    try:
      p.wait(timeout=max(end - time.monotonic(), 0.01))
    except subprocess.TimeoutExpired:
      _signal(p, signal.SIGKILL)
      p.wait()


def _signal(p, sig) -> None:
  # Each process leads its own session (start_new_session), so its children go too.
  try:
    os.killpg(p.pid, sig)
  except ProcessLookupError:
    pass


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if "--" not in argv:
    print("usage: python -m fdg_jax.launch --num-processes N [--cpu-devices M] [--port P] "
          "[--timeout S] [--pin] [--grace S] -- COMMAND ...", file=sys.stderr)
    return 2
  split = argv.index("--")
  parser = argparse.ArgumentParser(prog="python -m fdg_jax.launch",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--num-processes", type=int, required=True)
  parser.add_argument("--cpu-devices", type=int, default=None,
                      help="run each process on this many CPU devices")
  parser.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
  parser.add_argument("--timeout", type=float, default=None, help="seconds before stopping all")
  parser.add_argument("--pin", action="store_true",
                      help="hold process i to one core (the i-th this launcher may use)")
  parser.add_argument("--grace", type=float, default=5.0,
                      help="seconds a stopped process has to end before it is killed")
  args = parser.parse_args(argv[:split])
  command = argv[split + 1:]
  if not command or args.num_processes < 1:
    parser.error("give a command after -- and --num-processes >= 1")
  return launch(command, args.num_processes, cpu_devices=args.cpu_devices, port=args.port,
                timeout_s=args.timeout, pin=args.pin, grace_s=args.grace)


if __name__ == "__main__":
  sys.exit(main())
