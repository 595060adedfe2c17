"""What the docker runtime asks of the engine for a job: the container a user's job would get.

No engine is needed: these check the request that would be sent (a GPU cannot exist here).
"""

from __future__ import annotations

from pathlib import Path
from uuid import uuid4

from prefect_docker.worker import DockerWorkerJobConfiguration

from e31_prefect import job_entry
from e31_prefect.data.results import result_environment
from e31_prefect.host.inventory import Device
from e31_prefect.model.job import parse_job
from e31_prefect.runtimes import container

H100S = [Device(1, "NVIDIA H100 80GB HBM3"), Device(2, "NVIDIA H100 80GB HBM3")]


def job(**request):
    return parse_job({"name": "train", "work": {"flow": "f.py:f", "image": "acme/trainer:1", "env": {"SEED": "7"}},
                      "request": {"max_duration": "1h", **request}})


def test_device_request_names_exactly_the_rented_gpus():
    [request] = container.device_requests(H100S, send=True)
    assert request["DeviceIDs"] == ["1", "2"]
    assert request["Capabilities"] == [["gpu"]]
    assert request["Count"] == 0  # the ids, not "any two"


def test_no_device_request_without_gpus_or_when_the_engine_cannot_honour_it():
    assert container.device_requests([], send=True) == []
    assert container.device_requests(H100S, send=False) == []


def test_isolation_drops_every_privilege_and_applies_the_request():
    options = container.isolation(job(gpus=2, cpus=2.5, memory="2g"), H100S, send_device_requests=True)
    assert options["cap_drop"] == ["ALL"]
    assert options["security_opt"] == ["no-new-privileges"]
    assert options["pids_limit"] == container.DEFAULT_PIDS_LIMIT
    assert options["nano_cpus"] == 2_500_000_000
    assert [r["DeviceIDs"] for r in options["device_requests"]] == [["1", "2"]]
    assert "device_requests" not in container.isolation(job(), [], send_device_requests=True)


def test_prepared_container_mounts_data_read_only_and_hides_host_environment(tmp_path: Path):
    base = DockerWorkerJobConfiguration(image="ignored", env={
        "PREFECT_API_URL": "http://127.0.0.1:4200/api", "PREFECT_API_KEY": "pnu_secret",
        "PREFECT_API_AUTH_STRING": "admin:pass", "PREFECT_SERVER_DATABASE_CONNECTION_URL": "postgresql://u:pw@db/p",
        "PREFECT__FLOW_RUN_ID": "abc", "UNSET": None})
    prepared = container.prepare(base, job(gpus=2, memory="512m"), H100S, tmp_path / "data", tmp_path / "out",
                                 tmp_path, send_device_requests=False, work_ended=tmp_path / "work-ended",
                                 api_socket=tmp_path / "api.sock", hand_over=tmp_path / "hand-over")
    assert prepared.image == "acme/trainer:1"
    assert prepared.command == "python /e31/bin/job_entry.py"  # Prefect's engine, saying when the work ends
    assert prepared.privileged is False and prepared.auto_remove is False
    assert prepared.volumes == [f"{tmp_path / 'data'}:/e31/data:ro", f"{tmp_path / 'out'}:/e31/output:rw",
                                f"{tmp_path}:{tmp_path}:ro", f"{job_entry.__file__}:/e31/bin/job_entry.py:ro",
                                f"{tmp_path / 'work-ended'}:/e31/control/work-ended:rw",
                                f"{tmp_path / 'hand-over'}:/e31/control/hand-over:ro",
                                f"{tmp_path / 'api.sock'}:/e31/control/api.sock:rw"]
    # No credential and no route to the real API: the job's entry serves its Prefect URL from the socket.
    assert prepared.network_mode == "none"
    assert prepared.env == {
        "PREFECT_API_URL": container.GATEWAY_PLACEHOLDER_URL, "E31_API_SOCKET": "/e31/control/api.sock",
        "PREFECT__FLOW_RUN_ID": "abc", "SEED": "7",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1,2", "NVIDIA_VISIBLE_DEVICES": "1,2",
        "E31_DATA_DIR": "/e31/data", "E31_OUTPUT_DIR": "/e31/output", "E31_WORK_ENDED": "/e31/control/work-ended",
        "E31_HAND_OVER": "/e31/control/hand-over",  # its devices' variables come there, once rented
        **result_environment("/e31/output"),  # the flow's result is persisted with its outputs
    }
    assert prepared.mem_limit == prepared.memswap_limit == str(512 * 1024 * 1024)
    assert prepared.labels["e31.job"] == "train"
    assert prepared.container_create_kwargs["working_dir"] == str(tmp_path)
    assert "device_requests" not in prepared.container_create_kwargs
    assert base.image == "ignored"  # the run's own configuration is left as it was


