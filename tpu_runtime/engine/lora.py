"""LoRA files merged into a model's weights on the devices.

One reader for the formats found in ComfyUI's ``models/loras/``, resolving every name against the model's own
modules (no per-format tables):

- ComfyUI / original Wan names: ``diffusion_model.blocks.0.self_attn.q.lora_down.weight`` / ``.lora_up.weight`` /
  ``.alpha``, or ``.lora_A.weight`` / ``.lora_B.weight``; ``.diff`` (a full weight difference, e.g. norms) and
  ``.diff_b`` (a bias difference), as the lightx2v distillation LoRAs carry;
- kohya / musubi-tuner: ``lora_unet_blocks_0_self_attn_q.lora_down.weight`` with ``.alpha``;
- diffusers / PEFT: ``transformer.blocks.0.attn1.to_q.lora_A.weight`` / ``lora_B.weight`` (``lora_B.bias``),
  which is also how CogVideoX LoRAs ship.

A low-rank pair adds ``strength × alpha / rank × up @ down`` to the weight (``alpha / rank`` is 1 without an
alpha, as PEFT saves them); a difference adds ``strength × diff``. Keys that name nothing in the model are listed
in a warning; a LoRA that matches nothing, or whose shapes are another size's, is refused.

Merging (``LoraMerger``) happens on the devices, each weight under its own sharding, from a copy of the unmerged
weight kept in host memory the first time a LoRA touches it: every change (add, remove, re-weight) recomputes the
touched weights from those copies, so nothing drifts and removing every LoRA gives back the loaded weights
exactly without reading the model files again. The device holds one copy of each weight (plus one weight's
worth while it is merged); the merge programs depend only on shapes and ranks, so a new strength compiles nothing
and the sampler's step program is the one compiled without LoRA.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from ..errors import InputError
from .catalogue import lora_owner
from .replay import replayed_method

log = logging.getLogger(__name__)

# Prefixes before the module name, longest first; one is removed.
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "base_model.model.", "transformer.", "lora_unet_",
            "unet.")
# Key endings after the module name and what they hold.
ROLES = ((".lora_down.weight", "down"), (".lora_A.weight", "down"), (".lora_up.weight", "up"),
         (".lora_B.weight", "up"), (".lora_B.bias", "diff_b"), (".alpha", "alpha"), (".diff_b", "diff_b"),
         (".diff", "diff"), (".dora_scale", "dora"))


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA file and its strength."""

    path: str
    strength: float = 1.0

    def __post_init__(self):
        if not isinstance(self.strength, (int, float)) or isinstance(self.strength, bool) or \
                not math.isfinite(self.strength):
            raise InputError(f"LoRA strength {self.strength!r} for {self.path} must be a finite number "
                             "(1.0 is the file's own strength, 0 turns it off)")


def parse_lora(text: str) -> LoraSpec:
    """``FILE[:STRENGTH]`` as the CLI takes it (a path may contain ':'; only a number after the last one is a
    strength)."""
    path, sep, tail = text.rpartition(":")
    if sep and path:
        try:
            return LoraSpec(path, float(tail))
        except ValueError:
            pass
    return LoraSpec(text, 1.0)


@dataclass
class Update:
    """What one LoRA file changes in one weight: low-rank pairs (``up`` [out, r], ``down`` [r, in], times
    ``scale`` = alpha / rank) and full differences."""

    pairs: list[tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=list)
    diffs: list[torch.Tensor] = field(default_factory=list)


@dataclass
class LoraFile:
    path: Path
    updates: dict[str, Update]  # weight name in the model -> update
    unmatched: list[str]  # keys of the file that name nothing in the model


