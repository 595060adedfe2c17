"""The GPUs on this host and which flow run rents each one.

``E31_GPUS="0:H100,1:H100" prefect worker start --pool gpu --type e31`` declares
an inventory; without it the worker asks NVML, and finds none where NVML does
not answer. Renting is all-or-nothing and per flow run, so returning a run's
devices twice is harmless.

A device is rented to one run at a time per host, whatever worker process asks
(any pool, any ``E31_HOME``): renting takes an exclusive ``flock`` on the
device's file in a host-wide folder (``E31_DEVICE_LOCKS``). The kernel drops a
lock when the last process holding it dies, so a killed worker or supervisor
never leaves a device rented. No job can open a lock file (the folder lets in
its owner and its group only), and one held by no e31 process is named in the log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import UUID

from e31_prefect.host.filelocks import try_lock
from e31_prefect.host.job_users import JOB_UIDS
from e31_prefect.host.lock_holders import StrangerWatch

_REPEAT = re.compile(r"^(\d+)\s*[xX]\s*(\S.*)$")


@dataclass(frozen=True, order=True)
class Device:
    """One GPU: its index on the host (as NVML and CUDA_VISIBLE_DEVICES count), its model name, and the minor
    number of its node ``/dev/nvidia<minor>`` where NVML told it (another count than the index: None means
    the index is the minor, as in a declared inventory)."""

    index: int
    name: str
    uuid: str | None = None
    minor: int | None = field(default=None, compare=False)


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
                                  _text(pynvml.nvmlDeviceGetUUID(handle)), _minor(pynvml, handle)))
        return devices
    finally:
        pynvml.nvmlShutdown()


def _minor(pynvml: Any, handle: Any) -> int | None:
    """The GPU's node's minor number (``/dev/nvidia<minor>``); None where NVML cannot tell (the index then)."""
    try:
        return int(pynvml.nvmlDeviceGetMinorNumber(handle))
    except pynvml.NVMLError:
        return None


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


LOCK_FOLDER_MODE = 0o2770  # its group's workers share it (each lock file takes its group); others, jobs too, not
LOCK_FILE_MODE = 0o660


class DeviceLocksError(RuntimeError):
    """The host's device lock folder is open to jobs, or closed to this worker, and this worker cannot fix it."""


def plan_lock_folder(mode: int, uid: int, gid: int, worker_uid: int) -> tuple[int | None, str | None]:
    """What to do with the lock folder found: ``(mode to set, None)`` to close it, ``(None, refusal)`` when it is
    open and not this worker's to close, ``(None, None)`` when closed (nothing for others, and a group no
    job is in: a job runs as the group of its uid's number)."""
    if not stat.S_IMODE(mode) & stat.S_IRWXO and gid not in JOB_UIDS:
        return None, None
    if worker_uid not in (0, uid):
        return None, (f"E31_DEVICE_LOCKS: the folder is {stat.S_IMODE(mode):04o} (owner uid {uid}, group {gid}), "
                      "so a job on this host could lock a GPU it never rented, and this worker cannot close it: "
                      f"have its owner run `chmod {LOCK_FOLDER_MODE:04o}` on it (with a group every e31 worker's "
                      "user is in), or set E31_DEVICE_LOCKS to a folder made so")
    return LOCK_FOLDER_MODE, None


class HostLocks:
    """One lock file per device index in a folder every e31 worker on the host shares, and no job opens.

    The folder is ``2770``: its owner's and its group's workers take locks in it (the lock files
    inherit its group); nobody else, a job's own uid included, can open them. A folder found open
    (the ``1777`` of e31 before) is closed and the change said; see :meth:`prepare`.
    """

    def __init__(self, root: Path, log: logging.Logger | None = None):
        self.root = root
        self.log = log or logging.getLogger("e31.inventory")
        self._prepared = False
        self._strangers = StrangerWatch(self.log)

    def prepare(self) -> list[str]:
        """Make the folder (closed), or close the one found open; returns a line per change.

        Raises :class:`DeviceLocksError` when it is open and another user's, or this worker may not use it.
        """
        said = []
        try:
            self.root.mkdir(mode=0o770, parents=True)
            os.chmod(self.root, LOCK_FOLDER_MODE)  # whatever the umask; setgid: its files take its group
        except FileExistsError:
            info = os.stat(self.root)
            mode, refusal = plan_lock_folder(info.st_mode, info.st_uid, info.st_gid, os.geteuid())
            if refusal is not None:
                raise DeviceLocksError(f"{refusal} ({self.root})") from None
            if mode is not None:
                os.chmod(self.root, mode)
                for lock in self.root.glob("gpu-*.lock"):  # a job that opened one before keeps no new way in
                    with contextlib.suppress(OSError):
                        lock.chmod(LOCK_FILE_MODE)
                said.append(f"{self.root} was open to other users ({stat.S_IMODE(info.st_mode):04o}), so a job "
                            f"could lock a GPU it never rented: closed it ({mode:04o})")
        if not os.access(self.root, os.R_OK | os.W_OK | os.X_OK):
            info = os.stat(self.root)
            raise DeviceLocksError(
                f"E31_DEVICE_LOCKS: {self.root} ({stat.S_IMODE(info.st_mode):04o}, owner uid {info.st_uid}, group "
                f"{info.st_gid}) does not let this worker's user (uid {os.geteuid()}) in: add that user to the "
                "folder's group (usermod -aG GROUP USER) and start the worker again")
        self._prepared = True
        for line in said:
            self.log.warning(line)
        return said

    def path(self, device: Device) -> Path:
        """The device's lock file."""
        return self.root / f"gpu-{device.index}.lock"

    def take(self, device: Device) -> int | None:
        """An open file holding the device's lock, or None when another holder has it."""
        if not self._prepared:
            self.prepare()
        path = self.path(device)
        fd = try_lock(path, LOCK_FILE_MODE)
        if fd is not None:
            with contextlib.suppress(PermissionError, FileNotFoundError):
                path.chmod(LOCK_FILE_MODE)  # whatever the creator's umask (only its owner may chmod)
        return fd

    def held_elsewhere(self, device: Device) -> bool:
        """Whether some other holder (another worker or a run's supervisor) has the device now; one that is
        neither is named in the log (:mod:`e31_prefect.host.lock_holders`)."""
        fd = self.take(device)
        if fd is None:
            self._strangers.locked(self.path(device))
            return True
        os.close(fd)
        return False


