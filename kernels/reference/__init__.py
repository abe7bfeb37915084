"""Plain-torch references of the Triton kernels (``kernels/triton``): the same modules, names
and signatures, written for clarity; the tests hold each kernel to its reference."""
