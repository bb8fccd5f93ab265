"""The one session-id -> directory-name codec: distinct keys never share a directory (session isolation), every
name is a single harmless path component, and plain ids stay readable."""

from __future__ import annotations

import hashlib
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from polar_gym.dirnames import dirname_for
from polar_gym.gateway.sandbox import safe_name
from polar_gym.proxy.capture import CaptureJournal


def _harmless(name: str) -> bool:
    return (0 < len(name.encode()) <= 255 and "/" not in name and "\0" not in name and not name.startswith(".")
            and name not in (".", ".."))


def test_ids_that_collided_before_get_distinct_directories():
    # the capture journal mapped these three to one directory, and the gateway cut long ids at 128 characters
    assert len({dirname_for(k) for k in ("abcdefg/x", "abcdefg\\x", "abcdefg:x")}) == 3
    long_task = "t" * 200
    assert safe_name(f"{long_task}-0-abc") != safe_name(f"{long_task}-1-abc")
    # a plain id cannot be chosen to land on another id's hashed name
    hashed = dirname_for("a/b")
    assert "+" in hashed and dirname_for(hashed) != hashed


def test_plain_ids_are_their_own_names():
    for key in ("demo-calc-add-0-1a2b3c4d", "s1", "A_b.c-9", "x" * 100):
        assert dirname_for(key) == key


def test_the_journal_and_the_gateway_use_the_same_codec(tmp_path: Path):
    journal = CaptureJournal(tmp_path)
    for key in ("a/../../b", "..", "é" * 300, "plain-1"):
        assert journal.session_dir(key) == tmp_path / dirname_for(key) == tmp_path / safe_name(key)


@settings(max_examples=400)
@given(st.lists(st.text(min_size=1, max_size=300), min_size=2, max_size=20, unique=True))
def test_distinct_ids_never_share_a_directory(keys):
    names = [dirname_for(k) for k in keys]
    assert len(set(names)) == len(names)
    assert all(_harmless(n) for n in names)


@given(st.text(alphabet=st.sampled_from("ab./-_+:\\\0"), min_size=1, max_size=8),
       st.text(alphabet=st.sampled_from("ab./-_+:\\\0"), min_size=1, max_size=8))
def test_near_identical_ids_never_share_a_directory(a, b):
    assert (dirname_for(a) == dirname_for(b)) == (a == b)
    assert _harmless(dirname_for(a))


def test_a_hashed_name_is_a_64_character_prefix_and_128_bits_of_sha256():
    """The documented shape (at most 97 characters): room left in a 255-byte component for suffixes, and a hash
    wide enough that ids never collide by accident."""
    key = "task/" + "x" * 300
    name = dirname_for(key)
    prefix, digest = name.split("+")
    assert prefix == ("task_" + "x" * 300)[:64]
    assert digest == hashlib.sha256(key.encode()).hexdigest()[:32]
    assert len(name) == 97
