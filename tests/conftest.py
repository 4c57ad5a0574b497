"""Test-wide settings: Triton kernels run in the interpreter on machines without a GPU."""

import os

# Must be set before triton compiles any kernel; on a CPU the engine itself uses
# the PyTorch references, so this only affects the kernel-versus-reference tests.
os.environ.setdefault("TRITON_INTERPRET", "1")
