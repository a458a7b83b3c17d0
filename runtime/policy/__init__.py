"""The policy form: selective activation checkpointing in the user's own loop."""
