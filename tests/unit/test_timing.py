"""Unit tests for e31_prefect.model.timing: durations, earliest starts, deadlines, latest starts, slack.

Everything here is pure time arithmetic; every "now" is a fixed, zone-aware datetime. Every
moment timing returns is in UTC, so wall-clock checks convert with ``.astimezone(zone)`` first.
Daylight-saving nights used below (2026):

- Europe/Paris springs forward on 2026-03-29 (02:00 -> 03:00) and falls back on
  2026-10-25 (03:00 -> 02:00);
- America/New_York springs forward on 2026-03-08 (02:00 -> 03:00).
"""

from __future__ import annotations

from datetime import datetime, time, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from e31_prefect.model import timing
from e31_prefect.model.timing import (
    DURATION_HINT,
    TIME_HINT,
    admission_duration,
    check_deadline,
    check_start,
    format_duration,
    job_deadline,
    latest_start,
    parse_aware_datetime,
    parse_duration,
    parse_time_of_day,
    resolve_deadline,
    resolve_start,
    slack,
    stop_at,
)

UTC = timezone.utc
PARIS = ZoneInfo("Europe/Paris")
NEW_YORK = ZoneInfo("America/New_York")


def hours(n: float) -> timedelta:
    return timedelta(hours=n)


# -- parse_duration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90m", timedelta(minutes=90)),
        ("2h", timedelta(hours=2)),
        ("1h30m", timedelta(hours=1, minutes=30)),
        ("1d", timedelta(days=1)),
        ("2d3h", timedelta(days=2, hours=3)),
        ("1h2m5s", timedelta(seconds=3725)),
        ("45s", timedelta(seconds=45)),
        ("1.5h", timedelta(minutes=90)),
        ("2H", timedelta(hours=2)),
        (" 90m ", timedelta(minutes=90)),
        ("PT2H", timedelta(hours=2)),
        ("PT1H30M", timedelta(minutes=90)),
        ("PT45S", timedelta(seconds=45)),
        ("P1D", timedelta(days=1)),
        ("P1DT2H", timedelta(days=1, hours=2)),
        ("pt2h", timedelta(hours=2)),
        ("3600", timedelta(hours=1)),
        ("0.5", timedelta(milliseconds=500)),
        (3600, timedelta(hours=1)),
        (90.5, timedelta(seconds=90.5)),
        (timedelta(minutes=5), timedelta(minutes=5)),
    ],
)
def test_parse_duration_reads_every_documented_form(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize(
    "bad",
    [
        "2hh", "", "   ", "h", "1h 30m", "1h30", "PT", "P", "P1H", "PT1D",
        "two hours", "90min", "1:30",
    ],
)
def test_parse_duration_refuses_malformed_text_with_a_hint(bad):
    with pytest.raises(ValueError) as caught:
        parse_duration(bad)
    message = str(caught.value)
    assert repr(bad.strip()) in message
    assert DURATION_HINT in message
    assert "is not a duration" in message


@pytest.mark.parametrize(
    "not_positive", ["0", 0, 0.0, "-5", -5, "-1.5", "0s", "0h0m", timedelta(0), -hours(1)]
)
def test_parse_duration_refuses_zero_and_negative(not_positive):
    with pytest.raises(ValueError, match="is not a positive duration") as caught:
        parse_duration(not_positive)
    assert DURATION_HINT in str(caught.value)


@pytest.mark.parametrize("flag", [True, False])
def test_parse_duration_refuses_booleans(flag):
    # True is an int in Python; a job file saying `max_duration: yes` must not mean one second.
    with pytest.raises(ValueError, match="is not a duration") as caught:
        parse_duration(flag)
    assert repr(flag) in str(caught.value)


@pytest.mark.parametrize(
    ("absurd", "message"),
    [
        ("inf", "'inf' is longer than a year"),
        ("1e20", "'1e20' is longer than a year"),
        ("nan", "'nan' is not a positive duration"),
        (float("inf"), "inf is longer than a year"),
        (1e20, "1e+20 is longer than a year"),
        (float("nan"), "nan is not a positive duration"),
    ],
)
def test_parse_duration_refuses_non_finite_numbers_with_the_hint(absurd, message):
    with pytest.raises(ValueError) as caught:
        parse_duration(absurd)
    assert str(caught.value) == f"{message}; {DURATION_HINT}"


def test_parse_duration_accepts_up_to_366_days_and_refuses_longer():
    assert parse_duration("366d") == timedelta(days=366)
    assert parse_duration("P366D") == timedelta(days=366)
    assert parse_duration(366 * 86400) == timedelta(days=366)
    with pytest.raises(ValueError) as caught:
        parse_duration("366d1s")
    assert str(caught.value) == f"'366d1s' is longer than a year; {DURATION_HINT}"
    with pytest.raises(ValueError) as caught:
        parse_duration(366 * 86400 + 1)
    assert str(caught.value) == f"31622401 is longer than a year; {DURATION_HINT}"


# -- format_duration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("delta", "text"),
    [
        (timedelta(minutes=90), "1h30m"),
        (timedelta(seconds=45), "45s"),
        (timedelta(days=2, hours=3), "2d3h"),
        (timedelta(seconds=3725), "1h2m5s"),
        (timedelta(days=1), "1d"),
        (timedelta(hours=2), "2h"),
        (timedelta(days=1, seconds=1), "1d1s"),
        (timedelta(0), "0s"),
        (timedelta(seconds=59.6), "59.6s"),
        (timedelta(seconds=0.5), "0.5s"),
        (timedelta(seconds=90.5), "1m30.5s"),
        (timedelta(hours=1, seconds=0.25), "1h0.25s"),
        (timedelta(days=1, milliseconds=100), "1d0.1s"),
    ],
)
def test_format_duration_writes_job_file_style(delta, text):
    assert format_duration(delta) == text


