"""Placeholder: filled by the kernels work."""

__all__ = []
