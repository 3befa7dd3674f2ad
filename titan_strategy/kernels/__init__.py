"""Kernels that models may call where torch's own are slower; each is optional and says what it needs."""
