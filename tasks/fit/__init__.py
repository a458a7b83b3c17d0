"""The largest batch that fits a device memory limit (`memplan fit`)."""
