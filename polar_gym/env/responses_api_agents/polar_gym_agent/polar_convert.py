"""Pure conversion for the polar_gym NeMo Gym agent: a Polar ``GET /sessions/{id}/nemo`` payload to NeMo Gym
response output items (plain dicts), the extra-chains modes, and policy URL normalization. Standard library only:
it runs in NeMo Gym's interpreter (next to app.py) and is unit-tested by path from polar_gym's own venv."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["EXTRA_CHAIN_MODES", "backend_urls", "main_chain_index", "output_items", "rollout_parts",
           "split_rollout", "task_id_for"]

EXTRA_CHAIN_MODES = ("separate_rows", "report")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return ""


def output_items(chain: dict[str, Any], prefix: str = "") -> list[dict[str, Any]]:
    """One chain as NeMo Gym output items: per sampled completion an assistant message carrying the token fields
    (prompt_token_ids cumulative, so NeMo RL's contiguity assertion holds), then its tool calls and their results
    as items without token fields (NeMo RL skips those; their tokens are already in the next prompt)."""
    items: list[dict[str, Any]] = []
    for k, item in enumerate(chain.get("items") or []):
        turn = item.get("turn") or {}
        text = _text(turn.get("content")) or _text(turn.get("reasoning_content"))
        items.append({"id": f"msg_{prefix}{k}", "type": "message", "role": "assistant", "status": "completed",
                      "content": [{"type": "output_text", "text": text, "annotations": []}],
                      "prompt_token_ids": list(item["prompt_token_ids"]),
                      "generation_token_ids": list(item["generation_token_ids"]),
                      "generation_log_probs": list(item["generation_log_probs"])})
        for c, call in enumerate(turn.get("tool_calls") or []):
            fn = call.get("function") or {}
            items.append({"id": f"fc_{prefix}{k}_{c}", "type": "function_call", "status": "completed",
                          "call_id": str(call.get("id") or f"call_{prefix}{k}_{c}"), "name": str(fn.get("name") or ""),
                          "arguments": fn.get("arguments") if isinstance(fn.get("arguments"), str)
                          else json.dumps(fn.get("arguments") or {})})
        for r, result in enumerate(turn.get("tool_results") or []):
            items.append({"id": f"fco_{prefix}{k}_{r}", "type": "function_call_output", "status": "completed",
                          "call_id": str(result.get("tool_call_id") or f"call_{prefix}{k}_{r}"),
                          "output": _text(result.get("content"))})
    return items


def _sampled(chain: dict[str, Any]) -> int:
    return sum(len(i.get("generation_token_ids") or []) for i in chain.get("items") or [])


def main_chain_index(chains: list[dict[str, Any]]) -> int | None:
    """The chain a row trains on: the one with the most sampled tokens (the first on ties); None if none sampled."""
    best = None
    for i, chain in enumerate(chains):
        if _sampled(chain) and (best is None or _sampled(chain) > _sampled(chains[best])):
            best = i
    return best


def rollout_parts(payload: dict[str, Any], extra_chains: str = "report") -> dict[str, Any]:
    """Everything run() answers with, from a /nemo payload: ``output`` (main chain items), ``metadata`` (string
    values, OpenAI's response metadata type: reward, session, counts of extra chains) and ``extras`` (top-level
    fields of the rollout line: ``polar`` summary, and ``polar_extra_chains`` item lists with separate_rows)."""
    if extra_chains not in EXTRA_CHAIN_MODES:
        raise ValueError(f"extra_chains must be one of {EXTRA_CHAIN_MODES}, got {extra_chains!r}")
    chains = payload.get("chains") or []
    main = main_chain_index(chains)
    others = [c for i, c in enumerate(chains) if i != main and c.get("items")]
    reward = payload.get("reward")
    summary = {
        "session_id": payload.get("session_id"), "task_id": payload.get("task_id"),
        "status": payload.get("status"), "reason": payload.get("reason"), "reward": reward,
        "passed": payload.get("passed"), "builder": payload.get("builder"),
        "main_trace_index": None if main is None else chains[main].get("trace_index"),
        "num_chains": len(chains), "extra_chains": len(others),
        "extra_chain_items": sum(len(c["items"]) for c in others),
        "extra_chain_generation_tokens": sum(_sampled(c) for c in others),
        "contiguity_errors": {str(c.get("trace_index")): c["contiguity_error"] for c in chains
                              if c.get("contiguity_error")},
        # per token-carrying item of the main chain, in order: the policy version that sampled it (staleness,
        # importance correction) and whether its generation_log_probs are placeholders
        "policy_versions": [i.get("policy_version") for i in (chains[main].get("items") or [])]
        if main is not None else [],
        "logprobs_missing": any(i.get("logprobs_missing") for i in (chains[main].get("items") or []))
        if main is not None else False,
    }
    metadata = {"polar_reward": "" if reward is None else repr(float(reward)),
                "polar_session_id": str(payload.get("session_id") or ""),
                "polar_status": str(payload.get("status") or ""),
                "polar_extra_chains": str(summary["extra_chains"]),
                "polar_extra_chain_items": str(summary["extra_chain_items"]),
                "polar_extra_chain_generation_tokens": str(summary["extra_chain_generation_tokens"])}
    extras: dict[str, Any] = {"polar": summary}
    if extra_chains == "separate_rows":
        extras["polar_extra_chains"] = [{"trace_index": c.get("trace_index"), "chain_cause": c.get("chain_cause"),
                                         "output": output_items(c, f"t{c.get('trace_index')}_")} for c in others]
    return {"output": [] if main is None else output_items(chains[main]), "metadata": metadata, "extras": extras}


def split_rollout(line: dict[str, Any]) -> list[dict[str, Any]]:
    """A rollout line written with ``extra_chains: separate_rows`` as one line per chain: the main line, then each
    extra chain as a copy whose ``response.output`` is that chain (same reward and session), tagged
    ``polar_chain``. Gym answers one response per row, so this is the offline step that makes them rows."""
    extra = line.get("polar_extra_chains") or []
    base = {k: v for k, v in line.items() if k != "polar_extra_chains"}
    rows = [{**base, "polar_chain": "main"}]
    for chain in extra:
        response = {**(base.get("response") or {}), "output": chain["output"]}
        rows.append({**base, "response": response, "polar_chain": chain.get("trace_index")})
    return rows


def backend_urls(value: Any) -> list[str]:
    """Policy server URL(s) as Polar gateway upstreams: a string (comma-separated allowed) or a list; the OpenAI
    ``/v1`` suffix NeMo Gym's ``policy_base_url`` carries is dropped (the gateway's engines add their own paths)."""
    if not value:
        return []
    raw = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    urls = []
    for url in (u.strip().rstrip("/") for u in raw):
        if url.endswith("/v1"):
            url = url[:-3]
        if url and url not in urls:
            urls.append(url)
    return urls


def task_id_for(polar_task: dict[str, Any], unique: str) -> str:
    """A fresh task id for one rollout (Polar's POST /tasks is idempotent by task_id, and NeMo Gym repeats rows)."""
    base = (polar_task.get("task_request") or {}).get("task_id") or polar_task.get("instance_id") \
        or polar_task.get("demo") or "nemo-gym"
    return f"{base}-{unique}"


if __name__ == "__main__":  # python polar_convert.py split IN.jsonl OUT.jsonl
    import sys

    if len(sys.argv) != 4 or sys.argv[1] != "split":
        sys.exit("usage: python polar_convert.py split ROLLOUTS.jsonl OUT.jsonl")
    with open(sys.argv[2]) as src, open(sys.argv[3], "w") as dst:
        for text in src:
            if text.strip():
                for row in split_rollout(json.loads(text)):
                    dst.write(json.dumps(row) + "\n")
