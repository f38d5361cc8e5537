"""Export: unrolled static ONNX graphs (fused shrinkage, frozen solver constants), precision, TensorRT."""
