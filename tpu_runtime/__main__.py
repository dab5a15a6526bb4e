"""``python -m tpu_runtime``: see ``tpu_runtime.tools.cli``."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from .tools.cli import main  # noqa: E402

sys.exit(main())
