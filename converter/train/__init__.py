"""Mixed-precision training: the dynamic loss scaler and the trainer with fp32 master weights."""
