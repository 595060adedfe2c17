"""Block documents (``e31 blocks apply``): secrets come from the environment, never from the file."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from e31_prefect.cli.block_documents import BlockFileError, read_block_files
from e31_prefect.data.blocks import E31Storage

REPO = Path(__file__).resolve().parents[2]
ENV = {"E31_STORE_ENDPOINT": "http://127.0.0.1:9000", "E31_STORE_KEY_ID": "AKIAEXAMPLE",
       "E31_STORE_SECRET": "s3cr3t-value"}


def write(folder: Path, text: str, name: str = "store.yaml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def problems(paths: list[Path], env: dict[str, str]) -> str:
    with pytest.raises(BlockFileError) as caught:
        read_block_files(paths, env)
    return str(caught.value)


def test_the_example_block_folder_reads_its_secrets_from_the_environment():
    [document] = read_block_files([REPO / "blocks"], ENV)
    assert document.name == "e31-store" and isinstance(document.block, E31Storage)
    assert document.block.access_key_id.get_secret_value() == "AKIAEXAMPLE"
    assert document.variables == {"endpoint_url": "E31_STORE_ENDPOINT", "access_key_id": "E31_STORE_KEY_ID",
                                  "secret_access_key": "E31_STORE_SECRET"}
    assert document.block.fsspec_options() == {"s3": {
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "region_name": "us-east-1"},
        "key": "AKIAEXAMPLE", "secret": "s3cr3t-value"}}


def test_a_secret_written_in_the_file_is_refused_without_echoing_it(tmp_path):
    path = write(tmp_path, """
        type: e31-storage
        name: store
        access_key_id: AKIALITERAL
        secret_access_key: {env: E31_STORE_SECRET}
        """)
    message = problems([path], ENV)
    assert "access_key_id" in message and "no secret is ever written in a file" in message
    assert "{env: VARIABLE}" in message and "AKIALITERAL" not in message


def test_a_missing_environment_variable_names_the_field_and_the_variable(tmp_path):
    path = write(tmp_path, """
        type: e31-storage
        name: store
        secret_access_key: {env: NOT_SET_ANYWHERE}
        """)
    message = problems([path], ENV)
    assert "secret_access_key" in message and "NOT_SET_ANYWHERE is not set" in message


def test_every_problem_in_every_file_is_listed(tmp_path):
    write(tmp_path, "type: e31-storag\nname: a\n", name="a.yaml")
    write(tmp_path, "type: e31-storage\nname: Bad_Name\nregoin: x\n", name="b.yaml")
    write(tmp_path, "type: e31-storage\nname: c\ns3_options: {key: AKIA}\n", name="c.yaml")
    message = problems([tmp_path], ENV)
    assert "a.yaml: type = 'e31-storag': is not a block type known here; did you mean e31-storage?" in message
    assert "b.yaml: name = 'Bad_Name': must use only lowercase letters" in message
    assert "c.yaml: s3_options: holds key: credentials go in access_key_id" in message and "AKIA" not in message


def test_an_unknown_field_suggests_the_nearest(tmp_path):
    message = problems([write(tmp_path, "type: e31-storage\nname: a\nregoin: eu-west-1\n")], ENV)
    assert "regoin: is not a field of e31-storage; did you mean region?" in message


def test_the_same_block_twice_is_refused(tmp_path):
    write(tmp_path, "type: e31-storage\nname: a\n---\ntype: e31-storage\nname: a\n")
    assert "is also given in" in problems([tmp_path], ENV)


def test_a_path_without_block_files_says_so(tmp_path):
    assert "no .yaml block files here" in problems([tmp_path], ENV)


def test_other_block_types_keep_their_secret_fields_secret(tmp_path):
    path = write(tmp_path, """
        type: secret
        name: token
        value: plain-text
        """)
    assert "value: is a secret written in the file" in problems([path], ENV)
    path.write_text("type: secret\nname: token\nvalue: {env: E31_STORE_SECRET}\n")
    [document] = read_block_files([path], ENV)
    assert document.block.get() == "s3cr3t-value"
