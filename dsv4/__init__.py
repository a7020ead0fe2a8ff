"""The DeepSeek-V4.1 model as pure JAX functions over pytrees (see DESIGN.md section 2)."""
