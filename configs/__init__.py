"""configs."""
