"""What the engine knows of the registered families, told by the registry (``families/registry.py``) as it
registers each: the settings each declares and the key names of the LoRAs made for its transformer. The engine
imports no family; it asks here whose a setting or a LoRA is, to name the family in a message. Importing this
module imports no torch."""

from __future__ import annotations

import re
from typing import Iterable

_SETTINGS: dict[str, list[tuple[str, object]]] = {}  # setting name -> [(family, its Setting)]
_LORA_KEYS: dict[str, str] = {}  # family -> regular expression its LoRAs' keys match


def declare(owner: str, settings: Iterable, lora_keys: str = "") -> None:
    """Record ``owner``'s settings (``settings.Setting``s) and LoRA key pattern (a family's name as users write
    it), replacing what it declared before."""
    withdraw(owner)
    for setting in settings:
        _SETTINGS.setdefault(setting.name, []).append((owner, setting))
    if lora_keys:
        _LORA_KEYS[owner] = lora_keys


def withdraw(owner: str) -> None:
    for name in list(_SETTINGS):
        _SETTINGS[name] = [(o, s) for o, s in _SETTINGS[name] if o != owner]
        if not _SETTINGS[name]:
            del _SETTINGS[name]
    _LORA_KEYS.pop(owner, None)


def owners(name: str) -> list[str]:
    """The families that declare a setting ``name``."""
    return [owner for owner, _ in _SETTINGS.get(name, ())]


def is_declared(name: str) -> bool:
    return name in _SETTINGS


# Models of no family here, by the key names of their LoRAs, tried after every family's.
OTHER_LORAS = ((r"double_blocks|single_blocks", "Flux or HunyuanVideo"),
               (r"down_blocks|input_blocks|lora_te", "Stable Diffusion"))


def lora_owner(keys: list[str]) -> str:
    """Whose LoRA the keys ``keys`` look like. Where several families' patterns match, the one matching the
    fewest keys is the most specific (a LoRA of a model with a sound track also has the keys a silent one's has)."""
    found = {owner: sum(1 for k in keys if re.search(pattern, k)) for owner, pattern in _LORA_KEYS.items()}
    found = {owner: n for owner, n in found.items() if n}
    if found:
        return min(found, key=found.get)
    text = " ".join(keys)
    for pattern, owner in OTHER_LORAS:
        if re.search(pattern, text):
            return owner
    return "an unknown model"