@pytest.mark.parametrize("seconds", [0.5, 0.1, 59.6, 90.5, 3600.25, 86400.75, 0.123])
def test_format_then_parse_round_trips_fractional_seconds(seconds):
    delta = timedelta(seconds=seconds)
    assert parse_duration(format_duration(delta)) == delta


@pytest.mark.parametrize(
    ("delta", "text"),
    [
        (timedelta(microseconds=1_234_567), "1.234567s"),
        (timedelta(seconds=90, microseconds=123_456), "1m30.123456s"),
        (timedelta(microseconds=1), "0.000001s"),
    ],
)
def test_format_duration_keeps_every_microsecond(delta, text):
    assert format_duration(delta) == text
    assert parse_duration(format_duration(delta)) == delta


@pytest.mark.parametrize(
    "seconds", [1, 59, 60, 61, 3599, 3600, 3725, 86399, 86400, 90061, 7 * 86400 + 5]
)
def test_format_then_parse_round_trips_whole_seconds(seconds):
    delta = timedelta(seconds=seconds)
    assert parse_duration(format_duration(delta)) == delta


@pytest.mark.parametrize("text", ["90m", "2h", "1h30m", "PT2H", "3600", "1d12h", "100000s"])
def test_parse_then_format_is_stable(text):
    once = format_duration(parse_duration(text))
    assert format_duration(parse_duration(once)) == once


# -- times of day, datetimes, zones -----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [("22:00", time(22, 0)), ("07:00", time(7, 0)), ("7:05", time(7, 5)), (" 23:59 ", time(23, 59)),
     ("00:00", time(0, 0))],
)
def test_parse_time_of_day(text, expected):
    assert parse_time_of_day(text) == expected


@pytest.mark.parametrize(
    "text", ["24:00", "22:60", "2200", "22:00:00", "22h", "", "+9h", "2026-12-03T07:00:00Z"]
)
def test_parse_time_of_day_returns_none_for_anything_else(text):
    assert parse_time_of_day(text) is None


