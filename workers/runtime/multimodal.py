"""Image placeholders: one ``<|image|>`` in the rendered prompt becomes one token per embedding."""

from __future__ import annotations

from workers.runtime.errors import InvalidRequestError


def expand_image_tokens(ids: list[int], image_token_id: int, tokens_per_image: int,
                        num_images: int) -> tuple[list[int], tuple[int, ...]]:
    """Repeat each image placeholder ``tokens_per_image`` times.

    Returns the expanded ids and the positions of every placeholder copy (where the image
    embeddings go, in order). The prompt must hold exactly one placeholder per image.
    """
    found = ids.count(image_token_id)
    if found != num_images:
        raise InvalidRequestError(f"the prompt has {found} image placeholders for {num_images} images")
    out: list[int] = []
    positions: list[int] = []
    for tok in ids:
        if tok == image_token_id:
            positions.extend(range(len(out), len(out) + tokens_per_image))
            out.extend([image_token_id] * tokens_per_image)
        else:
            out.append(tok)
    return out, tuple(positions)
