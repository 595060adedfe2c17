"""What a job runs (the job's ``work:``): a Prefect flow entrypoint or a plain command, and its shards (pure).
"""

from __future__ import annotations

import shlex
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from e31_prefect.model.job_values import (
    _SHARD_COUNTS,
    MAX_SHARD_RETRIES,
    MAX_SHARDS,
    Duration,
    Problem,
    _cross,
    _shown,
    _too_long,
)
from e31_prefect.model.shards import SHARD_PARAMETERS


class Work(BaseModel):
    """What runs: a Prefect flow entrypoint or a plain command, with its parameters and environment."""

    model_config = ConfigDict(extra="forbid")

    flow: str | None = Field(
        default=None,
        title="Flow entrypoint",
        description="A Prefect flow as path/to/file.py:function, relative to the job file. "
        "Leave empty in a deployment: its entrypoint is the flow.",
        examples=["flows/retrain.py:retrain"],
    )
    command: list[str] | None = Field(
        default=None,
        title="Command",
        description="A plain command, run by e31's built-in command flow in the job's folder "
        "(instead of a flow).",
        examples=[["python", "sim.py", "--n", "10000"]],
    )
    parameters: dict[str, Any] = Field(
        default_factory=dict,
        title="Flow parameters",
        description="Parameters passed to the flow (each shard of a sharded flow also receives shard_index "
        "and shard_count).",
        examples=[{"epochs": 3}],
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        title="Job environment",
        description="Environment variables the work sees.",
        examples=[{"SEED": "7"}],
    )
    image: str | None = Field(
        default=None,
        title="Image",
        description="Container image for the docker runtime; without one the job runs as a local process.",
        examples=["ghcr.io/acme/trainer:2026.12"],
    )

    shards: int | None = Field(
        default=None,
        title="Shards",
        description="Run the command or flow this many times, as shards of one job (a Slurm job array): one "
        "rent, one meter, shards spread over the rented GPUs, each with E31_SHARD_INDEX set (a flow also "
        f"receives shard_index and shard_count as parameters). At most {MAX_SHARDS}.",
        examples=[10000],
    )
    gpus_per_shard: int | None = Field(
        default=None,
        title="GPUs per shard",
        description="GPUs each shard sees (default 1; 0 for CPU-only shards of a job renting no GPU).",
        examples=[1],
    )
    shards_per_gpu: int | None = Field(
        default=None,
        title="Shards at once per GPU",
        description="How many shards share a GPU at once (default 1); for CPU-only shards, how many run at once.",
        examples=[2],
    )
    shard_retries: int | None = Field(
        default=None,
        title="Shard retries",
        description=f"How many times a failed shard is run again, on any free slot (default 0, at most "
        f"{MAX_SHARD_RETRIES}).",
        examples=[2],
    )
    allow_failed_shards: int | float | None = Field(
        default=None,
        title="Failed shards allowed",
        description="How many shards may still fail (after retries) with the job Completed: a count (3) or a "
        "fraction of the shards (0.01). Default 0: every shard must succeed.",
        examples=[0.01],
    )
    expected_shard_duration: Duration | None = Field(
        default=None,
        title="Expected shard duration",
        description="How long one shard usually takes: an until-done job's expected duration is then its shards "
        "spread over its slots, used to judge the deadline.",
        examples=["30s"],
    )
    reduce: list[str] | None = Field(
        default=None,
        title="Reduce command",
        description="A command run once after all shards, in the same rent, to combine their outputs "
        "(each shard writes under shard-<index>/ of the output dir).",
        examples=[["python", "sims/summarize.py"]],
    )

    @field_validator("command", "reduce", mode="before")
    @classmethod
    def _split_command(cls, value: Any) -> Any:
        if isinstance(value, str):
            return shlex.split(value)
        if isinstance(value, list):
            # YAML reads 10000 as a number; a command line is text. Anything else was not meant.
            for item in value:
                if isinstance(item, bool) or not isinstance(item, (str, int, float)):
                    raise ValueError(f"item {item!r} is not text; quote each argument, e.g. \"--n\"")
            return [str(item) for item in value]
        return value

    @field_validator("command", "reduce")
    @classmethod
    def _command_runnable(cls, value: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("is empty; give the program and its arguments, e.g. [python, sim.py]")
        field = f"work.{info.field_name}"
        problems = [Problem(field, item, fix) for item in value or [] if (fix := _too_long(item, "argument"))]
        if problems:
            raise _cross(problems)
        return value

    @field_validator("flow")
    @classmethod
    def _flow_shape(cls, value: str | None) -> str | None:
        if value is not None and (":" not in value or not value.rsplit(":", 1)[1].isidentifier()):
            raise ValueError("is not a flow entrypoint; write path/to/file.py:flow_function")
        return value

    @field_validator("env", mode="before")
    @classmethod
    def _env_as_strings(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        env = {str(k): v for k, v in value.items()}
        problems = []
        for name, text in env.items():
            if not name or "=" in name:
                # The runtime writes NAME=value: an empty name or one with '=' would set some other variable.
                problems.append(Problem("work.env", name, "is not a variable name; use letters, digits and '_'"))
            elif text is None or isinstance(text, (dict, list)):
                problems.append(Problem(f"work.env.{name}", text,
                                        "is not text; write the value, quoted if need be (\"\" for empty)"))
            elif fix := _too_long(f"{name}={text}", "variable"):
                problems.append(Problem(f"work.env.{name}", text, fix))
        if problems:
            raise _cross(problems)
        return {name: str(text) for name, text in env.items()}

    @field_validator("shards", "gpus_per_shard", "shards_per_gpu", "shard_retries", mode="before")
    @classmethod
    def _count_in_range(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return value
        # pydantic would read true as 1 and 2.0 as 2: neither is how anyone writes a count.
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError("is not a whole number; write a count such as 4")
        low, high, fix = _SHARD_COUNTS[info.field_name or ""]
        if not low <= value <= high:
            raise ValueError(fix)
        return value

    @field_validator("allow_failed_shards", mode="before")
    @classmethod
    def _count_or_fraction(cls, value: Any) -> Any:
        if value is None:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("is not a count or a fraction; write e.g. 3 (shards) or 0.01 (of the shards)")
        if isinstance(value, float) and not 0 <= value < 1:  # also refuses NaN and infinity
            raise ValueError("is a fraction of the shards, so at least 0 and below 1; write a count (3) "
                             "or a fraction (0.01)")
        if isinstance(value, int) and value < 0:
            raise ValueError("must be 0 or more shards")
        return value

    @model_validator(mode="after")
    def _flow_or_command(self) -> Work:
        if self.flow and self.command:
            raise _cross([Problem("work", {"flow": self.flow, "command": self.command},
                                  "give either flow or command, not both")])
        problems = self.shard_problems()
        if problems:
            raise _cross(problems)
        return self

    def shard_problems(self) -> list[Problem]:
        """What is wrong with the work's shard fields on their own (the request's GPUs are checked by the job)."""
        problems = []
        if self.shards is not None and self.flow:
            # Each shard of a flow receives these two: a job's own value would be silently replaced.
            problems += [Problem(f"work.parameters.{name}", self.parameters[name], "is given to each shard by "
                                 "e31 (from 0 to shards - 1, and the shard count); remove it")
                         for name in SHARD_PARAMETERS if name in self.parameters]
        if isinstance(self.allow_failed_shards, int) and self.shards and self.allow_failed_shards >= self.shards:
            problems.append(Problem("work.allow_failed_shards", self.allow_failed_shards,
                                    f"allows all {self.shards} shards to fail, so the job could never fail; "
                                    "allow fewer"))
        if self.shards is None:
            given = [name for name in ("gpus_per_shard", "shards_per_gpu", "shard_retries", "allow_failed_shards",
                                       "expected_shard_duration", "reduce") if getattr(self, name) is not None]
            problems += [Problem(f"work.{name}", _shown(getattr(self, name)), "only applies to a sharded job; set "
                                 "work.shards (e.g. shards: 100) or remove it") for name in given]
        return problems