def test_parse_aware_datetime_accepts_z_and_offsets():
    assert parse_aware_datetime("2026-12-03T07:00:00Z") == datetime(2026, 12, 3, 7, tzinfo=UTC)
    assert parse_aware_datetime("2026-12-03T08:00:00+01:00") == datetime(2026, 12, 3, 7, tzinfo=UTC)


def test_parse_aware_datetime_refuses_a_naive_datetime_and_shows_the_fix():
    with pytest.raises(ValueError) as caught:
        parse_aware_datetime("2026-12-03T07:00:00")
    assert str(caught.value) == (
        "'2026-12-03T07:00:00' has no time zone; add one, e.g. 2026-12-03T07:00:00+00:00"
    )


def test_parse_aware_datetime_refuses_garbage_with_the_time_hint():
    with pytest.raises(ValueError) as caught:
        parse_aware_datetime("tomorrow")
    assert str(caught.value) == f"'tomorrow' is not a time; {TIME_HINT}"


def test_check_start_accepts_time_of_day_and_iso_and_strips():
    assert check_start(" 22:00 ") == "22:00"
    assert check_start("2026-12-03T07:00:00+00:00") == "2026-12-03T07:00:00+00:00"


@pytest.mark.parametrize("bad", ["25:00", "tonight", "2026-12-03T07:00:00", "+9h"])
def test_check_start_refuses_what_is_not_a_start(bad):
    with pytest.raises(ValueError):
        check_start(bad)


def test_check_deadline_accepts_relative_time_of_day_and_iso():
    assert check_deadline(" +9h ") == "+9h"
    assert check_deadline("07:00") == "07:00"
    assert check_deadline("2026-12-03T07:00:00Z") == "2026-12-03T07:00:00Z"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("+9hh", "is not a duration"),
        ("+0h", "is not a positive duration"),
        ("7am", "is not a time"),
    ],
)
def test_check_deadline_refuses_malformed(bad, message):
    with pytest.raises(ValueError, match=message):
        check_deadline(bad)


def test_zone_reads_iana_names_and_refuses_others():
    assert timing.zone("Europe/Paris") == PARIS
    with pytest.raises(ValueError) as caught:
        timing.zone("Mars/Olympus")
    assert str(caught.value) == (
        "'Mars/Olympus' is not a time zone; use an IANA name such as Europe/Paris"
    )


def test_zone_without_a_name_is_the_machines_local_zone():
    local = timing.zone(None)
    now = datetime.now(UTC)
    assert now.astimezone(local).utcoffset() == now.astimezone().utcoffset()


# -- resolve_start ----------------------------------------------------------------------------


NOON_UTC = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)  # 13:00 in Paris (UTC+1 in December)


@pytest.mark.parametrize("spec", [None, ""])
def test_resolve_start_without_a_start_is_now(spec):
    assert resolve_start(spec, NOON_UTC, PARIS) == NOON_UTC


def test_resolve_start_time_of_day_later_today():
    start = resolve_start("22:00", NOON_UTC, PARIS)
    assert start == datetime(2026, 12, 3, 21, 0, tzinfo=UTC)
    assert start.tzinfo is UTC
    assert start.astimezone(PARIS).replace(tzinfo=None) == datetime(2026, 12, 3, 22, 0)


def test_resolve_start_time_of_day_already_past_is_tomorrow():
    start = resolve_start("09:00", NOON_UTC, PARIS)
    assert start == datetime(2026, 12, 4, 9, 0, tzinfo=PARIS)


def test_resolve_start_time_of_day_equal_to_now_is_now():
    now = datetime(2026, 12, 3, 21, 0, tzinfo=UTC)  # exactly 22:00 in Paris
    assert resolve_start("22:00", now, PARIS) == now


