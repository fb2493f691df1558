"""The algorithm's math: stochastic steps and their log-probs, step schedules, group-relative
advantages, the clipped policy loss and its KL. Pure functions of tensors; no files, no models."""
