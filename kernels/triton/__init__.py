"""Triton kernels for the GPU path, each beside its plain-torch reference in
``kernels/reference`` (same module names, same signatures).

Importing a module here imports triton. On CPU the kernels run only under Triton's
interpreter, which reads ``TRITON_INTERPRET=1`` when a kernel is defined: set it before the
first import (the tests' conftest does). Its bf16 arithmetic is wrong, so bf16 is checked
on GPU only.
"""
