"""Where a model's weights go when it loads: whole on one device (the default), or, for a model
too big for one device, across a process's devices by accelerate's big-model inference
(``device_map="auto"``: its GPUs first, then the CPU, then disk).

Sharded this way, the model computes exactly what it computes whole: accelerate's
``AlignDevicesHook`` on each module moves the module's inputs (and, offloaded, its weights,
read back unchanged from CPU memory or the checkpoint's safetensors) to the module's execution
device before its own forward runs, and skips the cache argument, so every attention layer
writes its post-RoPE K/V to the cache as it would whole. The capture reads the cache, so it
sees the same tensors: bit for bit on one kind of device (the same kernels run on the same
weights); across GPUs only each layer's device differs, and ``gathered`` brings its K/V to the
device of the model's inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.cache import KVCache
from ..core.errors import KVMapError

PLACEMENT_DEVICES = ("gpu", "cpu")


@dataclass(frozen=True)
class Placement:
    """Load each model across this process's devices (accelerate's ``device_map="auto"``).

    ``max_memory``: (device, bytes) pairs, device "gpu" (each GPU this process owns) or "cpu",
    a budget per model; a device not named gets what accelerate finds free. What fits nowhere
    goes to disk: read from the checkpoint's safetensors, or, when a weight must be written
    again (another format), under ``offload_folder`` (each process and model in a folder of
    its own there).
    """

    max_memory: tuple[tuple[str, int], ...] = ()
    offload_folder: Path | None = None

    def __post_init__(self) -> None:
        for device, size in self.max_memory:
            if device not in PLACEMENT_DEVICES:
                raise KVMapError(f"max memory names device {device!r}; use one of gpu, cpu")
            if size <= 0:
                raise KVMapError(f"max memory for {device} must be positive, got {size} bytes")

    def loader_arguments(self, gpus: list[int], folder_name: str) -> dict:
        """``from_pretrained``'s placement arguments for a model of this process, which owns
        the GPUs ``gpus`` (indices; none: the CPU and disk only); ``folder_name`` names its
        offload folder (unique per process and model)."""
        arguments = {"device_map": "auto", "max_memory": self.budget(gpus)}
        if self.offload_folder is not None:
            arguments["offload_folder"] = str(Path(self.offload_folder) / folder_name)
        return arguments

    def fit_arguments(self) -> list[str]:
        """The `sgl-kvmap fit` options that load models so (for a fit started as a command)."""
        arguments = ["--device-map", "auto"]
        for device, size in self.max_memory:
            arguments += ["--max-memory", f"{device}={size}"]
        if self.offload_folder is not None:
            arguments += ["--offload-folder", str(self.offload_folder)]
        return arguments

    def budget(self, gpus: list[int]) -> dict[int | str, int]:
        """Bytes per device, the process's GPUs and the CPU only (accelerate's free memory
        where ``max_memory`` does not say)."""
        from accelerate.utils import get_max_memory

        free = get_max_memory()
        given = dict(self.max_memory)
        budget = {gpu: given.get("gpu", free[gpu]) for gpu in gpus}
        budget["cpu"] = given.get("cpu", free["cpu"])
        return budget


@dataclass(frozen=True)
class Loading:
    """How a fit loads each model: weights, so the captured K/V, in ``dtype`` (the statistics
    are float64 whatever it is); ``placement`` None: each model whole on its process's device."""

    dtype: torch.dtype = torch.float32
    placement: Placement | None = None


def parse_max_memory(text: str) -> tuple[str, int]:
    """``DEVICE=SIZE`` (``gpu=70GiB``, ``cpu=512MB``, ``cpu=1000000``) as (device, bytes)."""
    from accelerate.utils import convert_file_size_to_int

    device, sep, size = text.partition("=")
    if not sep or device not in PLACEMENT_DEVICES:
        raise KVMapError(f"max memory {text!r} is not DEVICE=SIZE with DEVICE gpu or cpu")
    try:
        return device, convert_file_size_to_int(int(size) if size.isdigit() else size)
    except ValueError:
        raise KVMapError(
            f"max memory {text!r}: {size!r} is not a size (e.g. 70GiB, 512MB)"
        ) from None


def process_gpus(local_rank: int, local_processes: int, gpu_count: int) -> list[int]:
    """The GPUs process ``local_rank`` of ``local_processes`` on a node of ``gpu_count`` GPUs
    owns when each loads its models sharded: an equal block each, in order (none on a node
    without GPUs)."""
    if gpu_count == 0:
        return []
    per_process = gpu_count // local_processes
    if per_process == 0:
        raise KVMapError(
            f"{local_processes} processes cannot each own a GPU of this node's {gpu_count}; "
            f"start at most {gpu_count}"
        )
    return list(range(local_rank * per_process, (local_rank + 1) * per_process))


def is_dispatched(model: torch.nn.Module) -> bool:
    """Whether accelerate placed ``model`` (sharded or offloaded; never move it whole)."""
    return getattr(model, "hf_device_map", None) is not None


def input_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s input ids go: the execution device accelerate gave its input
    embeddings when it dispatched the model (their weights may be offloaded, on "meta"), else
    the device of its first parameter."""
    hook = getattr(model.get_input_embeddings(), "_hf_hook", None)
    execution = getattr(hook, "execution_device", None)
    if execution is not None:
        return torch.device(execution)
    return next(model.parameters()).device


def gathered(cache: KVCache, device: torch.device) -> KVCache:
    """``cache`` with every layer's K/V on ``device`` (a model sharded across GPUs leaves each
    layer's on its own device). keys/values: L x [tokens, kv_heads, head_dim]."""
    return KVCache(
        [k.to(device) for k in cache.keys], [v.to(device) for v in cache.values], cache.positions
    )


def describe_placement(placement: Placement | None, gpus: list[int]) -> str:
    """How a process places each model, in words (printed by the command line)."""
    if placement is None:
        return "each model whole on one device"
    devices = [f"GPU {gpu}" for gpu in gpus] + ["CPU", "disk"]
    return "each model across " + ", ".join(devices) + " (accelerate, device_map=auto)"
