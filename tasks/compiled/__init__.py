"""The compiled form's plans and the policy form's search under torch.compile."""
