"""Writing frames to an mp4 (H.264, yuv420p: plays in browsers and ComfyUI's previews)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch


def frames_to_uint8(frames: torch.Tensor) -> np.ndarray:
    """``[F, H, W, 3]`` float in 0..1 to uint8, rounding like PIL/diffusers' ``numpy_to_pil``."""
    array = frames.detach().cpu().float().numpy()
    return (array * 255).round().clip(0, 255).astype(np.uint8)


def write_mp4(frames: torch.Tensor, path: str | Path, fps: int = 8) -> Path:
    """Write ``[F, H, W, 3]`` frames in 0..1 to ``path`` as an H.264 mp4."""
    import imageio_ffmpeg

    if fps < 1:
        raise ValueError(f"fps={fps} must be at least 1")
    path = Path(path)
    data = frames_to_uint8(frames)
    _, height, width, _ = data.shape
    writer = imageio_ffmpeg.write_frames(
        str(path), (width, height), fps=fps, codec="libx264", pix_fmt_in="rgb24", pix_fmt_out="yuv420p",
        quality=8, macro_block_size=2, ffmpeg_log_level="error",
    )
    with warnings.catch_warnings():
        # ffmpeg runs as a child process; the fork happens before any JAX work in it, so the warning is moot.
        warnings.filterwarnings("ignore", message="os.fork")
        writer.send(None)
    for frame in data:
        writer.send(np.ascontiguousarray(frame))
    writer.close()
    return path


def read_mp4(path: str | Path) -> tuple[np.ndarray, dict]:
    """Decode an mp4 back to ``[F, H, W, 3]`` uint8 frames and its metadata (used to check what we wrote)."""
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="os.fork")
        meta = next(reader)
    width, height = meta["size"]
    frames = [np.frombuffer(buf, dtype=np.uint8).reshape(height, width, 3) for buf in reader]
    return np.stack(frames), meta