def name_aliases(param_names: Iterable[str], original: Callable[[str], str] | None = None) -> dict[str, str]:
    """Every way a LoRA file may name a module (or a bare parameter) of the model -> its name in the model:
    the model's own names, the original checkpoint's names (``original`` maps one to the other), and both with
    dots written as underscores (kohya)."""
    aliases: dict[str, str] = {}
    for param in param_names:
        theirs = original(param) if original is not None else param
        owners = [param] + [param[: -len(s)] for s in (".weight", ".bias") if param.endswith(s)]
        for name in owners:
            tail = param[len(name):]
            forms = {name}
            if theirs.endswith(tail):
                forms.add(theirs[: len(theirs) - len(tail)])
            for form in list(forms):
                forms.add(form.replace(".", "_"))
            for form in forms:
                aliases.setdefault(form, name)
    return aliases


def _split_key(key: str) -> tuple[str, str] | None:
    for prefix in PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix):]
            break
    for ending, role in ROLES:
        if key.endswith(ending):
            return key[: -len(ending)], role
    return None


def read_lora(path: str | Path, params: dict[str, tuple[int, ...]], aliases: dict[str, str],
              model: str, family: str) -> LoraFile:
    """Read a LoRA file and match it to the model's weights ``params`` (name -> shape). Refuses a file that is
    missing or unreadable, matches nothing (another family's LoRA) or has another size's shapes."""
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    if not path.is_file():
        raise InputError(f"LoRA file {path} not found: give the path of a .safetensors LoRA (ComfyUI keeps them "
                         "in models/loras/)")
    from .weights import read_header

    read_header(path, "LoRA")  # a damaged or cut file is refused by name before any tensor is read
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - safetensors raises several kinds
        raise InputError(f"LoRA file {path} cannot be read as safetensors ({exc}): re-download it") from None
    groups: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    unmatched: list[str] = []
    for key, value in tensors.items():
        split = _split_key(key)
        if split is None:
            unmatched.append(key)
            continue
        module, role = split
        groups.setdefault(module, {})[role] = (key, value)

    updates: dict[str, Update] = {}
    wrong_size: list[str] = []
    for module, roles in groups.items():
        target = aliases.get(module)
        if target is None:
            unmatched.extend(key for key, _ in roles.values())
            continue
        if "dora" in roles:
            raise InputError(f"LoRA {path.name} is a DoRA (it has {roles['dora'][0]}), which this pack does not "
                             "merge: use a plain LoRA")
        weight = f"{target}.weight" if f"{target}.weight" in params else target
        if "down" in roles or "up" in roles:
            if "down" not in roles or "up" not in roles:
                have = ("down", "up")["up" in roles]
                raise InputError(f"LoRA {path.name}: {roles[have][0]} has no matching "
                                 f"lora_{'up' if have == 'down' else 'down'} / lora_{'B' if have == 'down' else 'A'}"
                                 ": the file is incomplete")
            down, up = roles["down"][1], roles["up"][1]
            rank = down.shape[0]
            shape = params.get(weight)
            if shape is None or up.shape[0] != shape[0] or up.ndim < 2 or up.shape[1] != rank or \
                    up.shape[0] * down[0].numel() != math.prod(shape):
                wrong_size.append(f"{weight}: {tuple(shape) if shape else 'no weight'} here, the LoRA's "
                                  f"{roles['up'][0]} is {tuple(up.shape)} and its down is {tuple(down.shape)}")
                continue
            alpha = float(roles["alpha"][1].item()) if "alpha" in roles else float(rank)
            up2, down2 = up.reshape(up.shape[0], rank), down.reshape(rank, -1)
            updates.setdefault(weight, Update()).pairs.append((up2, down2, alpha / rank))
        elif "alpha" in roles:
            unmatched.append(roles["alpha"][0])
        for role, name in (("diff", weight), ("diff_b", f"{target}.bias")):
            if role not in roles:
                continue
            key, value = roles[role]
            if name not in params:
                unmatched.append(key)
            elif tuple(value.shape) != tuple(params[name]):
                wrong_size.append(f"{name}: {tuple(params[name])} here, the LoRA's {key} is {tuple(value.shape)}")
            else:
                updates.setdefault(name, Update()).diffs.append(value)
    if wrong_size:
        listed = "; ".join(wrong_size[:3]) + (f"; and {len(wrong_size) - 3} more" if len(wrong_size) > 3 else "")
        raise InputError(f"LoRA {path.name} does not fit {model}: {listed}. It was trained for another size of "
                         f"the model: pick the LoRA made for this one")
    if not updates:
        keys = list(tensors)
        raise InputError(f"LoRA {path.name} matches none of {model}'s transformer weights ({len(keys)} keys, e.g. "
                         f"{', '.join(keys[:3])}); it looks like a LoRA for {lora_owner(keys)}, not {family}")
    if unmatched:
        log.warning("LoRA %s: %d keys match nothing in %s and are not applied: %s", path.name, len(unmatched),
                    model, ", ".join(sorted(unmatched)))
    return LoraFile(path, updates, sorted(unmatched))


