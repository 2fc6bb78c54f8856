"""dataflow."""
