"""CPU kernels written in C++ where no library serves the shape well (see each source)."""
