"""Unit tests for e31_prefect.host.device_rules: which device nodes a process job may open, before and after
its hand-over, as cgroup v1 lines and as the BPF program a cgroup v2 group runs.

The BPF program is run here by a small interpreter of the few instructions it is made of, and must decide
every device access exactly as the rules do (as a cgroup v1 ``devices`` group would).
"""

from __future__ import annotations

import itertools
import random
import struct

import pytest

from e31_prefect.host import device_rules
from e31_prefect.host.device_rules import BASE, Rule, allowed, character_majors, plan, program, uvm_missing

# /proc/devices of a host with its NVIDIA driver loaded (the uvm major is the module's, given as it loads).
PROC_DEVICES = """Character devices:
  1 mem
  4 /dev/vc/0
  4 tty
  5 /dev/tty
  5 /dev/ptmx
136 pts
195 nvidia-frontend
234 nvidia-uvm
235 nvidia-caps
254 ndctl

Block devices:
  7 loop
234 nvidia-uvm
259 blkext
"""
UVM = 234
NO_DRIVER = "Character devices:\n  1 mem\n136 pts\n\nBlock devices:\n  7 loop\n"
ACCESSES = ["".join(letters) for n in (1, 2, 3) for letters in itertools.combinations("rwm", n)]


def nvidia_nodes(rules: list[Rule]) -> set[tuple[int, int]]:
    """The (major, minor) of every NVIDIA node (GPU, control, uvm) the rules let be read and written."""
    nodes = {(195, minor) for minor in range(256)} | {(UVM, 0), (UVM, 1), (UVM, 2)}
    return {node for node in nodes if allowed(rules, "c", *node, "rw")}


# -- /proc/devices ------------------------------------------------------------------------------


def test_character_majors_are_read_by_name_and_block_devices_are_not():
    majors = character_majors(PROC_DEVICES)
    assert majors["nvidia-uvm"] == UVM and majors["nvidia-frontend"] == 195 and majors["pts"] == 136
    assert "loop" not in majors and "blkext" not in majors
    assert majors["tty"] == 4, "the first of a name is kept"
    assert character_majors("") == {} and character_majors("garbage\n  x y\n") == {}


# -- plan ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("minors", [None, [], ()], ids=["before-the-hand-over", "no-gpu", "empty"])
def test_before_the_hand_over_or_without_a_gpu_no_nvidia_node_opens(minors):
    rules = plan(minors, PROC_DEVICES)
    assert rules == list(BASE)
    assert nvidia_nodes(rules) == set()


def test_after_the_hand_over_exactly_the_rented_gpus_and_the_control_nodes_open():
    rules = plan([2, 1], PROC_DEVICES)
    assert nvidia_nodes(rules) == {(195, 1), (195, 2), (195, 255), (UVM, 0), (UVM, 1)}
    assert rules[:len(BASE)] == list(BASE)


def test_without_nvidia_uvm_loaded_its_node_stays_closed_and_the_operator_is_told():
    rules = plan([0], NO_DRIVER)
    assert nvidia_nodes(rules) == {(195, 0), (195, 255)}
    assert "nvidia-uvm is not loaded" in uvm_missing([0], NO_DRIVER)
    assert uvm_missing([0], PROC_DEVICES) is None
    assert uvm_missing([], NO_DRIVER) is None, "a run without a GPU needs no uvm"


def test_every_subset_of_eight_gpus_opens_exactly_itself():
    for size in range(1, 9):
        for rented in itertools.combinations(range(8), size):
            rules = plan(list(rented), PROC_DEVICES)
            gpus = {minor for major, minor in nvidia_nodes(rules) if major == 195 and minor < 254}
            assert gpus == set(rented), rented


@pytest.mark.parametrize("minor", [254, 255, -1, 256, 2**20, True, "1", 1.0])
def test_a_minor_that_is_no_gpus_is_refused(minor):
    with pytest.raises(ValueError, match="not a GPU's minor"):
        plan([0, minor], PROC_DEVICES)


