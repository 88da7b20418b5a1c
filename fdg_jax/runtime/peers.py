"""A lost peer process: one line naming it and the newest checkpoint, then a non-zero exit.

When one process of a multi-process run dies (kill -9, a lost node), JAX tells the others in
pieces: the next cross-process collective fails with gloo's "connection closed by peer", the
coordination service declares the process dead once its heartbeats have stopped for the
heartbeat timeout, and JAX's client then aborts the process from C++, with a stack trace,
while Python unwinds and waits at the shutdown barrier (before: 75 s and 186 lines). Its
client's abort cannot be caught in Python (this jaxlib cannot call a Python callback in its
place), so `train.py` runs the training of a multi-process run in a child process and
`supervise` watches it:

- the child's stdout passes through; its stderr passes through line by line until a
  traceback, a fatal error or a log line of the C++ runtime appears, from which on it is
  held back (and written to `<workdir>/peer_failure.log` if a peer was lost);
- if the child ends on a lost peer (its held-back output names one, or it was aborted after
  a failed collective), `supervise` prints one line, "lost process I of N ...; newest
  checkpoint: step S in DIR ...", and returns `EXIT_CODE`;
- otherwise it releases what it held back and returns the child's own exit code;
- SIGINT and SIGTERM go to the child (which saves a checkpoint and exits, as alone).

The time bound: a lost process is noticed when its heartbeats have been missing for the
heartbeat timeout (`timeout_s`, the trainer's `--config.peer_timeout_s`, passed to
`jax.distributed.initialize`), a lost coordinator (process 0, which hosts the coordination
service) at once; the survivor then exits within a second or two. Checkpoints on disk are
left as they are: a rerun of every process on the same workdir resumes from the newest
complete one.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

EXIT_CODE = 3
DEFAULT_TIMEOUT_S = 30
CHILD_ENV = "FDG_JAX_SUPERVISED"  # set in the child: it runs the training itself
FAILURE_LOG = "peer_failure.log"

# Output from which on the child's stderr is held back: Python tracebacks, fatal errors,
# and the C++ runtime's log lines ("E1201 21:33:10.431373 17947 file.cc:123] ...").
_HOLD = re.compile(r"^(Traceback \(most recent call last\)|Fatal Python error|terminate called"
                   r"|\*\*\* |[EWF]\d{4} \d\d:\d\d:\d\d)")
_LOST = [  # (pattern, which process it names: a group, 0 for the coordinator, None: unknown)
    (re.compile(r"tasks are unhealthy\s*\(stopped sending heartbeats\):\s*(\d+)"), "group"),
    (re.compile(r"[Tt]ask (\d+) heartbeat timeout"), "group"),
    (re.compile(r"coordination_service.*Socket closed|CoordinationService/\w+:.*\n?.*Socket "
                r"closed|Socket closed.*coordination", re.S), 0),
    (re.compile(r"Connection (closed|reset) by peer"), None),
]


def is_multiprocess_env(env=None) -> bool:
  """Whether this process is one of several (JAX_NUM_PROCESSES, SLURM or Open MPI)."""
  env = os.environ if env is None else env
  for name in ("JAX_NUM_PROCESSES", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    try:
      if int(env.get(name, "1") or 1) > 1:
        return True
    except ValueError:
      pass
  return False


def _process_ids(env) -> tuple[str, str]:
  for me, n in (("JAX_PROCESS_ID", "JAX_NUM_PROCESSES"), ("SLURM_PROCID", "SLURM_NTASKS"),
                ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
    if env.get(n):
      return env.get(me, "?"), env[n]
  return "?", "?"


def newest_checkpoint(workdir: str | None) -> str:
  """The newest complete checkpoint of `workdir` (orbax's step directories; its
  half-written ones carry a suffix), in a few words."""
  if not workdir:
    return "in the run's workdir (no --workdir was given)"
  directory = os.path.join(os.path.abspath(workdir), "checkpoints")
  try:
    steps = sorted(int(n) for n in os.listdir(directory) if n.isdigit())
  except OSError:
    steps = []
  return f"step {steps[-1]} in {directory}" if steps else f"none yet in {directory}"


def diagnose(text: str):
  """(lost, reason) from the child's held-back stderr: lost = a process index, or None for
  a peer not named; (False, None) when no peer was lost."""
  for pattern, who in _LOST:
    m = pattern.search(text)
    if m:
      if who == "group":
        return int(m.group(1)), "its heartbeats stopped"
      if who == 0:
        return 0, "the coordination service closed"
      return None, "a collective's connection was closed by the peer"
  return False, None


def workdir_of(argv) -> str | None:
  for i, a in enumerate(argv):
    if a.startswith("--workdir="):
      return a.split("=", 1)[1]
    if a == "--workdir" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _die_with_parent() -> None:
  """In the child, before it starts: SIGKILL when the supervising parent dies (Linux), so
  that killing the process a user or a scheduler sees ends the training too."""
  try:
    import ctypes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass


def supervise(argv: list[str], *, env=None) -> int:
  """Runs `python argv` as the child that trains; returns the exit code to end with."""
  env = dict(os.environ if env is None else env)
  env[CHILD_ENV] = "1"
  env.setdefault("PYTHONUNBUFFERED", "1")
  child = subprocess.Popen([sys.executable] + list(argv), env=env, stderr=subprocess.PIPE,
                           text=True, errors="replace", preexec_fn=_die_with_parent)
  held: list[str] = []

  def pump():
    holding = False
    for line in child.stderr:
      holding = holding or bool(_HOLD.match(line))
      if holding:
        held.append(line)
      else:
        sys.stderr.write(line)
        sys.stderr.flush()

  reader = threading.Thread(target=pump, daemon=True)
  reader.start()
  forward = lambda sig, frame: child.send_signal(sig)
  old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    rc = child.wait()
  finally:
    for s, h in old.items():
      signal.signal(s, h)
  reader.join(timeout=5)
  text = "".join(held)
  lost, why = diagnose(text) if rc != 0 else (False, None)
  if lost is False:
    sys.stderr.write(text)
    sys.stderr.flush()
    return rc if rc >= 0 else 128 - rc
  workdir = workdir_of(argv)
  me, n = _process_ids(env)
  details = ""
  if workdir:
    try:
      os.makedirs(workdir, exist_ok=True)
      path = os.path.join(workdir, f"{FAILURE_LOG}.{me}")
      with open(path, "w") as f:
        f.write(text)
      details = f"; details in {path}"
    except OSError:
      pass
  if lost is None and n == "2" and me in ("0", "1"):
    lost = 1 - int(me)  # of two processes, the lost one is the other
  who = "a peer process" if lost is None else f"process {lost}" + (
      " (the coordinator)" if lost == 0 else "")
  print(f"error: lost {who} of {n} ({why}); this is process {me}; newest checkpoint: "
        f"{newest_checkpoint(workdir)}; rerun every process with the same --workdir to "
        f"resume{details}", file=sys.stderr, flush=True)
  return EXIT_CODE
