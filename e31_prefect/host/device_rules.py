"""Which device nodes a process job may open: an allow-list, as cgroup device rules (pure).

A run's supervisor fences its work's devices (:mod:`e31_prefect.host.device_fence`) with
:func:`plan`, as Slurm's ``ConstrainDevices=yes`` and runc's default rules do: every process of
the run may open the few nodes any program needs (``/dev/null``, ``/dev/urandom``, a terminal
...) from its start, the nodes of its rented GPUs and the control nodes CUDA needs
(``nvidiactl``, ``nvidia-uvm``, ``nvidia-uvm-tools``) from the hand-over, and no other device
at all, whatever path it opens it by. The rules say how (:meth:`Rule.v1`, for a cgroup v1
``devices.allow``) and :func:`program` assembles them into the BPF program a cgroup v2 group
runs on each open (``BPF_PROG_TYPE_CGROUP_DEVICE``).

A GPU's node is ``/dev/nvidia<minor>``, character 195:<minor>. NVML tells a GPU's minor
number (its index is another count); a declared inventory's index is its minor. The
``nvidia-uvm`` major is given when its module loads: it is read from ``/proc/devices``.

Only the standard library: the supervisor plans these before it starts the work.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

NVIDIA_MAJOR = 195  # the NVIDIA driver's fixed major: /dev/nvidia<minor>, /dev/nvidiactl
NVIDIACTL_MINOR = 255
GPU_MINORS = range(0, 254)  # 254 is nvidia-modeset's, 255 nvidiactl's: neither is a GPU
UVM_NAME = "nvidia-uvm"  # its major is the module's, given as it loads; minor 0 is nvidia-uvm, 1 nvidia-uvm-tools
UVM_MINORS = (0, 1)


@dataclass(frozen=True)
class Rule:
    """One allowed kind of device: character (``c``) or block (``b``), its major and minor (None: any), and
    what may be done with it (``r`` read, ``w`` write, ``m`` mknod)."""

    kind: str
    major: int | None
    minor: int | None
    access: str = "rw"

    def v1(self) -> str:
        """The rule as a line of a cgroup v1 ``devices.allow`` (``c 1:3 rw``; ``*`` for any)."""
        def number(value: int | None) -> str:
            return "*" if value is None else str(value)

        return f"{self.kind} {number(self.major)}:{number(self.minor)} {self.access}"

    def allows(self, kind: str, major: int, minor: int, access: str) -> bool:
        """Whether this rule lets ``access`` (some of ``rwm``) be done to device ``kind`` major:minor."""
        return (kind == self.kind and self.major in (None, major) and self.minor in (None, minor)
                and set(access) <= set(self.access))


# What any program needs, as runc allows it in every container (but no mknod, here or anywhere: a job is
# no root, and a node it made would be judged by its numbers all the same).
BASE = (
    Rule("c", 1, 3),    # /dev/null
    Rule("c", 1, 5),    # /dev/zero
    Rule("c", 1, 7),    # /dev/full
    Rule("c", 1, 8),    # /dev/random
    Rule("c", 1, 9),    # /dev/urandom
    Rule("c", 5, 0),    # /dev/tty
    Rule("c", 5, 2),    # /dev/ptmx
    Rule("c", 136, None),  # /dev/pts/*
)


def character_majors(proc_devices: str) -> dict[str, int]:
    """The character devices' majors by name, from the text of ``/proc/devices``."""
    found: dict[str, int] = {}
    for line in proc_devices.split("Block devices:", 1)[0].splitlines():
        number, _, name = line.strip().partition(" ")
        if number.isdigit() and name.strip():
            found.setdefault(name.strip(), int(number))
    return found


def plan(gpu_minors: Sequence[int] | None, proc_devices: str) -> list[Rule]:
    """The run's allow-list: :data:`BASE`; with rented GPUs (their minors) also each one's node, ``nvidiactl``
    and, where its module is loaded, ``nvidia-uvm`` and ``nvidia-uvm-tools``. None or no minor (before the
    hand-over, or a run that rented none): no NVIDIA node at all.

    Raises ValueError for a minor that is no GPU's (a control node's, or out of the driver's range).
    """
    rules = list(BASE)
    for minor in gpu_minors or ():  # from the worker's hand-over message: JSON, checked
        if not isinstance(minor, int) or isinstance(minor, bool) or minor not in GPU_MINORS:
            raise ValueError(f"{minor!r} is not a GPU's minor number (0-{GPU_MINORS[-1]})")
    minors = sorted(set(gpu_minors or ()))
    if not minors:
        return rules
    rules += [Rule("c", NVIDIA_MAJOR, minor) for minor in minors]
    rules.append(Rule("c", NVIDIA_MAJOR, NVIDIACTL_MINOR))
    uvm = character_majors(proc_devices).get(UVM_NAME)
    if uvm is not None:
        rules += [Rule("c", uvm, minor) for minor in UVM_MINORS]
    return rules


