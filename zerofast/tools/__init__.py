"""What runs zerofast from the command line: the main job (train), the memory estimator (estimate,
pure arithmetic: no compiled code), and the small GPT and text they use (models, data)."""