class LoraMerger:
    """The LoRAs merged into one component's weights (a dict name -> device array, changed in place)."""

    def __init__(self, runtime, component: str):
        self.runtime = runtime
        self.component = component
        self.base: dict[str, np.ndarray] = {}  # host copies of the unmerged weights any LoRA has touched
        self.touched: set[str] = set()
        self.applied: tuple = ()
        self.files: list[LoraFile] = []
        self._read: dict[tuple, LoraFile] = {}

    def read(self, spec: LoraSpec, read: Callable[[str], LoraFile]) -> tuple[tuple, LoraFile]:
        path = Path(spec.path).expanduser()
        stat = path.stat() if path.is_file() else None
        key = (str(path.resolve()) if stat else str(path), stat.st_mtime_ns if stat else 0,
               stat.st_size if stat else 0)
        if key not in self._read or stat is None:
            self._read[key] = read(spec.path)
        return key, self._read[key]

    def apply(self, state: dict, specs: Sequence[LoraSpec], read: Callable[[str], LoraFile]) -> bool:
        """Make ``state`` the loaded weights plus ``specs``. Every file is read and checked before any weight
        changes. Returns whether anything changed."""
        read_files = [(self.read(spec, read), spec.strength) for spec in specs]
        wanted = tuple((key, float(strength)) for (key, _), strength in read_files)
        if wanted == self.applied:
            return False
        plan: dict[str, list[tuple[Update, float]]] = {}
        for (_, lora), strength in read_files:
            for name, update in lora.updates.items():
                plan.setdefault(name, []).append((update, float(strength)))
        for name in plan:
            if name not in self.base:  # first touch: keep the loaded weight on the host
                self.base[name] = self.runtime.host_numpy(state[name])
        for name in self.touched - set(plan):  # no longer touched: the loaded weight again
            state[name] = self.runtime.put(self.base[name], state[name].sharding)
        for name, updates in plan.items():
            state[name] = self._merged(name, state[name].sharding, updates)
        self.touched = set(plan)
        self.applied = wanted
        self.files = [lora for (_, lora), _ in read_files]
        return True

    def _merged(self, name: str, sharding, updates: list[tuple[Update, float]]):
        import jax

        ups, downs, scales, diffs, diff_scales = [], [], [], [], []
        for update, strength in updates:
            for up, down, scale in update.pairs:
                ups.append(up.float())
                downs.append(down.float())
                scales.append(scale * strength)
            for diff in update.diffs:
                diffs.append(diff.float())
                diff_scales.append(strength)
        base = self.runtime.put(self.base[name], sharding)
        replicated = self.runtime.sharding(sharding.mesh)
        args = (base, self.runtime.put(ups, replicated), self.runtime.put(downs, replicated),
                self.runtime.put(diffs, sharding), self.runtime.put(np.array(scales, np.float32), replicated),
                self.runtime.put(np.array(diff_scales, np.float32), replicated))
        key = ("lora-merge", tuple(base.shape), str(base.dtype), str(sharding.spec),
               tuple(sharding.mesh.shape.items()), tuple(d.id for d in sharding.mesh.devices.flat),
               tuple(tuple(u.shape) + tuple(d.shape) for u, d in zip(ups, downs)), len(diffs))

        def merge(base, ups, downs, diffs, scales, diff_scales):
            import jax.numpy as jnp

            total = base.astype(jnp.float32)
            for i, (up, down) in enumerate(zip(ups, downs)):
                total = total + (scales[i] * (up @ down)).reshape(base.shape)
            for i, diff in enumerate(diffs):
                total = total + diff_scales[i] * diff
            return jax.lax.with_sharding_constraint(total.astype(base.dtype), sharding)

        executable = self.runtime.compiled(key, merge, *args, describe=f"LoRA merge for {base.shape} weights")
        return executable(*args)


