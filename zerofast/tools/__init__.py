"""The command lines: the main job (train) and the estimator's (estimate, over the library's
zerofast/estimate/), the quantities they read and print (quantities), and the small GPT and text the
main job trains (models, data)."""
