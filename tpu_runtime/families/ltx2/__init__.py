"""LTX-2 (Lightricks; 2.0 and 2.3, dev and distilled): text and image to video with its sound track, in one stage
or two (half size, the spatial latent upsampler, a short refine at full size), from diffusers folders.

``model.py`` recognises and loads a model and runs the stages; ``programs.py`` builds the stage programs (Gemma 3
and the text connectors, the image encode, one denoising step with every guidance pass, the video and the sound
decode, the upsampler); ``schedule.py`` computes the sigmas, the sound's length and the token positions as
diffusers does; ``rules.py`` places the weights on a mesh; ``architectures.py`` holds the released model's
configs (``plan``); ``tiny.py`` builds tiny random-weight models. This file declares the family to the registry.
"""

from __future__ import annotations

from ..spec import Demo, FamilySpec, FileRole, FilesLoaderNode, NodeSpec, Recipe, SamplerNode, Sampling, Setting

SIGMA_SCHEDULES = ("default", "distilled", "stage2")  # the model's, the distilled model's 8 steps, the refine's 3

# The sampler's own settings, each left out the model's default (diffusers' LTX2Pipeline's): the guidance terms
# (one knob each for the video and the sound, as diffusers' video and audio scales), the rate and the schedule.
SETTINGS = (
    Setting("audio_guidance", float, "CFG scale of the sound", default=7.0, above=0.0, node_name="audio_cfg",
            node_max=30.0, node_step=0.1),
    Setting("stg_scale", float, "spatio-temporal guidance (video and sound); 0 turns it off", default=1.0,
            minimum=0.0, node_max=10.0, node_step=0.1),
    Setting("modality_scale", float, "modality-isolation guidance; 1 turns it off", default=3.0, minimum=0.0,
            node_max=10.0, node_step=0.1),
    Setting("guidance_rescale", float, "rescale of the guided prediction; 0 turns it off", default=0.7, minimum=0.0,
            node_max=1.0, node_step=0.05),
    Setting("frame_rate", float, "frames per second the video is made for: the sound's length and the positions "
            "(and the mp4's rate unless --fps)", default=24.0, above=0.0, node_max=120.0, node_step=1.0),
    Setting("sigmas", str, "the sigma schedule: the model's (default), the distilled model's 8 steps, the refine "
            "stage's 3", choices=SIGMA_SCHEDULES, node_unset="default"),
    Setting("stg_blocks", tuple, "the transformer blocks spatio-temporal guidance perturbs", default=(28,),
            cli=False, node=None),
    Setting("noise_scale", float, "sampling from given latents: how much fresh noise they get", minimum=0.0,
            below=1.0 + 1e-9, default_help="the schedule's first sigma", cli=False, node=None),
    Setting("upsampler", str, "the spatial latent upsampler's diffusers folder (two-stage generation)",
            default_help="the model folder's latent_upsampler/", stage="open", node="optional", node_unset=""),
)


