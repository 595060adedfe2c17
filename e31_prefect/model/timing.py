"""Durations, earliest starts, deadlines, latest starts and slack: pure time arithmetic.

Nothing here reads a clock: every function that needs "now" or a scheduled
start takes it as an argument, so the rules are tested exhaustively.

Every moment returned is in UTC: arithmetic on datetimes that share a named
zone is wall-clock arithmetic in Python, which is an hour off across a
daylight-saving change. Zones matter only for reading times of day.

The rules of the seed live here:

- a job's *time limit* is its ``max_duration``; an "until done" job has none of
  its own and is stopped at its deadline;
- ``latest_start = deadline - time_limit`` (``expected_duration`` stands in for
  the time limit of an "until done" job when judging admission);
- a run still waiting after its latest start can no longer finish in time.
"""

from __future__ import annotations

import re
from datetime import date, datetime, time, timedelta, timezone, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

_UNIT_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_COMPACT = re.compile(r"^(?:(\d+(?:\.\d+)?)d)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?$")
_ISO = re.compile(
    r"^P(?:(\d+(?:\.\d+)?)D)?(?:T(?:(\d+(?:\.\d+)?)H)?(?:(\d+(?:\.\d+)?)M)?(?:(\d+(?:\.\d+)?)S)?)?$"
)
_TIME_OF_DAY = re.compile(r"^([01]?\d|2[0-3]):([0-5]\d)$")

DURATION_HINT = "write a duration such as 90m, 2h, 1h30m, PT2H or a number of seconds"
MAX_DURATION = timedelta(days=366)
EARLIEST_YEAR, LATEST_YEAR = 1970, 9000
TIME_HINT = "write a time of day such as 22:00 or an ISO datetime with a zone such as 2026-12-03T07:00:00+00:00"


def parse_duration(value: str | int | float | timedelta) -> timedelta:
    """Read ``90m``, ``2h``, ``1h30m``, ``1d``, ``PT2H`` or plain seconds as a positive timedelta."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration; {DURATION_HINT}")
    elif isinstance(value, (int, float)):
        seconds = float(value)
    else:
        seconds = _parse_duration_text(str(value).strip())
    if not seconds > 0:  # also refuses NaN
        raise ValueError(f"{value!r} is not a positive duration; {DURATION_HINT}")
    if seconds > MAX_DURATION.total_seconds():
        raise ValueError(f"{value!r} is longer than a year; {DURATION_HINT}")
    return timedelta(seconds=seconds)


def _parse_duration_text(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    for pattern in (_COMPACT, _ISO):
        match = pattern.match(text.lower() if pattern is _COMPACT else text.upper())
        if match and any(match.groups()):
            days, hours, minutes, seconds = (float(g) if g else 0.0 for g in match.groups())
            return days * 86400 + hours * 3600 + minutes * 60 + seconds
    raise ValueError(f"{text!r} is not a duration; {DURATION_HINT}")


def format_duration(delta: timedelta) -> str:
    """Write a timedelta the way job files do: ``1h30m``, ``45s``, ``2d3h``, ``0.5s``."""
    total = round(delta.total_seconds(), 6)
    whole, fraction = int(total), round(total - int(total), 6)
    parts = []
    for unit, size in _UNIT_SECONDS.items():
        count, whole = divmod(whole, size)
        if unit == "s" and fraction:
            parts.append(f"{count + fraction:.6f}".rstrip("0") + "s")
        elif count:
            parts.append(f"{count}{unit}")
    return "".join(parts) or "0s"


def parse_time_of_day(text: str) -> time | None:
    """Return the ``HH:MM`` time in ``text``, or None when it is not a time of day."""
    match = _TIME_OF_DAY.match(text.strip())
    return time(int(match.group(1)), int(match.group(2))) if match else None


def parse_aware_datetime(text: str) -> datetime:
    """Read an ISO datetime that names its zone (``Z`` or an offset)."""
    try:
        moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{text!r} is not a time; {TIME_HINT}") from None
    if moment.tzinfo is None:
        raise ValueError(f"{text!r} has no time zone; add one, e.g. {text}+00:00")
    if not EARLIEST_YEAR <= moment.year <= LATEST_YEAR:
        # Far enough from datetime's own bounds that no deadline or start arithmetic can overflow.
        raise ValueError(f"{text!r} is out of range; give a date between {EARLIEST_YEAR} and {LATEST_YEAR}")
    return moment


def check_start(text: str) -> str:
    """Validate an earliest start: ``HH:MM`` or an ISO datetime with a zone."""
    if parse_time_of_day(text) is None:
        parse_aware_datetime(text)
    return text.strip()


def check_deadline(text: str) -> str:
    """Validate a deadline: ``+9h`` (after the scheduled start), ``HH:MM`` or an ISO datetime."""
    text = text.strip()
    if text.startswith("+"):
        parse_duration(text[1:])
    else:
        check_start(text)
    return text


def zone(name: str | None) -> tzinfo:
    """The named IANA zone, or the machine's local zone when no name is given."""
    if name:
        try:
            return ZoneInfo(name)
        except (ZoneInfoNotFoundError, ValueError, OSError):  # OSError: a name too long for a file name
            raise ValueError(f"{name!r} is not a time zone; use an IANA name such as Europe/Paris") from None
    local = datetime.now().astimezone().tzinfo
    assert local is not None
    return local


