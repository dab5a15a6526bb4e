"""Model families, one package each, and the registry (``registry.py``) that picks one for what a user points at.
A family declares itself in its package's ``__init__.py`` (``spec.py``'s ``FamilySpec``).

The registry is imported with the package: once any family is, the engine knows every registered family's
declared settings and LoRA key names (to name the family whose option or LoRA a model is given)."""

from . import registry  # noqa: F401
