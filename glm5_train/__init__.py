"""GLM-5 pre-training on megatron-core."""

# Before any megatron-core import (any glm5_train module makes one): megatron-core warns at
# import time, once per rank, about libraries a CPU run cannot have. Which library warnings a
# run hides, and why each does not apply, is one registry: glm5_train/known_warnings.py.
from glm5_train import known_warnings

known_warnings.install()
