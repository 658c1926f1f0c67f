"""Compute: numba kernels with fixed summation orders, the engine's forward pass, the KV cache and prefix cache,
the pure sampler, constrained decoding and the generation loop. Reads model/, never records/ or anything above."""
