"""CPU activation offloading for PyTorch, small enough to read in one sitting.

See :func:`get_cpu_offload_context` for the entry point and :mod:`offload_examples.engine` for the
life of an offloaded tensor.
"""

from .api import get_cpu_offload_context
from .engine import GraphCaptureError, LayerStats, OffloadEngine, OffloadWarning
from .layer_state import LayerState
from .policy import mark_not_offload
from .synchronizer import OffloadSynchronizer
from .host_pool import HostMemoryLimitError
from .optim_offload import OptimizerOffload
from .schedule import DefaultSchedule, ManualSchedule, SyncDictSchedule
from .weight_stream import StreamedLayers

__version__ = "0.1.0"

__all__ = [
    "DefaultSchedule",
    "GraphCaptureError",
    "HostMemoryLimitError",
    "LayerState",
    "LayerStats",
    "ManualSchedule",
    "OffloadEngine",
    "OffloadSynchronizer",
    "OffloadWarning",
    "OptimizerOffload",
    "StreamedLayers",
    "SyncDictSchedule",
    "get_cpu_offload_context",
    "mark_not_offload",
]
