"""The still images of image-to-video: read from a file (the CLI) or taken from a ComfyUI IMAGE, and resized to
the video's size the way diffusers does it.

Every image becomes an RGB ``PIL.Image`` first (a ComfyUI IMAGE is a float tensor ``[B, H, W, 3]`` in 0..1; it is
rounded to 8 bits, which is exact for an image from ``Load Image``), so a file given to the CLI and the same file
loaded in ComfyUI condition the video identically. Resizing is diffusers' ``VideoProcessor.preprocess`` (its
``VaeImageProcessor``): a Lanczos resize straight to the requested height x width, no crop, so an image of
another aspect ratio is stretched to the video's; then scaled to -1..1.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import InputError


def load_image(path, what: str = "--image"):
    """An RGB ``PIL.Image`` from ``path``, or a clear error naming ``what``."""
    from PIL import Image, UnidentifiedImageError

    file = Path(path).expanduser()
    if not file.is_file():
        raise InputError(f"{what} {file} does not exist: give the path of a PNG, JPEG or WebP image")
    try:
        with Image.open(file) as image:
            image.load()
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise InputError(f"{what} {file} is not an image this machine can read ({exc}): give a PNG, JPEG or "
                         "WebP file") from exc


def as_pil(image, what: str = "image"):
    """A ``PIL.Image`` (RGB) from a PIL image, a file path, or a ComfyUI IMAGE tensor ``[B, H, W, C]`` /
    ``[H, W, C]`` in 0..1 (its first picture; an alpha channel is dropped)."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, (str, Path)):
        return load_image(image, what)
    if isinstance(image, torch.Tensor):
        t = image.detach().cpu()
        if t.ndim == 4:
            if t.shape[0] > 1:
                import logging

                logging.getLogger(__name__).warning("%s holds %d pictures; the first one is used", what, t.shape[0])
            t = t[0]
        if t.ndim != 3 or t.shape[-1] not in (1, 3, 4) or min(t.shape[:2]) < 1:
            raise InputError(f"{what} has shape {tuple(image.shape)}; an image is [H, W, 3] (ComfyUI's IMAGE: "
                             "[B, H, W, 3]): connect Load Image or another IMAGE output")
        if t.shape[-1] == 1:
            t = t.expand(-1, -1, 3)
        pixels = (t[..., :3].float().clamp(0, 1) * 255.0).round().to(torch.uint8).numpy()
        return Image.fromarray(pixels, "RGB")
    raise InputError(f"{what} must be an image (a file, a PIL image or a ComfyUI IMAGE), got {type(image).__name__}")


def video_image(image, height: int, width: int) -> torch.Tensor:
    """``[1, 3, height, width]`` float32 in -1..1: ``image`` resized as diffusers' pipelines resize it."""
    from diffusers.video_processor import VideoProcessor

    processor = VideoProcessor(vae_scale_factor=8)
    return processor.preprocess(as_pil(image), height=height, width=width).to(torch.float32)

