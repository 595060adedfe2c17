"""Storage credentials as a Prefect block with secret fields: the ``E31 Storage`` block.

    e31 blocks apply blocks/          # create or update the blocks described in blocks/*.yaml

A job names the block it reads its data from and sends its outputs to with
``storage: NAME``; the worker loads it (the job itself never sees it) and hands
its options to s3fs. Without one, s3fs's default credential chain applies
(``AWS_*`` variables, profiles, instance roles).

The block is also a Prefect ``WritableFileSystem``: a run's result sent to
S3 is read back by ``state.result()`` through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from uuid import UUID

import fsspec
from fsspec.core import url_to_fs
from prefect._internal.compatibility.async_dispatch import async_dispatch
from prefect.filesystems import WritableFileSystem
from prefect.utilities.asyncutils import run_sync_in_worker_thread
from pydantic import Field, SecretStr, field_validator

if TYPE_CHECKING:
    from prefect.client.orchestration import PrefectClient

# s3fs options that carry a credential: they belong in the secret fields, never in s3_options.
CREDENTIAL_OPTIONS = frozenset({
    "key", "secret", "token", "password", "username", "aws_access_key_id", "aws_secret_access_key",
    "aws_session_token", "session_token", "access_key_id", "secret_access_key",
})


class StorageBlockError(RuntimeError):
    """A job's ``storage`` block does not exist or cannot be loaded; the message says what to do."""


class E31Storage(WritableFileSystem):
    """An S3-compatible store e31 jobs read their data from and send their outputs to.

    The access key id, secret access key and session token are secret fields:
    Prefect stores them encrypted and shows them masked. Leave them empty to
    use s3fs's default credential chain on the worker's host.
    """

    _block_type_name = "E31 Storage"
    _block_type_slug = "e31-storage"
    _documentation_url = "https://github.com/e31-network/e31-prefect#storage"

    endpoint_url: str | None = Field(
        default=None, title="Endpoint URL",
        description="The S3 API's URL; empty for AWS S3 itself.",
        examples=["https://minio.example.com:9000"])
    region: str | None = Field(
        default=None, title="Region", description="The store's region.", examples=["us-east-1"])
    access_key_id: SecretStr | None = Field(
        default=None, title="Access key id", description="Empty: s3fs's default credential chain.")
    secret_access_key: SecretStr | None = Field(
        default=None, title="Secret access key", description="Goes with the access key id.")
    session_token: SecretStr | None = Field(
        default=None, title="Session token", description="For temporary credentials only.")
    teams: list[str] = Field(
        default_factory=list, title="Teams",
        description="The teams whose jobs may use this block (a job of another team naming it fails before "
        "renting). Empty: every team's.", examples=[["vision", "speech"]])
    s3_options: dict[str, Any] = Field(
        default_factory=dict, title="Extra s3fs options",
        description="Other s3fs.S3FileSystem arguments (no credentials here: use the secret fields).",
        examples=[{"config_kwargs": {"max_pool_connections": 32}}])

    @field_validator("s3_options")
    @classmethod
    def _no_credentials_in_options(cls, value: dict[str, Any]) -> dict[str, Any]:
        found = sorted(CREDENTIAL_OPTIONS & {*value, *(value.get("client_kwargs") or {})})
        if found:
            raise ValueError(f"holds {', '.join(found)}: credentials go in access_key_id, secret_access_key "
                             "and session_token, which are kept secret")
        return value

    def serves(self, team: str | None) -> bool:
        """Whether a job of ``team`` may use this block."""
        return not self.teams or team in self.teams

    def fsspec_options(self) -> dict[str, dict[str, Any]]:
        """The options staging hands to fsspec, by URL scheme: ``{"s3": {...s3fs arguments...}}``."""
        s3 = {k: v for k, v in self.s3_options.items() if k != "client_kwargs"}
        client_kwargs = dict(self.s3_options.get("client_kwargs") or {})
        if self.endpoint_url:
            client_kwargs["endpoint_url"] = self.endpoint_url
        if self.region:
            client_kwargs["region_name"] = self.region
        if client_kwargs:
            s3["client_kwargs"] = client_kwargs
        for option, secret in (("key", self.access_key_id), ("secret", self.secret_access_key),
                               ("token", self.session_token)):
            if secret is not None:
                s3[option] = secret.get_secret_value()
        return {"s3": s3}

    def _filesystem(self, path: str) -> tuple[fsspec.AbstractFileSystem, str]:
        scheme = path.split("://", 1)[0] if "://" in path else "file"
        # A fresh instance each time: fsspec's instance cache keys on these options only, so a cached one
        # could carry an endpoint or credentials s3fs took from another environment (store.filesystem caches).
        return url_to_fs(path, skip_instance_cache=True, **self.fsspec_options().get(scheme, {}))

    def _read(self, path: str) -> bytes:
        fs, target = self._filesystem(path)
        return fs.cat_file(target)

    def _write(self, path: str, content: bytes) -> str:
        fs, target = self._filesystem(path)
        if "file" in fs.protocol:
            fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(target, content)
        return path

    async def aread_path(self, path: str) -> bytes:
        """The bytes at ``path`` (a full URL such as ``s3://bucket/key``)."""
        return await run_sync_in_worker_thread(self._read, path)

    @async_dispatch(aread_path)
    def read_path(self, path: str) -> bytes:
        """The bytes at ``path`` (a full URL such as ``s3://bucket/key``)."""
        return self._read(path)

    async def awrite_path(self, path: str, content: bytes) -> str:
        """Write ``content`` at ``path`` (a full URL); returns the path."""
        return await run_sync_in_worker_thread(self._write, path, content)

    @async_dispatch(awrite_path)
    def write_path(self, path: str, content: bytes) -> str:
        """Write ``content`` at ``path`` (a full URL); returns the path."""
        return self._write(path, content)

    async def get_directory(self, from_path: str | None = None, local_path: str | None = None) -> None:
        """Not a deployment storage: e31 jobs stage data through their ``data`` entries."""
        raise NotImplementedError("E31 Storage holds job data and outputs, not flow code")


