"""The content cache's pure rules (key, eviction order) and its behaviour on a real folder."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

from e31_prefect.data.cache import (
    CacheCorrupt,
    ContentCache,
    Entry,
    Verified,
    cache_key,
    changed_since_verified,
    etag_md5,
    plan_eviction,
)
from e31_prefect.data.staging import remove_workspace

MD5 = "9e107d9d372bb6826bd81d3542a419d6"


def test_the_key_is_etag_and_size_so_one_data_set_in_two_buckets_shares_entries():
    assert cache_key(f'"{MD5}"', 43, "s3://a/x") == cache_key(MD5.upper(), 43, "s3://b/y")
    assert cache_key(MD5, 43, "s3://a/x") != cache_key(MD5, 44, "s3://a/x")
    assert cache_key(f"{MD5}-3", 43, "s3://a/x") == cache_key(f"{MD5}-3", 43, "s3://b/x")


def test_an_opaque_etag_is_keyed_with_its_url_too():
    assert cache_key("v1", 10, "s3://a/x") != cache_key("v1", 10, "s3://a/y")


def test_only_a_single_part_etag_is_an_md5():
    assert etag_md5(f'"{MD5}"') == MD5
    assert etag_md5(f"{MD5}-12") is None
    assert etag_md5(None) is None


def test_eviction_takes_the_least_recently_used_first_until_the_bound():
    entries = [Entry("new", 40, 300.0, False), Entry("old", 40, 100.0, False), Entry("mid", 40, 200.0, False)]
    assert plan_eviction(entries, 80) == ["old"]
    assert plan_eviction(entries, 40) == ["old", "mid"]
    assert plan_eviction(entries, 120) == []


def test_eviction_never_takes_an_entry_in_use():
    entries = [Entry("old-in-use", 50, 1.0, True), Entry("newer", 50, 2.0, False)]
    assert plan_eviction(entries, 50) == ["newer"]
    assert plan_eviction([Entry("only", 90, 1.0, True)], 10) == []


def fill_with(data: bytes, calls: list[int]):
    def fill(path: Path) -> None:
        calls.append(1)
        path.write_bytes(data)
    return fill


def test_a_second_provide_links_the_entry_without_downloading(tmp_path):
    cache, calls = ContentCache(tmp_path / "cache", 1 << 20), []
    assert not cache.provide("k1", 5, tmp_path / "a" / "x", fill_with(b"hello", calls))
    assert cache.provide("k1", 5, tmp_path / "b" / "x", fill_with(b"hello", calls))
    assert calls == [1] and (tmp_path / "b" / "x").read_bytes() == b"hello"
    assert os.stat(tmp_path / "b" / "x").st_ino == os.stat(tmp_path / "a" / "x").st_ino  # a hard link
    assert (cache.counters.hits, cache.counters.downloads) == (1, 1)


def test_bytes_that_do_not_match_never_enter_the_cache(tmp_path):
    cache = ContentCache(tmp_path / "cache", 1 << 20)
    with pytest.raises(CacheCorrupt, match="3 bytes of 5"):
        cache.provide("k", 5, tmp_path / "x", fill_with(b"abc", []))
    with pytest.raises(CacheCorrupt, match="MD5"):
        cache.provide("k", 5, tmp_path / "x", fill_with(b"hellO", []), md5="5d41402abc4b2a76b9719d911017c592")
    assert cache.entries() == [] and list(cache.incoming.iterdir()) == []


def test_an_entry_written_through_a_workspace_link_is_dropped(tmp_path):
    cache, calls = ContentCache(tmp_path / "cache", 1 << 20), []
    cache.provide("k", 5, tmp_path / "a", fill_with(b"hello", calls))
    (tmp_path / "a").chmod(0o644)
    (tmp_path / "a").write_bytes(b"HELLO")  # a job running as root ignores read-only bits
    cache.provide("k", 5, tmp_path / "b", fill_with(b"hello", calls))
    assert calls == [1, 1] and (tmp_path / "b").read_bytes() == b"hello"


def test_a_job_that_writes_through_its_link_and_puts_the_times_back_poisons_nothing(tmp_path, caplog):
    cache, calls = ContentCache(tmp_path / "cache", 1 << 20), []
    cache.provide("weights", 5, tmp_path / "job1" / "w.bin", fill_with(b"clean", calls))
    staged = tmp_path / "job1" / "w.bin"
    before = staged.stat()
    # What a hostile job running as the worker's user can do: make its read-only link writable, write the
    # same number of bytes, and set the mode and modification time back as they were. Only the change
    # time, which no call sets, still tells.
    staged.chmod(0o644)
    with staged.open("r+b") as out:
        out.write(b"EVIL!")
    staged.chmod(before.st_mode)
    os.utime(staged, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (staged.stat().st_size, staged.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    with caplog.at_level(logging.WARNING, logger="e31.cache"):
        hit = cache.provide("weights", 5, tmp_path / "job2" / "w.bin", fill_with(b"clean", calls))
    assert not hit and calls == [1, 1], "the changed entry was fetched again"
    assert (tmp_path / "job2" / "w.bin").read_bytes() == b"clean"
    assert cache.counters.changed == ["weights"]
    assert "Cache entry weights changed since it was verified (ctime_ns" in caplog.text
    assert "fetched again" in caplog.text
    # The poisoned file stays only in the workspace that wrote it; the next job links the clean entry.
    assert cache.provide("weights", 5, tmp_path / "job3" / "w.bin", fill_with(b"clean", calls))
    assert (tmp_path / "job3" / "w.bin").read_bytes() == b"clean" and calls == [1, 1]


def test_an_entry_a_finished_workspace_linked_is_still_a_hit(tmp_path):
    cache, calls = ContentCache(tmp_path / "cache", 1 << 20), []
    for run in range(3):
        workspace = tmp_path / f"run{run}"
        hit = cache.provide("k", 5, workspace / "data" / "x", fill_with(b"hello", calls))
        assert hit == (run > 0)
        remove_workspace(workspace, cache)  # unlinking moves the entry's change time: released, re-recorded
        assert not workspace.exists()
    assert calls == [1] and cache.counters.changed == []


def test_a_workspace_removed_after_its_job_wrote_through_the_link_evicts_the_entry(tmp_path):
    cache, calls = ContentCache(tmp_path / "cache", 1 << 20), []
    cache.provide("k", 5, tmp_path / "run" / "data" / "x", fill_with(b"hello", calls))
    staged = tmp_path / "run" / "data" / "x"
    staged.chmod(0o644)
    staged.write_bytes(b"HELLO")
    remove_workspace(tmp_path / "run", cache)
    assert cache.entries() == [] and cache.counters.changed == ["k"]
    assert not cache.provide("k", 5, tmp_path / "next" / "x", fill_with(b"hello", calls))
    assert (tmp_path / "next" / "x").read_bytes() == b"hello" and calls == [1, 1]


def test_an_entry_with_no_record_of_its_verification_is_fetched_again(tmp_path):
    cache, calls = ContentCache(tmp_path / "cache", 1 << 20), []
    (cache.objects / "old").write_bytes(b"hello")  # left by an e31 that kept no records
    assert not cache.take("old", 5, tmp_path / "x")
    assert not (cache.objects / "old").exists() and cache.counters.changed == ["old"]
    assert not cache.provide("old", 5, tmp_path / "x", fill_with(b"hello", calls)) and calls == [1]


@pytest.mark.parametrize(("record", "why"), [
    (None, "no record of it being verified"),
    (Verified("other", 5, 1, 2), "no record of it being verified"),
    (Verified("k", 5, 1, 2), None),
    (Verified("k", 6, 1, 2), "changed since it was verified (size 6 -> 5)"),
    (Verified("k", 5, 1, 3), "changed since it was verified (ctime_ns 3 -> 2)"),
    (Verified("k", 5, 9, 9), "changed since it was verified (mtime_ns 9 -> 1, ctime_ns 9 -> 2)"),
])
def test_what_counts_as_changed_since_verified(record, why):
    info = os.stat_result((0o100444, 7, 1, 1, 0, 0, 5, 0, 0, 0, 0.0, 0.0, 0.0, 0, 1, 2))
    assert (info.st_size, info.st_mtime_ns, info.st_ctime_ns) == (5, 1, 2)
    assert changed_since_verified(record, "k", info) == why


def test_trim_evicts_unused_entries_least_recently_used_first(tmp_path):
    cache = ContentCache(tmp_path / "cache", 10)
    for index, key in enumerate(["a", "b", "c"]):
        cache.provide(key, 4, tmp_path / key, fill_with(b"1234", []))
        record = cache.verified / "{0.st_dev}-{0.st_ino}".format(os.stat(cache.objects / key))
        os.utime(record, (index, index))  # each link rewrites its entry's record: the record's time is its last use
    (tmp_path / "b").unlink()
    (tmp_path / "c").unlink()
    # a is linked into a "workspace": in use, never evicted; b is the least recently used of the rest.
    assert cache.trim() == ["b"]
    assert sorted(e.key for e in cache.entries()) == ["a", "c"]


def test_threads_wanting_one_object_at_once_download_it_once(tmp_path):
    cache, calls = ContentCache(tmp_path / "cache", 1 << 20), []
    started = threading.Barrier(8)

    def slow_fill(path: Path) -> None:
        calls.append(1)
        path.write_bytes(b"x" * 1000)

    def stage(n: int) -> None:
        started.wait()
        cache.provide("same", 1000, tmp_path / f"w{n}", slow_fill)

    threads = [threading.Thread(target=stage, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and cache.counters.hits == 7


def test_an_encrypted_objects_etag_is_not_taken_for_its_md5(tmp_path):
    from e31_prefect.data.cache import ETAG_NOT_MD5, CacheCorrupt, check
    from e31_prefect.data.store import etag_is_md5

    # SSE-KMS and SSE-C objects have ETags that look like an MD5 but are not one.
    assert not etag_is_md5({"ServerSideEncryption": "aws:kms", "ETag": '"0123456789abcdef0123456789abcdef"'})
    assert not etag_is_md5({"ServerSideEncryption": "aws:kms:dsse"})
    assert not etag_is_md5({"SSECustomerAlgorithm": "AES256"})
    assert etag_is_md5({"ServerSideEncryption": "AES256"}) and etag_is_md5({})
    staged = tmp_path / "object"
    staged.write_bytes(b"x" * 10)
    check(staged, 10, "0123456789abcdef0123456789abcdef", ETAG_NOT_MD5)  # the size alone is checked
    with pytest.raises(CacheCorrupt):
        check(staged, 10, "0123456789abcdef0123456789abcdef")
    with pytest.raises(CacheCorrupt):
        check(staged, 11, "0123456789abcdef0123456789abcdef", ETAG_NOT_MD5)
