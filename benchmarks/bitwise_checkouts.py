"""Two checkouts of fdg_jax, the same ticks from the same state: are the results bitwise equal?

    python benchmarks/bitwise_checkouts.py OLD_REF [--ticks 12] [--out FILE]

For a redesign that must not change a single number. OLD_REF is a git commit (checked out in a
temporary worktree) or a directory holding another checkout. In each checkout one child
process runs every case through the public API only (`fdg_jax.create`, `init`, `step`, `run`,
`params`, `model_states`, `evaluate`): a 3-stage MLP with BatchNorm and dropout on random
8x8 images, SGD with momentum, the same initial parameters and batches; then this process
compares every parameter, model state, per-tick metric and evaluation output of the two,
bit for bit (`np.array_equal` on the raw values, NaNs included).

Cases: every built-in schedule x every engine it runs on x backward policy (bp, ddg, fdg:
stash and recompute; gpipe, 1f1b: M = 2 and 4) x `step` and `run`; the fused engine with
both gates (mask, cond); FDG on the SPMD engine; DP x FDG on a (2, 3) mesh (per-stage and
SPMD); FDG with beta 0.5; a plan given as a value. Prints one line per case and a summary;
exit status 1 if any case differs.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
K = 3


def cases() -> list[dict]:
  out = []
  for algorithm in ("bp", "ddg", "fdg"):
    for backward in ("stash", "recompute"):
      for engine, gate in (("fused", "mask"), ("fused", "cond"), ("per_stage", None)):
        for call in ("step", "run"):
          out.append({"algorithm": algorithm, "backward": backward, "engine": engine,
                      "gate": gate, "call": call})
  for call in ("step", "run"):
    out.append({"algorithm": "fdg", "backward": "stash", "engine": "spmd", "call": call})
    out.append({"algorithm": "fdg", "backward": "stash", "engine": "fused", "gate": None,
                "call": call, "beta": 0.5})
    for engine in ("per_stage", "spmd"):
      out.append({"algorithm": "fdg", "backward": "stash", "engine": engine, "call": call,
                  "mesh": [2, K]})
    for algorithm in ("gpipe", "1f1b"):
      for engine in ("fused", "per_stage"):
        for m in (2, 4):
          out.append({"algorithm": algorithm, "engine": engine, "call": call,
                      "microbatches": m})
    out.append({"algorithm": "plan:delayed_backprop", "backward": "stash", "engine": "fused",
                "gate": None, "call": call})
  for i, c in enumerate(out):
    c["name"] = f"{i:02d} " + " ".join(f"{k}={v}" for k, v in c.items())
  return out


# ------------------------------------------------------------------------------ the child
def child(out_dir: str, ticks: int) -> None:
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  jax.config.update("jax_platforms", "cpu")
  import jax.numpy as jnp
  import numpy as np
  import optax
  import fdg_jax

  def dense(width_in, width_out, bn, dropout):
    def init(rng, x):
      w = jax.random.normal(rng, (width_in, width_out)) / np.sqrt(width_in)
      p = {"w": w, "b": jnp.zeros(width_out)}
      s = {"mean": jnp.zeros(width_out), "var": jnp.ones(width_out)} if bn else {}
      return p, s

    def apply(p, s, x, *, train, rng=None):
      x = x.reshape(x.shape[0], -1)
      z = x @ p["w"] + p["b"]
      if bn:
        if train:
          m, v = z.mean(0), z.var(0)
          s = {"mean": 0.9 * s["mean"] + 0.1 * m, "var": 0.9 * s["var"] + 0.1 * v}
        else:
          m, v = s["mean"], s["var"]
        z = (z - m) / jnp.sqrt(v + 1e-5)
      z = jnp.tanh(z)
      if dropout and train:
        keep = jax.random.bernoulli(rng, 0.9, z.shape)
        z = jnp.where(keep, z / 0.9, 0.0)
      return z, s
    return fdg_jax.Stage(apply=apply, init=init)

  def head(width_in):
    def init(rng, x):
      return {"w": jax.random.normal(rng, (width_in, 10)) / np.sqrt(width_in),
              "b": jnp.zeros(10)}, {}

    def apply(p, s, x, *, train, rng=None):
      return x @ p["w"] + p["b"], s
    return fdg_jax.Stage(apply=apply, init=init)

  stages = [dense(64, 16, True, True), dense(16, 16, False, True), head(16)]
  x0 = np.zeros((1, 8, 8, 1), np.float32)
  params, states = fdg_jax.init_stages(stages, jax.random.PRNGKey(0), x0)
  rng = np.random.default_rng(0)
  xs = rng.normal(size=(ticks, 16, 8, 8, 1)).astype(np.float32)
  ys = rng.integers(0, 10, size=(ticks, 16)).astype(np.int32)
  loss = lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  devices = jax.devices()
  results = {}
  for case in cases():
    kwargs = {}
    if case.get("mesh"):
      r, k = case["mesh"]
      kwargs["mesh"] = jax.make_mesh((r, k), ("data", "stage"), devices=devices[:r * k])
    elif case["engine"] != "fused":
      kwargs["devices"] = devices[:K]
    kwargs["engine"] = case["engine"]
    if case.get("gate"):
      kwargs["gate"] = case["gate"]
    if case["algorithm"] in ("ddg", "fdg"):
      kwargs["backward"] = case["backward"]
    if case.get("beta"):
      kwargs["beta"] = case["beta"]
    if case.get("microbatches"):
      kwargs["microbatches"] = case["microbatches"]
    try:
      if case["algorithm"].startswith("plan:"):
        from fdg_jax.plans import Call, Plan
        plan = Plan("delayed_backprop", K, (
            Call(0, True, False, "batch", None), Call(1, True, False, "now", None),
            Call(2, True, True, "now", None), Call(1, False, True, None, "inbox"),
            Call(0, False, True, None, "now")))
        schedule = fdg_jax.Schedule(plan, stages, loss, optax.sgd(0.05, momentum=0.9),
                                    backward=case["backward"], **kwargs)
      else:
        schedule = fdg_jax.create(case["algorithm"], stages, loss,
                                  optax.sgd(0.05, momentum=0.9), **kwargs)
      state = schedule.init(params, states, rng=jax.random.PRNGKey(1))
      rows = {}
      if case["call"] == "step":
        for t in range(ticks):
          state, m = schedule.step(state, (xs[t], ys[t]))
          for name in ("loss", "accuracy"):
            if name in m:
              rows.setdefault(name, []).append(np.asarray(m[name]))
      else:
        half = ticks // 2
        for lo, hi in ((0, half), (half, ticks)):
          state, m = schedule.run(state, (xs[lo:hi], ys[lo:hi]))
          for name in ("loss", "accuracy", "updated", "valid"):
            rows.setdefault(name, []).append(np.asarray(m[name]))
      out = {f"metric/{n}": np.stack(v) for n, v in rows.items()}
      leaves = jax.tree_util.tree_flatten_with_path(
          (schedule.params(state), schedule.model_states(state)))[0]
      out.update({f"state/{jax.tree_util.keystr(p)}": np.asarray(jax.device_get(a))
                  for p, a in leaves})
      out["eval"] = np.asarray(jax.device_get(schedule.evaluate(state, xs[0])))
      np.savez(os.path.join(out_dir, f"{case['name'][:2]}.npz"), **out)
      results[case["name"]] = "ran"
    except Exception as e:  # noqa: BLE001  reported by the parent, case by case
      results[case["name"]] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(results, f)


# ------------------------------------------------------------------------------ the parent
def run_child(checkout: pathlib.Path, out_dir: str, ticks: int) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
  env["PYTHONPATH"] = str(checkout)
  env["FDG_JAX_COMPILATION_CACHE"] = "off"
  subprocess.run([sys.executable, str(pathlib.Path(__file__).resolve()), "--child", out_dir,
                  "--ticks", str(ticks)], cwd=checkout, env=env, check=True)
  with open(os.path.join(out_dir, "results.json")) as f:
    return json.load(f)


def equal(a, b) -> bool:
  import numpy as np
  return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(
      a.view(np.uint8) if a.dtype != bool else a, b.view(np.uint8) if b.dtype != bool else b)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("old", nargs="?", help="a git commit, or a directory with another checkout")
  parser.add_argument("--new", default=str(ROOT))
  parser.add_argument("--ticks", type=int, default=12)
  parser.add_argument("--out", default="")
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    child(args.child, args.ticks)
    return 0
  import numpy as np
  tmp = pathlib.Path(tempfile.mkdtemp(prefix="bitwise_"))
  old = pathlib.Path(args.old)
  if not old.is_dir():
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tmp / "old"),
                    args.old], check=True, capture_output=True)
    old = tmp / "old"
  (tmp / "a").mkdir()
  (tmp / "b").mkdir()
  ra = run_child(old, str(tmp / "a"), args.ticks)
  rb = run_child(pathlib.Path(args.new), str(tmp / "b"), args.ticks)
  lines, differ = [], 0
  for name in ra:
    if ra[name] != "ran" or rb.get(name) != "ran":
      same = ra[name] == rb.get(name)  # both refused alike: the same behaviour
      verdict = ("same refusal" if same else f"old {ra[name]} / new {rb.get(name)}")
      differ += not same
    else:
      a, b = np.load(tmp / "a" / f"{name[:2]}.npz"), np.load(tmp / "b" / f"{name[:2]}.npz")
      bad = sorted(set(a.files) ^ set(b.files)) + [
          k for k in a.files if k in b.files and not equal(a[k], b[k])]
      verdict = "bitwise equal" if not bad else f"DIFFERS in {', '.join(bad[:4])}"
      differ += bool(bad)
    lines.append(f"{name}: {verdict}")
  lines.append(f"{len(ra) - differ} of {len(ra)} cases identical (old {args.old}, new "
               f"{args.new}, {args.ticks} ticks)")
  text = "\n".join(lines)
  print(text)
  if args.out:
    pathlib.Path(args.out).write_text(text + "\n")
  if not pathlib.Path(args.old).is_dir():
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)],
                   capture_output=True)
  return 1 if differ else 0


if __name__ == "__main__":
  sys.exit(main())
