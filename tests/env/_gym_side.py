"""Run in NeMo Gym's interpreter (PYTHONPATH = the clone):

- ``python -m tests.env._gym_side freeze ROOT ROLLOUT``: freeze a rollout through polar_gym's journal transport and
  print, as one JSON object, what a NeMo RL consumer would get: every entry's lineage, what Gym's own builder makes
  of the snapshot (its chains, the one it delivers, the links it refused), every chain as contiguous output items
  (``PolarTokenSource.chains``) and how a fresh resolver answers each journaled call's own request;
- ``python -m tests.env._gym_side deliver ROOT ROLLOUT PAYLOAD.json``: what the agent does with a session's
  ``/nemo`` payload (every chain's calls through ``PolarTokenSink``, twice: a retry is a no-op);
- ``drop ROOT ROLLOUT SNAPSHOT_ID VERSION`` (a consumer retiring what it froze) and ``wiring ROOT ROLLOUT`` (Gym
  building the transport from a ``token_id_capture`` block)."""

from __future__ import annotations

import asyncio
import json
import sys

from nemo_gym.token_id_capture.builder import prefix_merging, project_main_chain_response
from nemo_gym.token_id_capture.records import compute_digest

from polar_gym.env.nemo_transport import (
    JournalTokenStore,
    PolarLineageResolver,
    PolarTokenSink,
    PolarTokenSource,
    deliver_session,
)
from polar_gym.journal import read_session


def _contiguous(items: list[dict]) -> bool:
    seen: list[int] = []
    for item in items:
        if not item.get("generation_token_ids"):
            continue
        if item["prompt_token_ids"][:len(seen)] != seen:
            return False
        seen = list(item["prompt_token_ids"]) + list(item["generation_token_ids"])
    return bool(seen)


async def freeze(root: str, rollout_id: str) -> dict:
    source = PolarTokenSource(root)
    snapshot = await source.freeze(rollout_id)
    entries = list(snapshot.entries)
    by_id = {e.model_call_id: e for e in entries}
    built = prefix_merging(entries)
    main = project_main_chain_response(rollout_id, built)
    chains = await source.chains(rollout_id)
    await source.close()
    # request-time lineage: each proxy-journaled call's own request (chat form), resolved by a fresh resolver
    resolver = PolarLineageResolver(root)
    resolved = {}
    for record in read_session(JournalTokenStore(root).stream_dir(rollout_id)):
        messages = record.normalized_request.get("messages")
        if messages is not None:
            answer = await resolver.resolve(rollout_id, messages)
            resolved[record.completion_id] = [str(answer.status), answer.match.model_call_id if answer.match else None]
    return {
        "incomplete": snapshot.incomplete, "version": snapshot.version, "snapshot_id": snapshot.snapshot_id,
        "entries": [{"call": e.model_call_id, "parent": e.parent_call_id, "resolution": str(e.parent_resolution),
                     "chain": getattr(e, "polar_chain", None), "parent_chain": getattr(e, "polar_parent_chain", None),
                     "cause": getattr(e, "polar_chain_cause", None), "items": len(e.output_items),
                     "generation": len(e.generation_token_ids), "digest": e.digest,
                     # Gym's own check of a link: the child's prompt starts with the parent's whole sequence
                     "link_verified": e.parent_call_id is None or compute_digest(
                         e.prompt_token_ids[:by_id[e.parent_call_id].cum_len]) == by_id[e.parent_call_id].digest}
                    for e in entries],
        "gym_chains": len(built.chains), "gym_quarantined": list(built.quarantined),
        "gym_delivered_fraction": built.notes.delivered_fraction,
        "gym_link_failures": dict(built.notes.parent_link_failures),
        "gym_main_generation_items": sum(1 for i in main.get("output", []) if i.get("generation_token_ids")),
        "every_chain_items": [sum(1 for i in c if i.get("generation_token_ids")) for c in chains],
        "every_chain_contiguous": [_contiguous(c) for c in chains],
        "request_time": resolved,
    }


