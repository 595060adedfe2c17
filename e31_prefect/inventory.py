"""The GPUs on this host and which flow run rents each one.

``E31_GPUS="0:H100,1:H100" prefect worker start --pool gpu --type e31`` declares
an inventory; without it the worker asks NVML, and finds none where NVML does
not answer. Renting is all-or-nothing and per flow run, so returning a run's
devices twice is harmless.

A device is rented to one run at a time per host, whatever worker process asks
(any pool, any ``E31_HOME``): renting takes an exclusive ``flock`` on the
device's file in a host-wide folder (``E31_DEVICE_LOCKS``). The kernel drops a
lock when the last process holding it dies, so a killed worker or supervisor
never leaves a device rented.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from uuid import UUID

from e31_prefect.filelocks import try_lock

_REPEAT = re.compile(r"^(\d+)\s*[xX]\s*(\S.*)$")


@dataclass(frozen=True, order=True)
class Device:
    """One GPU: its index on the host (as NVML and CUDA_VISIBLE_DEVICES count) and its model name."""

    index: int
    name: str
    uuid: str | None = None


class InventoryError(ValueError):
    """A declared inventory that cannot be read."""


def parse_declared(text: str) -> list[Device]:
    """Read ``"0:H100,1:H100"``, ``"4xH100"`` or ``"2xA100,2xH100"`` into devices.

    Repeated groups take the next free indices; an empty text declares none.
    """
    devices: list[Device] = []
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        if (repeat := _REPEAT.match(token)) is not None:
            start = max((d.index for d in devices), default=-1) + 1
            devices += [Device(start + i, repeat.group(2).strip()) for i in range(int(repeat.group(1)))]
        elif ":" in token and token.split(":", 1)[0].strip().isdigit():
            index, name = token.split(":", 1)
            devices.append(Device(int(index), name.strip() or "GPU"))
        else:
            raise InventoryError(
                f"E31_GPUS: {token!r} is not a device; write INDEX:TYPE (0:H100) or COUNTxTYPE (4xH100)"
            )
    indices = [d.index for d in devices]
    if len(set(indices)) != len(indices):
        raise InventoryError(f"E31_GPUS: {text!r} declares a device index twice")
    return sorted(devices)


def discover_nvml() -> list[Device]:
    """The GPUs NVML reports on this host; none where the NVIDIA driver is absent."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        devices = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            devices.append(Device(index, _text(pynvml.nvmlDeviceGetName(handle)),
                                  _text(pynvml.nvmlDeviceGetUUID(handle))))
        return devices
    finally:
        pynvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def discover(declared: str | None) -> list[Device]:
    """A declared inventory wins (an operator's word, and what tests use); else NVML; else none."""
    if declared is not None and declared.strip():
        return parse_declared(declared)
    return discover_nvml()


def matches(device: Device, gpu_type: str | None) -> bool:
    """Whether a device is of the requested type: ``H100`` matches ``NVIDIA H100 80GB HBM3``."""
    return gpu_type is None or gpu_type.lower() in device.name.lower()


def pick_devices(free: Sequence[Device], gpus: int, gpu_type: str | None) -> list[Device] | None:
    """The lowest-indexed ``gpus`` free devices of the right type, all one model, or None if they do not fit.

    One model, because a job spread over two models runs at the slower one's pace.
    """
    models: dict[str, list[Device]] = {}
    for device in sorted(free):
        if matches(device, gpu_type):
            models.setdefault(device.name, []).append(device)
    if gpus == 0:
        return []
    return next((devices[:gpus] for devices in models.values() if len(devices) >= gpus), None)


class HostLocks:
    """One lock file per device index in a folder every e31 process on the host shares."""

    def __init__(self, root: Path):
        self.root = root

    def take(self, device: Device) -> int | None:
        """An open file holding the device's lock, or None when another holder has it."""
        self.root.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(PermissionError):  # another user made it: it is theirs to open up
            self.root.chmod(0o1777)  # every user's workers share it, as /tmp is shared
        path = self.root / f"gpu-{device.index}.lock"
        fd = try_lock(path, 0o666)
        with contextlib.suppress(PermissionError, FileNotFoundError):
            path.chmod(0o666)  # whatever the creator's umask
        return fd

    def held_elsewhere(self, device: Device) -> bool:
        """Whether some other holder (another worker or a run's supervisor) has the device now."""
        fd = self.take(device)
        if fd is None:
            return True
        os.close(fd)
        return False


class Inventory:
    """This host's devices and the flow run renting each; safe to share between threads.

    With ``locks``, a device is also taken on the host's lock folder, so two worker processes
    never rent it at once; :meth:`lock_files` hands the held locks to the run's supervisor.
    """

    def __init__(self, devices: Iterable[Device], locks: Path | None = None):
        self.devices: list[Device] = sorted(devices)
        self._holder: dict[Device, UUID] = {}
        self._files: dict[Device, int] = {}
        self._host = HostLocks(locks) if locks is not None else None
        self._lock = threading.Lock()

    def free(self) -> list[Device]:
        """Devices no run holds now, here or in another process on this host."""
        with self._lock:
            mine = [d for d in self.devices if d not in self._holder]
        return [d for d in mine if self._host is None or not self._host.held_elsewhere(d)]

    def hold(self, flow_run_id: UUID, devices: Sequence[Device]) -> bool:
        """Hold exactly these devices for the run if all are free; otherwise hold nothing."""
        with self._lock:
            if any(self._holder.get(d, flow_run_id) != flow_run_id for d in devices):
                return False
            if any(d not in self.devices for d in devices):
                return False
            taken: dict[Device, int] = {}
            for device in devices:
                if device in self._files or self._host is None:
                    continue
                fd = self._host.take(device)
                if fd is None:
                    for fd in taken.values():
                        os.close(fd)
                    return False
                taken[device] = fd
            self._files.update(taken)
            for device in devices:
                self._holder[device] = flow_run_id
            return True

    def give_back(self, flow_run_id: UUID) -> list[Device]:
        """Return every device the run holds to the pool; returns what was freed.

        Closing the lock files frees the devices on the host unless the run's supervisor,
        which holds the same open files, still runs.
        """
        with self._lock:
            freed = self._held(flow_run_id)
            for device in freed:
                del self._holder[device]
                fd = self._files.pop(device, None)
                if fd is not None:
                    os.close(fd)
            return freed

    def lock_files(self, flow_run_id: UUID) -> list[int]:
        """The open lock files of the run's devices, to hand to its supervisor."""
        with self._lock:
            return [self._files[d] for d in self._held(flow_run_id) if d in self._files]

    def holders(self) -> dict[Device, UUID]:
        """Each held device and the run holding it."""
        with self._lock:
            return dict(self._holder)

    def held_by(self, flow_run_id: UUID) -> list[Device]:
        """The devices the run holds now."""
        with self._lock:
            return self._held(flow_run_id)

    def _held(self, flow_run_id: UUID) -> list[Device]:
        return sorted(d for d, holder in self._holder.items() if holder == flow_run_id)


def visible_devices_env(devices: Sequence[Device]) -> dict[str, str]:
    """The variables that show a run exactly its rented devices and no others."""
    indices = ",".join(str(d.index) for d in devices)
    return {
        # NVML and CUDA must count devices the same way for the indices to mean the same GPUs.
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": indices,
        "NVIDIA_VISIBLE_DEVICES": indices or "none",
    }
