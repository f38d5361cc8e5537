"""Fixed-iteration solver layers: each one unrolls K steps of a convex (or NMF) solver."""