class Inventory:
    """This host's devices and the flow run renting each; safe to share between threads.

    With ``locks``, a device is also taken on the host's lock folder, so two worker processes
    never rent it at once; :meth:`lock_files` hands the held locks to the run's supervisor.

    A run whose work still loads holds nothing: its poll only plans devices for it (:meth:`plan`),
    which this worker's next polls leave to it a while, and it rents from what is free once ready
    (:meth:`choose`).
    """

    def __init__(self, devices: Iterable[Device], locks: Path | None = None, log: logging.Logger | None = None):
        self.devices: list[Device] = sorted(devices)
        self._holder: dict[Device, UUID] = {}
        self._planned: dict[UUID, tuple[tuple[Device, ...], float]] = {}  # devices, and until when (monotonic)
        self._files: dict[Device, int] = {}
        self._host = HostLocks(locks, log) if locks is not None else None
        self._lock = threading.Lock()
        self._drained: dict[Device, str] = {}  # devices no new run rents, and why (a failed health check, an operator)

    def prepare(self) -> list[str]:
        """Make or close the host's lock folder (:meth:`HostLocks.prepare`); a line per change."""
        return self._host.prepare() if self._host is not None else []

    def free(self) -> list[Device]:
        """Devices no run holds now, here or in another process on this host, and not drained."""
        with self._lock:
            mine = [d for d in self.devices if d not in self._holder and d not in self._drained]
        return [d for d in mine if self._host is None or not self._host.held_elsewhere(d)]

    def set_drained(self, drained: dict[int, str]) -> None:
        """Drain these devices (by index, with why): no new run rents them; a run on one goes on."""
        with self._lock:
            self._drained = {d: drained[d.index] for d in self.devices if d.index in drained}

    def drained(self) -> dict[Device, str]:
        """Each drained device and why."""
        with self._lock:
            return dict(self._drained)

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
            self._planned.pop(flow_run_id, None)
            return True

    def plan(self, flow_run_id: UUID, devices: Sequence[Device], seconds: float) -> None:
        """Note that a poll placed the run on these devices while its work loads. Nothing is held (no lock, no
        holder: another run, of this worker or another, may rent them meanwhile); for ``seconds`` at most,
        this worker's polls plan around them (:meth:`planned`)."""
        with self._lock:
            self._planned[flow_run_id] = (tuple(devices), time.monotonic() + seconds)

    def planned(self) -> dict[Device, UUID]:
        """Each device a poll planned for a run that holds nothing yet, and that run; a plan past its time
        is left out (its run loads for longer than a run should: it delays no other run)."""
        at = time.monotonic()
        with self._lock:
            return {device: run for run, (devices, until) in self._planned.items() if until > at
                    for device in devices}

    def choose(self, flow_run_id: UUID, gpus: int, gpu_type: str | None) -> list[Device] | None:
        """The devices the run would rent now: those planned for it where all are free, else the fitting free
        ones no other run's plan names, else any fitting free ones; None where none fit."""
        free = self.free()
        with self._lock:
            mine = sorted(self._planned.get(flow_run_id, ((), 0.0))[0])
        if len(mine) == gpus and all(device in free for device in mine):
            return mine
        others = set(self.planned()) - set(mine)
        unplanned = pick_devices([device for device in free if device not in others], gpus, gpu_type)
        return unplanned if unplanned is not None else pick_devices(free, gpus, gpu_type)

    def give_back(self, flow_run_id: UUID) -> list[Device]:
        """Return every device the run holds to the pool; returns what was freed.

        Closing the lock files frees the devices on the host unless the run's supervisor,
        which holds the same open files, still runs.
        """
        with self._lock:
            self._planned.pop(flow_run_id, None)
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


def gpu_minors(devices: Sequence[Device]) -> list[int]:
    """The minor numbers of the devices' nodes, which a run's supervisor opens to its work at the hand-over."""
    return [device.index if device.minor is None else device.minor for device in devices]


def visible_devices_env(devices: Sequence[Device]) -> dict[str, str]:
    """The variables that show a run exactly its rented devices and no others."""
    indices = ",".join(str(d.index) for d in devices)
    return {
        # NVML and CUDA must count devices the same way for the indices to mean the same GPUs.
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": indices,
        "NVIDIA_VISIBLE_DEVICES": indices or "none",
    }
