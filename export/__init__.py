"""Deployment side: ONNX export and an ONNX Runtime translator."""
