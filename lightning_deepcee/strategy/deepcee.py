"""DeepCEEStrategy: trains a LightningModule as a pipeline over several processes.

Layout: ``world_size = num_stages * num_replicas``. By default global rank ``r`` runs stage
``r % num_stages`` of pipeline replica ``r // num_stages``; ``placement`` puts stages on any
ranks (e.g. to follow the network: one stage per region). Each replica sees its own share of
the data (the sampler shards by replica, never by stage) and the gradients of one stage are
averaged over its replicas in a per-stage process group.

One training step runs the whole lowered schedule inside Lightning's ``training_step``; the
gradients it leaves are moved aside and put back in :meth:`DeepCEEStrategy.backward`, because
Lightning's automatic optimization zeroes gradients between ``training_step`` and ``backward``
(its closure runs ``training_step``, ``zero_grad``, ``backward``, then the optimizer step). The
optimizer then steps once per batch, after every W of the step: exact synchronous semantics, the
same update a single device computes on the whole batch.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from typing_extensions import override

from lightning_deepcee._compat import fit_dataloader
from lightning_deepcee.planner import DEVICE_GAIN, Plan
from lightning_deepcee.profiler import ClusterProfile, DeviceGroups
from lightning_deepcee.runtime import (
    PipelineExecutor,
    PipelineSpec,
    Stage,
    batch_size_of,
    get_pipeline_spec,
)
from lightning_deepcee.runtime.executor import StepStats
from lightning_deepcee.runtime.layout import (
    ManualLayout,
    batch_dependent_modules,
    batch_statistics_warning,
    call_with_output,
)
from lightning_deepcee.runtime.liveness import (
    Heartbeat,
    default_store,
    explain_failure,
    is_communication_failure,
    report_failure,
)
from lightning_deepcee.runtime.loaders import real_batch, stand_in_warning
from lightning_deepcee.runtime.stage import tied_parameters
from lightning_deepcee.runtime.step_figures import StepFigures
from lightning_deepcee.strategy.elastic import ElasticStrategy
from lightning_deepcee.strategy.gc_freeze import GcFreeze
from lightning_deepcee.strategy.module_checks import refuse_manual_optimization
from lightning_deepcee.strategy.plan_trial import trial_plans
from lightning_deepcee.strategy.reporting import (
    SetupTimer,
    check_versions,
    print_everywhere,
    summarise_whole_model,
    warn_unrun_steps,
)
from lightning_deepcee.strategy.setup_plan import initial_plan
from lightning_deepcee.strategy.setup_profile import ProfileSettings, profile_at_setup

__all__ = ["DeepCEEStrategy"]

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
"""Seconds between a rank's liveness beats in the rendezvous store."""
LIVENESS_WAIT_S = 3.0
"""After a failed step, how long a rank watches the heartbeats to name the lost device."""


