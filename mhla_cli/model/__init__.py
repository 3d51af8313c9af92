"""Layer 4, model: the learned function and what evaluates it.

heads (V, Q heads <-> coef p <-> W), model (a fitted Model and its file), export (heads to npz / torch /
safetensors), forward (the forward pass, predict over files), scores (MSE, R^2), reduce (wide tokens ->
d by their second moments), synthetic (teachers and data), compare (distance between two functions),
canonical (a function in the canonical coordinates of its data: heads found there, changes measured on it).
"""
