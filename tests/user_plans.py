"""A module that registers a schedule, as a user's would (`--config.plan_module=user_plans`):
FDG's plan under another name, so that its runs can be compared with FDG's exactly."""

from fdg_jax import plans


def copy_of_fdg(num_stages: int) -> plans.Plan:
  return plans.Plan("fdg_copy", num_stages, plans.fdg(num_stages).calls)


if "fdg_copy" not in plans.names():
  plans.register("fdg_copy", copy_of_fdg, options=("beta", "backward"),
                 description="FDG's plan, registered by a user module")
