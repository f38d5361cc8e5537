"""Image decoding, fitting to a model's card, σ estimation and encoding: the pre- and post-processing every image
path shares (the gateway, and the Triton backend that takes encoded images). Pillow and NumPy only: no web
framework, no PyTorch, so the Triton Python backend imports it as cheaply as the gateway."""
