"""Artifacts: the standalone model.py with its weights, train.py, the report files and ONNX."""
