"""A run's attempts: when a host is lost, when a cut-off host fences, what becomes of a lost attempt (pure)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from e31_prefect.model import attempts
from e31_prefect.model.attempts import Beat, Loss

T0 = datetime(2026, 12, 3, 2, 0, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_a_cut_off_supervisor_fences_well_before_the_pool_requeues():
    for lost in (6.0, 120.0, 600.0):
        fence, beat = attempts.fence_seconds(lost), attempts.beat_seconds(lost)
        assert fence <= lost * 0.75 < lost, "the work stops a quarter of the lost time before the requeue"
        assert beat * 4 <= fence, "a few lost heartbeats in a row never fence a host"


def test_a_host_is_lost_after_its_lost_time_of_silence_and_not_before():
    beats = {"a": Beat("a", at(0), 120), "b": Beat("b", at(100), 120)}
    assert attempts.lost_hosts(beats, at(120), 120) == {}
    assert attempts.lost_hosts(beats, at(121), 120) == {"a": beats["a"]}


def test_a_host_whose_supervisors_fence_later_is_waited_for_longer():
    beats = {"slow": Beat("slow", at(0), 600)}
    assert attempts.lost_hosts(beats, at(300), 120) == {}
    assert attempts.lost_hosts(beats, at(601), 120) == beats


def test_a_judge_that_was_cut_off_itself_waits_before_it_judges_anyone():
    """After an API outage every heartbeat is old: the hosts get a while to write one again."""
    beats = {"a": Beat("a", at(0), 120)}
    assert attempts.lost_hosts(beats, at(200), 120, since=at(190)) == {}
    assert attempts.lost_hosts(beats, at(200), 120, since=at(160)) == beats


def test_a_beat_variable_that_is_not_one_is_ignored():
    assert attempts.parse_beat({"host": "a", "at": at(0).isoformat(), "lost_seconds": 120}) == Beat("a", at(0), 120)
    for junk in ({}, {"host": "a"}, {"host": "a", "at": "yesterday", "lost_seconds": 1},
                 {"host": "a", "at": at(0).isoformat(), "lost_seconds": "x"}):
        assert attempts.parse_beat(junk) is None
    latest = attempts.latest_beats([Beat("a", at(5), 1), Beat("a", at(9), 1), Beat("b", at(1), 1)])
    assert latest == {"a": Beat("a", at(9), 1), "b": Beat("b", at(1), 1)}


LOSS = Loss(attempts.HOST_LOST, "a", at(0), "Host a was lost.")


def test_a_lost_attempt_is_requeued_while_its_deadline_and_attempts_allow():
    verdict = attempts.verdict(LOSS, True, 0, 2, at(130), at(3600))
    assert verdict.again and verdict.name == "HostLost" and "Requeued as attempt 2" in verdict.why


def test_a_lost_attempt_past_its_latest_start_ends_deadline_missed_saying_why():
    verdict = attempts.verdict(LOSS, True, 0, 2, at(130), at(60), " (planned for 14 min)")
    assert not verdict.again and verdict.name == "DeadlineMissed"
    assert "had to start again by" in verdict.why and "planned for 14 min" in verdict.why


def test_a_run_out_of_attempts_ends_under_its_loss():
    verdict = attempts.verdict(LOSS, True, 1, 2, at(130), at(3600))
    assert not verdict.again and verdict.name == "HostLost" and "E31_HOST_ATTEMPTS=2" in verdict.why


def test_a_loss_before_the_rent_uses_no_attempt():
    assert attempts.verdict(LOSS, False, 1, 2, at(130), at(3600)).again


def test_only_losses_count_against_the_attempts():
    names = ["Scheduled", "Pending", "Running", "HostLost", "Pending", "Running", "AwaitingRetry", "DeviceFailed"]
    assert attempts.rented_losses(names) == 2


def test_a_loss_gives_back_the_retry_prefect_counted_for_it():
    assert attempts.retries_after_loss(2, was_running=True) == 3
    assert attempts.retries_after_loss(2, was_running=False) == 2, "never Running: Prefect counted nothing"
    assert attempts.retries_after_loss(None, was_running=True) is None


def test_an_attempt_is_superseded_once_its_run_went_back_to_the_queue():
    mine = [("s0", "SCHEDULED", "Scheduled"), ("p1", "PENDING", "Pending"), ("p2", "PENDING", "Submitting"),
            ("r1", "RUNNING", "Running"), ("s1", "SCHEDULED", "AwaitingRetry"), ("r2", "RUNNING", "Retrying")]
    assert not attempts.superseded(mine, "p1"), "its own flow's retries are its own"
    requeued = [*mine, ("s2", "SCHEDULED", "HostLost"), ("p3", "PENDING", "Pending")]
    assert attempts.superseded(requeued, "p1")
    assert not attempts.superseded(requeued, "p3")
    handed_back = [("p1", "PENDING", "Pending"), ("s2", "SCHEDULED", "Scheduled")]
    assert attempts.superseded(handed_back, "p1")
    assert attempts.superseded(mine, "elsewhere"), "a take not in the run's history is not the run's"
    assert not attempts.superseded(mine, None), "a run not taken from the pool (e31 run) is its caller's"


def test_an_attempt_the_pool_ended_for_its_lost_host_is_superseded_though_nothing_came_after():
    """Its last attempt lost: the pool ended the run HostLost (Failed), not requeued. The host that comes back
    keeps its outputs in its spool, as it would for a requeued run."""
    taken = [("p1", "PENDING", "Pending"), ("r1", "RUNNING", "Running")]
    assert attempts.superseded([*taken, ("f1", "FAILED", "HostLost")], "p1")
    assert attempts.superseded([*taken, ("f1", "FAILED", "DeviceFailed")], "p1")
    assert not attempts.superseded([*taken, ("f1", "FAILED", "Failed")], "p1"), "its flow's own end is its own"


def test_labels_name_the_attempt_and_the_earlier_bill():
    assert attempts.attempt_of(None) == 1 and attempts.attempt_of({"e31.attempt": 3}) == 3
    assert attempts.attempt_of({"e31.attempt": "junk"}) == 1
    assert attempts.earlier_billed({"e31.billed-earlier-s": 12.5}) == 12.5 and attempts.earlier_billed({}) == 0


def test_e31_queue_names_a_requeued_runs_attempt_and_not_a_first_one():
    assert attempts.shown_name("amber-otter", {"e31.attempt": 2}) == "amber-otter (attempt 2)"
    assert attempts.shown_name("amber-otter", {}) == "amber-otter"
    assert attempts.shown_name("amber-otter", None) == "amber-otter"


def test_a_run_taken_after_its_host_fell_silent_is_another_workers_unless_its_host_handed_it_over_after():
    heard = datetime(2026, 12, 7, 13, 9, 39, 500000, tzinfo=timezone.utc)
    taken = heard + timedelta(seconds=0.4)  # the lost host took it just after its last heartbeat
    assert attempts.taken_since_silence(taken, None, heard)  # nothing after the take: another worker's take
    assert attempts.taken_since_silence(taken, heard - timedelta(seconds=5), heard)  # an earlier attempt's
    # The host handed it over (or its flow started) after taking it: its own attempt, lost with it.
    assert not attempts.taken_since_silence(taken, taken + timedelta(seconds=1.5), heard)
    assert not attempts.taken_since_silence(heard - timedelta(seconds=1), None, heard)  # taken before the silence
    assert not attempts.taken_since_silence(None, None, heard)
