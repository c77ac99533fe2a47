"""Images in chat requests: `image_url` parts (`data:` URLs, or http(s) URLs from the domains the server
allows) decoded with Pillow, turned into the vision tower's patches by transformers' Qwen2-VL image
processor, and each image's placeholder token in the rendered prompt expanded to one per merged patch (what
transformers' processor does to its text)."""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError
from transformers import PretrainedConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from ..network.vision import ImageInput
from .errors import bad_request

# Qwen3.5 / Qwen3.6's preprocessor_config.json, for a checkpoint that lacks one: the patch and merge sizes
# come from its vision_config.
QWEN36_IMAGE_PROCESSOR = dict(
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
    size={"shortest_edge": 65536, "longest_edge": 16777216},
)
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")


@dataclass(frozen=True)
class ImageLimits:
    """What a request's images may be: how many per prompt, how many pixels each (larger ones are scaled
    down by the processor), and where URLs may point (data: URLs always; http(s) only to these domains and
    their subdomains), fetched within a timeout and a size."""

    max_images_per_prompt: int = 4
    max_pixels: int | None = None
    allowed_media_domains: tuple[str, ...] = ()
    fetch_timeout_s: float = 10.0
    max_image_bytes: int = 20 * 2**20


class ImageReader:
    """Reads a request's image parts into `ImageInput`s and places their tokens in its prompt."""

    def __init__(
        self,
        checkpoint_dir: str | None,
        vision_config: PretrainedConfig,
        image_token_id: int,
        limits: ImageLimits,
    ) -> None:
        options = dict(QWEN36_IMAGE_PROCESSOR)
        saved = os.path.join(checkpoint_dir, "preprocessor_config.json") if checkpoint_dir else None
        if saved and os.path.isfile(saved):
            with open(saved) as f:
                stored = json.load(f)
            options.update({k: stored[k] for k in ("image_mean", "image_std", "size") if k in stored})
        if limits.max_pixels is not None:
            options["size"] = {**options["size"], "longest_edge": limits.max_pixels}
        self.processor = Qwen2VLImageProcessorPil(
            patch_size=vision_config.patch_size,
            temporal_patch_size=vision_config.temporal_patch_size,
            merge_size=vision_config.spatial_merge_size,
            **options,
        )
        self.merge_size = vision_config.spatial_merge_size
        self.image_token_id = image_token_id
        self.limits = limits

    def read(self, parts: Sequence[tuple[str, str]]) -> list[ImageInput]:
        """The images of `parts` ((where, url) in prompt order; `where` names the part in errors)."""
        limit = self.limits.max_images_per_prompt
        if len(parts) > limit:
            raise bad_request(
                f"the request has {len(parts)} images; this server takes at most {limit} per prompt "
                "(--limit-mm-per-prompt).",
                "messages",
            )
        images = []
        for where, url in parts:
            picture = self._decode(where, self._image_bytes(where, url))
            out = self.processor(images=[picture], return_tensors="pt")
            images.append(ImageInput(out["pixel_values"], tuple(out["image_grid_thw"][0].tolist())))
        return images

    def place(self, prompt_ids: Sequence[int], images: Sequence[ImageInput]) -> list[int]:
        """The prompt with each image's placeholder token (in order) repeated once per merged patch."""
        ids, expanded, index = list(prompt_ids), [], 0
        for token in ids:
            if token != self.image_token_id:
                expanded.append(token)
                continue
            if index >= len(images):
                raise bad_request("the prompt holds more image placeholders than image parts.", "messages")
            expanded.extend([token] * images[index].num_tokens(self.merge_size))
            index += 1
        if index != len(images):
            raise bad_request(
                f"the rendered prompt holds {index} image placeholders for {len(images)} image parts: the "
                "chat template did not render every image.",
                "messages",
            )
        return expanded

    def placed_history(
        self, prompt_ids: Sequence[int], history: int | None, images: Sequence[ImageInput]
    ) -> int | None:
        """Where the conversation so far ends in the placed prompt, from where it ends in `prompt_ids`."""
        if history is None:
            return None
        before = list(prompt_ids[:history]).count(self.image_token_id)
        return history + sum(image.num_tokens(self.merge_size) - 1 for image in images[:before])

    def _image_bytes(self, where: str, url: str) -> bytes:
        if url.startswith("data:"):
            header, comma, data = url.partition(",")
            if not comma or not header.endswith(";base64"):
                raise bad_request(f"{where}: a data URL must be data:<type>;base64,<data>.", where)
            try:
                raw = base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError) as error:
                raise bad_request(f"{where}: the data URL's base64 is invalid ({error}).", where) from error
            self._check_size(where, len(raw))
            return raw
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https"):
            raise bad_request(f"{where}: image URLs are data: or http(s) URLs, got {parsed.scheme!r}.", where)
        host = (parsed.hostname or "").lower()
        allowed = self.limits.allowed_media_domains
        if not any(host == domain or host.endswith("." + domain) for domain in allowed):
            reason = (
                "this server fetches no image URLs (start it with --allowed-media-domains to allow some)"
                if not allowed
                else f"{host!r} is not among the allowed media domains {list(allowed)}"
            )
            raise bad_request(f"{where}: {reason}; send the image as a data: URL instead.", where)
        return self._fetch(where, url)

    def _fetch(self, where: str, url: str) -> bytes:
        limit = self.limits.max_image_bytes
        try:
            with urllib.request.urlopen(url, timeout=self.limits.fetch_timeout_s) as response:
                data = response.read(limit + 1)
        except (urllib.error.URLError, TimeoutError, OSError) as error:
            raise bad_request(f"{where}: the image could not be fetched ({error}).", where) from error
        self._check_size(where, len(data))
        return data

    def _check_size(self, where: str, size: int) -> None:
        limit = self.limits.max_image_bytes
        if size > limit:
            raise bad_request(f"{where}: the image is larger than this server's {limit} bytes.", where)

    @staticmethod
    def _decode(where: str, data: bytes) -> Image.Image:
        try:
            picture = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
            picture.load()
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as error:
            raise bad_request(
                f"{where}: the image could not be decoded as PNG, JPEG or WebP ({error}).", where
            ) from error
        return picture.convert("RGB")
