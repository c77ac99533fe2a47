"""A request's images in the engine: placed on their placeholder tokens at admission
(`network.vision.place_images`: the prompt's multimodal rotary positions), each encoded when the first chunk
holding its tokens runs and its features kept until its last token is computed (a chunk may end inside an
image). The prefix cache keys image tokens with their image's content hash (request.py)."""

from __future__ import annotations

import torch

from ..backends.base import ImageEncoder, StepBackend
from ..network.vision import PromptImages, place_images
from .request import EngineRequest, Request
from .runner import ChunkImages


class EngineImages:
    """Where an engine's requests' images go: `place` at admission, `chunk` for each prefill chunk."""

    def __init__(self, encoder: ImageEncoder | None, backend: StepBackend, speculative: bool) -> None:
        self.encoder = encoder
        self.backend = backend
        self.speculative = speculative

    def place(self, request: EngineRequest) -> PromptImages | None:
        """The request's images on its prompt's placeholder tokens; a clear error where this engine cannot
        take them or the prompt does not match them."""
        encoder = self.encoder
        if encoder is None:
            if request.images:
                raise ValueError(
                    "this model has no vision tower: it takes text only. Load a checkpoint with a "
                    "vision_config through NeuronQwen36ForConditionalGeneration to send images."
                )
            return None
        if not request.images and not any(t in encoder.placeholder_ids for t in request.prompt_ids):
            return None
        if not self.backend.takes_images:
            raise ValueError(
                f"the {self.backend.name} backend's compiled steps take text only; export with "
                "backend='eager' to send images."
            )
        if self.speculative:
            raise ValueError(
                "images with MTP speculative decoding are not supported: export without "
                "num_speculative_tokens to send images."
            )
        return place_images(
            request.prompt_ids, request.images, encoder.placeholder_ids, encoder.spatial_merge_size
        )

    def chunk(self, request: Request, start: int, end: int) -> ChunkImages | None:
        """What the chunk start..end of a request with images reads besides its tokens: their rotary
        positions, and the features of the image tokens among them (each image encoded when its first chunk
        runs and dropped after its last). Every chunk of such a request passes features (none past its
        images): one step signature, one graph where the backend's graphs have static shapes."""
        placed = request.images
        if placed is None:
            return None
        assert self.encoder is not None
        features = self.encoder.no_features(end - start)
        images = ChunkImages(
            placed.positions(start, end), features, torch.zeros(end - start, dtype=torch.bool)
        )
        for index, (image, first, last) in enumerate(
            zip(placed.images, placed.starts, placed.ends(), strict=True)
        ):
            if last <= start or first >= end:
                continue
            encoded = request.image_features.get(index)
            if encoded is None:
                encoded = request.image_features[index] = self.encoder.encode(image)
            lo, hi = max(first, start), min(last, end)
            features[lo - start : hi - start] = encoded[lo - first : hi - first]
            images.mask[lo - start : hi - start] = True
            if last <= end:
                del request.image_features[index]
        return images