def test_no_rule_allows_mknod_or_a_block_device_or_a_device_outside_the_list():
    for rented in (None, [0], [0, 1, 2, 3]):
        rules = plan(rented, PROC_DEVICES)
        for major, minor in itertools.product(range(0, 300), [0, 1, 2, 3, 5, 7, 8, 9, 254, 255]):
            assert not allowed(rules, "c", major, minor, "m") and not allowed(rules, "b", major, minor, "r")
            if allowed(rules, "c", major, minor, "r"):
                assert (major, minor) in {(1, 3), (1, 5), (1, 7), (1, 8), (1, 9), (5, 0), (5, 2)} \
                    or major == 136 or (major, minor) in nvidia_nodes(rules), (major, minor)
    # What a job itself needs, whatever it rented.
    for path, node in {"null": (1, 3), "zero": (1, 5), "urandom": (1, 9), "tty": (5, 0), "pts/7": (136, 7)}.items():
        assert allowed(plan(None, ""), "c", *node, "rw"), path


def test_rules_as_cgroup_v1_lines():
    assert Rule("c", 1, 3).v1() == "c 1:3 rw"
    assert Rule("c", 136, None).v1() == "c 136:* rw"
    assert Rule("b", None, None, "m").v1() == "b *:* m"
    assert [rule.v1() for rule in plan([3], PROC_DEVICES)[len(BASE):]] == [
        "c 195:3 rw", "c 195:255 rw", f"c {UVM}:0 rw", f"c {UVM}:1 rw"]


# -- the BPF program ----------------------------------------------------------------------------


def run_program(code: bytes, kind: str, major: int, minor: int, access: str) -> int:
    """Run a device program on one access, as the kernel would (the instructions it is made of only)."""
    context = [(sum(device_rules.ACCESS[a] for a in access) << 16) | device_rules.KINDS[kind], major, minor]
    registers = [0] * 11
    at = 0
    for _ in range(10_000):
        op, regs, offset, imm = struct.unpack_from("<BBhi", code, at * 8)
        dst, src = regs & 0xF, regs >> 4
        at += 1
        if op == device_rules.LDX_W:
            assert src == 1 and offset in (0, 4, 8)
            registers[dst] = context[offset // 4]
        elif op == device_rules.AND_K:
            registers[dst] &= imm & 0xFFFFFFFF
        elif op == device_rules.RSH_K:
            registers[dst] = (registers[dst] & 0xFFFFFFFF) >> imm
        elif op == device_rules.MOV_K:
            registers[dst] = imm & 0xFFFFFFFF
        elif op == device_rules.MOV_X:
            registers[dst] = registers[src] & 0xFFFFFFFF
        elif op == device_rules.JNE_K:
            if registers[dst] != imm:
                at += offset
        elif op == device_rules.JNE_X:
            if registers[dst] != registers[src]:
                at += offset
        elif op == device_rules.EXIT:
            return registers[0]
        else:
            raise AssertionError(f"unknown opcode {op:#x}")
        assert 0 <= at < len(code) // 8, "a jump out of the program"
    raise AssertionError("the program never exits")


@pytest.mark.parametrize("rented", [None, [0], [1, 2], [0, 5, 253]], ids=str)
def test_the_bpf_program_decides_every_access_as_the_rules_do(rented):
    rules = plan(rented, PROC_DEVICES)
    code = program(rules)
    assert len(code) % 8 == 0 and len(code) // 8 < 4096, "the kernel's limit for an unprivileged program"
    majors = [0, 1, 4, 5, 136, 137, 194, 195, 196, UVM, 255, 511, 4095]
    minors = [0, 1, 2, 3, 5, 7, 8, 9, 253, 254, 255, 256, 2**20 - 1]
    for kind, access, major, minor in itertools.product("bc", ACCESSES, majors, minors):
        expected = allowed(rules, kind, major, minor, access)
        assert run_program(code, kind, major, minor, access) == int(expected), (kind, access, major, minor)


def test_the_bpf_program_of_random_rules_decides_as_they_do():
    chance = random.Random(31)
    for _ in range(200):
        rules = [Rule(chance.choice("bc"), chance.choice([None, *range(4)]), chance.choice([None, *range(4)]),
                      "".join(sorted(set(chance.choices("rwm", k=chance.randint(1, 3))))))
                 for _ in range(chance.randint(0, 6))]
        code = program(rules)
        for kind, access, major, minor in itertools.product("bc", ACCESSES, range(5), range(5)):
            assert run_program(code, kind, major, minor, access) == int(allowed(rules, kind, major, minor, access))
