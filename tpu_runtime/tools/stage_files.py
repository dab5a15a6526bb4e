"""The files between stages, so any stage can be retried alone.

``stage1_embeddings.safetensors``  prompt_embeds, negative_prompt_embeds ``[1, L, D]`` (and a sound track's
                                   audio_prompt_embeds, negative_audio_prompt_embeds)
``stage1_image.safetensors``       image-to-video: the image encode stage's output (``ImageConditioning``)
``stage2_latents.safetensors``     latents ``[B, C, T, H/8, W/8]`` float32 (before VAE scaling; and a sound
                                   track's audio latents ``[B, C, L, M]``)
``frames.safetensors``             frames ``[F, H, W, 3]`` float32 in 0..1 (and a sound track's waveform
                                   ``audio`` ``[channels, samples]`` float32)
``generation_config.json``         the settings, the model and the per-stage timings

Each safetensors file records the model signature it was made with, and the sizes, in its metadata.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..engine.stages import ImageConditioning, TextEmbeddings, VideoLatents
from ..errors import StageFileError

EMBEDDINGS_FILE = "stage1_embeddings.safetensors"
IMAGE_FILE = "stage1_image.safetensors"
LATENTS_FILE = "stage2_latents.safetensors"
FRAMES_FILE = "frames.safetensors"
CONFIG_FILE = "generation_config.json"
VIDEO_FILE = "output_video.mp4"
AUDIO_FILE = "output_audio.wav"
AUDIO_EMBEDDINGS = ("audio_prompt_embeds", "negative_audio_prompt_embeds")


def save_embeddings(directory: Path, emb: TextEmbeddings, size: tuple[int, int, int] | None = None) -> Path:
    """The embeddings, and the video size (height, width, frames) the run that encoded them was for: a later
    ``--stage sample`` takes it from here."""
    path = Path(directory) / EMBEDDINGS_FILE
    metadata = {"model_signature": emb.model_signature, "prompt": emb.prompt, "negative_prompt": emb.negative_prompt}
    if size is not None:
        metadata.update(height=str(size[0]), width=str(size[1]), num_frames=str(size[2]))
    tensors = {"prompt_embeds": emb.prompt_embeds.contiguous(),
               "negative_prompt_embeds": emb.negative_prompt_embeds.contiguous()}
    tensors.update({name: getattr(emb, name).contiguous() for name in AUDIO_EMBEDDINGS
                    if getattr(emb, name) is not None})
    save_file(tensors, str(path), metadata=metadata)
    return path


def encoded_size(directory: Path) -> tuple[int, int, int] | None:
    """(height, width, frames) the stage-1 files in ``directory`` were encoded for (None: not recorded)."""
    path = Path(directory) / EMBEDDINGS_FILE
    with _open(path, "text-embedding", "--stage encode") as f:
        meta = f.metadata() or {}
    if {"height", "width", "num_frames"} <= set(meta):
        return int(meta["height"]), int(meta["width"]), int(meta["num_frames"])
    return None


def _open(path: Path, stage: str, producer: str):
    if not path.is_file():
        raise StageFileError(f"{path} not found: run {producer} first (or --stage all), with the same --output-dir")
    from ..engine.weights import DamagedFile, read_header

    try:
        read_header(path)  # whole: a file cut short is refused at once, not when its tensors are read
    except DamagedFile as exc:
        raise StageFileError(f"{path} is not a readable {stage} file: it {exc.reason}; re-run {producer}") from None
    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as exc:  # noqa: BLE001 - a foreign file
        raise StageFileError(f"{path} is not a readable {stage} file ({exc}): re-run {producer}") from exc
    return handle


def load_embeddings(directory: Path) -> TextEmbeddings:
    path = Path(directory) / EMBEDDINGS_FILE
    with _open(path, "text-embedding", "--stage encode") as f:
        meta = f.metadata() or {}
        keys = set(f.keys())
        if {"prompt_embeds", "negative_prompt_embeds"} - keys or "model_signature" not in meta:
            raise StageFileError(f"{path} is not a stage-1 embeddings file of this tool: re-run --stage encode")
        return TextEmbeddings(
            f.get_tensor("prompt_embeds"), f.get_tensor("negative_prompt_embeds"),
            meta.get("prompt", ""), meta.get("negative_prompt", ""), meta["model_signature"],
            **{name: f.get_tensor(name) for name in AUDIO_EMBEDDINGS if name in keys},
        )


def save_image(directory: Path, cond: ImageConditioning) -> Path:
    path = Path(directory) / IMAGE_FILE
    tensors = {"latents": cond.latents.contiguous()}
    for name in ("latents_std", "image_embeds"):
        if getattr(cond, name) is not None:
            tensors[name] = getattr(cond, name).contiguous()
    save_file(tensors, str(path), metadata={
        "model_signature": cond.model_signature, "height": str(cond.height), "width": str(cond.width),
        "num_frames": str(cond.num_frames), "last_image": str(int(cond.last_image))})
    return path


def drop_image(directory: Path) -> None:
    """Remove an image file left by an earlier image-to-video run in the same folder."""
    (Path(directory) / IMAGE_FILE).unlink(missing_ok=True)


def load_image(directory: Path) -> ImageConditioning:
    path = Path(directory) / IMAGE_FILE
    with _open(path, "image-encoding", "--stage encode with --image") as f:
        meta = f.metadata() or {}
        keys = set(f.keys())
        if "latents" not in keys or not {"model_signature", "height", "width", "num_frames"} <= set(meta):
            raise StageFileError(f"{path} is not an image-encoding file of this tool: re-run --stage encode")
        return ImageConditioning(
            f.get_tensor("latents"), int(meta["height"]), int(meta["width"]), int(meta["num_frames"]),
            meta["model_signature"],
            latents_std=f.get_tensor("latents_std") if "latents_std" in keys else None,
            image_embeds=f.get_tensor("image_embeds") if "image_embeds" in keys else None,
            last_image=meta.get("last_image") == "1")


def has_image(directory: Path) -> bool:
    return (Path(directory) / IMAGE_FILE).is_file()


def save_latents(directory: Path, lat: VideoLatents) -> Path:
    path = Path(directory) / LATENTS_FILE
    tensors = {"latents": lat.latents.float().contiguous()}
    if lat.audio is not None:
        tensors["audio"] = lat.audio.float().contiguous()
    save_file(
        tensors,
        str(path),
        metadata={
            "model_signature": lat.model_signature, "height": str(lat.height), "width": str(lat.width),
            "num_frames": str(lat.num_frames),
        },
    )
    return path


def load_latents(directory: Path) -> VideoLatents:
    path = Path(directory) / LATENTS_FILE
    with _open(path, "latents", "--stage sample") as f:
        meta = f.metadata() or {}
        keys = set(f.keys())
        if "latents" not in keys or not {"model_signature", "height", "width", "num_frames"} <= set(meta):
            raise StageFileError(f"{path} is not a stage-2 latents file of this tool: re-run --stage sample")
        return VideoLatents(
            f.get_tensor("latents"), int(meta["height"]), int(meta["width"]), int(meta["num_frames"]),
            meta["model_signature"], audio=f.get_tensor("audio") if "audio" in keys else None,
        )


def save_frames(directory: Path, frames: torch.Tensor, audio: torch.Tensor | None = None) -> Path:
    """The frames, and a sound track's waveform ``audio`` ``[channels, samples]`` float32 (LTX-2) beside them."""
    path = Path(directory) / FRAMES_FILE
    tensors = {"frames": frames.float().contiguous()}
    if audio is not None:
        tensors["audio"] = audio.float().contiguous()
    save_file(tensors, str(path))
    return path


def load_frames(directory: Path) -> torch.Tensor:
    with _open(Path(directory) / FRAMES_FILE, "frames", "--stage decode") as f:
        return f.get_tensor("frames")


def recorded(directory: Path, key: str):
    """A value ``generation_config.json`` in ``directory`` holds (None: no file, or not in it)."""
    path = Path(directory) / CONFIG_FILE
    try:
        return json.loads(path.read_text()).get(key) if path.is_file() else None
    except (ValueError, AttributeError):
        return None


def update_config(directory: Path, **values) -> dict:
    """Merge ``values`` into ``generation_config.json`` (the later stage's values win) and return it."""
    path = Path(directory) / CONFIG_FILE
    config = json.loads(path.read_text()) if path.is_file() else {}
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key].update(value)
        else:
            config[key] = value
    path.write_text(json.dumps(config, indent=2, sort_keys=True))
    return config
