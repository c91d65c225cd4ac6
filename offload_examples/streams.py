"""The three streams the engine works on, and no-op stand-ins when there is no GPU.

Compute runs on the caller's current stream. Device-to-host copies get their own stream so they
overlap with the forward; host-to-device copies get another so that, in the backward, a reload
never queues behind an offload (and both directions of PCIe are used at once). Ordering between
streams is expressed with CUDA events only: a stream *waits on an event* on the device, the host
never blocks.

On the CPU every method below does nothing and copies run synchronously, so the engine executes
the same lines with or without a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["Streams"]


class Streams:
    """Side streams for one device.

    Parameters
    ----------
    device:
        The compute device. For ``cpu`` no streams are created.
    offload_stream:
        Stream to use for device-to-host copies (Transformer Engine's ``offload_stream``);
        a new one when ``None``.
    """

    def __init__(self, device: torch.device, offload_stream: torch.cuda.Stream | None = None):
        self.device = device
        self.is_cuda = device.type == "cuda"
        if offload_stream is not None and not self.is_cuda:
            raise ValueError("offload_stream was given but the offload device is not a CUDA device")
        if self.is_cuda:
            self.d2h = offload_stream or torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)
        else:
            self.d2h = self.h2d = None

    def current(self) -> torch.cuda.Stream | None:
        """The compute stream: whatever stream the caller is running on now."""
        return torch.cuda.current_stream(self.device) if self.is_cuda else None

    @contextlib.contextmanager
    def on(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        """Make ``stream`` current for the copies issued inside the block."""
        if stream is None:
            yield
        else:
            with torch.cuda.stream(stream):
                yield

    @staticmethod
    def record(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """An event marking everything queued on ``stream`` so far."""
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    @staticmethod
    def wait(stream: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
        """Make ``stream`` wait (on the device) until ``event`` has completed."""
        if stream is not None and event is not None:
            stream.wait_event(event)

    @staticmethod
    def wait_stream(stream: torch.cuda.Stream | None, other: torch.cuda.Stream | None) -> None:
        """Make ``stream`` wait for all work queued on ``other`` so far."""
        if stream is not None and other is not None and stream != other:
            stream.wait_stream(other)
