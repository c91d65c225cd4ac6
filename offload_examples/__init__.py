"""CPU activation offloading for PyTorch, small enough to read in one sitting.

See :func:`get_cpu_offload_context` for the entry point and :mod:`offload_examples.core.engine` for the
life of an offloaded tensor.
"""

from .core.api import get_cpu_offload_context
from .core.engine import GraphCaptureError, LayerStats, OffloadEngine, OffloadWarning
from .core.host_pool import HostMemoryLimitError
from .core.layer_state import LayerState
from .core.policy import mark_not_offload
from .core.schedule import DefaultSchedule, ManualSchedule, SyncDictSchedule
from .core.synchronizer import OffloadSynchronizer
from .features.apply import offload_layers
from .features.optim_offload import OptimizerOffload
from .features.weight_stream import StreamedLayers

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
    "offload_layers",
]
