"""CogVideoX (2b, 5b, 1.5; 5b-I2V, 1.5-I2V): text and image to video, from diffusers folders.

``model.py`` recognises and loads a folder and runs the stages; ``programs.py`` builds the stage programs;
``schedule.py`` writes the DDIM/DPM schedulers as per-step coefficients; ``rules.py`` places the weights on a
mesh; ``architectures.py`` holds the released models' configs (``plan``); ``tiny.py`` builds tiny random-weight
models (``demo``, ``bench``, the tests). This file declares the family to the registry.
"""

from __future__ import annotations

from ..spec import Demo, FamilySpec, NodeSpec, SamplerNode, Sampling, Setting

GROUP_NORMS = ("stock", "jnp_var")  # the VAE GroupNorm's lowerings: torchax's own, one vectorised jnp.var

SPEC = FamilySpec(
    name="cogvideox",
    display_name="CogVideoX",
    package=__name__,
    family_class="model:CogVideoXFamily",
    pipelines=("CogVideoXPipeline", "CogVideoXImageToVideoPipeline"),
    pipeline_prefix="CogVideoX",
    unsupported="this pack runs text-to-video (CogVideoXPipeline) and image-to-video "
                "(CogVideoXImageToVideoPipeline) models: use CogVideoX-2b/5b, CogVideoX1.5-5B, CogVideoX-5b-I2V or "
                "CogVideoX1.5-5B-I2V",
    example_repo="THUDM/CogVideoX-2b",
    folder_names=("diffusers", "CogVideo"),
    architectures="architectures:ARCHITECTURES",
    step_cache=True,
    sampling=Sampling(steps=50, guidance=6.0, schedulers=("ddim", "dpm")),
    settings=(
        Setting("dynamic_cfg", bool, "CogVideoX's cosine guidance schedule", default=False),
        Setting("tiling", bool, "decode in spatial tiles (large frames)", default=False, stage="decode",
                flag="--vae-tiling"),
        Setting("group_norm", str, "the VAE GroupNorm's lowering: torchax's own (stock) or one vectorised jnp.var "
                "reduction", default="stock", choices=GROUP_NORMS, stage="decode", node=None),
        Setting("loop", str, "the decode's programs: the first two latent batches then one call per later batch, "
                "or one program holding every batch", choices=("batches", "unrolled"), default_help="batches",
                stage="decode", cli=False, node=None),
    ),
    lora_keys=r"transformer_blocks[._]\d+",
    bench={"load-folder": "bench:folder_load"},
    demos={"2b": Demo("tiny:build_tiny_cogvideox", ("2b",), 64, 96, 9),
           "5b": Demo("tiny:build_tiny_cogvideox", ("5b",), 64, 96, 9),
           "1.5": Demo("tiny:build_tiny_cogvideox", ("1.5",), 64, 64, 17)},
    nodes=NodeSpec(
        prefix="TPUCogVideoX",
        title="CogVideoX",
        category="TPU video/CogVideoX",
        type_prefix="TPU_COGVIDEOX",
        loader_description="Loads a CogVideoX text-to-video model (2b, 5b or 1.5) for the TPU/JAX runtime.",
        loader_tooltip="diffusers CogVideoX folders in models/diffusers and models/CogVideo",
        text_encode_doc="T5 embeddings for a prompt and a negative prompt.",
        image_encode_doc="CogVideoX-5b-I2V / 1.5-I2V: the first frame VAE-encoded on the devices; the sampler draws "
                         "from it.",
        sampler=SamplerNode(
            width=720, height=480, frames=49, frames_tip="8N+1 for 2b/5b (49 native), 16N+1 for 1.5 (81 native)",
            size_step=16, length_step=8),
        image_size=(720, 480, 49),
        image_frames_tip="the sampler's frames: 8N+1 for 5b-I2V (49), 16N+1 for 1.5-I2V (81)",
    ),
)
