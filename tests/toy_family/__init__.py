"""A minimal extra model family, declared and built in the tests folder only: it guards the registry (a family is a
package and a declaration; nothing outside its files changes), it is not a product.

"Toy" video: a word-embedding text encoder, a small MLP that denoises latents with the flow-matching Euler
scheduler (one compiled step for every step), and a linear VAE decode, each a tiny torch module built from its
``config.json`` and loaded from safetensors through the engine's one loading path. It declares a sampler option of
its own (``toy_noise``), a stage of its own (``sharpen``) and a recipe that runs it (``--toy-sharpened``): the
command line, the nodes, ``plan`` and a multi-host slice take them from this declaration alone.
"""

from __future__ import annotations

from tpu_runtime.families.spec import Demo, FamilySpec, NodeSpec, Recipe, SamplerNode, Sampling, Setting


SPEC = FamilySpec(
    name="toy",
    display_name="Toy",
    package=__name__,
    family_class="model:ToyFamily",
    pipelines=("ToyVideoPipeline",),
    pipeline_prefix="Toy",
    unsupported="this pack runs ToyVideoPipeline models",
    example_repo="toy/toy-video",
    folder_names=("diffusers",),
    architectures="model:ARCHITECTURES",
    demos={"toy": Demo("model:build_tiny_toy", (), 16, 16, 5)},
    message_types=("model:ToyOptions",),
    sampling=Sampling(steps=3, guidance=1.0),
    settings=(Setting("toy_noise", float, "how much of the seeded noise the toy starts from", default=1.0,
                      above=0.0, node_max=4.0, node_step=0.05),),
    stages=("sharpen",),
    recipes=(Recipe("toy_sharpened", "the toy's recipe: sample, then sharpen the latents", ("sample", "sharpen"),
                    "model:sharpened_settings"),),
    nodes=NodeSpec(
        prefix="TPUToy", title="Toy", category="TPU video/Toy", type_prefix="TPU_TOY",
        loader_description="Loads a toy model.", loader_tooltip="toy folders",
        sampler=SamplerNode(width=16, height=16, frames=5, frames_tip="4N+1"),
        image_size=(16, 16, 5), image_frames_tip="4N+1",
    ),
)
