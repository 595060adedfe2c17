"""A run's devices fenced by its cgroup: only the allowed nodes open, the rented GPUs only from the hand-over.

A run's supervisor makes a :class:`DeviceFence` on the run's cgroup(s) before it starts the
work, so the rules hold from the process's first instruction: no GPU node opens to it while it
waits for its devices. At the hand-over the supervisor opens the rented GPUs' nodes and the
control nodes CUDA needs (:meth:`DeviceFence.open_gpus`), then passes the hand-over on to the
job. The rules are :func:`e31_prefect.host.device_rules.plan`'s; hosts differ in how they hold them:

- cgroup v2: a ``BPF_PROG_TYPE_CGROUP_DEVICE`` program attached to the run's group (as runc and
  systemd do), loaded here through ``bpf()``, after any a group of the same name kept from an earlier
  run is detached; the hand-over attaches the wider program, then detaches the first (both hold for
  a moment, which only narrows);
- cgroup v1 ``devices`` (a hybrid host): ``a`` denied (which also clears what a group of the same
  name kept from an earlier run), then each rule allowed, in the run's group;
- neither (no permission, no cgroupfs, ``bpf()`` refused): the run goes on and its record says
  device isolation is not enforced.

A hybrid host that gives both gets both. Only the standard library: it runs in the supervisor.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import struct
from collections.abc import Sequence
from pathlib import Path

from e31_prefect.host import device_rules

PROC_DEVICES = Path("/proc/devices")
BPF_PROG_LOAD, BPF_PROG_ATTACH, BPF_PROG_DETACH, BPF_PROG_GET_FD_BY_ID, BPF_PROG_QUERY = 5, 8, 9, 13, 16
BPF_PROG_TYPE_CGROUP_DEVICE, BPF_CGROUP_DEVICE, BPF_F_ALLOW_MULTI = 15, 6, 2
BPF_SYSCALL = {"x86_64": 321, "aarch64": 280}  # bpf()'s number where e31's GPU hosts run
ATTR_BYTES = 128  # what the kernel reads of union bpf_attr; the bytes it does not know are zeros
LICENSE = b"Apache-2.0"


def bpf(command: int, attr: bytes) -> int:
    """The ``bpf()`` system call with ``attr`` (union bpf_attr, zero-padded); its result, or OSError."""
    return _bpf(command, ctypes.create_string_buffer(attr.ljust(ATTR_BYTES, b"\0"), ATTR_BYTES))


def _bpf(command: int, attr: ctypes.Array) -> int:
    """``bpf()`` on a buffer of ATTR_BYTES, which the kernel may write its answer into."""
    number = BPF_SYSCALL.get(platform.machine())
    if number is None:
        raise OSError(0, f"e31 knows no bpf() system call number for {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.syscall(ctypes.c_long(number), ctypes.c_int(command), attr, ctypes.c_uint(ATTR_BYTES))
    if result < 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    return result


def load(rules: Sequence[device_rules.Rule]) -> int:
    """The rules loaded as a device program; its descriptor (close-on-exec, as every BPF one is)."""
    code = device_rules.program(rules)
    instructions = ctypes.create_string_buffer(code, len(code))
    license_text = ctypes.create_string_buffer(LICENSE)
    # prog_type, insn_cnt, insns, license (log_level, log_size, log_buf, kern_version ... all 0)
    return bpf(BPF_PROG_LOAD, struct.pack("<IIQQ", BPF_PROG_TYPE_CGROUP_DEVICE, len(code) // 8,
                                          ctypes.addressof(instructions), ctypes.addressof(license_text)))


def attach(group: int, program: int) -> None:
    """Attach a device program to a cgroup (an open folder), beside any attached before."""
    bpf(BPF_PROG_ATTACH, struct.pack("<IIII", group, program, BPF_CGROUP_DEVICE, BPF_F_ALLOW_MULTI))


def detach(group: int, program: int) -> None:
    """Detach one device program from a cgroup."""
    bpf(BPF_PROG_DETACH, struct.pack("<III", group, program, BPF_CGROUP_DEVICE))


def attached(group: int) -> list[int]:
    """The ids of the device programs attached to a cgroup itself (not its parents')."""
    ids = (ctypes.c_uint32 * 64)()
    answer = ctypes.create_string_buffer(ATTR_BYTES)
    # target_fd, attach_type, query_flags, attach_flags, prog_ids, prog_cnt (in: room; out: how many)
    struct.pack_into("<IIIIQI", answer, 0, group, BPF_CGROUP_DEVICE, 0, 0, ctypes.addressof(ids), len(ids))
    _bpf(BPF_PROG_QUERY, answer)
    count = struct.unpack_from("<I", answer, 24)[0]
    return list(ids[:min(count, len(ids))])


def detach_all(group: int) -> None:
    """Detach every device program attached to a cgroup: a group left by an earlier run of the same name
    (a retried flow run whose group could not be removed) keeps nothing of that run's rules."""
    for program_id in attached(group):
        program = bpf(BPF_PROG_GET_FD_BY_ID, struct.pack("<I", program_id))
        try:
            detach(group, program)
        finally:
            os.close(program)


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


class DeviceFence:
    """The device rules of one run's cgroup(s); see the module's docstring. Made with :meth:`create`."""

    def __init__(self, v2: Path | None, v1: Path | None, table: Path = PROC_DEVICES):
        self.v2 = v2  # the run's cgroup v2 folder, where a BPF program holds the rules
        self.v1 = v1  # the run's cgroup v1 devices folder
        self.table = table  # /proc/devices: where nvidia-uvm's major is read at the hand-over
        self.ways: list[str] = []  # how the rules are held: "cgroup v2 BPF", "cgroup v1 devices"
        self.why: list[str] = []  # what the host could not give, in words, for the run's log
        self._group = -1
        self._program = -1

    @classmethod
    def create(cls, v2: Path | None, v1: Path | None, table: Path = PROC_DEVICES) -> DeviceFence:
        """Fence the run's groups with the rules of a run that holds no GPU yet; call before the work starts."""
        fence = cls(v2, v1, table)
        rules = device_rules.plan(None, "")
        failed: list[str] = []
        if v2 is not None:
            try:
                fence._attach_v2(rules)
                fence.ways.append("cgroup v2 BPF")
            except OSError as exc:
                failed.append(f"cannot attach a BPF device program to {v2}: {_reason(exc)}")
        if v1 is not None:
            try:
                _write(v1 / "devices.deny", "a")
                fence._allow_v1(rules)
                fence.ways.append("cgroup v1 devices")
            except OSError as exc:
                with contextlib.suppress(OSError):  # half a fence would refuse the work /dev/null: none
                    _write(v1 / "devices.allow", "a")
                failed.append(f"cannot set the device rules of {v1}: {_reason(exc)}")
        if not fence.ways:  # one way that holds is enough: the other's failure is no news to the operator
            fence.why += failed + [
                "this host gives e31 no device rules for this run (no cgroup v1 devices group, no BPF device "
                "program on a cgroup v2 group): device isolation is not enforced, so its processes may open "
                "every GPU of the host"]
        return fence

    @property
    def enforced(self) -> bool:
        """Whether the kernel holds the run to its rules in some way."""
        return bool(self.ways)

    def open_gpus(self, minors: Sequence[int]) -> list[str]:
        """At the hand-over: open the rented GPUs (their minor numbers) and the control nodes CUDA needs to
        the run's processes; returns what to tell the operator. Raises OSError (or ValueError for a minor
        that is no GPU's) where a fence could not be widened: the run must not start half-fenced."""
        table = _read(self.table)
        rules = device_rules.plan(minors, table)
        if "cgroup v2 BPF" in self.ways:
            self._attach_v2(rules)
        if "cgroup v1 devices" in self.ways:
            assert self.v1 is not None
            self._allow_v1(rules)
        missing = device_rules.uvm_missing(minors, table)
        return [missing] if missing and self.ways else []

    def close(self) -> None:
        """Let go of the program and the group (the group's removal detaches what is attached)."""
        for fd in (self._program, self._group):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._program = self._group = -1

    def _attach_v2(self, rules: Sequence[device_rules.Rule]) -> None:
        """Attach a program of these rules to the v2 group, then detach the one it replaces."""
        assert self.v2 is not None
        if self._group < 0:
            self._group = os.open(self.v2, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            detach_all(self._group)
        program = load(rules)
        try:
            attach(self._group, program)
        except OSError:
            os.close(program)
            raise
        if self._program >= 0:  # until here both held: a device is open only where both allow it
            try:
                detach(self._group, self._program)
            except OSError:
                os.close(program)  # still attached, with the first: the run stays as narrow as it was
                raise
            os.close(self._program)
        self._program = program

    def _allow_v1(self, rules: Sequence[device_rules.Rule]) -> None:
        assert self.v1 is not None
        for rule in rules:
            _write(self.v1 / "devices.allow", rule.v1())


def _write(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
