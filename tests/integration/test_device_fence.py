"""A run's device fence on real cgroups, each way a host may hold it: cgroup v1 ``devices``, a BPF program on a
cgroup v2 group, and both (a hybrid host).

The GPUs are faked as the driver's nodes made with mknod (character 195:N, nvidiactl 195:255, an
nvidia-uvm major named in a /proc/devices of the test's own). No driver serves them, so a node the
fence lets a process open fails only for want of one (ENXIO); one it keeps closed fails on
permission (EPERM). A process in the run's cgroup tries each node before and after the hand-over.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from e31_prefect.host import cgroups
from e31_prefect.host.device_fence import DeviceFence

pytestmark = pytest.mark.integration

# What a process of the run does: open each node named (as a job that ignores CUDA_VISIBLE_DEVICES would), and
# make a GPU node of its own to open (as root could, but for the fence).
PROBE = """
import errno, json, os, stat, sys
seen = {}
for path in sys.argv[2:]:
    try:
        os.close(os.open(path, os.O_RDWR))
        seen[path] = "opened"
    except OSError as error:
        seen[path] = errno.errorcode[error.errno]
try:
    os.mknod(sys.argv[1], stat.S_IFCHR | 0o666, os.makedev(195, 3))
    seen["mknod"] = "made"
except OSError as error:
    seen["mknod"] = errno.errorcode[error.errno]
print(json.dumps(seen))
"""


def free_major() -> int:
    """A character major no driver of this host holds: a uvm-like node of it opens to ENXIO, if at all."""
    taken = {int(line.split()[0]) for line in Path("/proc/devices").read_text().split("Block")[0].splitlines()
             if line.strip()[:1].isdigit()}
    return next(major for major in range(511, 300, -1) if major not in taken)


def make_nodes(folder: Path, uvm: int) -> dict[str, Path]:
    """The nodes of a 4-GPU host under ``folder`` (its uvm major ``uvm``)."""
    folder.mkdir(parents=True, exist_ok=True)
    numbers = {f"nvidia{n}": (195, n) for n in range(4)} | {
        "nvidiactl": (195, 255), "nvidia-uvm": (uvm, 0), "nvidia-uvm-tools": (uvm, 1),
        "elsewhere-nvidia3": (195, 3)}  # GPU 3's node under another name, as a job would make it
    nodes = {}
    for name, (major, minor) in numbers.items():
        os.mknod(folder / name, stat.S_IFCHR | 0o666, os.makedev(major, minor))
        os.chmod(folder / name, 0o666)  # whatever the umask: only the fence may refuse it
        nodes[name] = folder / name
    return nodes


def devices_table(path: Path, uvm: int) -> Path:
    """A /proc/devices of a host whose nvidia-uvm module was given the major ``uvm``."""
    path.write_text(f"Character devices:\n  1 mem\n195 nvidia-frontend\n{uvm} nvidia-uvm\n\nBlock devices:\n  7 loop\n")
    return path


def tried(group: cgroups.RunGroup, nodes: dict[str, Path], mine: Path) -> dict[str, str]:
    """What a process in the run's cgroup(s) got, per node name (and its own mknod)."""
    files = group.join_files
    paths = [str(path) for path in nodes.values()] + ["/dev/null", "/dev/urandom"]
    done = subprocess.run([sys.executable, "-c", PROBE, str(mine), *paths], capture_output=True, text=True,
                          preexec_fn=lambda: cgroups.join(files), timeout=60)
    assert done.returncode == 0, done.stderr
    by_path = json.loads(done.stdout)
    named = {name: by_path[str(path)] for name, path in nodes.items()}
    return named | {"null": by_path["/dev/null"], "urandom": by_path["/dev/urandom"], "mknod": by_path["mknod"]}


def ways() -> dict[str, cgroups.Mounts]:
    host = cgroups.host_mounts()
    return {"cgroup-v1-devices": cgroups.Mounts(None, {k: v for k, v in host.v1.items() if k == "devices"}),
            "cgroup-v2-bpf": cgroups.Mounts(host.v2, {}), "hybrid": host}


