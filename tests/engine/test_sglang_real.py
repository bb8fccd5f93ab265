"""The proxy in front of a real SGLang server, for a GPU node (SGLang has no CPU build): what we record must be
exactly the token data SGLang put in ``choices[0].prompt_token_ids`` and ``choices[0].meta_info``. Skips, saying
how to run it, unless ``POLAR_SGLANG_URL`` points at a server."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.engine


def test_sglang_chat_records_the_engines_tokens(sglang_proxy):
    session = "e-sglang"
    with openai.OpenAI(base_url=sglang_proxy.url + "/v1", api_key=session, max_retries=0) as c:
        c.chat.completions.create(model="policy", max_tokens=16, messages=[{"role": "user", "content": "Say hi"}])
    resp = httpx.get(f"{sglang_proxy.url}/sessions/{session}/completions",
                     headers={"authorization": f"Bearer {session}"})
    (rec,) = resp.json()["completions"]
    (call,) = sglang_proxy.exchanges
    choice = call.answer["choices"][0]
    triples = choice["meta_info"]["output_token_logprobs"]
    assert rec["prompt_ids"] == choice["prompt_token_ids"]
    assert rec["response_ids"] == [t[1] for t in triples]
    assert rec["response_logprobs"] == [t[0] for t in triples]
    assert rec["token_faithful"] and rec["engine"] == "sglang"
