"""Suite-wide setup that must run before any test module imports triton.

Without a GPU, Triton kernels can only run in its interpreter, and triton reads ``TRITON_INTERPRET`` when it
is first imported: set it here, first, so kernel tests work in any order.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
