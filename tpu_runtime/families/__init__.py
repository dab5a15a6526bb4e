"""Model families, one package each, and the registry (``registry.py``) that picks one for what a user points at.
A family declares itself in its package's ``__init__.py`` (``spec.py``'s ``FamilySpec``)."""
