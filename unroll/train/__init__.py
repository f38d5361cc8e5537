"""Seeded training recipes for the demo models (``unroll train NAME``)."""
