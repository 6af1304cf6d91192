"""Runtime: stage construction, point-to-point transport and the schedule executor."""

from lightning_deepcee.runtime.executor import PipelineExecutionError, PipelineExecutor, StepStats
from lightning_deepcee.runtime.liveness import DeviceLostError
from lightning_deepcee.runtime.measure import (
    BlockTimings,
    NetworkMeasurement,
    ProfilingTimeoutError,
    available_memory_bytes,
    measure_blocks,
    measure_network,
    profile_cluster,
    profile_or_load,
)
from lightning_deepcee.runtime.routing import Piece, Router, StageLayout, split_rows
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
from lightning_deepcee.runtime.transport import (
    P2PTransport,
    TransferRecord,
    all_reduce_,
    start_all_reduce,
    wire_device,
)

__all__ = [
    "BlockTimings",
    "DeviceLostError",
    "NetworkMeasurement",
    "P2PTransport",
    "Piece",
    "PipelineExecutionError",
    "PipelineExecutor",
    "PipelineSpec",
    "ProfilingTimeoutError",
    "Router",
    "Stage",
    "StageLayout",
    "StepStats",
    "TransferRecord",
    "all_reduce_",
    "available_memory_bytes",
    "batch_size_of",
    "build_stage",
    "default_input_fn",
    "get_pipeline_spec",
    "measure_blocks",
    "measure_network",
    "profile_cluster",
    "profile_or_load",
    "split_batch",
    "split_rows",
    "split_sizes",
    "start_all_reduce",
    "wire_device",
]
