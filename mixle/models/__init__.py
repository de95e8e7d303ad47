"""Models and QAT backends."""
