"""What makes members the same architecture, and the errors when they are not."""
