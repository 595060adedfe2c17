"""The content cache's pure rules (key, eviction order) and its behaviour on a real folder."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from e31_prefect.cache import CacheCorrupt, ContentCache, Entry, cache_key, etag_md5, plan_eviction

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


def test_trim_evicts_unused_entries_least_recently_used_first(tmp_path):
    cache = ContentCache(tmp_path / "cache", 10)
    for index, key in enumerate(["a", "b", "c"]):
        cache.provide(key, 4, tmp_path / key, fill_with(b"1234", []))
        os.utime(cache.objects / key, ns=(index * 10**9, os.stat(cache.objects / key).st_mtime_ns))
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
    from e31_prefect.cache import ETAG_NOT_MD5, CacheCorrupt, check
    from e31_prefect.store import etag_is_md5

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
