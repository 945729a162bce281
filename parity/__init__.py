"""Certifies the optimized Kimi-Linear path against the float64 reference."""