class FamilyLoras:
    """The LoRAs of a model (a part of ``ModelFamily``): which transformer each of the settings' LoRA slots goes
    to, and merging them on the devices. A family whose LoRA files name parameters otherwise than its modules do
    maps the names in ``_lora_original_name``."""

    two_experts = False  # a second (low-noise) transformer, Wan 2.2 A14B's: the second LoRA slot is its

    def _init_loras(self) -> None:
        self._loras: dict[str, LoraMerger] = {}

    def _lora_original_name(self, name: str) -> str:
        """The name the original checkpoint (and LoRA files trained on it) gives parameter ``name``."""
        return name

    def lora_targets(self, settings) -> dict[str, tuple]:
        """Component -> the LoRAs ``settings`` asks for on it."""
        if settings.loras_2 and not self.two_experts:
            raise InputError(f"{self.label} has one transformer: the second LoRA slot (--lora-2, lora_2) is for "
                             "two-expert models (the low-noise expert); give these LoRAs as --lora")
        targets = {"transformer": tuple(settings.loras)}
        if self.two_experts:
            targets["transformer_2"] = tuple(settings.loras_2)
        for specs in targets.values():
            for spec in specs:
                if not isinstance(spec, LoraSpec):
                    raise InputError(f"a LoRA must be given as a file and a strength, got {spec!r}")
        return targets

    def lora_merger(self, component: str) -> "LoraMerger | None":
        """What is merged into ``component``'s weights (None: nothing yet)."""
        return self._loras.get(component)

    @replayed_method
    def apply_loras(self, targets: dict[str, tuple], merge: bool = True) -> None:
        """Merge the LoRAs of ``targets`` (component -> LoraSpecs, as ``lora_targets`` gives) into those weights
        on the devices, removing any others merged before; nothing happens when they are the ones already merged.
        Every file is read and checked before any weight changes; ``merge=False`` only reads and checks them."""
        import time

        import jax

        for component, specs in targets.items():
            if component not in self._loras and not specs:
                continue
            state = self.state(component)
            start = time.perf_counter()
            merger = self._loras.setdefault(component, LoraMerger(self.runtime, component))
            params = {name: tuple(value.shape) for name, value in state.items()}
            aliases = name_aliases(params, self._lora_original_name)
            what = f"{self.label} ({component})" if self.two_experts else self.label

            def read(path, params=params, aliases=aliases, what=what):
                return read_lora(path, params, aliases, what, self.FAMILY_NAME)

            if not merge:
                for spec in specs:
                    merger.read(spec, read)
                continue
            if merger.apply(state, specs, read):
                jax.block_until_ready([state[name] for name in merger.touched])
                seconds = time.perf_counter() - start
                self.timings.lora += seconds
                log.info("%s: %s merged in %.2f s (%d weights)", what, ", ".join(
                    f"{Path(spec.path).name}:{spec.strength:g}" for spec in specs) or "LoRAs removed", seconds,
                    len(merger.touched))
