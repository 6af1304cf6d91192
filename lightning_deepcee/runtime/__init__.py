"""Runtime: stage construction, point-to-point transport and the schedule executor."""

from lightning_deepcee.runtime.executor import PipelineExecutionError, PipelineExecutor, StepStats
from lightning_deepcee.runtime.stage import (
    PipelineSpec,
    Stage,
    batch_size_of,
    build_stage,
    default_input_fn,
    get_pipeline_spec,
    split_batch,
    split_sizes,
)
from lightning_deepcee.runtime.transport import P2PTransport, TransferRecord

__all__ = [
    "P2PTransport",
    "PipelineExecutionError",
    "PipelineExecutor",
    "PipelineSpec",
    "Stage",
    "StepStats",
    "TransferRecord",
    "batch_size_of",
    "build_stage",
    "default_input_fn",
    "get_pipeline_spec",
    "split_batch",
    "split_sizes",
]
