"""Issue 42: builders and the Slime export carry a multimodal session's images. A prefix-merged trace's
``metadata.images`` are its last call's (every image of the chain, spans in the trace's own token positions), its
messages hold the pixels, and a Slime sample puts them in ``multimodal_inputs`` in the order of their placeholders."""

from __future__ import annotations

from typing import Any

from polar_gym.merge import MergeConfig
from polar_gym.merge.exports import slime_samples
from polar_gym.merge.prefix_merging import prefix_merging
from polar_gym.schema import CompletionRecord, CompletionSession

PAD, START, END, EOT = 151655, 151652, 151653, 151645
RED, BLUE = "data:image/png;base64,UkVE", "data:image/png;base64,QkxVRQ=="


def _user(text: str, url: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        {"type": "image_url", "image_url": {"url": url}}]}


def _image(sha: str, start: int, n: int) -> dict[str, Any]:
    return {"sha256": sha * 32, "media_type": "image/png", "size": 3, "prompt_span": {"start": start, "end": start + n}}


def test_a_merged_chain_carries_every_image_where_its_placeholders_sit() -> None:
    first_prompt = [1, START, *[PAD] * 4, END, 2]  # the red card's 4 placeholders at 2..6
    first_reply = [10, 11, EOT]
    second_prompt = [*first_prompt, *first_reply, 3, START, *[PAD] * 6, END, 4]  # the blue card's 6 at 13..19
    messages = [_user("what is this?", RED)]
    reply = {"role": "assistant", "content": "red"}
    records = [
        CompletionRecord(completion_id="c0", session_id="s", index=0, provider="openai_chat", engine="vllm",
                         normalized_request={"messages": messages}, response={"message": reply},
                         prompt_ids=first_prompt, response_ids=first_reply, response_logprobs=[-0.1] * 3,
                         images=[_image("ab", 2, 4)]),
        CompletionRecord(completion_id="c1", session_id="s", index=1, provider="openai_chat", engine="vllm",
                         normalized_request={"messages": [*messages, reply, _user("and this?", BLUE)]},
                         response={"message": {"role": "assistant", "content": "blue"}},
                         prompt_ids=second_prompt, response_ids=[12, EOT], response_logprobs=[-0.2] * 2,
                         images=[_image("ab", 2, 4), _image("cd", 13, 6)]),
    ]
    trajectory = prefix_merging(CompletionSession(session_id="s", completions=records),
                                MergeConfig(end_of_turn_ids=(EOT,)))
    (trace,) = trajectory.traces
    sequence = [*trace.prompt_ids, *trace.response_ids]
    spans = [(image["prompt_span"]["start"], image["prompt_span"]["end"]) for image in trace.metadata["images"]]
    assert spans == [(2, 6), (13, 19)] and all(set(sequence[a:b]) == {PAD} for a, b in spans)
    (sample,) = slime_samples(trajectory)
    assert sample.multimodal_inputs == {"images": [RED, BLUE]}  # the order of the placeholders in tokens
    assert sample.metadata["images"] == trace.metadata["images"] and sample.tokens == sequence


def test_a_text_trace_has_no_multimodal_inputs() -> None:
    record = CompletionRecord(completion_id="c0", session_id="s", index=0, provider="openai_chat", engine="vllm",
                              normalized_request={"messages": [{"role": "user", "content": "hi"}]},
                              prompt_ids=[1, 2], response_ids=[3, EOT], response_logprobs=[-0.1, -0.2])
    (sample,) = slime_samples(prefix_merging(CompletionSession(session_id="s", completions=[record]), MergeConfig()))
    assert sample.multimodal_inputs is None and "images" not in sample.metadata


def test_trainers_that_take_token_ids_only_never_train_a_multimodal_trace() -> None:
    """TRL's rollout_func, the verl bridge and the reference trainer have no way to feed pixels: each would train
    the image placeholders as if they were text. Each keeps the row untrained and says why."""
    from polar_gym.bridges.trl import rollout_output, session_row
    from polar_gym.bridges.verl import verl_row
    from polar_gym.trainer import grpo_sequences
    from tests._vision import image_session

    result, _ = image_session()
    row = session_row(result, end_id=EOT)
    assert row.reward is None and not any(row.env_mask)
    assert row.images == slime_samples(result)[0].multimodal_inputs["images"] and len(row.images) == 2  # type: ignore[index]
    assert rollout_output([row])["polar_images"] == [row.images]  # what TRL's reward functions get
    assert len(row.prompt_ids) + len(row.completion_ids) == len(result.trajectory.traces[0].prompt_ids) + len(
        result.trajectory.traces[0].response_ids)  # type: ignore[union-attr]
    verl = verl_row(result, prompt_length=64, response_length=64, filler_id=EOT)
    assert not any(verl.response_mask) and "images" in verl.extra_fields["polar_reason"]
    (sequence,) = grpo_sequences([result])
    assert not any(sequence.loss_mask)
    text = result.model_copy(deep=True)
    text.trajectory.traces[0].metadata.pop("images")  # type: ignore[union-attr]
    assert any(session_row(text, end_id=EOT).env_mask) and any(grpo_sequences([text])[0].loss_mask)


def test_the_nemo_payload_and_its_entries_carry_each_image_once_with_its_span() -> None:
    """The /nemo payload's chain names its images (spans in its token positions) and holds their pixels once; the
    entries made of it (and of the journal's records) name the images in each call's prompt, and the first call
    that saw an image carries its pixels."""
    from polar_gym.env.token_lineage import calls_from_nemo_payload, calls_from_records
    from polar_gym.merge.nemo_payload import session_nemo_payload
    from tests._vision import image_session

    result, records = image_session()
    payload = session_nemo_payload(result)
    (chain,) = payload["chains"]
    red, blue = (image["sha256"] for image in chain["images"])
    assert set(chain["image_data"]) == {red, blue}
    assert all(url.startswith("data:image/png;base64,") for url in chain["image_data"].values())
    for calls in (calls_from_nemo_payload(payload), calls_from_records(records)[0]):
        first, second = calls
        assert [i["sha256"] for i in first.extras["polar_images"]] == [red]
        assert [i["sha256"] for i in second.extras["polar_images"]] == [red, blue]
        assert first.extras["polar_image_data"] == {red: chain["image_data"][red]}
        assert second.extras["polar_image_data"] == {blue: chain["image_data"][blue]}  # red's pixels came already
        for call in calls:
            for image in call.extras["polar_images"]:
                span = image["prompt_span"]
                assert set(call.prompt[span["start"]:span["end"]]) == {PAD} and span["end"] <= len(call.prompt)
    text = session_nemo_payload(result.model_copy(update={"trajectory": result.trajectory.model_copy(update={
        "traces": [result.trajectory.traces[0].model_copy(update={"metadata": {}})]})}))  # type: ignore[union-attr]
    assert "images" not in text["chains"][0] and all("polar_images" not in c.extras
                                                     for c in calls_from_nemo_payload(text))
