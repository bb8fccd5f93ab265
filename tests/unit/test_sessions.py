"""The proxy's session registry (issue 11, faults 4 and 9): keys are fresh secrets served while registered, found
by digest and compared in constant time; a revoked key reads nothing; ad-hoc sessions are bounded."""

from __future__ import annotations

import base64
import hmac

import pytest

import polar_gym.proxy.service as service_mod
from polar_gym.proxy.errors import AuthError
from polar_gym.proxy.service import SessionInfo, SessionRegistry, new_session_key


def test_session_keys_are_fresh_and_have_at_least_128_bits() -> None:
    keys = {new_session_key() for _ in range(1000)}
    assert len(keys) == 1000
    for key in list(keys)[:20]:
        assert len(base64.urlsafe_b64decode(key + "=" * (-len(key) % 4))) * 8 >= 128


def test_a_key_serves_its_session_until_revoked() -> None:
    reg = SessionRegistry(allow_adhoc=False)
    key = new_session_key()
    reg.register(SessionInfo("task-0-abcd1234", "policy", attempt="a1", key=key))
    info = reg.resolve(key)
    assert info.session_id == "task-0-abcd1234" and info.attempt == "a1"
    assert reg.may_read(key, "task-0-abcd1234") and not reg.may_read(key, "other")
    for wrong in ("task-0-abcd1234", key[:-1], key + "x", "", None):
        with pytest.raises(AuthError):
            reg.resolve(wrong)
        assert not reg.may_read(wrong, "task-0-abcd1234")
    assert reg.unregister("task-0-abcd1234")
    with pytest.raises(AuthError):
        reg.resolve(key)
    assert not reg.may_read(key, "task-0-abcd1234")
    assert key not in repr(info)


def test_registering_again_replaces_the_key() -> None:
    reg = SessionRegistry()
    old, new = new_session_key(), new_session_key()
    reg.register(SessionInfo("s", key=old))
    reg.register(SessionInfo("s", key=new))
    assert reg.resolve(new).session_id == "s"
    with pytest.raises(AuthError):
        reg.resolve(old)


def test_keys_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(service_mod.hmac, "compare_digest", spy)
    reg = SessionRegistry()
    key = new_session_key()
    reg.register(SessionInfo("s", key=key))
    assert reg.resolve(key).session_id == "s"
    assert compared and all(len(a) == len(b) == 32 for a, b in compared)  # digests: length leaks nothing


def test_adhoc_mode_uses_the_name_as_key_but_never_a_registered_sessions_name() -> None:
    forgotten: list[str] = []
    reg = SessionRegistry(allow_adhoc=True, max_adhoc=3, on_forget=forgotten.append)
    reg.register(SessionInfo("owned", key=new_session_key()))
    with pytest.raises(AuthError):
        reg.resolve("owned")  # a registered session's name is not a key, even in ad-hoc mode
    assert not reg.may_read("owned", "owned")
    assert reg.resolve("mine").session_id == "mine" and reg.may_read("mine", "mine")
    for name in ("b", "c", "d", "e"):
        reg.resolve(name)
    assert reg.count() == 1 + 3 and forgotten == ["mine", "b"]  # least recently used ad-hoc sessions go first
    assert reg.resolve("mine").session_id == "mine"  # and come back on their next call (journal on disk)