def test_resolve_start_reads_the_time_of_day_in_the_jobs_zone():
    # 13:00 in Paris is 07:00 in New York: 08:00 New York is still today there.
    assert resolve_start("08:00", NOON_UTC, NEW_YORK) == datetime(2026, 12, 3, 13, 0, tzinfo=UTC)
    assert resolve_start("08:00", NOON_UTC, PARIS) == datetime(2026, 12, 4, 7, 0, tzinfo=UTC)


def test_resolve_start_iso_with_zone_in_the_future_is_itself():
    assert resolve_start("2026-12-04T07:00:00+00:00", NOON_UTC, PARIS) == datetime(
        2026, 12, 4, 7, tzinfo=UTC
    )
    assert resolve_start("2026-12-03T23:30:00+05:00", NOON_UTC, PARIS) == datetime(
        2026, 12, 3, 18, 30, tzinfo=UTC
    )


@pytest.mark.parametrize("past", ["2026-12-03T11:59:59Z", "2020-01-01T00:00:00+00:00"])
def test_resolve_start_is_never_earlier_than_now(past):
    assert resolve_start(past, NOON_UTC, PARIS) == NOON_UTC


def test_resolve_start_inside_a_spring_forward_gap_lands_on_a_real_instant():
    # 02:30 does not exist in New York on 2026-03-08: it lands on 03:30 EDT (07:30 UTC).
    now = datetime(2026, 3, 8, 0, 0, tzinfo=NEW_YORK)
    start = resolve_start("02:30", now, NEW_YORK)
    assert start == datetime(2026, 3, 8, 7, 30, tzinfo=UTC)
    assert start.tzinfo is UTC
    local = start.astimezone(NEW_YORK)
    assert local.replace(tzinfo=None) == datetime(2026, 3, 8, 3, 30)
    assert local.utcoffset() == hours(-4)  # EDT


# -- resolve_deadline -------------------------------------------------------------------------


def test_resolve_deadline_none_without_a_deadline():
    assert resolve_deadline(None, NOON_UTC, PARIS) is None
    assert resolve_deadline("", NOON_UTC, PARIS) is None


def test_resolve_deadline_relative_counts_from_the_scheduled_start():
    assert resolve_deadline("+9h", NOON_UTC, PARIS) == NOON_UTC + hours(9)
    assert resolve_deadline("+90m", NOON_UTC, PARIS) == NOON_UTC + timedelta(minutes=90)


def test_resolve_deadline_time_of_day_is_next_morning_after_an_evening_start():
    start = datetime(2026, 12, 3, 22, 0, tzinfo=PARIS)
    assert resolve_deadline("07:00", start, PARIS) == datetime(2026, 12, 4, 7, 0, tzinfo=PARIS)


def test_resolve_deadline_time_of_day_same_day_when_still_ahead():
    start = datetime(2026, 12, 3, 6, 59, tzinfo=PARIS)
    assert resolve_deadline("07:00", start, PARIS) == datetime(2026, 12, 3, 7, 0, tzinfo=PARIS)


def test_resolve_deadline_time_of_day_is_strictly_after_the_start():
    start = datetime(2026, 12, 3, 7, 0, tzinfo=PARIS)
    assert resolve_deadline("07:00", start, PARIS) == datetime(2026, 12, 4, 7, 0, tzinfo=PARIS)


def test_resolve_deadline_time_of_day_from_a_utc_start_reads_the_jobs_zone():
    start = datetime(2026, 12, 3, 21, 0, tzinfo=UTC)  # 22:00 Paris
    assert resolve_deadline("07:00", start, PARIS) == datetime(2026, 12, 4, 6, 0, tzinfo=UTC)


def test_resolve_deadline_iso_is_itself():
    start = datetime(2026, 12, 3, 22, 0, tzinfo=PARIS)
    deadline = resolve_deadline("2026-12-04T07:00:00+00:00", start, PARIS)
    assert deadline == datetime(2026, 12, 4, 7, tzinfo=UTC)