def test_a_deployment_built_with_its_code_inside_gets_no_job_folder_mount(tmp_path: Path):
    prepared = container.prepare(DockerWorkerJobConfiguration(image="x"), job(), [], tmp_path / "d", tmp_path / "o",
                                 None, send_device_requests=False)
    assert [volume.split(":")[1] for volume in prepared.volumes] == ["/e31/data", "/e31/output",
                                                                     "/e31/bin/job_entry.py"]
    assert "working_dir" not in prepared.container_create_kwargs


def test_a_deployments_relative_paths_are_read_from_its_folder(tmp_path: Path):
    from e31_prefect.surface.worker_configuration import E31JobConfiguration

    configuration = E31JobConfiguration(
        request={"max_duration": "1h"}, work={"parameters": {}},
        data=[{"from": "./data/train.csv"}, {"from": "s3://bucket/frames/", "to": "frames"}],
        output={"to": "outputs/{flow_run.name}/"})
    configuration._code_folder = tmp_path
    job = configuration.job("nightly")
    assert [d.source for d in job.data] == [f"file://{tmp_path}/data/train.csv", "s3://bucket/frames/"]
    assert job.output.to == f"file://{tmp_path}/outputs/{{flow_run.name}}/"
    configuration._code_folder = None
    assert configuration.job("nightly").data[0].source == "./data/train.csv"


# -- prefect-docker's settings on an e31 pool ---------------------------------------------------


def test_each_refused_docker_setting_is_named_with_the_e31_way_instead(tmp_path: Path):
    settings = {"command": "python -m my.thing", "image": "acme/other:2", "mem_limit": "300m",
                "memswap_limit": "600m", "privileged": True, "auto_remove": True,
                "container_create_kwargs": {"shm_size": "1g", "ipc_mode": "host", "cap_add": ["SYS_ADMIN"],
                                            "pid_mode": "host"},
                "volumes": ["/etc:/host-etc", "named-volume:/data"]}
    problems = {p.field: str(p) for p in container.setting_problems(settings, [tmp_path])}
    # Not the image: prefect-docker's image is the job's image (tests/unit/test_pool_template.py).
    assert set(problems) == {"command", "mem_limit", "memswap_limit", "privileged", "auto_remove",
                             "container_create_kwargs.ipc_mode", "container_create_kwargs.cap_add",
                             "container_create_kwargs.pid_mode", "volumes"}
    assert "use request.memory" in problems["mem_limit"]
    assert "work.flow or work.command" in problems["command"]
    assert "never run privileged" in problems["privileged"]
    assert "use one of private, shareable, none" in problems["container_create_kwargs.ipc_mode"]
    assert "E31_ALLOWED_VOLUMES" in problems["volumes"]


