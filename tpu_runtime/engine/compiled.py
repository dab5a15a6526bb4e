"""A model's stage programs as the runtime compiles and runs them (``CompiledStages``, a part of ``ModelFamily``):
their inputs placed on the mesh, what they are traced under, the runtime's program table entry for each (key =
family, stage, model signature, shapes, options, mesh), and the compile time, XLA compile counts and run time each
stage spent (``StageTimings``)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from .attention import attention_scope
from .dtypes import jax_dtype
from .memory import PLAN_FAMILY, is_out_of_memory, out_of_memory
from .runtime import compile_stats
from .stages import StageProgram
from .streaming import run_streamed

if TYPE_CHECKING:
    from .program_key import ProgramKey


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
        saved = None  # the saved programs' key, computed before the scope patches the modules
        if self.runtime.program_info(key) is None and self.runtime.saved_programs.enabled:
            saved = self.saved_key(program)
        with program.scope(), self.memory_named(f"{self.label}'s {program.name} program ({program.describe})",
                                                "while compiling it"):
            executable = self.runtime.compiled(key, program.fn, *program.example, describe=program.describe,
                                               saved=saved)
        t = self.timings
        t.programs[stage] = self.runtime.program_info(key)
        t.compile[stage] = t.compile.get(stage, 0.0) + time.perf_counter() - start
        delta = compile_stats().since(before)
        t.compiles[stage] = t.compiles.get(stage, 0) + delta.xla_compiles
        t.cache_hits[stage] = t.cache_hits.get(stage, 0) + delta.persistent_cache_hits
        t.loaded[stage] = t.loaded.get(stage, 0) + delta.programs_loaded
        slice_ = getattr(self.runtime, "slice", None)
        if slice_ is not None:  # a multi-host slice: every host compiled it before any runs it
            slice_.barrier(program.describe)
        return executable

    def saved_key(self, program: StageProgram) -> "ProgramKey | None":
        """What ``program`` is for the saved programs (``program_store.py``): the family, the stage, the model's
        config signature, the program's own key, dtype, mesh and FSDP, and the modules it traces (classes, code,
        attributes); the runtime adds its arguments (the weights' names, shapes, dtypes and shardings among them),
        devices and software. None when the key holds an object that another process cannot recognise."""
        from .program_key import ProgramKey, describe_module, stable_text

        text = stable_text((self.FAMILY, program.stage, self.signature, program.key, self.dtype_name,
                            self.mesh_spec.sizes, self.fsdp))
        if text is None:
            return None
        return ProgramKey(f"{self.FAMILY} {program.name}", {
            "program": text, "model": {c: describe_module(self.component(c)) for c in program.components}})

    @contextlib.contextmanager
    def memory_named(self, part: str, doing: str):
        """Out of device memory inside the block, raise the error that names ``part`` (a component, a program) and
        what it was ``doing``, the numbers, this model's mesh and the fix (``memory_error``)."""
        try:
            yield
        except Exception as error:  # noqa: BLE001 - the devices' own errors, named for the user where we can
            if is_out_of_memory(error):
                raise self.memory_error(part, doing, error) from error
            raise

    def memory_error(self, part: str, doing: str, error: BaseException, needs: str = ""):
        """The ``DeviceMemoryError`` of ``part`` out of device memory while ``doing``: what it needed against what a
        chip has, the mesh, and the fix for this model (``fsdp`` where it is off; ``plan`` with its folder)."""
        fsdp = "" if self.fsdp else (", `fsdp` (the loader's fsdp input, `--fsdp`: splits the transformer's and text "
                                     "encoder's weights over dp as well; needs dp of 2 or more)")
        fix = f"Use a larger slice (more chips share the weights and the activations){fsdp}, or a smaller height, " \
              "width or frame count."
        path = getattr(self, "path", None)
        plan = PLAN_FAMILY.replace("MODEL", str(path)) if path is not None and Path(path).is_dir() else PLAN_FAMILY
        return out_of_memory(part, doing, error, self.mesh, needs=needs, fix=fix, plan=plan)

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
