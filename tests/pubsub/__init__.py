"""Test doubles for resty.loom.publish: a fault-injecting fake Pub/Sub with
token and metadata endpoints, test certificates, and the real emulator."""
