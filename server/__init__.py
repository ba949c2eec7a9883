"""Runs SGLang: capacity planning, launch, supervision, and a simulator for tests and dry runs."""
