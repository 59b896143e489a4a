"""Test doubles: a JAX-free fake runner and a server app over it, for engine and server tests."""
