"""Make the repository root importable (glm5_train, parallel, tests.parity) however pytest runs."""

import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)
