"""The Lightning strategy: ``DeepCEEStrategy`` (hooks only) and the parts it holds.

- :mod:`~lightning_deepcee.strategy.deepcee`: the strategy class, registered as ``"deepcee"``;
- :mod:`~lightning_deepcee.strategy.layout`: the running plan on this rank, build and re-layout;
- :mod:`~lightning_deepcee.strategy.elastic`: sharded checkpoints, exact resume, restarts;
- :mod:`~lightning_deepcee.strategy.setup_profile`, :mod:`~lightning_deepcee.strategy.plan_trial`:
  the set-up steps (profile the cluster, time the plan's rivals);
- :mod:`~lightning_deepcee.strategy.precision`, :mod:`~lightning_deepcee.strategy.reporting`,
  :mod:`~lightning_deepcee.strategy.gc_freeze`: precision plugins, what set-up prints, the
  garbage-collector freeze.
"""

from lightning_deepcee.strategy.deepcee import DeepCEEStrategy

__all__ = ["DeepCEEStrategy"]
