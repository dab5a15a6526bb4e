"""Scheduler coefficient plans: diffusers' scheduler arithmetic turned into per-step arrays on the host, so one
compiled step program serves every step, every step count and every seed.

``linear_plan`` serves any deterministic scheduler whose step is a linear combination, element by element, of the
sample, the model output and tensors it keeps from earlier steps (flow-matching UniPC with its predictor-corrector
history, flow-matching Euler). The coefficients are not re-derived here: diffusers' own ``step`` is run once per
step on one-hot basis tensors, which reads its exact coefficients off, whatever the solver order, corrector
settings or final-sigma rule. The step program then carries the kept tensors as arrays and applies a small
coefficient matrix. A family whose scheduler is not linear writes its own plan (CogVideoX's DDIM/DPM:
``families/cogvideox/schedule.py``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InputError


# --- any linear scheduler, read off by probing ------------------------------------------------------------------
@dataclass
class LinearStepPlan:
    """Per-step coefficient matrices of a linear scheduler.

    The step's inputs are ``[sample, model_output, *kept]`` and its outputs ``[prev_sample, *kept']``, where
    ``kept`` are the tensors the scheduler keeps between steps (UniPC: its last sample and its list of x0
    predictions; Euler: none). ``matrices[i]`` has shape ``(1 + K, 2 + K)``: output row r is
    ``sum_c matrices[i][r, c] * input_c``. ``round_to_model_dtype``: the scheduler casts its result to the model
    output's dtype (Euler), which the step program repeats.
    """

    timesteps: np.ndarray  # float32, what the transformer is given at each step
    matrices: list[np.ndarray]  # float32 (1 + K, 2 + K) per step
    kept: int  # K
    round_to_model_dtype: bool

    @property
    def steps(self) -> int:
        return len(self.matrices)


def _kept_slots(scheduler) -> list[tuple[str, int | None]]:
    """The tensors a scheduler keeps between steps, as (attribute, list index or None)."""
    slots: list[tuple[str, int | None]] = []
    if hasattr(scheduler, "last_sample"):
        slots.append(("last_sample", None))
    if hasattr(scheduler, "model_outputs"):
        slots += [("model_outputs", j) for j in range(len(scheduler.model_outputs))]
    return slots


def _get(scheduler, slot):
    attr, j = slot
    value = getattr(scheduler, attr)
    return value if j is None else value[j]


def _set(scheduler, slot, value) -> None:
    attr, j = slot
    if j is None:
        setattr(scheduler, attr, value)
    else:
        getattr(scheduler, attr)[j] = value


def check_linear(scheduler) -> None:
    """Refuse scheduler settings whose step is not a fixed linear combination (what ``linear_plan`` needs)."""
    name = type(scheduler).__name__
    config = scheduler.config
    if config.get("thresholding"):
        raise InputError(f"{name} with thresholding=True is not supported (its step is not linear): turn it off")
    if getattr(scheduler, "solver_p", None) is not None:
        raise InputError(f"{name} with a solver_p scheduler is not supported")
    if config.get("stochastic_sampling"):
        raise InputError(f"{name} with stochastic_sampling=True is not supported: use the deterministic form")


def linear_plan(scheduler, steps: int) -> LinearStepPlan:
    """Set ``scheduler`` to ``steps`` steps and read off each step's coefficients from its own ``step``.

    A shadow copy of the scheduler is stepped through the whole schedule on zero tensors, so its counters (step
    index, solver order warm-up, lower-order final steps, corrector on/off) are those of a real run. Before
    each of its steps, a copy of it gets one-hot basis tensors in place of the sample, the model output and
    every kept tensor; since the step is linear element by element, element c of each result is the
    coefficient of input c.
    """
    check_linear(scheduler)
    scheduler.set_timesteps(steps, device="cpu")
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(0)
    timesteps = scheduler.timesteps
    slots = _kept_slots(scheduler)
    k = len(slots)
    width = 2 + k
    basis = torch.eye(width, dtype=torch.float64).to(torch.float32).view(width, 1, width, 1)  # [input][1, C, 1]
    zero = torch.zeros(1, width, 1)
    shadow = copy.deepcopy(scheduler)
    matrices = []
    for t in timesteps:
        probe = copy.deepcopy(shadow)
        present = []
        for c, slot in enumerate(slots):
            if _get(probe, slot) is not None:
                _set(probe, slot, basis[2 + c].clone())
                present.append(c)
        out = probe.step(basis[1].clone(), t, basis[0].clone(), return_dict=False)[0]
        matrix = np.zeros((1 + k, width), dtype=np.float32)
        matrix[0] = out.reshape(width).double().numpy()
        for c, slot in enumerate(slots):
            value = _get(probe, slot)
            if value is not None:
                matrix[1 + c] = value.reshape(width).double().numpy()
        if not np.isfinite(matrix).all():
            raise InputError(f"{type(scheduler).__name__} gives non-finite coefficients at timestep {int(t)}: "
                             "check its configuration (sigmas, shift)")
        # Inputs that were None stay zero arrays in the program; their columns must not matter.
        matrices.append(matrix)
        shadow.step(zero.clone(), t, zero.clone(), return_dict=False)
    round_to_model_dtype = type(scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    return LinearStepPlan(timesteps.to(torch.float32).numpy(), matrices, k, round_to_model_dtype)


def euler_simple_scheduler(num_train_timesteps: int = 1000, shift: float = 1.0):
    """diffusers' flow-matching Euler with ComfyUI's "simple" spacing: sigmas 1, 1 - 1/N, ..., 1/N (then shifted)
    instead of diffusers' ``linspace(1, 1/1000, N)``. The few-step distillation LoRAs (lightx2v) are trained on
    this spacing: 4 steps at shift 5 are the timesteps 1000, 937.5, 833.3, 625 of their cards. Every step is
    diffusers' own ``step``; only ``set_timesteps`` passes the sigmas."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    class FlowMatchEulerSimpleScheduler(FlowMatchEulerDiscreteScheduler):
        def set_timesteps(self, num_inference_steps=None, device=None, **kwargs):
            if num_inference_steps is not None and "sigmas" not in kwargs:
                kwargs["sigmas"] = np.linspace(1.0, 0.0, num_inference_steps + 1)[:-1].tolist()
                num_inference_steps = None
            return super().set_timesteps(num_inference_steps, device=device, **kwargs)

    return FlowMatchEulerSimpleScheduler(num_train_timesteps=num_train_timesteps, shift=shift)
