"""A video through a causal VAE in chunks, as two compiled programs: what every family's decode (and Wan's image
encode) does alike.

diffusers runs its video VAEs chunk by chunk (CogVideoX: two latent frames a batch; Wan: one latent frame to
decode, the first frame then 4 frames to encode), each causal convolution carrying a cache of its last input
frames from one chunk to the next. Compiling that loop unrolled makes one program hold a copy of the network per
chunk: its compile grows with the frame count and the TPU compiler keeps far more than one chunk's activations
live. Here it is two programs instead:

- the *start* program: prepares the input once (e.g. de-normalises the latents), runs the first two chunks (after
  them every cache has its steady shape) and returns the prepared input, their output and the caches;
- the *later* program: one chunk at a traced index, caches in and out, called once per later chunk with the
  prepared input and the caches kept on the devices (placed as the next call takes them: ``vae_placement``).

So the compile does not grow with the frames and memory is bounded by a chunk; each chunk's output is copied to
the host as it is made.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from .runtime import tracing
from .stages import StageProgram


def to_frames(video):
    """``[1, 3, F, H, W]`` in -1..1 -> ``[F, H, W, 3]`` float32 in 0..1 (inside a program)."""
    import jax.numpy as jnp

    video = jnp.clip(video.astype(jnp.float32) * 0.5 + 0.5, 0.0, 1.0)
    return jnp.transpose(video[0], (1, 2, 3, 0))


def vae_placement(family) -> tuple[Callable, Callable]:
    """For a video run in pieces: ``keep(value)`` inside a program (a carried value stays placed as the next call
    takes it: the family's VAE layout) and ``placed(struct)`` (that placement as the next program's input)."""
    import jax

    def keep(value):
        spec = family.vae_input_spec(value.shape)
        return jax.lax.with_sharding_constraint(value, family.runtime.sharding(family.mesh, spec))

    def placed(struct):
        return None if struct is None else family.arg(struct.shape, struct.dtype, family.vae_input_spec(struct.shape))

    return keep, placed


def streamed_programs(family, *, stage: str, what: str, key: tuple, scope, components: tuple[str, ...],
                      example: tuple, chunks: int, prepare: Callable, chunk: Callable,
                      finish: Callable = lambda out: out, later: tuple[str, str] = ("chunk", "each later chunk"),
                      ) -> list[StageProgram]:
    """The start program and (for more than two chunks) the later program of a streamed VAE pass.

    ``example``: (state, *inputs) of the start program. ``prepare(state, *inputs)`` -> the source (a pytree) every
    chunk reads; ``chunk(state, source, index, caches)`` -> (output, caches): ``index`` is a Python int in the
    start program (0, 1) and a traced int32 in the later one (what the runner passes), ``caches`` None before the
    first chunk; ``finish(output)`` turns a chunk's (or the first chunks' concatenated) output into the result.
    ``later``: the later program's part name and how its description calls a chunk ("frame", "each later latent
    frame")."""
    import jax
    import jax.numpy as jnp

    keep, placed = vae_placement(family)
    first = min(chunks, 2)

    def start_fn(state, *inputs):
        source = prepare(state, *inputs)
        outs, caches = [], None
        for i in range(first):
            out, caches = chunk(state, source, i, caches)
            outs.append(out)
        out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)
        return jax.tree_util.tree_map(keep, source), finish(out), jax.tree_util.tree_map(keep, caches)

    programs = [StageProgram(stage, start_fn, example, key + ("start",), f"{what}: the first {first} "
                             f"{'chunk' if first == 1 else 'chunks'}", scope, components, part="start")]
    if chunks <= 2:
        return programs
    if family.abstract:  # planned: the start program's outputs found by tracing it without data
        with scope(), tracing():
            source_struct, _, cache_structs = jax.eval_shape(start_fn, *example)
    else:  # it is compiled (or loaded, traced by no one) next anyway: its outputs' shapes come with it
        source_struct, _, cache_structs = family.compile_stage(programs[0]).out_info

    def later_fn(state, source, index, caches):
        out, caches = chunk(state, source, index, caches)
        return finish(out), jax.tree_util.tree_map(keep, caches)

    later_example = (example[0], jax.tree_util.tree_map(placed, source_struct), family.arg((), jnp.int32),
                     jax.tree_util.tree_map(placed, cache_structs))
    part, chunk_what = later
    programs.append(StageProgram(stage, later_fn, later_example, key + (part,), f"{what}: {chunk_what}", scope,
                                 components, part=part))
    return programs


def run_streamed(family, programs: Sequence[StageProgram], inputs: Sequence, later: Sequence[int]) -> list:
    """Run a stage's programs on ``inputs`` (device values): one program alone, or the start program then the
    later program once per index of ``later`` with the caches kept on the devices. Returns each call's output on
    the host, in order; the stage's run time is recorded (compiles excluded)."""
    executables = [family.compile_stage(p) for p in programs]
    state = programs[0].example[0]
    stage = programs[0].stage
    start = time.perf_counter()
    with family.memory_named(f"{family.label}'s {stage} stage ({programs[0].describe})", "while running it"):
        if programs[0].part != "start":
            parts = [family.runtime.to_cpu(executables[0](state, *inputs))]
        else:
            source, out, caches = executables[0](state, *inputs)
            parts = [family.runtime.to_cpu(out)]
            for index in later:
                out, caches = executables[1](state, source, family.put(np.array(index, np.int32)), caches)
                parts.append(family.runtime.to_cpu(out))
    family.record_run(stage, start)
    return parts
