"""Wan (2.1 1.3B/14B, 2.2 A14B, TI2V-5B; I2V, FLF2V, 2.2 I2V-A14B): text and image to video, from diffusers folders
or ComfyUI's single files.

``model.py`` recognises and loads a model and runs the stages; ``programs.py`` builds the stage programs;
``files.py`` reads ComfyUI's single files (architecture from tensor shapes, keys to diffusers' names);
``rules.py`` places the weights on a mesh; ``architectures.py`` holds the released models' configs (``plan``);
``tiny.py`` builds tiny random-weight models and their single-file and LoRA exports. This file declares the family
to the registry.
"""

from __future__ import annotations

from ..spec import Demo, FamilySpec, FileRole, FilesLoaderNode, NodeSpec, SamplerNode, Sampling, Setting


SPEC = FamilySpec(
    name="wan",
    display_name="Wan",
    package=__name__,
    family_class="model:WanFamily",
    pipelines=("WanPipeline", "WanImageToVideoPipeline"),
    pipeline_prefix="Wan",
    unsupported="this pack runs WanPipeline (text-to-video, TI2V-5B) and WanImageToVideoPipeline "
                "(Wan2.1-I2V/FLF2V-14B, Wan2.2-I2V-A14B) models",
    example_repo="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
    folder_names=("diffusers",),
    architectures="architectures:ARCHITECTURES",
    step_cache=True,
    sampling=Sampling(steps=50, guidance=5.0, schedulers=("unipc", "euler", "euler_simple")),
    settings=(
        Setting("shift", float, "flow shift", above=0.0, default_help="the model's: 3 for 2.1, 12 for 2.2 A14B, 5 "
                "TI2V-5B", node="optional", node_max=100.0, node_step=0.1),
        Setting("guidance_2", float, "Wan 2.2 A14B: guidance of the low-noise expert", minimum=0.0,
                default_help="the guidance", node="optional", node_name="cfg_2", node_max=30.0, node_step=0.1),
        Setting("boundary", float, "Wan 2.2 A14B: switch to the low-noise expert below this fraction of the 1000 "
                "training timesteps", above=0.0, below=1.0, default_help="the model's: 0.875 T2V, 0.9 I2V",
                node="optional", node_max=0.999, node_step=0.005),
        Setting("loop", str, "the decode's programs: the first two latent frames then one call per later frame, or "
                "one program holding every frame", choices=("frames", "unrolled"), default_help="frames",
                stage="decode", cli=False, node=None),
    ),
    lora_keys=r"(?<!transformer_)blocks[._]\d+[._](self_attn|cross_attn|attn1|attn2|ffn)",
    bench={"load-file": "bench:file_load", "lora-merge": "bench:lora_merge",
           "mag-ratios": "bench:stand_in_mag_ratios"},
    demos={"wan2.1": Demo("tiny:build_tiny_wan", ("2.1",), 64, 96, 9),
           "wan2.2-a14b": Demo("tiny:build_tiny_wan", ("2.2-A14B",), 64, 96, 9),
           "wan2.2-ti2v-5b": Demo("tiny:build_tiny_wan", ("2.2-TI2V-5B",), 64, 96, 9)},
    file_roles=(
        FileRole("transformer", "--transformer", "diffusion_models", True,
                 "the diffusion model, models/diffusion_models/; for Wan 2.2 A14B the high-noise expert"),
        FileRole("transformer_2", "--transformer-2", "diffusion_models", False,
                 "Wan 2.2 A14B: the low-noise expert file"),
        FileRole("text_encoder", "--text-encoder", "text_encoders", True,
                 "the umT5 text encoder, models/text_encoders/umt5_xxl_*.safetensors"),
        FileRole("vae", "--vae", "vae", True, "the VAE, models/vae/wan_2.1_vae or wan2.2_vae"),
        FileRole("clip_vision", "--clip-vision", "clip_vision", False,
                 "Wan 2.1 I2V / FLF2V: the CLIP vision file, models/clip_vision/clip_vision_h.safetensors"),
    ),
    recognise_files="files:recognise",
    message_types=("files:WanFiles",),
    nodes=NodeSpec(
        prefix="TPUWan",
        title="Wan",
        category="TPU video/Wan",
        type_prefix="TPU_WAN",
        loader_description="Loads a Wan model from a diffusers folder (Wan2.1-T2V-1.3B/14B, Wan2.2-T2V-A14B, "
                           "Wan2.2-TI2V-5B; image-to-video: Wan2.1-I2V-14B-480P/720P, Wan2.1-FLF2V-14B, "
                           "Wan2.2-I2V-A14B) for the TPU/JAX runtime.",
        loader_tooltip="diffusers Wan folders (model_index.json) in models/diffusers",
        text_encode_doc="umT5 embeddings for a prompt and a negative prompt (512 tokens).",
        image_encode_doc="Wan I2V / FLF2V / 2.2 I2V-A14B / TI2V-5B: the first (and FLF2V's last) frame VAE-encoded on "
                         "the devices, with CLIP vision features for Wan 2.1 I2V and FLF2V.",
        sampler_doc="Denoise a video latent: one compiled program per shape (shared by Wan 2.2's two experts), reused "
                    "for every step and every seed.",
        decode_doc="Wan VAE decode to an IMAGE batch [frames, H, W, 3] for ComfyUI's CreateVideo / SaveVideo.",
        sampler=SamplerNode(
            width=832, height=480, frames=81, frames_tip="4N+1 (81 native; TI2V-5B 121)", size_step=16,
            length_step=4),
        image_size=(832, 480, 81),
        image_frames_tip="the sampler's frames: 4N+1 (81; TI2V-5B 121)",
        lora_optional={"expert": (["both", "high noise", "low noise"], {
            "default": "both", "tooltip": "Wan 2.2 A14B: which expert gets it (the lightx2v 2.2 LoRAs ship a high- "
                                          "and a low-noise file)"})},
        files_loader=FilesLoaderNode(
            description="Loads Wan from ComfyUI's single files (fp16, bf16, fp8 and scaled fp8 are dequantised on "
                        "load); the architecture is read from the weights.",
            required=(("diffusion_model", "transformer", "models/diffusion_models: e.g. wan2.1_t2v_1.3B_fp16; for "
                       "Wan 2.2 A14B the high-noise file"),
                      ("text_encoder", "text_encoder", "models/text_encoders: umt5_xxl_fp16 or "
                       "umt5_xxl_fp8_e4m3fn_scaled"),
                      ("vae", "vae", "models/vae: wan_2.1_vae (wan2.2_vae for TI2V-5B)")),
            optional=(("diffusion_model_2", "transformer_2", "Wan 2.2 A14B only: the low-noise file"), "@device",
                      ("clip_vision", "clip_vision", "Wan 2.1 I2V / FLF2V only: models/clip_vision/clip_vision_h"),
                      "@layout"),
        ),
    ),
)