def uvm_missing(gpu_minors: Sequence[int] | None, proc_devices: str) -> str | None:
    """Where GPUs are rented and ``nvidia-uvm`` is not loaded, what to tell the operator (None: all is well)."""
    if not gpu_minors or UVM_NAME in character_majors(proc_devices):
        return None
    return (f"{UVM_NAME} is not loaded on this host (not in /proc/devices), so this run's processes cannot "
            "open it and CUDA will not start: load it at boot (`nvidia-modprobe -u -c=0`, or "
            "nvidia-persistenced)")


def allowed(rules: Iterable[Rule], kind: str, major: int, minor: int, access: str) -> bool:
    """Whether some rule allows ``access`` to the device: what a cgroup v1 ``devices`` group decides."""
    return any(rule.allows(kind, major, minor, access) for rule in rules)


# The BPF program a cgroup v2 group runs on each open and mknod. Its context is struct bpf_cgroup_dev_ctx:
# u32 access_type ((access << 16) | kind), u32 major, u32 minor. It returns 1 to allow, 0 to refuse (EPERM).
KINDS = {"b": 1, "c": 2}  # BPF_DEVCG_DEV_BLOCK, BPF_DEVCG_DEV_CHAR
ACCESS = {"m": 1, "r": 2, "w": 4}  # BPF_DEVCG_ACC_MKNOD, _READ, _WRITE
# Opcodes (class | operation | source): loads of a 32-bit word, 32-bit ALU, 64-bit jumps, exit.
LDX_W = 0x61
AND_K, RSH_K, MOV_K, MOV_X = 0x54, 0x74, 0xB4, 0xBC
JNE_K, JNE_X, EXIT = 0x55, 0x5D, 0x95
R0, R1, R2, R3, R4, R5 = range(6)


def instruction(code: int, dst: int = 0, src: int = 0, offset: int = 0, imm: int = 0) -> bytes:
    """One BPF instruction (struct bpf_insn, little-endian: the destination register in the low nibble)."""
    return struct.pack("<BBhi", code, dst | src << 4, offset, imm)


def program(rules: Iterable[Rule]) -> bytes:
    """The rules as a BPF_PROG_TYPE_CGROUP_DEVICE program: a block per rule, each jumping past itself to the
    next at the first field that does not match, and returning 1 (allow) if all match; 0 after the last."""
    code = [
        instruction(LDX_W, R2, R1, 0), instruction(AND_K, R2, imm=0xFFFF),  # r2: the device's kind
        instruction(LDX_W, R3, R1, 0), instruction(RSH_K, R3, imm=16),      # r3: the access asked for
        instruction(LDX_W, R4, R1, 4),                                      # r4: major
        instruction(LDX_W, R5, R1, 8),                                      # r5: minor
    ]
    for rule in rules:
        access = sum(ACCESS[letter] for letter in set(rule.access))
        # Each check is a jump to the next block; its offset is counted from the instruction after it.
        checks: list[tuple[int, int, int, int]] = [(JNE_K, R2, 0, KINDS[rule.kind])]
        if access != sum(ACCESS.values()):  # r1 = r3 & access; the access asked for must all be allowed
            checks += [(MOV_X, R1, R3, 0), (AND_K, R1, 0, access), (JNE_X, R1, R3, 0)]
        if rule.major is not None:
            checks.append((JNE_K, R4, 0, rule.major))
        if rule.minor is not None:
            checks.append((JNE_K, R5, 0, rule.minor))
        length = len(checks) + 2  # the checks, then r0 = 1 and exit
        for at, (op, dst, src, imm) in enumerate(checks):
            offset = length - at - 1 if op in (JNE_K, JNE_X) else 0
            code.append(instruction(op, dst, src, offset, imm))
        code += [instruction(MOV_K, R0, imm=1), instruction(EXIT)]
    code += [instruction(MOV_K, R0, imm=0), instruction(EXIT)]
    return b"".join(code)