def test_resolve_deadline_across_paris_fall_back_keeps_the_wall_clock():
    start = datetime(2026, 10, 24, 22, 0, tzinfo=PARIS)  # CEST, UTC+2
    deadline = resolve_deadline("07:00", start, PARIS)
    assert deadline == datetime(2026, 10, 25, 6, 0, tzinfo=UTC)
    assert deadline.tzinfo is UTC
    local = deadline.astimezone(PARIS)
    assert local.replace(tzinfo=None) == datetime(2026, 10, 25, 7, 0)
    assert local.utcoffset() == hours(1)  # CET after the change
    # Ten real hours: 9h on the wall clock plus the hour given back.
    assert deadline - start == hours(10)


def test_resolve_deadline_across_paris_spring_forward_keeps_the_wall_clock():
    start = datetime(2026, 3, 28, 22, 0, tzinfo=PARIS)  # CET, UTC+1
    deadline = resolve_deadline("07:00", start, PARIS)
    assert deadline == datetime(2026, 3, 29, 5, 0, tzinfo=UTC)  # 07:00 CEST
    assert deadline.tzinfo is UTC
    local = deadline.astimezone(PARIS)
    assert local.replace(tzinfo=None) == datetime(2026, 3, 29, 7, 0)
    assert local.utcoffset() == hours(2)  # CEST after the change
    assert deadline - start == hours(8)


def test_resolve_deadline_across_new_york_spring_forward_keeps_the_wall_clock():
    start = datetime(2026, 3, 7, 22, 0, tzinfo=NEW_YORK)  # EST, UTC-5 = 03:00 UTC on the 8th
    deadline = resolve_deadline("07:00", start, NEW_YORK)
    assert deadline == datetime(2026, 3, 8, 11, 0, tzinfo=UTC)
    assert deadline.tzinfo is UTC
    local = deadline.astimezone(NEW_YORK)
    assert local.replace(tzinfo=None) == datetime(2026, 3, 8, 7, 0)
    assert local.utcoffset() == hours(-4)  # EDT
    assert deadline - start == hours(8)


# The same instant written in two zones must give the same answers. Python subtracts and adds
# wall-clock time when two datetimes share a ZoneInfo, so "+9h" and "deadline - 9h" would come out
# an hour off across a daylight-saving change if timing did its arithmetic in the job's zone.

SPRING_START_PARIS = datetime(2026, 3, 28, 22, 0, tzinfo=PARIS)  # = 21:00 UTC


def test_relative_deadline_is_the_same_instant_whatever_zone_the_start_is_in():
    from_paris = resolve_deadline("+9h", SPRING_START_PARIS, PARIS)
    from_utc = resolve_deadline("+9h", SPRING_START_PARIS.astimezone(UTC), PARIS)
    assert from_utc == datetime(2026, 3, 29, 6, 0, tzinfo=UTC)
    assert from_paris == from_utc
    assert from_paris.tzinfo is UTC
    assert from_paris - SPRING_START_PARIS == hours(9)


def test_latest_start_counts_real_time_across_spring_forward():
    deadline = datetime(2026, 3, 29, 7, 0, tzinfo=PARIS)  # 05:00 UTC
    latest = latest_start(deadline, hours(9))
    assert latest == datetime(2026, 3, 28, 20, 0, tzinfo=UTC)
    assert latest.tzinfo is UTC
    assert latest == latest_start(deadline.astimezone(UTC), hours(9))
    assert deadline - latest == hours(9)


def test_slack_counts_real_time_across_spring_forward():
    latest = datetime(2026, 3, 29, 7, 0, tzinfo=PARIS)
    now = SPRING_START_PARIS
    assert slack(latest, now) == hours(8)



