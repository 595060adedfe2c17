"""Whether this host's GPUs are healthy: NVML's word (lost, Xid, ECC) and the operator's health command.

    E31_GPU_HEALTH_COMMAND="/usr/local/bin/gpu-ok {index}" prefect worker start --pool gpu --type e31

A pool's worker checks its devices every ``E31_GPU_HEALTH_SECONDS``. A device fails when NVML reports it lost
(``GPU_IS_LOST``), a critical Xid event on it, or uncorrected volatile ECC errors, or when the operator's
health command (run once per device, ``{index}`` and ``{uuid}`` filled in and ``E31_GPU_INDEX`` set; a
non-zero exit or a hang of 30 s is a failure, its last line of output the reason) says so. A failed device
is drained on its host (no run rents it) and the run on it ends ``DeviceFailed``, requeued as a lost host's
is (:mod:`e31_prefect.surface.lost_attempts`).

A declared inventory (``E31_GPUS``, a host with no NVIDIA driver) is checked by its command alone.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
from collections.abc import Sequence
from typing import Any

from e31_prefect.host.inventory import Device

COMMAND_SECONDS = 30.0
XID_IGNORED = {31, 43, 45}  # a job's own faults (memory page fault, stopped kernel, preempted), not the GPU's


def command_problem(command: str, device: Device) -> str | None:
    """What the operator's health command says is wrong with ``device`` (None: it is healthy)."""
    argv = [part.replace("{index}", str(device.index)).replace("{uuid}", device.uuid or "")
            for part in shlex.split(command)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_SECONDS, stdin=subprocess.DEVNULL,
                              env={**os.environ, "E31_GPU_INDEX": str(device.index), "E31_GPU_UUID": device.uuid or ""})
    except subprocess.TimeoutExpired:
        return f"the health command did not answer in {COMMAND_SECONDS:.0f} s"
    except OSError as exc:
        return f"the health command could not run: {exc}"
    if done.returncode == 0:
        return None
    said = (done.stdout + done.stderr).strip().splitlines()
    return f"the health command exited {done.returncode}" + (f": {said[-1][:200]}" if said else "")


class NvmlHealth:
    """NVML's word on the host's GPUs, where NVML answers: lost devices, critical Xid events since the last look,
    uncorrected ECC errors. Opened once (its Xid events are kept between looks)."""

    def __init__(self, devices: Sequence[Device]):
        self.nvml: Any = None
        self.events: Any = None
        with contextlib.suppress(Exception):
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.events = pynvml.nvmlEventSetCreate()
            for device in devices:
                with contextlib.suppress(pynvml.NVMLError):
                    pynvml.nvmlDeviceRegisterEvents(pynvml.nvmlDeviceGetHandleByIndex(device.index),
                                                    pynvml.nvmlEventTypeXidCriticalError, self.events)

    def problems(self, devices: Sequence[Device]) -> dict[int, str]:
        """Each failing device's index and what NVML says of it."""
        if self.nvml is None:
            return {}
        pynvml, found = self.nvml, {}
        while self.events is not None:
            try:
                event = pynvml.nvmlEventSetWait_v2(self.events, 0)
            except pynvml.NVMLError:
                break
            if int(event.eventData) not in XID_IGNORED:
                with contextlib.suppress(pynvml.NVMLError):
                    index = pynvml.nvmlDeviceGetIndex(event.device)
                    found[index] = f"NVML reported Xid {int(event.eventData)}"
        for device in devices:
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(device.index)
                pynvml.nvmlDeviceGetUUID(handle)  # a GPU fallen off the bus answers no more
            except pynvml.NVMLError as exc:
                found[device.index] = f"NVML lost the GPU ({exc})"
                continue
            with contextlib.suppress(pynvml.NVMLError):
                ecc = pynvml.nvmlDeviceGetTotalEccErrors(handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                         pynvml.NVML_VOLATILE_ECC)
                if ecc:
                    found.setdefault(device.index, f"NVML counts {ecc} uncorrected ECC error(s)")
        return found


def problems(devices: Sequence[Device], command: str | None, nvml: NvmlHealth | None) -> dict[int, str]:
    """Each failing device's index and why: NVML's word first, then the operator's command."""
    found = nvml.problems(devices) if nvml is not None else {}
    if command:
        for device in devices:
            if device.index not in found and (problem := command_problem(command, device)) is not None:
                found[device.index] = problem
    return found
