"""The profile stage: every node's time and bytes on one device."""
