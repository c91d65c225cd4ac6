"""The engine's exceptions and warning, and the longer messages it raises."""

from __future__ import annotations

__all__ = ["GraphCaptureError", "OffloadWarning"]


class OffloadWarning(UserWarning):
    """Something was not offloaded as asked, or was brought back later than planned."""


class GraphCaptureError(RuntimeError):
    """The engine was used in a way a CUDA graph cannot capture (raised during the capture).

    Also raised by eager steps after :meth:`OffloadEngine.freeze_host_buffers`, which follow
    the capture's rules without a GPU.
    """


def in_place_error(layer: int) -> RuntimeError:
    return RuntimeError(
        f"a tensor saved for backward in layer {layer} was modified in place after it was saved, "
        "so its gradient would be wrong. Clone it before modifying it (autograd reports the same "
        "misuse without offloading)."
    )


def capture_mismatch_error(layer: int, captured: bool, what: str) -> GraphCaptureError:
    """A record of one CUDA graph capture used outside it, or one made outside used inside."""
    if captured:
        return GraphCaptureError(
            f"layer {layer}'s saved tensors were saved inside a CUDA graph capture but are {what} outside it. "
            "Capture the offloaded layers' backward, and with per-layer graphs the layer after each offloaded "
            "one, too: a whole step (capture_step), a whole model's forward and backward "
            "(make_graphed_callables), or every layer (make_graphed_layers)."
        )
    return GraphCaptureError(
        f"layer {layer}'s saved tensors were saved before the CUDA graph capture began but are {what} "
        "inside it. Begin the capture before the first layer's forward (capture whole steps)."
    )


def no_buffer_error(layer: int, captured: bool, err: Exception) -> GraphCaptureError:
    if captured:
        why = ("the engine does not pin host memory during a CUDA graph capture (it fails on many PyTorch "
               "releases). Run at least one eager step with the same shapes before capturing, with "
               "retain_pinned_cpu_buffers=True or after freeze_host_buffers(), so the pool keeps every buffer")
    else:
        why = ("the host buffers were frozen (freeze_host_buffers), so a step may only use buffers that "
               "earlier steps made; this step saves a tensor of a size they did not")
    return GraphCaptureError(f"layer {layer}: {err}: {why}")


def nested_error() -> RuntimeError:
    return RuntimeError(
        "another offload context is already active in this thread: contexts cannot be nested "
        "(the inner one would take every tensor the outer one should see). Give each layer "
        "one context; two models may each have their own, entered one after the other."
    )


def hooks_refused_error(err: Exception) -> RuntimeError:
    return RuntimeError(
        f"saved-tensor hooks are refused here ({err}): a torch.func transform or "
        "torch.autograd.graph.disable_saved_tensors_hooks is active, and offloading works through those "
        "hooks. Run this layer outside the offload context; the next entry starts a new step."
    )


def timing_in_capture_error() -> GraphCaptureError:
    return GraphCaptureError(
        "timing marks are read on the host after the step, which a CUDA graph replay never "
        "reaches: record a timeline of an eager step, or of a replay with the profiler"
    )


def aborted_step_error() -> RuntimeError:
    return RuntimeError(
        "this saved tensor belonged to a step that failed or was reset; its memory was given "
        "back. Run the forward again before calling backward."
    )


def reload_never_started_error(schedule: str, layer: int) -> RuntimeError:
    return RuntimeError(
        f"{schedule}: backward needs layer {layer}'s saved tensors but their reload was never started "
        "(pass each layer's output through sync() so backward triggers are seen)"
    )
