"""CogVideoX's DDIM and DPM schedulers as per-step coefficient vectors: one formula whose 9 coefficients come from
diffusers' own scheduler tensors, computed on the host, so one compiled step program serves every step (DPM's
random draws stay on the host, in diffusers' order)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ...errors import ModelFolderError

# One step computes, with s the latents, m the (guided) model output and o the previous step's x0:
#   x0   = (C_SAMPLE * s - C_MODEL * m) / C_DIV
#   prev = A * s - M1 * (P * x0 - Q * o) + D * noise
# which is exactly diffusers' CogVideoXDDIMScheduler.step (M1 = -b_t, P = 1, Q = D = 0) and
# CogVideoXDPMScheduler.step (the first-order and the second-order branch) for every prediction type.
COGVIDEOX_COEFFS = ("C_SAMPLE", "C_MODEL", "C_DIV", "A", "M1", "P", "Q", "D", "GUIDANCE")


@dataclass
class CogVideoXStepPlan:
    coeffs: list[np.ndarray]  # one float32 vector per step, in COGVIDEOX_COEFFS order
    second_draw: list[bool]  # DPM draws a second noise tensor on its second-order steps


def cogvideox_plan(scheduler, timesteps: torch.Tensor, guidance: float, dynamic_cfg: bool,
                   dpm: bool) -> CogVideoXStepPlan:
    """Per-step coefficient vectors, computed with diffusers' scheduler tensors and formulas on the host."""
    steps = scheduler.num_inference_steps
    stride = scheduler.config.num_train_timesteps // steps
    prediction = scheduler.config.prediction_type
    one = torch.tensor(1.0)
    coeffs, second = [], []
    for i, t in enumerate(timesteps):
        t = int(t)
        prev_t = t - stride
        alpha = scheduler.alphas_cumprod[t]
        alpha_prev = scheduler.alphas_cumprod[prev_t] if prev_t >= 0 else scheduler.final_alpha_cumprod
        beta = 1 - alpha
        if prediction == "v_prediction":
            c_sample, c_model, c_div = alpha**0.5, beta**0.5, one
        elif prediction == "epsilon":
            c_sample, c_model, c_div = one, beta**0.5, alpha**0.5
        elif prediction == "sample":
            c_sample, c_model, c_div = torch.tensor(0.0), -one, one
        else:
            raise ModelFolderError(f"scheduler prediction_type {prediction!r} is not supported")
        zero = torch.tensor(0.0)
        if not dpm:
            a_t = ((1 - alpha_prev) / (1 - alpha)) ** 0.5
            b_t = alpha_prev**0.5 - alpha**0.5 * a_t
            row, draw2 = (a_t, -b_t, one, zero, zero), False
        else:
            back = scheduler.alphas_cumprod[int(timesteps[i - 1])] if i > 0 else None
            h, r, _, _ = scheduler.get_variables(alpha, alpha_prev, back)
            mult = list(scheduler.get_mult(h, r, alpha, alpha_prev, back))
            mult_noise = (1 - alpha_prev) ** 0.5 * (1 - (-2 * h).exp()) ** 0.5
            draw2 = i > 0 and prev_t >= 0
            if draw2:
                row = (mult[0], mult[1], mult[2], mult[3], mult_noise)
            else:
                row = (mult[0], mult[1], one, zero, mult_noise)
        g = guidance
        if dynamic_cfg:
            g = 1 + guidance * ((1 - math.cos(math.pi * ((steps - t) / steps) ** 5.0)) / 2)
        values = [c_sample, c_model, c_div, *row, g]
        coeffs.append(np.array([float(v) for v in values], dtype=np.float32))
        second.append(draw2)
    return CogVideoXStepPlan(coeffs, second)