async def deliver(root: str, rollout_id: str, payload: dict) -> dict:
    sink = PolarTokenSink(root)
    first = await deliver_session(sink, rollout_id, payload)
    assert await deliver_session(sink, rollout_id, payload) == first  # a repeated delivery: the same bytes
    await sink.close()
    return first


async def wiring(root: str, rollout_id: str) -> dict:
    """The documented NeMo RL wiring: Gym builds the sink and resolver from ``token_id_capture`` (its own protocol
    checks included); an entry put through that sink resolves through that resolver and freezes from a source."""
    from nemo_gym.token_id_capture.config import token_id_capture_config
    from nemo_gym.token_id_capture.lineage import stamp_continuation
    from nemo_gym.token_id_capture.records import ParentResolutionStatus, TokenEntry, stamp_lineage

    block = {"enabled": True, "sink": "polar_gym.env.nemo_transport:PolarTokenSink", "sink_kwargs": {"root": root},
             "lineage_store": "polar_gym.env.nemo_transport:PolarLineageResolver",
             "lineage_store_kwargs": {"root": root}, "rebuild_response": False}
    config = token_id_capture_config({"token_id_capture": block})
    sink, resolver = config.build_sink(), config.build_lineage_store()
    request = [{"role": "user", "content": "hi"}]
    entry = TokenEntry(rollout_id=rollout_id, model_call_id="call-1", prompt_token_ids=[1, 2],
                       generation_token_ids=[3], generation_log_probs=[-0.5], token_item_index=0,
                       output_items=[{"type": "message", "role": "assistant",
                                      "content": [{"type": "output_text", "text": "hello"}]}])
    stamp_lineage(stamp_continuation(entry, request), None, parent_resolution=ParentResolutionStatus.ROOT)
    await sink.put(entry)
    answer = await resolver.resolve(rollout_id, request + list(entry.output_items) + [{"role": "user", "content": "?"}])
    snapshot = await PolarTokenSource(root).freeze(rollout_id)
    # a writer with delta_records: true stores a continuation as its suffix; it freezes as put, chains() refuses it
    delta = TokenEntry(rollout_id=rollout_id, model_call_id="call-2", prompt_token_ids=[4], generation_token_ids=[5],
                       generation_log_probs=[-0.5], prompt_is_delta=True, parent_call_id="call-1",
                       parent_resolution=ParentResolutionStatus.RESOLVED)
    stamp_lineage(delta, "call-1", parent_resolution=ParentResolutionStatus.RESOLVED, cumulative=[1, 2, 3, 4, 5])
    await sink.put(delta)
    source = PolarTokenSource(root)
    frozen = await source.freeze(rollout_id)
    try:
        await source.chains(rollout_id)
        refused = False
    except ValueError:
        refused = True
    return {"sink": type(sink).__name__, "resolver": type(resolver).__name__, "resolved": str(answer.status),
            "frozen": [e.model_call_id for e in snapshot.entries],
            "delta_frozen": [e.prompt_is_delta for e in frozen.entries], "delta_chains_refused": refused}


async def drop(root: str, rollout_id: str, snapshot_id: str, version: str) -> dict:
    return {"dropped": await PolarTokenSource(root).drop(rollout_id, snapshot_id=snapshot_id, version=int(version))}


if __name__ == "__main__":
    command, root, rollout = sys.argv[1:4]
    if command == "drop":
        print(json.dumps(asyncio.run(drop(root, rollout, *sys.argv[4:6]))))
    elif command == "wiring":
        print(json.dumps(asyncio.run(wiring(root, rollout))))
    elif command == "deliver":
        with open(sys.argv[4]) as fh:
            print(json.dumps(asyncio.run(deliver(root, rollout, json.load(fh)))))
    else:
        assert command == "freeze", command
        print(json.dumps(asyncio.run(freeze(root, rollout))))