@pytest.mark.parametrize(("scheduled", "due"), [
    (datetime(2026, 12, 3, 22, 0, tzinfo=PARIS), datetime(2026, 12, 4, 7, 0, tzinfo=PARIS)),  # at its start
    (datetime(2026, 12, 3, 6, 45, tzinfo=PARIS), datetime(2026, 12, 4, 7, 0, tzinfo=PARIS)),  # --now, morning
    (datetime(2026, 12, 3, 13, 0, tzinfo=PARIS), datetime(2026, 12, 4, 7, 0, tzinfo=PARIS)),  # --now, noon
])
def test_a_time_of_day_deadline_is_the_one_after_the_start_the_job_declares(scheduled, due):
    assert job_deadline("07:00", "22:00", scheduled, PARIS) == due


def test_a_job_with_no_start_or_another_deadline_counts_from_its_scheduled_start():
    morning = datetime(2026, 12, 3, 6, 45, tzinfo=PARIS)
    assert job_deadline("07:00", None, morning, PARIS) == datetime(2026, 12, 3, 7, 0, tzinfo=PARIS)
    assert job_deadline("+1h", "22:00", morning, PARIS) == datetime(2026, 12, 3, 7, 45, tzinfo=PARIS)
    assert job_deadline("2026-12-05T07:00:00Z", "22:00", morning, PARIS) == datetime(2026, 12, 5, 7, 0, tzinfo=UTC)
    assert job_deadline(None, "22:00", morning, PARIS) is None

# -- latest_start, slack, stop_at, admission_duration -----------------------------------------


def test_latest_start_is_deadline_minus_duration():
    deadline = datetime(2026, 12, 4, 6, 0, tzinfo=UTC)
    assert latest_start(deadline, hours(2)) == datetime(2026, 12, 4, 4, 0, tzinfo=UTC)
    assert latest_start(deadline, timedelta(0)) == deadline


def test_latest_start_without_a_deadline_is_none():
    assert latest_start(None, hours(2)) is None


def test_slack_is_positive_before_and_negative_after_the_latest_start():
    latest = datetime(2026, 12, 4, 4, 0, tzinfo=UTC)
    assert slack(latest, datetime(2026, 12, 4, 3, 30, tzinfo=UTC)) == timedelta(minutes=30)
    assert slack(latest, latest) == timedelta(0)
    assert slack(latest, datetime(2026, 12, 4, 4, 15, tzinfo=UTC)) == timedelta(minutes=-15)
    assert slack(None, latest) is None


def test_slack_across_zones_uses_the_real_instants():
    latest = datetime(2026, 12, 4, 5, 0, tzinfo=PARIS)  # 04:00 UTC
    assert slack(latest, datetime(2026, 12, 4, 3, 0, tzinfo=UTC)) == hours(1)


def test_stop_at_is_the_time_limit_when_there_is_one():
    started = datetime(2026, 12, 3, 21, 0, tzinfo=UTC)
    deadline = datetime(2026, 12, 4, 6, 0, tzinfo=UTC)
    twenty_past = datetime(2026, 12, 3, 21, 20, tzinfo=UTC)
    assert stop_at(started, timedelta(minutes=20), deadline) == twenty_past
    assert stop_at(started, timedelta(minutes=20), None) == twenty_past


def test_stop_at_counts_real_time_across_spring_forward():
    started = SPRING_START_PARIS  # 21:00 UTC
    assert stop_at(started, hours(9), None) == datetime(2026, 3, 29, 6, 0, tzinfo=UTC)
    assert stop_at(started, hours(9), None).tzinfo is UTC
    deadline = datetime(2026, 3, 29, 7, 0, tzinfo=PARIS)
    assert stop_at(started, None, deadline) == datetime(2026, 3, 29, 5, 0, tzinfo=UTC)
    assert stop_at(started, None, deadline).tzinfo is UTC


def test_stop_at_is_the_deadline_for_an_until_done_run():
    started = datetime(2026, 12, 3, 21, 0, tzinfo=UTC)
    deadline = datetime(2026, 12, 4, 6, 0, tzinfo=UTC)
    assert stop_at(started, None, deadline) == deadline
    assert stop_at(started, None, None) is None


