"""Devices and dtypes: the configuration's names turned into torch's, checked against this machine.

`resolve_device` parses a device name (`cpu`, `cuda`, `cuda:N`, `mps`, or `auto`: CUDA when this
machine has it, else the CPU) and fails with a message naming the configuration field when the
device does not exist here. `resolve_dtype` does the same for `fp32` / `bf16` / `fp16` on a device
(bf16 on a CUDA GPU older than Ampere is refused: it would be emulated, slowly).
"""

from __future__ import annotations

import torch

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The dtypes a run may name, by their short names."""


class DeviceError(ValueError):
    """A configured device or dtype that this machine cannot run."""


def resolve_device(name: str, field: str) -> torch.device:
    """The torch device `name` stands for on this machine; `DeviceError` naming `field` if none."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise DeviceError(f"{field}: {name!r} is not a device; use cpu, cuda, cuda:N, mps or auto") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise DeviceError(
                f"{field}: {name} asked for, but this machine has no usable CUDA device (torch "
                f"{torch.__version__} is {build}; is the GPU driver installed?); use cpu or auto"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DeviceError(f"{field}: {name} asked for, but this machine has {count} CUDA device(s)")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"{field}: mps asked for, but this machine has no usable Metal device; use cpu")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise DeviceError(f"{field}: device type {device.type!r} is not supported; use cpu, cuda or mps")
    return device


def resolve_dtype(name: str, device: torch.device, field: str) -> torch.dtype:
    """The torch dtype `name` (`fp32`, `bf16`, `fp16`), checked to run natively on `device`."""
    if name not in TORCH_DTYPES:
        raise DeviceError(f"{field}: unknown dtype {name!r}; use one of {', '.join(TORCH_DTYPES)}")
    dtype = TORCH_DTYPES[name]
    if (
        dtype == torch.bfloat16
        and device.type == "cuda"
        and not torch.cuda.is_bf16_supported(including_emulation=False)
    ):
        raise DeviceError(
            f"{field}: bf16 is not supported natively by {torch.cuda.get_device_name(device)}; use fp16 or fp32"
        )
    return dtype