def utc(moment: datetime) -> datetime:
    """The same instant as a plain UTC datetime, where subtraction counts real seconds.

    Built field by field: datetime subclasses (Prefect's own DateTime among them) may
    return a naive value from ``astimezone``.
    """
    offset = moment.utcoffset()
    if offset is None:
        raise ValueError(f"{moment!r} has no time zone")
    plain = datetime(moment.year, moment.month, moment.day, moment.hour, moment.minute, moment.second,
                     moment.microsecond)
    return (plain - offset).replace(tzinfo=timezone.utc)


def next_occurrence(at: time, after: datetime, tz: tzinfo, *, inclusive: bool) -> datetime:
    """The first instant showing wall-clock ``at`` in ``tz`` at or after (or strictly after) ``after``.

    The day is chosen on the local calendar, so a 07:00 deadline stays 07:00
    local across a daylight-saving change; the result is in UTC.
    """
    after = utc(after)
    day = after.astimezone(tz).date()
    for _ in range(3):
        candidate = _wall_clock(day, at, tz)
        if candidate > after or (inclusive and candidate == after):
            return candidate
        day += timedelta(days=1)
    raise AssertionError("a time of day recurs within three days")


def _wall_clock(day: date, at: time, tz: tzinfo) -> datetime:
    # Via UTC, so a time inside a spring-forward gap lands on a real instant.
    return utc(datetime.combine(day, at).replace(tzinfo=tz))


def resolve_start(spec: str | None, now: datetime, tz: tzinfo) -> datetime:
    """The earliest start a job asks for, seen from ``now``: never earlier than now."""
    now = utc(now)
    if not spec:
        return now
    at = parse_time_of_day(spec)
    moment = next_occurrence(at, now, tz, inclusive=True) if at else utc(parse_aware_datetime(spec))
    return max(moment, now)


def resolve_deadline(spec: str | None, scheduled_start: datetime, tz: tzinfo) -> datetime | None:
    """The absolute deadline of a run scheduled to start at ``scheduled_start``.

    ``+9h`` counts from the scheduled start; ``07:00`` is the next 07:00 after it;
    an ISO datetime is itself.
    """
    if not spec:
        return None
    if spec.startswith("+"):
        return utc(scheduled_start) + parse_duration(spec[1:])
    at = parse_time_of_day(spec)
    if at:
        return next_occurrence(at, scheduled_start, tz, inclusive=False)
    return utc(parse_aware_datetime(spec))



def job_deadline(spec: str | None, start_spec: str | None, scheduled_start: datetime, tz: tzinfo) -> datetime | None:
    """The absolute deadline of a job's run scheduled to start at ``scheduled_start``.

    A time of day is the next one after the start the job declares, seen from then: a run started early
    (``e31 run --now`` at 06:45 of a job that starts at 22:00 and is done by 07:00) keeps its night's deadline,
    not one 15 minutes away. A relative deadline counts from the scheduled start; an ISO datetime is itself.
    """
    declared = resolve_start(start_spec, scheduled_start, tz) if spec and parse_time_of_day(spec) else scheduled_start
    return resolve_deadline(spec, declared, tz)

def admission_duration(max_duration: timedelta | None, expected_duration: timedelta | None) -> timedelta:
    """How long a run must be given before its deadline: its time limit, else its expected duration."""
    return max_duration or expected_duration or timedelta(0)


def latest_start(deadline: datetime | None, duration: timedelta) -> datetime | None:
    """The last moment a run can start and still finish by its deadline (None: no deadline)."""
    return None if deadline is None else utc(deadline) - duration


def slack(latest: datetime | None, now: datetime) -> timedelta | None:
    """How long a run can still wait; negative once its latest start has passed."""
    return None if latest is None else utc(latest) - utc(now)


def stop_at(
    started: datetime, max_duration: timedelta | None, deadline: datetime | None
) -> datetime | None:
    """When a started run is stopped: at its time limit, or at its deadline when it has none."""
    if max_duration is not None:
        return utc(started) + max_duration
    return None if deadline is None else utc(deadline)