class DeepCEEStrategy(ElasticStrategy):
    """Pipeline-parallel training across heterogeneous devices, exact synchronous gradients.

    Three ways to choose the layout:

    - ``DeepCEEStrategy()`` (no layout argument): profile the devices and links at setup, search
      a plan (stages per network group, compute-aware partition, micro-batch count, batch shares
      proportional to device speed) and run it.
    - ``plan="plan.json"``: run a saved plan (``deepcee plan`` or ``Plan.to_json``), no search.
    - any of ``partition``, ``schedule``, ``num_microbatches``, ``num_stages``, ``placement``:
      a manual layout (one device per stage per replica; unset values default to a balanced
      partition, ``1f1b`` and 4 micro-batches).

    Args:
        plan: ``"auto"`` (the default when no manual argument is given) or a saved plan's path.
        partition: blocks per stage, either stage sizes (``[3, 2, 3]``) or block ranges
            (``[[0, 3], [3, 5], [5, 8]]``). ``None`` balances parameter counts.
        schedule: one of ``gpipe``, ``1f1b``, ``zb-h1``.
        num_microbatches: micro-batches per step and replica; batches need at least as many
            samples. Uneven splits are fine.
        num_stages: pipeline depth; ``None`` uses one stage per process. Must divide the world
            size; the quotient is the number of data-parallel pipeline replicas.
        placement: the global ranks of each stage, one per replica, e.g. ``[[2], [0], [1]]`` runs
            stage 0 on rank 2. ``None`` places stage ``s`` of replica ``d`` on ``d * S + s``.
        profile: measure every device (per-block forward / input-gradient / weight-gradient
            times on the first training micro-batch, memory) and every link (latency and
            bandwidth, rounds of disjoint pairs) at setup, group devices, and print the table.
        profile_cache: a JSON/YAML file that caches the profile; reused only while the model
            and the cluster are unchanged (otherwise re-measured with a warning).
        profile_budget_s: the network measurement fails with an error naming the pair it was
            measuring when it takes longer than this.
        profile_rounds: the block timings are measured this many times in a row and every
            figure taken at its median (a single reading under a CPU quota is noisy); 1
            measures once, for a quicker setup.
        profile_block_budget_s: about how long each device may spend timing its blocks: a
            slow device takes fewer rounds and repeats (at least one round of two). ``None``:
            always ``profile_rounds`` full rounds, however long they take.
        device_cache: a directory where each device keeps its block timings, reused while the
            model, micro-batch and CPU quota are unchanged; ``"auto"``: one per torchrun elastic
            job (a restart measures only new devices), none otherwise; ``None``: never reuse.
        timeout_s: seconds a collective or transfer may block before the process group fails;
            a dead device or link therefore stops every rank within about this long (plus a
            3 s look at the heartbeats), with a ``DeviceLostError`` naming the lost rank, its
            stage and host, or a ``RankFailedError`` with the error of the rank that failed.
            Forming the process group waits longer for slow starters (``START_TIMEOUT_S``).
        verbose: print the partition and schedule on rank 0 at setup.
        receive_ahead: on gloo, post every receive of a step when it starts, into payload
            slots sized by the last step, so senders never wait for the receiver to reach its
            receive (gloo moves a message only once it is posted). Results are identical
            either way (docs/architecture.md). ``False`` posts each receive when the schedule
            reaches it.
        freeze_gc: when training starts, run one full garbage collection and freeze what
            survives (``gc.freeze()``), so later collections skip the model, the data and
            the framework set up before training (in a pipeline one rank's collection pause
            stalls every stage); unfrozen when training ends. ``False`` leaves the garbage
            collector alone.
        async_checkpoint: a checkpoint save snapshots this rank's state and returns; the files
            are written and committed in the background (crash-safe: an interrupted save leaves
            the previous checkpoint the newest complete one). ``False`` blocks until committed.
        device_gain: the automatic plan uses more devices than another only when predicted at
            least this fraction faster (``plan_search``); 0 takes the fastest prediction.
        plan_trial: the automatic plan and up to ``plan_trial - 1`` rivals predicted within 10%
            of it (the search's runners-up, near layouts: the cost model cannot rank them) each
            run a few steps at setup on the first batch, without optimizer steps, and the clock
            picks what trains (``plan_trial.py``); 1 trains the searched plan untimed.
    """

    strategy_name = "deepcee"

    def __init__(
        self,
        plan: str | None = None,
        partition: Sequence[int] | Sequence[Sequence[int]] | None = None,
        schedule: str | None = None,
        num_microbatches: int | None = None,
        num_stages: int | None = None,
        placement: Sequence[Sequence[int]] | None = None,
        profile: bool = False,
        profile_cache: str | None = None,
        profile_budget_s: float = 60.0,
        profile_rounds: int = 3,
        profile_block_budget_s: float | None = 20.0,
        device_cache: str | None = "auto",
        timeout_s: float = 60.0,
        verbose: bool = True,
        receive_ahead: bool = True,
        freeze_gc: bool = True,
        async_checkpoint: bool = True,
        device_gain: float = DEVICE_GAIN,
        plan_trial: int = 4,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
    ) -> None:
        manual = any(
            x is not None for x in (partition, schedule, num_microbatches, num_stages, placement)
        )
        if plan is not None and manual:
            raise ValueError(
                "DeepCEEStrategy(plan=...) decides partition, schedule, micro-batches and "
                "placement; pass either a plan or those arguments, not both."
            )
        self.plan_arg = plan if plan is not None else (None if manual else "auto")
        self._manual = ManualLayout.from_arguments(
            partition, schedule, num_microbatches, num_stages, placement
        )
        for name, value in (
            ("timeout_s", timeout_s),
            ("profile_budget_s", profile_budget_s),
            (
                "profile_block_budget_s",
                1.0 if profile_block_budget_s is None else profile_block_budget_s,
            ),
        ):
            if value <= 0:
                raise ValueError(f"DeepCEEStrategy({name}={value}) must be > 0.")
        rounds = profile_rounds
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"DeepCEEStrategy(profile_rounds={rounds!r}) must be an integer >= 1.")
        if isinstance(device_gain, bool) or not 0 <= device_gain < 1:
            raise ValueError(f"DeepCEEStrategy(device_gain={device_gain!r}) must be in [0, 1).")
        if isinstance(plan_trial, bool) or not isinstance(plan_trial, int) or plan_trial < 1:
            raise ValueError(f"DeepCEEStrategy(plan_trial={plan_trial!r}) must be an integer >= 1.")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout_s),
        )
        self.num_microbatches = self._manual.num_microbatches
        """Micro-batches per step now: the plan's, until the adapter re-splits."""
        self.profile = profile or profile_cache is not None or self.plan_arg == "auto"
        self.profile_cache = profile_cache
        self.profile_budget_s, self.profile_block_budget_s = (
            profile_budget_s,
            profile_block_budget_s,
        )
        self.profile_rounds, self.device_cache = profile_rounds, device_cache
        self.cluster_profile: ClusterProfile | None = None
        self.setup_seconds: dict[str, float] = {}
        """The last fit's set-up in seconds, part by part (``SetupTimer.flat``)."""
        self.device_groups: DeviceGroups | None = None
        self.verbose = verbose
        self.receive_ahead = receive_ahead
        self.freeze_gc = freeze_gc
        self.async_checkpoint, self.device_gain = async_checkpoint, device_gain
        self.plan_trial = plan_trial
        self._gc = GcFreeze()
        self.ranges: list[tuple[int, int]] = []
        self.spec: PipelineSpec | None = None
        self.stage: Stage | None = None
        self._executor: PipelineExecutor | None = None
        self._eval_executor: PipelineExecutor | None = None
        self._predict_executor: PipelineExecutor | None = None
        self._stage_group: Any = None
        self.plan: Plan | None = None
        """The running layout (every layout is a Plan; a manual one has no predictions)."""
        self.plan_alternatives: list[Plan] = []
        """Rank 0, automatic plan: the search's other best plans, for the plan trial."""
        self._pending_grads: list[torch.Tensor | None] | None = None
        self._global_batch_size = 0
        self.last_step_stats: StepStats | None = None
        self.last_step_samples = 0
        self.last_step_tokens: int | None = None
        self._heartbeat: Heartbeat | None = None
        self._hosts: list[str] = []
        self._block_names: list[str] = []
        """Qualified name of every block in the unsplit module, so a rebuild can put back the
        blocks that ``build_stage`` replaced by ``nn.Identity``."""
        self._split_module: Any = None
        """The module whose blocks ``build_stage`` split (a second setup of it restores them)."""
        self._synced_buffers: list[torch.Tensor] = []
        self._ties, self._tie_groups = [], []  # tied parameters (typed in the base class)
        self._figures = StepFigures()

    # ------------------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._hosts = check_versions(self.world_size)
        store = default_store()
        if store is not None and self.world_size > 1:
            self._heartbeat = Heartbeat(store, self.global_rank, interval_s=HEARTBEAT_S).start()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        refuse_manual_optimization(module)
        if self._split_module is module and self.spec is not None:
            # A second setup of the same module (validate/test after fit): its blocks are split
            # for the old layout; put them back and keep the spec of the whole model.
            self._restore_blocks()
        else:
            self.spec = get_pipeline_spec(module)
            qualified = {id(m): name for name, m in module.named_modules()}
            self._block_names = [qualified[id(block)] for block in self.spec.blocks]
            self._ties = [
                (tie, module.get_parameter(tie.names[0]))
                for tie in tied_parameters(module, self.spec.blocks)
            ]
        spec = self.spec
        assert spec is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        timer = SetupTimer()
        if self.profile and fitting:
            with timer("profile"):  # blocks are timed where they will run: on root_device
                self.model_to_device()
                found = profile_at_setup(
                    trainer,
                    self.batch_to_device(next(iter(fit_dataloader(trainer)))),
                    spec=spec,
                    num_microbatches=self.num_microbatches,
                    device=self.root_device,
                    world_size=self.world_size,
                    settings=ProfileSettings(
                        cache=self.profile_cache,
                        budget_s=self.profile_budget_s,
                        rounds=self.profile_rounds,
                        block_budget_s=self.profile_block_budget_s,
                        device_cache_dir=self.device_cache_dir(),
                    ),
                )
                self.cluster_profile, self.device_groups = found.profile, found.groups
                self._global_batch_size = found.global_batch_size
                timer.detail["profile"] = found.parts
        with timer("plan"):
            plan = self._initial_plan(fitting)
        with timer("build"):
            self._build(plan, trainer)
        if fitting and self.plan_arg == "auto" and self.plan_trial > 1:
            with timer("trial"):
                trial_plans(self, trainer, self.plan_trial)
        if fitting:
            timer.report(trainer)
            self.setup_seconds = timer.flat()
        summarise_whole_model(trainer, self.whole_model)
        assert self.plan is not None
        batch_warning = batch_statistics_warning(
            batch_dependent_modules(spec.blocks),
            self.plan,
            self.num_microbatches,
            type(module).__name__,
        )
        if batch_warning is not None:
            rank_zero_warn(batch_warning, category=UserWarning)
        callbacks = getattr(trainer, "callbacks", [])  # set by its connector, not declared
        hooks_warning = stand_in_warning(self.plan.idle_ranks, module, callbacks)
        if hooks_warning is not None:
            rank_zero_warn(hooks_warning, category=UserWarning)
        warn_unrun_steps(module, spec)
        # train/val/test_loss are all-reduced before they are logged (every rank holds the same
        # value), so Lightning's advice to sync them on epoch level does not apply.
        warnings.filterwarnings(
            "ignore",
            message=r"It is recommended to use `self\.log\('(train|val|test)_",
            category=PossibleUserWarning,
        )

    def _initial_plan(self, fitting: bool) -> Plan:
        """The layout setup builds (:func:`initial_plan`); validate/test after fit keep the
        layout that trained (re-planned or not)."""
        assert self.spec is not None
        if self.plan is not None and not fitting:
            return self.plan
        plan, alternatives = initial_plan(
            self.plan_arg,
            manual=self._manual,
            blocks=self.spec.blocks,
            world_size=self.world_size,
            cluster_profile=self.cluster_profile,
            global_batch_size=self._global_batch_size,
            device_gain=self.device_gain,
        )
        if alternatives is not None:
            self.plan_alternatives = alternatives
        return plan

    # ----------------------------------------------------------------------------- steps
    def _run(self, kind: str, batch: Any, prefix: str) -> torch.Tensor:
        """Run one step (:meth:`run_schedule` of ``kind``); log and return the whole batch's loss
        on every rank.

        The loss and the module's ``metrics_fn`` metrics travel in one all-reduce (each rank
        holds its rows' weighted share; :mod:`~lightning_deepcee.runtime.step_figures`), posted
        before the schedule by every rank outside the last stage; every rank logs them as
        ``<prefix>_loss`` and ``<prefix>_<name>``, so whichever rank writes the logs has them.
        An idle rank (no executor) computes nothing and adds zeros.
        """
        total = batch_size_of(batch)
        figures = self._figures
        early = figures.names is not None and self.global_rank not in self.placement[-1]
        pending = self._post_figures(batch, None, {}) if early else None
        loss = self.run_schedule(kind, batch)
        if pending is None:
            executor = self._executor if kind == "train" else self._eval_executor
            mine = {} if executor is None else executor.last_metrics
            figures.agree_names(mine)
            pending = self._post_figures(batch, loss, mine)
        summed = pending()  # the last-stage devices each contribute their rows
        self.last_step_samples = total * self.num_replicas
        tokens_fn = self.spec.tokens_fn if self.spec is not None else None
        self.last_step_tokens = round(summed[1].item()) if tokens_fn else None
        module = self.lightning_module
        assert module is not None and figures.names is not None
        training = prefix == "train"
        value = summed[0].float()
        module.log(f"{prefix}_loss", value, prog_bar=True, on_step=training, on_epoch=True)
        for name, metric in zip(figures.names, summed[2:].float(), strict=True):
            module.log(f"{prefix}_{name}", metric, on_step=training, on_epoch=True)
        return value

    def _post_figures(
        self, batch: Any, loss: torch.Tensor | None, metrics: dict[str, Any]
    ) -> Callable[[], torch.Tensor]:
        """Post this rank's part of the step's figures; the callable waits for the sum."""
        tokens_fn = self.spec.tokens_fn if self.spec is not None else None
        # Tokens from each replica's first device (an idle rank's batch is a stand-in).
        first = self.global_rank in self.placement[0][: self.num_replicas]
        tokens = float(tokens_fn(batch)) if tokens_fn is not None and first else 0.0
        return self._figures.post(loss, tokens, metrics, self.root_device)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        assert self.stage is not None
        params = self.stage.parameters()
        # With accumulate_grad_batches > 1 the parameters hold the earlier batches' sum: set it
        # aside so the schedule's gradients are this batch's alone, and put it back below.
        held = [p.grad for p in params]
        for p in params:
            p.grad = None
        start = time.perf_counter()
        batch = args[0] if args else kwargs["batch"]
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None:  # a stand-in, on a rank a re-plan has just made active
            batch = real_batch(trainer.train_dataloader, batch, self.is_idle, self.batch_to_device)
        with self._failures_named():
            loss = self._run("train", batch, "train")
            synced = self.sync_copies()  # 0 when no copy of this stage's parameters lives elsewhere
        # Lightning zeroes gradients between training_step and backward: keep them aside.
        self._pending_grads = [p.grad for p in params]
        for p, g in zip(params, held, strict=True):
            p.grad = g
        self.last_step_stats = self._executor.last_stats if self._executor else StepStats()
        self.last_step_stats.wall_s = time.perf_counter() - start
        self.last_step_stats.grad_sync_s = synced
        return loss

    def _describe_rank(self, rank: int) -> str:
        stages = [s for s, ranks in enumerate(self.placement) if rank in ranks]
        where = f"stage {stages[0]}" if stages else "idle"
        host = self._hosts[rank] if rank < len(self._hosts) else "?"
        return f"rank {rank} ({where}, host {host})"

    @contextmanager
    def _failures_named(self) -> Iterator[None]:
        """Say who failed. A rank's own error is posted in the store before it propagates; a
        failed transfer or collective is explained by another rank's posted error, or else by
        the heartbeats (a lost device)."""
        try:
            yield
        except Exception as exc:
            if is_communication_failure(exc):
                raise self._lost_device_error(exc) from exc
            store = default_store()
            if self._heartbeat is not None and store is not None:
                report_failure(store, self.global_rank, exc)
            raise

    def _lost_device_error(self, cause: Exception) -> RuntimeError:
        """Name the rank whose own error stopped the step or, failing that, the lost device from
        the heartbeats (blocks ``LIVENESS_WAIT_S``)."""
        store = default_store() if self._heartbeat is not None else None
        error = explain_failure(
            cause,
            store=store,
            rank=self.global_rank,
            world_size=self.world_size,
            describe=self._describe_rank,
            wait_s=LIVENESS_WAIT_S,
        )
        print_everywhere(f"[rank {self.global_rank}] {error}")
        return error

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.freeze_gc:
            self._gc.freeze(self.verbose)

    @override
    def on_train_end(self) -> None:
        self._gc.unfreeze()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        self._gc.unfreeze()
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        super().teardown()

    @override
    def backward(
        self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        module = self.lightning_module
        assert module is not None and self.stage is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        # Lightning divides the loss by accumulate_grad_batches before backward: the gradients
        # computed in training_step are divided the same way, then summed over the batches.
        accumulate = module.trainer.accumulate_grad_batches
        if self._pending_grads is not None:
            for p, g in zip(self.stage.parameters(), self._pending_grads, strict=True):
                if g is not None:
                    g = g if accumulate == 1 else g / accumulate
                    p.grad = g if p.grad is None else p.grad + g
            self._pending_grads = None
        return self.precision_plugin.post_backward(closure_loss, module)

    def _eval_step(self, name: str, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with torch.no_grad(), self._failures_named():
            loss = self._run("eval", args[0] if args else kwargs["batch"], name)
        return loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._eval_step("val", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._eval_step("test", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own ``predict_step``, with the pipeline's output for the batch standing
        in for ``forward``; every rank returns it (``trainer.predict`` gives rank 0's)."""
        assert self.spec is not None
        batch = args[0] if args else kwargs["batch"]
        with torch.no_grad(), self._failures_named():
            self.run_schedule("predict", batch)
            executor = self._predict_executor  # an idle rank has nothing to add
            output = self._gathered_output([] if executor is None else executor.last_outputs)
        module = self.lightning_module
        assert module is not None
        return call_with_output(
            module, output, batch, self.spec.input_fn, module.predict_step, *args, **kwargs
        )

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        # Lightning accumulates (accumulate_grad_batches): zero_grad and the optimizer step only
        # every k batches; training_step and backward keep the sum (see there).
        return False

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="DeepCEE pipeline strategy", override=True
        )
