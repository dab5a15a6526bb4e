"""Checks of what a user typed, shared by every family: sizes, frame counts, steps. Each returns or raises a
message that names the input, the rule and a value that would be accepted."""

from __future__ import annotations

from ..errors import InputError


def nearest_multiple(value, multiple: int) -> int:
    """The positive multiple of ``multiple`` nearest ``value`` (for error messages)."""
    try:
        return max(multiple, int(round(float(value) / multiple)) * multiple)
    except (TypeError, ValueError):
        return multiple


def size_problems(height, width, multiple: int, why: str = "") -> list[str]:
    """Messages for a height/width that is not a positive multiple of ``multiple``."""
    problems = []
    for name, value in (("height", height), ("width", width)):
        if not isinstance(value, int) or value <= 0 or value % multiple:
            problems.append(f"{name}={value} must be a positive multiple of {multiple}{why} "
                            f"(e.g. {nearest_multiple(value, multiple)})")
    return problems


def frame_problem(num_frames, rule: int, native: int, model: str) -> str | None:
    """A message for a frame count that is not ``rule * N + 1``, naming the nearest valid value."""
    if isinstance(num_frames, int) and num_frames >= 1 and (num_frames - 1) % rule == 0:
        return None
    try:
        k = max(0, round((float(num_frames) - 1) / rule))
    except (TypeError, ValueError):
        k = 0
    return (f"frames={num_frames} must be {rule}*N+1 for {model} "
            f"(e.g. {k * rule + 1} or {native}, the native length)")


def check_steps(steps) -> None:
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise InputError(f"steps={steps} must be a positive whole number (50 is the usual choice)")


def raise_problems(problems: list[str]) -> None:
    if problems:
        raise InputError("; ".join(problems))
