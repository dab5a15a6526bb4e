"""Step caching: whole transformer passes skipped the way diffusers' MagCache and FirstBlockCache hooks skip them,
number for number, with every program compiled once per shape.

Only the transformer's block stack is ever skipped; what lies outside it (patch and time embeddings, RoPE, the output
norm and projection, guidance, the scheduler update) runs every step. A family declares its block list and what
its blocks take and return (``BlockSpec``); the rest is here, for every family:

- **MagCache** (``magcache``): the decision is fixed in advance by calibrated magnitude ratios (``schedule``: the
  hook's float32 arithmetic, threshold, at most K skips in a row, the first steps always computed), so it is taken
  on the host with no read-back. A computed step is the *full* program, which also returns the block stack's
  residual (last block's output minus the first block's input); a skipped step is the *skip* program: the first
  block's input plus that residual, and everything outside the blocks as usual.
- **FirstBlockCache** (``first-block``): every step runs the *first-block* program (everything up to and including
  the first block, and the relative change of its residual against the last computed step's, one scalar per cache
  context read back); the host decides; then the *rest* program runs the other blocks from the first block's output
  (a context that skips takes its cached residual instead), or, when every context skips, the *skip* program adds
  the cached residual to the first block's output.

Cache contexts follow diffusers' pipelines: Wan calls its conditional and unconditional passes separately
(``"halves"``: one state and one decision each, though we run them as one batch), CogVideoX calls them as one batch
(``"batch"``: one state, one decision). Each transformer of a two-expert model keeps its own state and counts its
own steps. Thresholds, ratios and the skip pattern are inputs or host decisions: changing them compiles nothing,
and a run without caching runs the programs it always did.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..errors import InputError
from .stages import StageProgram, StepCache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockSpec:
    """How a family's transformer runs its blocks: the ``attribute`` holding the block list, the block arguments
    that are streams of tokens (returned by each block in this order), and which of them MagCache's residual covers
    (diffusers' CogVideoX hook caches the video tokens only and passes the text tokens through)."""

    attribute: str
    streams: tuple[str, ...] = ("hidden_states",)
    mag_streams: tuple[str, ...] = ("hidden_states",)


def parse_mag_ratios(text: str, where: str = "--mag-ratios") -> dict[str, tuple[float, ...]]:
    """MagCache ratios as a user gives them: comma-separated numbers, a JSON list, a JSON object with one list per
    transformer ("transformer", "transformer_2", as ``--cache-calibrate`` writes them), or a JSON file holding a
    list or such an object. One list applies to every transformer ("*")."""
    import json
    from pathlib import Path

    text = str(text).strip()
    if not text:
        raise InputError(f"{where} is empty: give comma-separated numbers or a JSON file of them")
    source = text
    if text[0] not in "[{" and not _number(text.split(",")[0]):
        path = Path(text).expanduser()
        if not path.is_file():
            raise InputError(f"{where} {text!r} is neither numbers nor a file: give comma-separated ratios (1.0,0.99,"
                             "...) or the path of a JSON file (a list, or one list per transformer)")
        source, text = str(path), path.read_text()
    try:
        value = json.loads(text) if text.lstrip()[:1] in "[{" else [float(x) for x in text.split(",") if x.strip()]
    except (ValueError, json.JSONDecodeError) as exc:
        raise InputError(f"{where} ({source}) is not a list of numbers: {exc}") from None
    value = {"*": value} if isinstance(value, list) else value
    if not isinstance(value, dict) or not value:
        raise InputError(f"{where} ({source}) must be a list of numbers or an object of such lists per transformer")
    out = {}
    for name, ratios in value.items():
        if not isinstance(ratios, list) or not ratios or not all(
                isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r > 0
                for r in ratios):
            raise InputError(f"{where} ({source}): {name if name != '*' else 'the list'} must be positive numbers, "
                             f"got {str(ratios)[:80]}")
        out[str(name)] = tuple(float(r) for r in ratios)
    return out


def _number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


# --- MagCache's schedule, on the host ------------------------------------------------------------------------------
def nearest_interp(ratios, steps: int) -> np.ndarray:
    """diffusers' ``nearest_interp``: the ratios picked at ``round(i * (L-1)/(N-1))`` on a float32 grid (round half to
    even), both ends kept; the last ratio alone for one step."""
    ratios = np.asarray(ratios, dtype=np.float32)
    if len(ratios) == steps:
        return ratios
    if steps == 1:
        return ratios[-1:]
    scale = np.float32((len(ratios) - 1) / (steps - 1))
    return ratios[np.round(np.arange(steps, dtype=np.float32) * scale).astype(np.int64)]


def schedule(ratios, steps: int, threshold: float, max_skip: int, retention: float,
             calls: int | None = None) -> list[bool]:
    """Which calls MagCache computes (True) or skips (False), as diffusers' hook decides them for one cache context
    of one transformer whose ``MagCacheConfig`` says ``num_inference_steps=steps`` and which is called ``calls``
    times (default ``steps``; a Wan 2.2 expert given the run's whole step count is called for its own steps only).
    The hook's arithmetic: the ratios interpolated to ``steps`` (a float32 tensor) and read at the transformer's own
    call count (1.0 past their end); the ratio multiplied in before the test; skip while the accumulated error is
    <= the threshold for at most ``max_skip`` calls in a row; the first ``int(retention * steps + 0.5)`` calls
    always computed; after ``steps`` calls the state starts over (nothing cached, counted from 0 again)."""
    r = nearest_interp(ratios, steps)
    calls = steps if calls is None else calls
    keep = int(retention * steps + 0.5)
    thr, one = np.float32(threshold), np.float32(1.0)
    out, have_residual, step = [], False, 0
    acc_ratio, acc_err, acc_steps = one, np.float32(0.0), 0
    for _ in range(calls):
        compute = True
        if step >= keep:
            acc_ratio = np.float32(acc_ratio * (r[step] if step < len(r) else one))
            acc_steps += 1
            acc_err = np.float32(acc_err + np.float32(abs(one - acc_ratio)))
            if have_residual and acc_err <= thr and acc_steps <= max_skip:
                compute = False
            else:
                acc_ratio, acc_err, acc_steps = one, np.float32(0.0), 0
        have_residual = have_residual or compute
        out.append(compute)
        step += 1
        if step >= steps:  # the hook's end of inference: its state is reset
            step, have_residual = 0, False
            acc_ratio, acc_err, acc_steps = one, np.float32(0.0), 0
    return out


# --- the block list, seen through while tracing --------------------------------------------------------------------
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("tpu_video_step_cache", default=None)


class _CachedBlocks(torch.nn.ModuleList):
    """The class a transformer's block list takes while a cached program is traced: iterating it yields one callable
    that runs the step-cache logic over the real blocks (the names of the parameters do not change)."""

    def __iter__(self):
        active = _ACTIVE.get()
        if active is None:
            return super().__iter__()
        return iter([active.bind(list(super().__iter__()))])


class _Pass:
    """One traced pass of the block stack in one of the cached modes. ``inputs``: the cached tensors the program
    takes (torch tensors inside the trace); ``outputs``: what it gives back."""

    def __init__(self, spec: BlockSpec, mode: str, inputs: dict, contexts: str, env):
        self.spec, self.mode, self.inputs, self.contexts, self.env = spec, mode, inputs, contexts, env
        self.outputs: dict = {}
        self.blocks: list = []

    def bind(self, blocks: list) -> Callable:
        self.blocks = blocks
        signature = inspect.signature(blocks[0].forward)

        def fused(*args, **kwargs):
            arguments = dict(signature.bind(*args, **kwargs).arguments)
            return self.run(arguments)

        return fused

    def _call(self, i: int, arguments: dict, streams: tuple) -> tuple:
        arguments = dict(arguments, **dict(zip(self.spec.streams, streams)))
        out = self.blocks[i](**arguments)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def _returned(self, streams: tuple):
        return streams if len(self.spec.streams) > 1 else streams[0]

    def run(self, arguments: dict):
        spec, mode = self.spec, self.mode
        streams = tuple(arguments[name] for name in spec.streams)
        mag = [spec.streams.index(name) for name in spec.mag_streams]
        if mode == "mag_full":
            out = streams
            for i in range(len(self.blocks)):
                out = self._call(i, arguments, out)
            self.outputs["residual"] = tuple(out[k] - streams[k] for k in mag)
            return self._returned(out)
        if mode == "mag_skip":
            cached = self.inputs["residual"]
            out = list(streams)
            for j, k in enumerate(mag):
                out[k] = streams[k] + cached[j]
            return self._returned(tuple(out))
        if mode == "fbc_first":
            first = self._call(0, arguments, streams)
            residual = first[0] - streams[0]
            reference = self.inputs["first_residual"]
            dims = tuple(range(1, residual.ndim)) if self.contexts == "halves" else tuple(range(residual.ndim))
            change = (residual - reference).abs().mean(dim=dims) / reference.abs().mean(dim=dims)
            self.outputs.update(first=first, first_residual=residual, change=change.reshape(-1).float())
            return self._returned(first)
        if mode in ("fbc_rest", "fbc_skip"):
            first = self.inputs["first"]  # the first block's output: it is not run again
            cached = self.inputs["rest_residual"]
            if mode == "fbc_skip":
                return self._returned(tuple(c + f for c, f in zip(cached, first)))
            out = first
            for i in range(1, len(self.blocks)):
                out = self._call(i, arguments, out)
            fresh = tuple(o - f for o, f in zip(out, first))
            skip = self.inputs["skip"]  # per context: 1 takes the cached residual, 0 the blocks' output

            def select(a, b):  # a where the context skips, else b
                shape = [-1] + [1] * (a.ndim - 1)
                if self.contexts == "batch":
                    mask = skip.reshape([1] * a.ndim)
                else:
                    mask = skip.reshape(shape)
                return torch.where(mask > 0, a, b)

            final = tuple(select(c + f, o) for c, f, o in zip(cached, first, out))
            self.outputs["rest_residual"] = tuple(select(c, r) for c, r in zip(cached, fresh))
            self.outputs["first_residual"] = select(self.inputs["first_residual_ref"], self.inputs["first_residual"])
            return self._returned(final)
        raise ValueError(mode)


@contextlib.contextmanager
def cached_blocks(module: torch.nn.Module, spec: BlockSpec, active: _Pass):
    """While the block stack of ``module`` is traced, run it as ``active`` says."""
    blocks = getattr(module, spec.attribute)
    original = blocks.__class__
    blocks.__class__ = _CachedBlocks
    token = _ACTIVE.set(active)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        blocks.__class__ = original


# --- the programs ----------------------------------------------------------------------------------------------------
MODES = {"magcache": ("mag_full", "mag_skip"), "calibrate": ("mag_full",),
         "first-block": ("fbc_first", "fbc_rest", "fbc_skip")}


def cached_program(family, program, mode: str, spec: BlockSpec, contexts: str, cache_structs: dict):
    """``program`` (a family's sample step, ``fn(state, *args) -> outputs``) as the step-cache ``mode`` runs it:
    ``fn(state, *args, cache) -> (outputs, cache out)`` (the first-block program: ``-> cache out`` alone, which
    leaves the rest of the step out of it). ``cache_structs``: the shapes of the cached tensors it takes."""
    import jax


    env = family.runtime.env
    module = family.component(program.components[0])

    def fn(state, *args):
        *args, cache = args
        active = _Pass(spec, mode, env.j2t_iso(cache), contexts, env)
        with cached_blocks(module, spec, active):
            outputs = program.fn(state, *args)
        out = jax.tree_util.tree_map(lambda v: _spread(family, v), env.t2j_iso(active.outputs))
        if mode == "fbc_first":
            return out
        return outputs, out

    structs = jax.tree_util.tree_map(lambda s: family.arg(s.shape, s.dtype, _spread_spec(family, s.shape)),
                                     cache_structs)
    return StageProgram(program.stage, fn, program.example + (structs,), program.key + ("step cache", mode, contexts),
                        f"{program.describe} [step cache: {mode}]", program.scope, program.components, part=mode)


def _spread_spec(family, shape) -> tuple:
    """Where a cached tensor lives: tokens [B, S, D] split over the batch on dp and the sequence on the other
    axes where they divide it (a residual of Wan 14B at 720p with CFG is 1.5 GB: never on every chip whole)."""
    if len(shape) < 3:
        return ()
    mesh = dict(family.mesh.shape)
    batch = "dp" if mesh.get("dp", 1) > 1 and shape[0] % mesh["dp"] == 0 else None
    rest = tuple(a for a in ("sp", "tp") if mesh.get(a, 1) > 1)
    split = math.prod(mesh[a] for a in rest)
    return (batch, rest if rest and shape[1] % split == 0 else None) + (None,) * (len(shape) - 2)


def _spread(family, value):
    """A cached tensor placed as ``_spread_spec`` says; a small one (FirstBlockCache's change, read back on every
    process of a slice) on every device."""
    import jax

    if not hasattr(value, "shape"):
        return value
    spec = _spread_spec(family, value.shape)
    return jax.lax.with_sharding_constraint(value, family.runtime.sharding(family.mesh, spec))


def _shapes(family, program) -> dict:
    """The shapes (jax.ShapeDtypeStruct) of what ``program`` returns, traced as the runtime traces it."""
    import jax

    from .runtime import tracing

    with program.scope(), tracing():
        return jax.eval_shape(program.fn, *program.example)


def stream_shapes(family, program) -> tuple:
    """The shapes of the block stack's streams (its first block's inputs), traced once."""
    spec = family.STEP_CACHE_BLOCKS
    probe = cached_program(family, program, "mag_full", BlockSpec(spec.attribute, spec.streams, spec.streams),
                           "batch", {})
    return tuple(_shapes(family, probe)[1]["residual"])


def cache_structs(family, streams: tuple, n_contexts: int) -> dict[str, dict]:
    """What each mode's program takes as its cache input, from the streams' shapes."""
    import jax

    spec = family.STEP_CACHE_BLOCKS
    mag = tuple(streams[spec.streams.index(name)] for name in spec.mag_streams)
    skip = jax.ShapeDtypeStruct((n_contexts,), np.float32)
    return {"mag_full": {}, "mag_skip": {"residual": mag},
            "fbc_first": {"first_residual": streams[0]},
            "fbc_rest": {"first": streams, "rest_residual": streams, "skip": skip, "first_residual": streams[0],
                         "first_residual_ref": streams[0]},
            "fbc_skip": {"first": streams, "rest_residual": streams}}


def contexts_of(family, cfg: bool) -> tuple[str, int]:
    """The cache contexts of a run: ("halves", 2) where diffusers calls CFG's passes apart, else ("batch", 1)."""
    if cfg and family.CFG_CONTEXTS == "halves":
        return "halves", 2
    return "batch", 1


def step_cache_programs(family, method: str, program, cfg: bool) -> dict:
    """The programs a step-cached sampling run with ``method`` ("magcache", "calibrate", "first-block") runs in
    place of ``program``, by mode."""
    contexts, n = contexts_of(family, cfg)
    modes = MODES[method]
    streams = () if method == "calibrate" else stream_shapes(family, program)
    structs = cache_structs(family, streams, n) if streams else {"mag_full": {}}
    return {mode: cached_program(family, program, mode, family.STEP_CACHE_BLOCKS, contexts, structs[mode])
            for mode in modes}


# --- one generation's steps ------------------------------------------------------------------------------------------
@dataclass
class _ExpertState:
    """One transformer's cache: its own step count and cached tensors (None: nothing cached yet)."""

    schedule: list[bool] = field(default_factory=list)
    calls: int = 0
    residual: object = None  # MagCache: the block stack's residual
    first_residual: object = None  # FirstBlockCache: the first block's residual at the last computed step
    rest_residual: object = None  # FirstBlockCache: the other blocks' residual at the last computed step
    computed: np.ndarray | None = None  # FirstBlockCache: per context, whether a step was computed yet
    skipped: list = field(default_factory=list)  # per call: the contexts that skipped
    ratios: list = field(default_factory=list)  # calibration: one per call


class StepCacheRunner:
    """Runs a family's sample step with step caching: ``runner(i, state, *args)`` does what
    ``executable(state, *args)`` does for step ``i``, skipping the block stack where the method says so.
    ``experts``: the transformer each step uses ("transformer"; Wan 2.2: "transformer_2" for low-noise steps);
    ``ratios``: MagCache's, one list per transformer ("*": every one), ``source`` saying whose."""

    def __init__(self, family, cache: StepCache, program, experts: list[str], cfg: bool,
                 ratios: dict | None = None, source: str = ""):
        import jax

        if family.abstract:
            raise RuntimeError("a step cache runs on devices: plan compiles its programs with step_cache_programs")
        self.family, self.cache, self.experts, self.source = family, cache, list(experts), source
        self.contexts, self.n_contexts = contexts_of(family, cfg)
        self.cond = 1 if cfg else 0  # the conditional pass's place in the CFG batch [uncond, cond]
        self.threshold = cache.resolved_threshold()
        self.method = "calibrate" if cache.calibrate else cache.method
        self.layers = len(getattr(family.component(program.components[0]), family.STEP_CACHE_BLOCKS.attribute))
        self.programs = step_cache_programs(family, self.method, program, cfg)
        self.executables = {mode: family.compile_stage(p) for mode, p in self.programs.items()}
        if self.method == "first-block":
            self._first_struct = self.programs["fbc_first"].example[-1]["first_residual"]
        counts = {e: self.experts.count(e) for e in dict.fromkeys(self.experts)}
        self.state = {e: _ExpertState() for e in counts}
        if self.method == "magcache":
            for e, n in counts.items():
                own = (ratios or {}).get(e)
                listed = own if own is not None else (ratios or {}).get("*")
                if listed is None:
                    raise InputError(f"no MagCache ratios for {family.label}'s {e}: give them with --mag-ratios")
                # A transformer's own list: diffusers' config for that transformer counts its own steps. One list
                # for every transformer: one config enabled on each, counting the run's steps (a Wan 2.2 expert
                # then reads the list from its start and keeps its first steps from the run's count).
                total = n if own is not None else len(self.experts)
                self.state[e].schedule = schedule(listed, total, self.threshold, cache.max_skip, cache.retention,
                                                  calls=n)
        self._ratio_fn = jax.jit(_calibration_ratio, static_argnums=(2,)) if self.method == "calibrate" else None
        self.block_runs = 0  # transformer blocks run, the CFG batch counted once
        self.steps: list[tuple[int, str, tuple]] = []  # (step, transformer, contexts skipped)

    def __call__(self, i: int, state, *args):
        name = self.experts[i]
        expert = self.state[name]
        k = expert.calls
        expert.calls += 1
        if self.method == "calibrate":
            outputs, out = self.executables["mag_full"](state, *args, {})
            residual = out["residual"][0]
            context = self.cond if self.contexts == "halves" else None
            ratio = 1.0 if expert.residual is None else float(self._ratio_fn(residual, expert.residual, context))
            expert.ratios.append(ratio)
            expert.residual = residual
            skipped = ()
            self.block_runs += self.layers
        elif self.method == "magcache":
            if expert.schedule[k]:
                outputs, out = self.executables["mag_full"](state, *args, {})
                expert.residual = out["residual"]
                skipped = ()
                self.block_runs += self.layers
            else:
                outputs, _ = self.executables["mag_skip"](state, *args, {"residual": expert.residual})
                skipped = tuple(range(self.n_contexts))
        else:
            outputs, skipped = self._first_block(expert, state, args)
        expert.skipped.append(skipped)
        self.steps.append((i, name, skipped))
        return outputs

    def _first_block(self, expert: _ExpertState, state, args):
        import jax.numpy as jnp

        if expert.computed is None:
            expert.computed = np.zeros(self.n_contexts, dtype=bool)
        reference = expert.first_residual
        if reference is None:  # nothing to compare with: every context computes (the change is not used)
            reference = jnp.ones(self._first_struct.shape, self._first_struct.dtype)
        out = self.executables["fbc_first"](state, *args, {"first_residual": reference})
        change = self.family.runtime.host_numpy(out["change"]).astype(np.float64)
        log.debug("first-block change %s", change)
        # diffusers: a context computes its first call, then whenever the change is over the threshold
        skip = expert.computed & ~(change > self.threshold)
        skip = np.asarray(self.family.agree("first-block cache decision", skip.tolist()), dtype=bool)
        self.block_runs += 1
        skipped = tuple(int(c) for c in np.flatnonzero(skip))
        if skip.all():
            outputs, _ = self.executables["fbc_skip"](state, *args, {"first": out["first"],
                                                                     "rest_residual": expert.rest_residual})
            return outputs, skipped
        rest = expert.rest_residual if expert.rest_residual is not None else \
            tuple(jnp.zeros(s.shape, s.dtype) for s in out["first"])
        outputs, new = self.executables["fbc_rest"](state, *args, {
            "first": out["first"], "rest_residual": rest, "skip": jnp.asarray(skip, jnp.float32),
            "first_residual": out["first_residual"], "first_residual_ref": reference})
        expert.rest_residual, expert.first_residual = new["rest_residual"], new["first_residual"]
        expert.computed = expert.computed | ~skip
        self.block_runs += self.layers - 1
        return outputs, skipped

    # --- what the run reports -----------------------------------------------------------------------------------
    def skipped(self) -> dict[str, list[int]]:
        """Per transformer, its calls (counted from 0 within that transformer) that skipped its blocks (per-pass
        contexts: both passes)."""
        return {e: [k for k, s in enumerate(st.skipped) if len(s) == self.n_contexts] for e, st in self.state.items()}

    def skipped_per_context(self) -> dict[str, list[list[int]]]:
        return {e: [[k for k, s in enumerate(st.skipped) if c in s] for c in range(self.n_contexts)]
                for e, st in self.state.items()}

    def calibrated(self) -> dict[str, list[float]]:
        return {e: list(st.ratios) for e, st in self.state.items()}

    def report(self) -> dict:
        """What the run did, as generation_config.json records it (steps counted from 1)."""
        steps = len(self.steps)
        skipped = [i + 1 for i, _, s in self.steps if len(s) == self.n_contexts]
        report = {"method": self.method if self.method != "calibrate" else "magcache (calibrating)",
                  "steps": steps, "skipped_steps": skipped, "skipped": len(skipped),
                  "transformer_block_runs": self.block_runs, "uncached_block_runs": steps * self.layers}
        if self.method != "calibrate":
            report["threshold"] = self.threshold
        if self.method == "magcache":
            report.update(max_skip=self.cache.max_skip, retention=self.cache.retention, ratios=self.source)
        if self.n_contexts > 1:
            report["skipped_steps_per_pass"] = {
                name: [i + 1 for i, _, s in self.steps if c in s] for c, name in enumerate(("uncond", "cond"))}
        if len(self.state) > 1:
            report["skipped_per_transformer"] = {e: sum(1 for k in v) for e, v in self.skipped().items()}
        return report

    def summary(self) -> str:
        r = self.report()
        if self.method == "calibrate":
            return f"step cache: calibrating MagCache over {r['steps']} steps (none skipped)"
        per = ""
        if "skipped_per_transformer" in r:
            per = " (" + ", ".join(f"{e}: {n} of {self.state[e].calls}"
                                   for e, n in r["skipped_per_transformer"].items()) + ")"
        return (f"step cache {r['method']} (threshold {self.threshold:g}): skipped {r['skipped']} of {r['steps']} "
                f"steps{per}, {r['transformer_block_runs']} of {r['uncached_block_runs']} transformer block runs; "
                f"skipped steps: {r['skipped_steps'] or 'none'}")


def _calibration_ratio(residual, previous, context):
    """diffusers' calibration step: the mean over the batch and the tokens of ``||R_t|| / (||R_t-1|| + 1e-8)``,
    norms over channels in float32; for per-half contexts, the conditional half's (``context``)."""
    import jax.numpy as jnp

    if context is not None:
        residual, previous = residual[context:context + 1], previous[context:context + 1]
    now = jnp.linalg.norm(residual.astype(jnp.float32), axis=-1)
    before = jnp.linalg.norm(previous.astype(jnp.float32), axis=-1)
    return jnp.mean(now / (before + 1e-8))


# --- a family's step caching (a part of ModelFamily) ------------------------------------------------------------------
class StepCaching:
    """Step caching of a model (a part of ``ModelFamily``): its settings checked, the step function a sampling
    run calls, and what the cache did. A family sets ``STEP_CACHE_BLOCKS`` to take a step cache."""

    #: Where the transformer keeps its blocks and what they take and return; None: this family has none (the
    #: option is refused).
    STEP_CACHE_BLOCKS: "BlockSpec | None" = None
    #: How diffusers' pipeline of this family calls CFG's two passes: "halves" (one call each, so one cache state
    #: and one decision per pass, though we run them as one batch) or "batch" (one call, one state).
    CFG_CONTEXTS = "batch"
    step_cache_report: dict | None = None  # what the last sampling run's step cache did (``finish_step_cache``)
    step_cache_calibrated: dict | None = None  # a calibrating run's MagCache ratios, one list per transformer

    def published_mag_ratios(self, s, image: bool) -> "tuple[str, dict] | None":
        """MagCache's published ratios for this model, (which model's, one list per transformer), or None."""
        return None

    def check_step_cache(self, s) -> None:
        """The step cache's settings, and (MagCache) that there are ratios to run with: the user's or the model's
        published ones; refused before anything compiles, naming both ways out."""
        cache = s.cache
        if cache is None or not cache.active:
            return
        cache.check()
        if self.STEP_CACHE_BLOCKS is None:
            raise InputError(f"{self.FAMILY_NAME} has no step caching yet: run it with cache none")
        if cache.method != "magcache" or cache.calibrate:
            return
        names = ["transformer"] + (["transformer_2"] if self.two_experts else [])
        given = cache.mag_ratios or {}
        if given:
            extra = sorted(set(given) - set(names) - {"*"})
            missing = [n for n in names if n not in given and "*" not in given]
            if extra or missing:
                raise InputError(f"mag ratios name {', '.join(extra or missing)}: this model's transformers are "
                                 f"{', '.join(names)}; give one list (used for each) or an object with one list per "
                                 "transformer")
            return
        if self.published_mag_ratios(s, image=False) is None:
            raise InputError(f"{self.label} ({self.FAMILY_NAME}) has no published MagCache ratios: they are "
                             "measured per model. Give yours with --mag-ratios (comma-separated, or a JSON file; the "
                             "node's mag_ratios), or measure them with --cache magcache --cache-calibrate, which "
                             "writes mag_ratios.json")

    def step_function(self, program, s, experts: list[str], cfg: bool, image: bool = False) -> Callable:
        """``run(i, state, *args)`` for step ``i`` of a sampling run: the compiled ``program``, or with a step cache
        in ``s`` its cached programs (``experts``: the transformer each step uses). Compiled here, before the
        first step; ``step_cache_report`` holds what the cache did once the run ends."""
        self.step_cache_report = None
        cache = s.cache
        if cache is None or not cache.active:
            executable = self.compile_stage(program)
            return lambda i, state, *args: executable(state, *args)
        source, ratios = "", None
        if cache.method == "magcache" and not cache.calibrate:
            if cache.mag_ratios:
                source, ratios = "given", cache.mag_ratios
            else:
                source, ratios = self.published_mag_ratios(s, image)
        runner = StepCacheRunner(self, cache, program, experts, cfg, ratios, source)
        self._step_cache_runner = runner
        return runner

    def finish_step_cache(self) -> None:
        """After a sampling run: what its step cache did, in ``step_cache_report`` (logged)."""
        runner = self.__dict__.pop("_step_cache_runner", None)
        if runner is not None:
            self.step_cache_report = runner.report()
            self.step_cache_calibrated = runner.calibrated() if runner.method == "calibrate" else None
            log.info("%s", runner.summary())
