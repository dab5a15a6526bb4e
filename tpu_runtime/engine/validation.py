"""Checks of what a user typed, shared by every family and by the CLI and the nodes: numbers against their rules,
sizes, frame counts. Each returns or raises a message that names the input, the rule and what would be
accepted."""

from __future__ import annotations

import math

from ..errors import InputError


def neighbours(value, step: int, first: int) -> list[int]:
    """The valid values ``first + step * N`` (N >= 0) nearest ``value`` on each side: one where ``value`` lies
    below ``first`` or is no number (``first``), else the one below it and the one above it."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return [first]
    if not math.isfinite(v) or v <= first:
        return [first]
    below = first + int((v - first) // step) * step
    return [below] if below == v else [below, below + step]


def _nearest(values: list[int]) -> str:
    return f"nearest: {' or '.join(map(str, values))}"


def size_problems(height, width, multiple: int, why: str = "") -> list[str]:
    """Messages for a height/width that is not a positive multiple of ``multiple``, naming the nearest multiples
    on both sides."""
    problems = []
    for name, value in (("height", height), ("width", width)):
        if not isinstance(value, int) or value <= 0 or value % multiple:
            problems.append(f"{name}={value} must be a positive multiple of {multiple}{why} "
                            f"({_nearest(neighbours(value, multiple, multiple))})")
    return problems


def frame_problem(num_frames, rule: int, native: int, model: str) -> str | None:
    """A message for a frame count that is not ``rule * N + 1``, naming the nearest valid counts on both sides and
    the model's native length."""
    if isinstance(num_frames, int) and num_frames >= 1 and (num_frames - 1) % rule == 0:
        return None
    return (f"frames={num_frames} must be {rule}*N+1 for {model} "
            f"({_nearest(neighbours(num_frames, rule, 1))}; {native} is the native length)")


def check_number(name: str, value, *, minimum=None, above=None, below=None, integer: bool = False,
                 optional: bool = False) -> None:
    """Refuse ``value`` unless it is a finite number (a whole one with ``integer``) >= ``minimum``, > ``above``
    and < ``below``; None is allowed when ``optional`` (the default is used). The message names the input and
    the rule."""
    if value is None and optional:
        return
    kind = "a whole number" if integer else "a number"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and integer:
        ok = float(value).is_integer()
    rules = []
    if minimum is not None:
        rules.append(f"at least {minimum}")
        ok = ok and value >= minimum
    if above is not None:
        rules.append(f"above {above}")
        ok = ok and value > above
    if below is not None:
        rules.append(f"below {below}")
        ok = ok and value < below
    if not ok:
        leave = " (leave it out for the model's default)" if optional else ""
        given = f"{name} {value}" if name.startswith("--") else f"{name}={value}"  # as the user wrote it
        raise InputError(f"{given} must be {kind} {' and '.join(rules)}{leave}")


def raise_problems(problems: list[str]) -> None:
    if problems:
        raise InputError("; ".join(problems))
