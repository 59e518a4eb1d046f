"""Numerics: statistics on real inputs, calibration, accuracy search and measurement against fp32."""
