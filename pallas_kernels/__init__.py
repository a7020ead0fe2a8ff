"""Pallas kernels for V4.1's attention, one folder per kernel (see DESIGN.md section 3)."""
