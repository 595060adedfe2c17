"""Which host paths a job's bytes may come from and go to, and which of its outputs are its own.

    E31_FILE_ROOTS='{"*": ["/datasets"], "vision": ["/results/vision"]}' prefect worker start --pool gpu --type e31

The code a job runs is not trusted, so the paths it names are confined:

- ``file://`` inputs and destinations stay under the roots the pool's operator
  allows for the job's team (``E31_FILE_ROOTS``; ``"*"`` is every team), plus
  the job's own folder, plus (for destinations) the run's own folder of the
  worker's default outputs. Paths are compared after ``realpath``, so neither
  ``..`` nor a symbolic link leaves a root.
- Template values (``{flow_run.name}``, ``{job}`` ...) fill one path segment
  each: they cannot add ``/`` or ``..`` to a destination.
- Only a job's own bytes leave its output dir: regular files with one name.
  A symbolic link, a hard link (which may name any file of the host) or a
  special file (fifo, socket, device) is not sent, and is reported.

The rules are plain functions over paths and ``stat`` modes; the only
filesystem read is ``realpath`` in :func:`confine_file_url`.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import SimpleNamespace

EVERY_TEAM = "*"
SETTING = "E31_FILE_ROOTS"
# What replaces a character or sequence that would add a path segment to a destination.
REPLACEMENT = "_"


class PathRefused(ValueError):
    """A ``file://`` path a job names lies outside what it may read or write; the message says which rule."""


@dataclass(frozen=True)
class Skipped:
    """An entry of an output dir that was not sent, and why (its path is relative to the output dir)."""

    path: str
    why: str

    def __str__(self) -> str:
        return f"{self.path} ({self.why})"


# -- template values ------------------------------------------------------------------------------


def segment(value: object) -> str:
    """``value`` as one path segment: no ``/``, ``\\``, NUL or ``..`` (each becomes ``_``), never empty.

    A flow run named ``../../x`` so fills ``{flow_run.name}`` as ``____x``: one folder under the
    destination, never a way out of it.
    """
    text = str(value)
    for bad in ("\x00", "/", "\\"):
        text = text.replace(bad, REPLACEMENT)
    while ".." in text:
        text = text.replace("..", REPLACEMENT)
    return REPLACEMENT if text in ("", ".") else text


def format_destination(template: str, run_id: str, run_name: str, date: str, job: str) -> str:
    """The output destination for one run: ``template`` with each placeholder filled by one safe segment."""
    return template.format(
        flow_run=SimpleNamespace(id=segment(run_id), name=segment(run_name)),
        date=segment(date),
        job=segment(job),
    )


# -- roots ----------------------------------------------------------------------------------------


def team_roots(configured: Mapping[str, Sequence[Path]], team: str | None) -> list[Path]:
    """The folders the operator allows ``team`` (``E31_FILE_ROOTS``): those for every team, then its own."""
    roots = list(configured.get(EVERY_TEAM, ()))
    if team and team != EVERY_TEAM:
        roots += configured.get(team, ())
    return roots


def run_roots(configured: Mapping[str, Sequence[Path]], team: str | None, job_folder: Path | None,
              *extra: Path | None) -> list[Path]:
    """Every folder one run may name in ``file://``: the team's roots, its job's folder, and ``extra``."""
    return [*team_roots(configured, team), *(p for p in (job_folder, *extra) if p is not None)]


def within(path: str, root: str) -> bool:
    """Whether the absolute, normalised ``path`` is ``root`` or lies under it (pure: resolve both first)."""
    parent, child = PurePosixPath(root), PurePosixPath(path)
    return child == parent or parent in child.parents


def root_holding(path: str, roots: Iterable[str]) -> str | None:
    """The first of ``roots`` that holds ``path``, or None (all absolute and normalised)."""
    return next((root for root in roots if within(path, root)), None)


def refusal(what: str, url: str, resolved: str, roots: Sequence[str], team: str | None) -> str:
    """Why a ``file://`` path is refused, naming the path, the rule and the fix."""
    where = ", ".join(roots) if roots else "none"
    who = f"team {team!r}" if team else "a job with no team"
    plain = url.removeprefix("file://").rstrip("/") or "/"
    shown = url if resolved == plain else f"{url} (resolves to {resolved})"
    return (f"{what} {shown}: outside the folders {who} may use ({where}); a job's file:// paths stay "
            f"under its own job folder or a folder the pool's operator allows. Move it there, or ask the "
            f"operator to add its folder to {SETTING} for the team")


def confine_file_url(url: str, roots: Sequence[Path], what: str, team: str | None = None) -> str:
    """The real path of the ``file://`` URL (or plain path) ``url``; :class:`PathRefused` unless it lies
    under one of ``roots``.

    Both sides go through ``realpath``, so ``..`` segments and symbolic links anywhere on the way
    are followed before the comparison, not after it.
    """
    resolved = os.path.realpath(url.removeprefix("file://"))
    real_roots = [os.path.realpath(root) for root in roots]
    if root_holding(resolved, real_roots) is None:
        raise PathRefused(refusal(what, url, resolved, real_roots, team))
    return resolved


# -- outputs --------------------------------------------------------------------------------------


def not_sent_because(mode: int, links: int) -> str | None:
    """Why an output dir entry with this ``lstat`` mode and link count is not sent; None for one that is.

    Folders are walked (None too). Only a regular file with one name is the job's own bytes: a
    hard link may name any file of the host the job could reach, even one it could not read.
    """
    if stat.S_ISDIR(mode):
        return None
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISREG(mode):
        return None if links <= 1 else f"a hard link: one of {links} names of one file"
    if stat.S_ISFIFO(mode):
        return "a fifo"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def skipped_summary(skipped: Sequence[Skipped], limit: int = 10) -> str:
    """The skipped entries in one line, the first ``limit`` named (a state message stays short)."""
    named = "; ".join(map(str, skipped[:limit]))
    more = f"; and {len(skipped) - limit} more" if len(skipped) > limit else ""
    return (f"{len(skipped)} entr{'y' if len(skipped) == 1 else 'ies'} of the output dir not sent "
            f"(only regular files are: links and special files are never followed): {named}{more}")
