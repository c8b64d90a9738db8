"""Test harness for resty-loom: drives a real nginx with our module."""