def test_admission_duration_prefers_the_time_limit_then_the_expected_duration():
    assert admission_duration(hours(2), None) == hours(2)
    assert admission_duration(hours(2), timedelta(minutes=40)) == hours(2)
    assert admission_duration(None, timedelta(minutes=40)) == timedelta(minutes=40)
    assert admission_duration(None, None) == timedelta(0)


# -- every moment returned is in UTC ----------------------------------------------------------


PARIS_EVENING = datetime(2026, 12, 3, 22, 0, tzinfo=PARIS)  # 21:00 UTC


@pytest.mark.parametrize(
    ("moment", "expected"),
    [
        (lambda: resolve_start(None, PARIS_EVENING, PARIS), datetime(2026, 12, 3, 21, 0, tzinfo=UTC)),
        (lambda: resolve_start("23:00", PARIS_EVENING, PARIS), datetime(2026, 12, 3, 22, 0, tzinfo=UTC)),
        (lambda: resolve_start("2026-12-04T08:00:00+01:00", PARIS_EVENING, PARIS),
         datetime(2026, 12, 4, 7, 0, tzinfo=UTC)),
        (lambda: resolve_deadline("+1h", PARIS_EVENING, PARIS), datetime(2026, 12, 3, 22, 0, tzinfo=UTC)),
        (lambda: resolve_deadline("07:00", PARIS_EVENING, PARIS), datetime(2026, 12, 4, 6, 0, tzinfo=UTC)),
        (lambda: resolve_deadline("2026-12-04T08:00:00+01:00", PARIS_EVENING, PARIS),
         datetime(2026, 12, 4, 7, 0, tzinfo=UTC)),
        (lambda: timing.next_occurrence(time(7, 0), PARIS_EVENING, PARIS, inclusive=False),
         datetime(2026, 12, 4, 6, 0, tzinfo=UTC)),
        (lambda: latest_start(PARIS_EVENING, hours(1)), datetime(2026, 12, 3, 20, 0, tzinfo=UTC)),
        (lambda: stop_at(PARIS_EVENING, hours(1), None), datetime(2026, 12, 3, 22, 0, tzinfo=UTC)),
        (lambda: stop_at(PARIS_EVENING, None, PARIS_EVENING), datetime(2026, 12, 3, 21, 0, tzinfo=UTC)),
    ],
    ids=[
        "resolve_start-now", "resolve_start-time", "resolve_start-iso", "resolve_deadline-relative",
        "resolve_deadline-time", "resolve_deadline-iso", "next_occurrence", "latest_start",
        "stop_at-limit", "stop_at-deadline",
    ],
)
def test_every_moment_returned_is_in_utc(moment, expected):
    result = moment()
    assert result == expected
    assert result.tzinfo is UTC


def test_prefect_datetimes_become_plain_aware_utc_instants():
    """Prefect hands the worker its own DateTime; every moment derived from it stays comparable."""
    from prefect.types._datetime import DateTime

    scheduled = DateTime(2026, 12, 2, 22, 0, tzinfo=timezone.utc)
    deadline = timing.resolve_deadline("+2h", scheduled, timezone.utc)
    latest = timing.latest_start(deadline, timedelta(minutes=5))
    assert type(deadline) is datetime and deadline.tzinfo is timezone.utc
    assert latest == datetime(2026, 12, 2, 23, 55, tzinfo=timezone.utc)
    assert latest < datetime(2026, 12, 3, tzinfo=timezone.utc)


@pytest.mark.parametrize("text", ["0001-01-01T00:00:00+00:00", "9999-12-31T23:59:59+00:00",
                                  "1969-12-31T23:00:00+00:00"])
def test_a_start_or_deadline_out_of_range_is_refused_before_any_arithmetic_can_overflow(text):
    for check in (timing.check_start, timing.check_deadline):
        with pytest.raises(ValueError, match="out of range; give a date between 1970 and 9000"):
            check(text)
