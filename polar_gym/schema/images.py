"""Where a record's or a trace's images are: the data URLs of its OpenAI-shaped messages (the wire shape every front
end's image becomes), in order or by SHA-256. Free of everything but the standard library, like the rest of the
schema, so NeMo Gym's interpreter reads them too (:mod:`polar_gym.env.token_lineage`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["image_data_of", "image_urls_of"]


def image_urls_of(messages: list[dict[str, Any]]) -> list[str]:
    """The image URLs of OpenAI-shaped messages (a trace's, as builders write them), in order: with a trace's
    ``metadata.images`` (the placeholders' spans), the pixels a trainer feeds the model."""
    return [str((part.get("image_url") or {}).get("url")) for message in messages
            if isinstance(message.get("content"), list) for part in message["content"]
            if isinstance(part, dict) and part.get("type") == "image_url"]


def image_data_of(images: Sequence[Mapping[str, Any]], messages: list[dict[str, Any]]) -> dict[str, str]:
    """Each image's pixels by its SHA-256: ``images`` (a record's or a trace's refs) matched one for one, in order,
    with the data URLs of ``messages``; empty when they do not line up (the messages lost some pixels)."""
    urls = image_urls_of(messages)
    if len(urls) != len(images):
        return {}
    return {str(image["sha256"]): url for image, url in zip(images, urls, strict=True)}