@pytest.fixture(params=list(ways()))
def fenced(request, tmp_path):
    """A run's group made the one way, and its fence; skipped where this host does not give that way."""
    name = f"fence-{request.param}-{os.getpid()}-{tmp_path.name}"[:60]
    group = cgroups.RunGroup.create(name, None, None, ways()[request.param])
    uvm = free_major()
    nodes = make_nodes(tmp_path / "dev", uvm)
    fence = DeviceFence.create(group.v2, group.v1.get("devices"), devices_table(tmp_path / "devices", uvm))
    try:
        if not fence.enforced:
            pytest.skip(f"this host gives e31 no {request.param} device rules: {fence.why}")
        yield request.param, group, fence, nodes
    finally:
        group.kill()
        group.remove()
        fence.close()


def test_no_gpu_node_opens_before_the_hand_over_and_exactly_the_rented_ones_after(fenced, tmp_path):
    way, group, fence, nodes = fenced
    assert fence.ways == {"cgroup-v1-devices": ["cgroup v1 devices"], "cgroup-v2-bpf": ["cgroup v2 BPF"],
                          "hybrid": ["cgroup v2 BPF", "cgroup v1 devices"]}[way]
    EPERM, ENXIO = errno.errorcode[errno.EPERM], errno.errorcode[errno.ENXIO]

    waiting = tried(group, nodes, tmp_path / "mine-before")
    assert {name: waiting[name] for name in nodes} == dict.fromkeys(nodes, EPERM), waiting
    assert waiting["null"] == waiting["urandom"] == "opened"
    assert waiting["mknod"] == EPERM

    assert fence.open_gpus([1, 2]) == []  # the test's /proc/devices names nvidia-uvm: nothing to tell
    running = tried(group, nodes, tmp_path / "mine-after")
    assert running == {"nvidia0": EPERM, "nvidia1": ENXIO, "nvidia2": ENXIO, "nvidia3": EPERM,
                       "nvidiactl": ENXIO, "nvidia-uvm": ENXIO, "nvidia-uvm-tools": ENXIO,
                       "elsewhere-nvidia3": EPERM, "null": "opened", "urandom": "opened", "mknod": EPERM}


def test_a_group_left_by_an_earlier_run_of_the_same_name_keeps_none_of_its_rules(fenced, tmp_path):
    """A retried flow run's cgroup has its first try's name; where that group could not be removed, the new
    fence takes nothing of the old rules, narrower or wider."""
    way, group, first, nodes = fenced
    first.close()  # the first try never got its hand-over, and its group stayed: its rules are still on it
    second = DeviceFence.create(group.v2, group.v1.get("devices"), first.table)
    second.open_gpus([0, 1, 2, 3])
    seen = tried(group, nodes, tmp_path / "mine-second")
    assert [seen[f"nvidia{n}"] for n in range(4)] == ["ENXIO"] * 4, f"the first try's rules held: {seen}"
    second.close()  # the second try had every GPU, and its group stayed too
    third = DeviceFence.create(group.v2, group.v1.get("devices"), first.table)
    try:
        waiting = tried(group, nodes, tmp_path / "mine-third-waiting")
        assert {waiting[name] for name in nodes} == {"EPERM"}, f"the second try's GPUs open: {waiting}"
        third.open_gpus([1, 2])
        running = tried(group, nodes, tmp_path / "mine-third")
        assert [running[f"nvidia{n}"] for n in range(4)] == ["EPERM", "ENXIO", "ENXIO", "EPERM"], running
    finally:
        third.close()


def test_a_host_without_cgroups_says_devices_are_not_fenced(tmp_path):
    group = cgroups.RunGroup.create("fence-none", None, None, cgroups.Mounts())
    fence = DeviceFence.create(group.v2, group.v1.get("devices"))
    assert not fence.enforced and fence.ways == []
    assert any("device isolation is not enforced" in line for line in fence.why), fence.why
    assert fence.open_gpus([0]) == [], "nothing to open, nothing to tell beyond the note"
