"""The Lightning strategy: ``DeepCEEStrategy`` (hooks only) and the parts it holds.

- :mod:`~lightning_deepcee.strategy.deepcee`: the strategy class, registered as ``"deepcee"``;
- :mod:`~lightning_deepcee.strategy.stage_part`: this rank's stage, executors, process groups
  and the one step function; :mod:`~lightning_deepcee.strategy.placement`: where a rank sits;
- :mod:`~lightning_deepcee.strategy.layout_build`: building a plan and switching plans (the
  Lightning side); :mod:`~lightning_deepcee.strategy.plan_checks`: whether a plan may replace
  the running one;
- :mod:`~lightning_deepcee.strategy.checkpointer`: sharded checkpoints, exact resume, restarts;
- :mod:`~lightning_deepcee.strategy.step_log`, :mod:`~lightning_deepcee.strategy.failure_naming`:
  a step's logged totals, and naming the rank that failed;
- :mod:`~lightning_deepcee.strategy.setup_profile`, :mod:`~lightning_deepcee.strategy.setup_plan`,
  :mod:`~lightning_deepcee.strategy.plan_trial`: the set-up steps (profile the cluster, plan,
  time the plan's rivals);
- :mod:`~lightning_deepcee.strategy.module_checks`: the arguments and the module, checked early;
- :mod:`~lightning_deepcee.strategy.precision`, :mod:`~lightning_deepcee.strategy.reporting`,
  :mod:`~lightning_deepcee.strategy.gc_freeze`: precision plugins, what set-up prints, the
  garbage-collector freeze.
"""

from lightning_deepcee.strategy.deepcee import DeepCEEStrategy

__all__ = ["DeepCEEStrategy"]
