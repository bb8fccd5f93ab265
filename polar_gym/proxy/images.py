"""Images in a request, checked once after a front end has normalised them (every protocol's image becomes a
``ContentPart(type="image_url")``), before any engine sees them; and where they sit in the prompt a model saw.

Only inline images are taken (``data:<type>;base64,...``). An address (``https://``, ``file://``, a Google
``fileUri``) is refused, not fetched: the engine would fetch it from inside the cluster on behalf of whoever wrote
the request (an agent, a task), which is a request forgery, and the record would hold a pointer instead of the pixels
a trainer must replay. Types are the four every front end's API documents (PNG, JPEG, GIF, WebP), checked against the
bytes themselves, with a size and a count limit. Also how a Qwen2-VL-family processor expands an image into
placeholder tokens (:class:`ImageGrid`), for token-in prompts. Pure: no I/O.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import itertools
from dataclasses import dataclass

from polar_gym.proxy.chat import ChatRequest
from polar_gym.proxy.errors import PayloadTooLarge, RequestError
from polar_gym.schema import ImageRef, TokenSpan

__all__ = ["IMAGE_PLACEHOLDERS", "ImageGrid", "ImageLimits", "RequestImage", "collapse_placeholders",
           "expand_placeholders", "has_images", "image_refs", "image_size", "image_urls", "placeholder_runs",
           "request_images"]

#: the image types taken, by the bytes each file starts with (WebP: ``RIFF....WEBP``)
_MAGIC: dict[str, tuple[bytes, ...]] = {
    "image/png": (b"\x89PNG\r\n\x1a\n",), "image/jpeg": (b"\xff\xd8\xff",), "image/gif": (b"GIF87a", b"GIF89a"),
    "image/webp": (b"RIFF",),
}
#: the token a vision-language model's processor repeats once per image patch, by family (Qwen2-VL, Qwen2.5-VL,
#: Qwen3-VL); the first a tokenizer's vocabulary holds is the model's
IMAGE_PLACEHOLDERS = ("<|image_pad|>",)


@dataclass(frozen=True)
class ImageLimits:
    """What a request may carry: images in its whole conversation (0: the model takes none) and bytes of one image,
    decoded (the proxy's ``max_images`` and ``max_image_bytes`` settings)."""

    max_images: int = 32
    max_image_bytes: int = 10 * 1024 * 1024


@dataclass(frozen=True)
class RequestImage:
    """One image of a request, in conversation order: its SHA-256, type, decoded size and where it is (``image
    <n> of the conversation``, counting image parts from the start in any protocol)."""

    sha256: str
    media_type: str
    size: int
    where: str


#: images whose checks are remembered, by their URL's text (a session sends its earlier images again every turn); the
#: cache holds the URLs themselves, so it is small: at the size limit, 16 of them are about 220 MB
_CACHED_IMAGES = 16


@functools.lru_cache(maxsize=_CACHED_IMAGES)
def _decoded(url: str) -> tuple[str, str, int] | str:
    """(sha256, media type, size) of a data URL, or why it cannot be taken (cached)."""
    head, comma, payload = url.partition(",")
    if not url.startswith("data:") or not comma:
        scheme = url.split(":", 1)[0][:16] if ":" in url else "no scheme"
        return f"image addresses are not fetched ({scheme}): send the image's bytes inline, as base64"
    media_type, _, encoding = head[5:].partition(";")
    media_type = media_type.strip().lower()
    if encoding.strip().lower() != "base64":
        return "an inline image must be base64 data (data:<type>;base64,...)"
    if media_type not in _MAGIC:
        return f"image type {media_type or 'none'!r} is not taken (png, jpeg, gif, webp are)"
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        return "the image's base64 data does not decode"
    if not data.startswith(_MAGIC[media_type]) or (media_type == "image/webp" and data[8:12] != b"WEBP"):
        return f"the image's bytes are not {media_type}"
    return hashlib.sha256(data).hexdigest(), media_type, len(data)


def request_images(request: ChatRequest, limits: ImageLimits) -> list[RequestImage]:
    """The request's images in order, each checked (RequestError: an address, another type, bytes that are not the
    type they claim; PayloadTooLarge: over the limits)."""
    images: list[RequestImage] = []
    for message in request.messages:
        if isinstance(message.content, str) or message.content is None:
            continue
        for part in message.content:
            if part.type != "image_url":
                continue
            # by its rank: every protocol keeps the images' order, but not the messages' and parts' positions
            where = f"image {len(images) + 1} of the conversation"
            url = (part.image_url or {}).get("url")
            decoded = _decoded(url) if isinstance(url, str) else "an image part needs a url"
            if isinstance(decoded, str):
                raise RequestError(f"{where}: {decoded}")
            sha256, media_type, size = decoded
            if size > limits.max_image_bytes:
                raise PayloadTooLarge(f"{where}: an image of {size} bytes exceeds the limit of "
                                      f"{limits.max_image_bytes}")
            images.append(RequestImage(sha256, media_type, size, where))
    if len(images) > limits.max_images:
        raise PayloadTooLarge(f"{len(images)} images in the conversation exceed the limit of {limits.max_images}"
                              if limits.max_images else "this model takes no images")
    return images


def has_images(request: ChatRequest) -> bool:
    """Whether any message of ``request`` holds an image part."""
    return any(isinstance(m.content, list) and any(p.type == "image_url" for p in m.content) for m in request.messages)


def placeholder_runs(prompt_ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of ``token_id`` in ``prompt_ids``: where an image's patches sit."""
    runs, offset = [], 0
    for token, group in itertools.groupby(prompt_ids):
        length = sum(1 for _ in group)
        if token == token_id:
            runs.append((offset, offset + length))
        offset += length
    return runs


def image_refs(images: list[RequestImage], prompt_ids: list[int], token_id: int | None) -> tuple[list[ImageRef],
                                                                                                   str | None]:
    """The record's description of each image, with its placeholder span in ``prompt_ids`` when the model's image
    token is known, and a note when the spans cannot be told (None: they were, or there is no image)."""
    runs = placeholder_runs(prompt_ids, token_id) if token_id is not None and images else []
    note = None
    if images and token_id is None:
        note = "image spans unknown: the proxy has no tokenizer of the model (set one to record them)"
    elif images and len(runs) != len(images):
        note = f"image spans unknown: {len(images)} images but {len(runs)} placeholder runs in the prompt"
        runs = []
    refs: list[ImageRef] = []
    for k, image in enumerate(images):
        span = TokenSpan(start=runs[k][0], end=runs[k][1]) if runs else None
        refs.append(ImageRef(sha256=image.sha256, media_type=image.media_type, size=image.size, prompt_span=span))
    return refs, note


def image_urls(request: ChatRequest) -> list[str]:
    """The image URLs of ``request``, in order."""
    return [str((part.image_url or {}).get("url", "")) for message in request.messages
            if isinstance(message.content, list) for part in message.content if part.type == "image_url"]


@functools.lru_cache(maxsize=_CACHED_IMAGES)
def image_size(url: str) -> tuple[int, int]:
    """(width, height) of a checked data URL's image (its header only; cached by the URL's text)."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(base64.b64decode(url.partition(",")[2]))) as image:
        return image.size


@dataclass(frozen=True)
class ImageGrid:
    """How a Qwen2-VL-family processor turns an image into placeholders: resized to multiples of ``patch_size`` x
    ``merge_size`` pixels with its area within ``[min_pixels, max_pixels]``, one placeholder per ``merge_size``
    squared patches. Read from a model's ``preprocessor_config.json``."""

    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int

    @classmethod
    def from_config(cls, config: dict[str, object]) -> ImageGrid | None:
        """The grid of a processor config (None: not a Qwen2-VL-family one)."""
        size = config.get("size")
        edges: dict[str, object] = size if isinstance(size, dict) else {}  # newer configs: size.shortest_edge, ...
        values = [config.get("patch_size"), config.get("merge_size"),
                  config.get("min_pixels", edges.get("shortest_edge")),
                  config.get("max_pixels", edges.get("longest_edge"))]
        numbers = [v for v in values if isinstance(v, int) and v > 0]
        if len(numbers) != 4:
            return None
        return cls(*numbers)

    def placeholders(self, width: int, height: int) -> int:
        """How many placeholders an image of ``width`` x ``height`` pixels becomes (transformers' own resize rule)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        resized_height, resized_width = smart_resize(height, width, factor=self.patch_size * self.merge_size,
                                                     min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        return int(resized_height // self.patch_size) * int(resized_width // self.patch_size) // self.merge_size ** 2


def expand_placeholders(ids: list[int], token_id: int, counts: list[int]) -> list[int]:
    """``ids`` with its k-th ``token_id`` repeated ``counts[k]`` times (ValueError: another number of them)."""
    found = ids.count(token_id)
    if found != len(counts):
        raise ValueError(f"the prompt has {found} image placeholders for {len(counts)} images")
    out: list[int] = []
    it = iter(counts)
    for token in ids:
        out.extend([token] * next(it) if token == token_id else [token])
    return out


def collapse_placeholders(ids: list[int], token_id: int) -> list[int]:
    """``ids`` with each run of ``token_id`` down to one (what a server that expands images itself is sent)."""
    return [token for k, token in enumerate(ids) if token != token_id or k == 0 or ids[k - 1] != token_id]
