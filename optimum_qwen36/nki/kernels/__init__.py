"""Gated DeltaNet NKI kernels and their PyTorch twins, nki-library style: ``x.py`` (the NKI kernel and its
thin torch wrapper) beside ``x_torch.py`` (the PyTorch twin with the same tiling).

They live in this subpackage, not in :mod:`optimum_qwen36.nki` itself, because the kernel modules are
named after the public functions of :mod:`optimum_qwen36.nki`: importing
``optimum_qwen36.nki.chunk_gated_delta_rule`` as a module would rebind the package's function of that
name. Nothing is re-exported here; import the modules.
"""