SPEC = FamilySpec(
    name="ltx2",
    display_name="LTX-2",
    package=__name__,
    family_class="model:LTX2Family",
    pipelines=("LTX2Pipeline", "LTX2ImageToVideoPipeline"),
    pipeline_prefix="LTX2",
    unsupported="this pack runs LTX2Pipeline and LTX2ImageToVideoPipeline models (Lightricks/LTX-2, LTX-2.3)",
    example_repo="Lightricks/LTX-2",
    architectures="architectures:ARCHITECTURES",
    folder_names=("diffusers",),
    sampling=Sampling(steps=30, guidance=3.0, refine=True),
    settings=SETTINGS,
    stages=("upsample", "decode_audio"),
    recipes=(Recipe(
        "two_stage", "LTX-2's recipe: sample at half the width and height, upsample the latents x2, refine 3 steps "
        "(stage-2 sigmas, one pass a step; --lora-2 adds LoRAs to this stage only)", ("sample", "upsample", "sample"),
        "recipes:two_stage_settings"),),
    lora_keys=r"audio_attn\d|audio_ff|audio_to_video_attn|patchify_proj",
    bench={"load-file": "bench:file_load"},
    demos={"ltx2": Demo("tiny:build_tiny_ltx2", ("2.0",), 64, 96, 17),
           "ltx2.3": Demo("tiny:build_tiny_ltx2", ("2.3",), 64, 96, 17)},
    file_roles=(
        FileRole("checkpoint", "--checkpoint", "checkpoints", True,
                 "LTX-2's all-in-one checkpoint (transformer, connectors, VAEs, vocoder), models/checkpoints/, "
                 "e.g. ltx-2-19b-dev.safetensors"),
        FileRole("text_encoder", "--text-encoder", "text_encoders", True,
                 "the Gemma 3 text encoder, models/text_encoders/gemma_3_12B_it*.safetensors"),
        FileRole("latent_upscaler", "--latent-upscaler", "latent_upscale_models", False,
                 "LTX-2 two-stage generation: the spatial upscaler, models/latent_upscale_models/"
                 "ltx-2-spatial-upscaler-x2-1.0.safetensors"),
        FileRole("tokenizer", "--tokenizer", "text_encoders", False,
                 "LTX-2: a Gemma tokenizer folder, only for a Gemma file without its tokenizer inside", directory=True),
        FileRole("config", "--config", "diffusers", False,
                 "LTX-2: a diffusers folder of the model's configs, for a model other than the released ones (what "
                 "the files' shapes cannot tell: head counts, Gemma's attention pattern, the vocoder's strides)",
                 directory=True),
    ),
    recognise_files="files:recognise",
    message_types=("files:LTX2Files",),
    nodes=NodeSpec(
        prefix="TPULTX2",
        title="LTX-2",
        category="TPU video/LTX-2",
        type_prefix="TPU_LTX2",
        loader_description="Loads an LTX-2 model (video with sound: LTX-2, LTX-2.3, dev or distilled) from a "
                           "diffusers folder for the TPU/JAX runtime.",
        loader_tooltip="diffusers LTX-2 folders (model_index.json) in models/diffusers",
        text_encode_doc="Gemma 3 and the text connectors: the video and the sound prompt streams (1024 tokens).",
        image_encode_doc="Image to video: the first frame through the H.264 round trip LTX-2 was trained with, "
                         "VAE-encoded on the devices.",
        sampler_doc="Denoise the video and its sound together: every guidance pass of a step in one compiled "
                    "program per shape; new scales, seeds and prompts compile nothing.",
        decode_doc="Decode to an IMAGE batch and ComfyUI's AUDIO, for CreateVideo / SaveVideo with sound.",
        sampler=SamplerNode(
            width=768, height=512, frames=121, frames_tip="8N+1 (121 native: 5 s at 24 fps)", size_step=32,
            length_step=8),
        image_size=(768, 512, 121),
        image_frames_tip="the sampler's frames: 8N+1 (121)",
        audio=True,
        upsample_doc="Two-stage generation: the video latents at twice the width and height (the spatial latent "
                     "upsampler), the sound's as they are; feed them to a second sampler (sigmas stage2) to refine.",
        files_loader=FilesLoaderNode(
            description="Loads LTX-2 from ComfyUI's single files (the all-in-one checkpoint and Gemma 3; bf16, fp16, "
                        "fp8 or nvfp4, dequantised on load); the architecture is read from the weights.",
            required=(("checkpoint", "checkpoint", "models/checkpoints: e.g. ltx-2-19b-dev"),
                      ("text_encoder", "text_encoder", "models/text_encoders: gemma_3_12B_it")),
            optional=(("latent_upscaler", "latent_upscaler", "models/latent_upscale_models: "
                       "ltx-2-spatial-upscaler-x2 (two-stage generation)"), "@device", "@layout",
                      ("config", "config", "a diffusers folder of the model's configs, for a model other than the "
                       "released ones; empty: the released model's")),
        ),
    ),
)
