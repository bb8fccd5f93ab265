"""Provider detection: path first (query strings allowed), then headers, then body shape."""

from __future__ import annotations

import pytest

from polar_gym.proxy.detect import detect_provider, split_google_path


@pytest.mark.parametrize(("path", "expected"), [
    ("/v1/messages", "anthropic"),
    ("/v1/messages?beta=true", "anthropic"),
    ("/anthropic/v1/messages/count_tokens", "anthropic"),
    ("/v1/chat/completions", "openai_chat"),
    ("/api/v1/chat/completions/", "openai_chat"),
    ("/v1/responses", "openai_responses"),
    ("/v1beta/models/gemini-2.5-pro:generateContent", "google"),
    ("/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse", "google"),
    ("/v1/models/policy:streamGenerateContent", "google"),
])
def test_by_path(path, expected):
    assert detect_provider(path, {}, None) == expected


def test_path_wins_over_headers_and_body():
    assert detect_provider("/v1/chat/completions", {"anthropic-version": "2023-06-01"}, {"contents": []}) == \
        "openai_chat"


@pytest.mark.parametrize(("headers", "expected"), [
    ({"Anthropic-Version": "2023-06-01"}, "anthropic"),
    ({"x-api-key": "k"}, "anthropic"),
    ({"x-goog-api-key": "k"}, "google"),
])
def test_by_headers(headers, expected):
    assert detect_provider("/", headers, {"messages": []}) == expected


@pytest.mark.parametrize(("body", "expected"), [
    ({"contents": [{"parts": [{"text": "hi"}]}]}, "google"),
    ({"model": "m", "input": "hi"}, "openai_responses"),
    ({"model": "m", "system": "s", "max_tokens": 5, "messages": []}, "anthropic"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]},
     "anthropic"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "openai_chat"),
    ({"unrelated": 1}, None),
    (None, None),
])
def test_by_body(body, expected):
    assert detect_provider("/", {"authorization": "Bearer k"}, body) == expected


def test_split_google_path():
    assert split_google_path("/v1beta/models/gemini-2.5-flash:streamGenerateContent") == \
        ("gemini-2.5-flash", "streamGenerateContent")
    assert split_google_path("/v1/models/tuned/x:generateContent") == ("tuned/x", "generateContent")
    assert split_google_path("/v1/models") is None
