"""Kernels generated from a small spec, compiled and verified, to fill gaps between providers."""
