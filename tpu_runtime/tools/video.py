"""Writing frames to an mp4 (H.264, yuv420p: plays in browsers and ComfyUI's previews), with a sound track (AAC)
when the model makes one, and the sound alone as a WAV file."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch


def frames_to_uint8(frames: torch.Tensor) -> np.ndarray:
    """``[F, H, W, 3]`` float in 0..1 to uint8, rounding like PIL/diffusers' ``numpy_to_pil``."""
    array = frames.detach().cpu().float().numpy()
    return (array * 255).round().clip(0, 255).astype(np.uint8)


def write_wav(waveform: torch.Tensor, path: str | Path, sample_rate: int) -> Path:
    """Write a ``[channels, samples]`` waveform in -1..1 to ``path`` as 16-bit PCM WAV (values past -1..1 are
    clipped there, as any 16-bit writer must)."""
    import wave

    path = Path(path)
    data = waveform.detach().cpu().float().numpy()
    if data.ndim != 2:
        raise ValueError(f"waveform has shape {data.shape}; expected [channels, samples]")
    pcm = (np.clip(data, -1.0, 1.0) * 32767).round().astype("<i2").T  # interleaved: [samples, channels]
    with wave.open(str(path), "wb") as f:
        f.setnchannels(data.shape[0])
        f.setsampwidth(2)
        f.setframerate(int(sample_rate))
        f.writeframes(np.ascontiguousarray(pcm).tobytes())
    return path


def write_mp4(frames: torch.Tensor, path: str | Path, fps: int = 8, audio: str | Path | None = None) -> Path:
    """Write ``[F, H, W, 3]`` frames in 0..1 to ``path`` as an H.264 mp4; ``audio``: a WAV file muxed in as its
    AAC sound track."""
    import imageio_ffmpeg

    if fps < 1:
        raise ValueError(f"fps={fps} must be at least 1")
    path = Path(path)
    data = frames_to_uint8(frames)
    _, height, width, _ = data.shape
    writer = imageio_ffmpeg.write_frames(
        str(path), (width, height), fps=fps, codec="libx264", pix_fmt_in="rgb24", pix_fmt_out="yuv420p",
        quality=8, macro_block_size=2, ffmpeg_log_level="error",
        **({"audio_path": str(audio), "audio_codec": "aac"} if audio is not None else {}),
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
