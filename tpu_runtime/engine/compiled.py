"""A model's stage programs as the runtime compiles and runs them (``CompiledStages``, a part of ``ModelFamily``):
their inputs placed on the mesh, what they are traced under, the runtime's program table entry for each (key =
family, stage, model signature, shapes, options, mesh), and the compile time, XLA compile counts and run time each
stage spent (``StageTimings``)."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Sequence

import torch

from .attention import attention_scope
from .dtypes import jax_dtype
from .runtime import compile_stats
from .stages import StageProgram
from .streaming import run_streamed


@contextlib.contextmanager
def forwards_replaced(root: torch.nn.Module, replacement: Callable[[torch.nn.Module], Callable | None]):
    """While the block runs, every submodule of ``root`` for which ``replacement(module)`` gives a function runs
    that function as its forward (for tracing through XLA); the originals come back afterwards."""
    saved = []
    try:
        for module in root.modules():
            forward = replacement(module)
            if forward is not None:
                saved.append((module, module.__dict__.get("forward")))
                module.forward = forward
        yield
    finally:
        for module, previous in reversed(saved):
            if previous is None:
                del module.forward
            else:
                module.forward = previous


class CompiledStages:
    """Compiling and running a model's stage programs (a part of ``ModelFamily``)."""

    def compile_stage(self, program: StageProgram):
        """The executable of ``program`` (compiled on first use, then from the program table), its cost
        recorded in ``timings``."""
        if self.abstract:
            raise RuntimeError(f"{self.label} is planned for devices this process cannot run on: compile its "
                               "stage programs with plan, not the runtime")
        stage = program.stage
        before = compile_stats()
        start = time.perf_counter()
        key = (self.FAMILY, stage, self.signature, program.key, self.dtype_name, self.mesh_spec.sizes, self.fsdp)
        with program.scope():
            executable = self.runtime.compiled(key, program.fn, *program.example, describe=program.describe)
        t = self.timings
        t.programs[stage] = self.runtime.program_info(key)
        t.compile[stage] = t.compile.get(stage, 0.0) + time.perf_counter() - start
        delta = compile_stats().since(before)
        t.compiles[stage] = t.compiles.get(stage, 0) + delta.xla_compiles
        t.cache_hits[stage] = t.cache_hits.get(stage, 0) + delta.persistent_cache_hits
        slice_ = getattr(self.runtime, "slice", None)
        if slice_ is not None:  # a multi-host slice: every host compiled it before any runs it
            slice_.barrier(program.describe)
        return executable

    def run_stage(self, programs: Sequence[StageProgram], inputs: Sequence, chunks: Sequence[int] = ()) -> list:
        """Run a stage's programs on ``inputs`` (device values): one program, or a streamed pass's start program
        then its later program once per index of ``chunks`` (``streaming.py``). Each call's output on the host,
        in order; the stage's run time is recorded."""
        return run_streamed(self, programs, inputs, chunks)

    def record_run(self, stage: str, start: float) -> None:
        """Add the time since ``start`` to ``stage``'s run time."""
        self.timings.run[stage] = self.timings.run.get(stage, 0.0) + time.perf_counter() - start

    def arg(self, shape, dtype, spec: tuple = ()):
        """An input of a stage program: a shape struct of ``dtype`` (torch or jax) placed on the mesh by ``spec``."""
        import jax

        if isinstance(dtype, torch.dtype):
            dtype = jax_dtype(dtype)
        return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=self.runtime.sharding(self.mesh, spec))

    def model_dtype(self):
        """The model dtype as a jax dtype (inside programs)."""
        return jax_dtype(self.dtype)

    def put(self, value, spec: tuple = ()):
        """CPU tensors onto this model's mesh, placed by ``spec`` (replicated by default)."""
        if self.abstract:
            raise RuntimeError(f"{self.label} is planned for devices this process cannot run on: it takes no "
                               "inputs; compile its stage programs with plan, not the runtime")
        return self.runtime.put(value, self.runtime.sharding(self.mesh, spec))

    def traced(self, *patches: Callable[[], contextlib.AbstractContextManager]):
        """What a stage is traced under: this model's attention settings on its mesh, and ``patches`` (module
        replacements for XLA) around it. Called with patches, it returns a scope for a ``StageProgram``."""
        if patches:
            @contextlib.contextmanager
            def scope():
                with contextlib.ExitStack() as stack:
                    stack.enter_context(attention_scope(self.attention, self.mesh))
                    for patch in patches:
                        stack.enter_context(patch())
                    yield

            return scope
        return attention_scope(self.attention, self.mesh)
