"""``--device`` / ``EngineConfig.device`` checked up front: one clear line instead of torch's AssertionError deep in a
model load. The engine runs on ``cpu`` and ``cuda`` (``cuda:N``) only."""

from __future__ import annotations

import os

SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")


def machine_cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class DeviceError(ValueError):
    """The device cannot be used here; the message says why and what to do."""


def check_device(spec: str) -> None:
    """Raise :class:`DeviceError` unless ``spec`` names a device this torch build can run the engine on."""
    import torch

    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in SUPPORTED_DEVICE_TYPES:
        raise DeviceError(f"unknown device {spec!r}: use cpu, cuda or cuda:N")
    if device.type == "cpu":
        return
    if not torch.backends.cuda.is_built():
        raise DeviceError(f"device {spec!r} needs a CUDA build of torch, but torch {torch.__version__} is CPU-only: "
                          "install a CUDA wheel (https://pytorch.org/get-started/locally/) or use --device cpu")
    count = torch.cuda.device_count()
    if count == 0:
        raise DeviceError(f"device {spec!r}: torch {torch.__version__} is built with CUDA but sees no GPU "
                          "(check the driver and CUDA_VISIBLE_DEVICES) or use --device cpu")
    if device.index is not None and device.index >= count:
        raise DeviceError(f"device {spec!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
