"""What users run: the command line (``generate``, ``demo``, ``bench``, ``plan``, ``worker``), the stage files
between stages, and video export."""
