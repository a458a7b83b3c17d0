"""The graph and plan formats (torch-free): JSON files, schedules and their checker."""
