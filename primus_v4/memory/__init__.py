"""Memory: the plan (static terms from the meta model + activations per token), the activation
model, the launch gate, and the saved-bytes measurement the plan is checked against."""