def test_what_e31_would_replace_or_withhold_is_refused_by_name_not_ignored(tmp_path: Path):
    settings = {"network_mode": "host", "networks": ["host", "lab"],
                "env": {"PREFECT_API_URL": "http://10.0.0.5:4200/api", "PREFECT_API_KEY": "pnu_secret",
                        "PREFECT_SERVER_DATABASE_CONNECTION_URL": "postgresql://u:pw@db/p",
                        "CUDA_VISIBLE_DEVICES": "0,1,2,3", "E31_OUTPUT_DIR": "/etc", "SEED": "7", "HOME": "/h"}}
    problems = [str(p) for p in container.setting_problems(settings, [tmp_path])]
    assert problems[:2] == [f"network_mode = 'host': {container.NETWORK_FIX}",
                            f"networks = 'host': {container.NETWORK_FIX}"]
    text = "\n".join(problems)
    assert "env.PREFECT_API_URL = 'http://10.0.0.5:4200/api': e31 sets it" in text
    assert "env.CUDA_VISIBLE_DEVICES = '0,1,2,3': e31 sets it for each run" in text
    assert "env.E31_OUTPUT_DIR = '/etc': e31 sets it for each run" in text
    assert "env.PREFECT_API_KEY = '<hidden>': a job never receives the worker's Prefect credentials" in text
    assert "env.PREFECT_SERVER_DATABASE_CONNECTION_URL = '<hidden>'" in text
    assert "pnu_secret" not in text and "pw@db" not in text  # a state message is no place for a secret
    assert len(problems) == 7  # the job's own SEED and HOME, and a named network, are the job's
    assert container.setting_problems({"network_mode": "container:other-job"}, [])[0].field == "network_mode"
    labelled = container.setting_problems({"labels": {"prefect.io/flow-run-id": "another-run", "team": "vision",
                                                      "io.prefect.version": "0", "e31.job": "x"}}, [])
    assert [p.field for p in labelled] == ["labels.prefect.io/flow-run-id", "labels.io.prefect.version",
                                           "labels.e31.job"]  # a label of the team's own is the team's
    # Unsetting what e31 never passes on (prefect-docker's way: a None value) asks for what e31 does anyway.
    assert container.setting_problems({"env": {"PREFECT_API_KEY": None, "PREFECT_HOME": None}}, []) == []
    [huge] = container.setting_problems({"env": {"PREFECT_SERVER_" + "X" * 100_000: "v" * 100_000}}, [])
    assert len(str(huge)) < 400  # a hostile name or value does not swell the run's state
    for fine in ("none", "bridge", "lab-net"):
        assert container.setting_problems({"network_mode": fine}, []) == []


def test_a_runs_own_prefect_environment_is_not_taken_for_a_setting(tmp_path: Path):
    """The worker's API URL and the run's id, which Prefect adds to every run's env, are not the user's."""
    from prefect.client.schemas.objects import FlowRun

    from e31_prefect.surface.worker_configuration import E31JobConfiguration

    configuration = E31JobConfiguration(env={"SEED": "7"}, labels={"team": "vision"}, request={"max_duration": "1h"})
    configuration.prepare_for_flow_run(FlowRun(flow_id=uuid4(), name="my run"))
    assert "PREFECT_API_URL" in configuration.env and "PREFECT__FLOW_RUN_ID" in configuration.env
    assert "io.prefect.flow-run-id" in configuration.labels
    assert configuration.setting_problems([]) == []
    given = E31JobConfiguration(env={"PREFECT_API_URL": "http://elsewhere/api"}, request={"max_duration": "1h"})
    given.prepare_for_flow_run(FlowRun(flow_id=uuid4(), name="my run"))
    assert [p.field for p in given.setting_problems([])] == ["env.PREFECT_API_URL"]


def test_defaults_and_passed_on_settings_are_not_problems(tmp_path: Path):
    (tmp_path / "datasets").mkdir()
    settings = {"command": None, "image": None, "mem_limit": None, "privileged": False, "auto_remove": False,
                "container_create_kwargs": {"shm_size": "2g", "ipc_mode": "shareable", "ulimits": []},
                "volumes": [f"{tmp_path / 'datasets'}:/datasets"]}
    assert container.setting_problems(settings, [tmp_path]) == []


def test_allowed_volumes_are_mounted_read_only_and_symlinks_out_are_refused(tmp_path: Path):
    allowed = tmp_path / "allowed"
    (allowed / "set").mkdir(parents=True)
    (allowed / "escape").symlink_to("/etc")
    assert container.read_only_volume(f"{allowed}/set:/in:rw", [allowed]) == f"{allowed}/set:/in:ro"
    assert container.read_only_volume(f"{allowed}/escape:/in", [allowed]) is None
    assert container.read_only_volume(f"{allowed}/../x:/in", [allowed]) is None
    assert container.read_only_volume("relative/path:/in", [allowed]) is None


def test_the_pool_form_describes_every_docker_setting_as_it_works_on_e31():
    from e31_prefect.surface.worker import E31Worker
    from e31_prefect.surface.worker_configuration import E31Variables

    form = E31Worker.get_default_base_job_template()["variables"]["properties"]
    for name in container.DOCKER_SETTINGS:
        assert form[name]["description"] == container.DOCKER_SETTINGS[name]
    assert "Refused" in form["command"]["description"]
    assert "Refused: PREFECT_API_URL" in form["env"]["description"]
    assert "CUDA_VISIBLE_DEVICES" in form["env"]["description"]
    assert E31Variables.model_fields["image"].default is None
