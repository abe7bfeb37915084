"""Compute kernels, each beside the plain-torch reference it must agree with."""