async def load_job_storage(name: str, team: str | None) -> E31Storage:
    """The named E31 Storage block for a job of ``team``: :func:`load_storage`, refusing a block that is not
    that team's."""
    block = await load_storage(name)
    if not block.serves(team):
        raise StorageBlockError(
            f"storage block {name!r} is for team(s) {', '.join(block.teams)}, and this job's team is "
            f"{team or 'none'}: name a block of the job's team, or ask its owner to add it")
    return block


async def load_storage(name: str) -> E31Storage:
    """The named E31 Storage block; :class:`StorageBlockError` says how to create it if it is missing."""
    try:
        return await E31Storage.aload(name)
    except ValueError as exc:
        if "Unable to find block document" in str(exc):
            raise StorageBlockError(
                f"storage = {name!r}: no E31 Storage block named {name!r} exists on this Prefect server; "
                f"describe it in blocks/{name}.yaml (type: e31-storage, name: {name}) and run "
                "`e31 blocks apply blocks/`, or remove storage from the job to use the default credentials"
            ) from None
        raise StorageBlockError(f"storage = {name!r}: the block cannot be loaded: {exc}") from exc
    except Exception as exc:
        raise StorageBlockError(
            f"storage = {name!r}: the block cannot be loaded: {type(exc).__name__}: {exc}") from exc


async def storage_options(name: str | None) -> dict[str, dict[str, Any]] | None:
    """fsspec options for the named E31 Storage block (None: s3fs's default credential chain).

    Raises :class:`StorageBlockError` when the block is missing or cannot be loaded.
    """
    if name is None:
        return None
    return (await load_storage(name)).fsspec_options()


_default_chain: dict[str, UUID] = {}


async def result_block_id(storage: E31Storage | None, client: PrefectClient) -> UUID:
    """The saved block a caller reads a run's S3 result through.

    The job's own block, or (for a job without one) an anonymous E31 Storage block with no
    credentials: whoever reads the result then uses s3fs's default credential chain, as the worker did.
    """
    if storage is not None and storage._block_document_id is not None:
        return storage._block_document_id
    api = str(client.api_url)
    if api not in _default_chain:
        # Anonymous blocks are not listed in the UI; one per worker process and server is enough.
        _default_chain[api] = await E31Storage()._save(is_anonymous=True, client=client)
    return _default_chain[api]
